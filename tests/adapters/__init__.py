"""Engine-adapter tests against the engines' own arithmetic, re-stated in `engine_ref.py`."""
