"""The core: hook specification, plugin manager, settings, Engine, checkpoints, CLI.

It imports only torch, pluggy and the standard library.
"""
