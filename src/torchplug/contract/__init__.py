"""The contract a plugin builds on: the hook specification (`spec`), the record types
(`types`), the hook context and its typed façade (`context`, `hooks`), dispatch, the plugin
manager with validation and API versions, the registry and discovery. Stdlib, pluggy and torch
only; everything else in torchplug sits above it. Plugin authors import it through
`torchplug.plugin`."""
