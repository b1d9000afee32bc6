"""Paged-cache tests; the independent oracle is `oracle.py`, the batch fixture `batch.py`."""
