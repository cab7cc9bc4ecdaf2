"""The type the Engine's helper modules (checkpointing, collectives, resume, scaling, wrappers)
annotate their ``engine`` argument with.

They take the Engine whose state they work on; importing `torchplug.engine.engine` for the
annotation would make an import cycle (the Engine imports them), so the name is an alias of
``Any`` here. Each function's docstring names the Engine members it uses.
"""

from typing import Any

Engine = Any
