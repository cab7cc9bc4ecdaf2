"""The user's Engine (`torchplug.engine.engine`) and the objects it is a façade over: settings
and the connector, the optimizer and model wrappers, collectives, checkpointing, resume."""
