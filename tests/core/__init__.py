"""Core tests: descriptors, layouts, validation, the C ABI structs; helpers in `helpers.py`."""
