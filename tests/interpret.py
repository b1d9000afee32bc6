"""Off CUDA, tests that force the KVX Triton kernels (`dispatch._kernel_device` patched) run them under the Triton
interpreter. TRITON_INTERPRET is read when a kernel is defined, so the conftest of each directory with such tests
imports this module, before any kernel module loads."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
