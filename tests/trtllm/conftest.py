"""TRT-LLM bridge tests: those that force the KVX kernels on CPU run them under the interpreter."""
from .. import interpret  # noqa: F401  (TRITON_INTERPRET=1 off CUDA)
