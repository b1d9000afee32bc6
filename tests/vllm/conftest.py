"""Shared fixture of the vLLM tests."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def checkpoint() -> str:
    """SmolLM2-135M: `KVX_VLLM_CKPT` (the GPU machine's copy) or the demo's local checkpoint."""
    if os.environ.get("KVX_VLLM_CKPT"):
        return os.environ["KVX_VLLM_CKPT"]
    from kvx_demo.model import ensure_local_checkpoint

    return str(ensure_local_checkpoint())
