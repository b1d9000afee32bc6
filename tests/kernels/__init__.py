"""Kernel tests (Triton and CUDA): on CUDA when present, else on CPU under TRITON_INTERPRET=1 (conftest.py)."""
