"""Built-in plugins. Each is listed in the ``torchplug`` entry-point group, like a third party's."""
