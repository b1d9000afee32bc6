"""Format tests against the independent numpy/ml_dtypes oracles in `oracles.py`."""
