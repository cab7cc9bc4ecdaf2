"""The core: hook specification, plugin manager, settings, cluster detection, the Engine.

It imports only torch, pluggy and the standard library.
"""
