"""Shared fixture of the vLLM tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def checkpoint() -> str:
    """SmolLM2-135M: `KVX_VLLM_CKPT` (the GPU machine's copy) or the demo's local checkpoint."""
    if os.environ.get("KVX_VLLM_CKPT"):
        return os.environ["KVX_VLLM_CKPT"]
    from kvx_demo.model import ensure_local_checkpoint

    return str(ensure_local_checkpoint())


@pytest.fixture(scope="module")
def smoothed_model_dir(checkpoint, tmp_path_factory) -> Path:
    """The checkpoint's files as symlinks plus a KV calibration with key smoothing for kvx_nvfp4, written by
    `kvx calibrate-kv --smooth-keys 0.5` (256 demo tokens): what the vLLM plugin loads from the model directory."""
    from kvx_cli.main import main
    from kvx_core.kv_calibration import FILENAME

    d = tmp_path_factory.mktemp("calibrated")
    for f in Path(checkpoint).iterdir():
        if f.name != FILENAME:
            (d / f.name).symlink_to(f.resolve())
    assert main(["calibrate-kv", "--model", str(d), "--source", "text", "--smooth-keys", "0.5", "--formats", "nvfp4",
                 "--window-len", "256"]) == 0
    return d
