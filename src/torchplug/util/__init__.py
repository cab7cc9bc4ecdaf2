"""Helpers with no torchplug imports: every torch private (`torchplug.util.torchprivate`),
capability probes, nested-structure walking, the version. The bottom layer: anything may import
it, it imports nothing of torchplug's."""
