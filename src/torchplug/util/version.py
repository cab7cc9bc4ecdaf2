"""torchplug's release version, here so that the core can name it without importing the package's
front door (``torchplug.__version__`` is this value)."""

VERSION = "0.1.0"
