"""The `kvx` command line: `kvx inspect` (an engine's cache as KVX descriptors) and `kvx demo`."""
