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


def _calibrated_model_dir(checkpoint: str, tmp_path_factory, name: str, *flags: str) -> Path:
    """The checkpoint's files as symlinks plus a KV calibration for kvx_nvfp4 written by `kvx calibrate-kv
    --source text --formats nvfp4 --tokens 256 <flags>`: what the vLLM plugin loads from the model directory."""
    from kvx_cli.main import main
    from kvx_core.kv_calibration import FILENAME, LEGACY_FILENAME

    d = tmp_path_factory.mktemp(name)
    for f in Path(checkpoint).iterdir():
        if f.name not in (FILENAME, LEGACY_FILENAME):
            (d / f.name).symlink_to(f.resolve())
    assert main(["calibrate-kv", "--model", str(d), "--source", "text", *flags, "--formats", "nvfp4",
                 "--tokens", "256"]) == 0
    return d


@pytest.fixture(scope="module")
def smoothed_model_dir(checkpoint, tmp_path_factory) -> Path:
    """A model directory with a key-smoothing calibration (`--smooth-keys 0.5`, 256 demo tokens)."""
    return _calibrated_model_dir(checkpoint, tmp_path_factory, "calibrated", "--smooth-keys", "0.5",
                                 "--no-center-keys")


@pytest.fixture(scope="module")
def centered_model_dir(checkpoint, tmp_path_factory) -> Path:
    """A model directory with a key-centering + smoothing calibration (`--smooth-keys 0.5 --center-keys`; the
    smoothing fitted on the centered keys)."""
    return _calibrated_model_dir(checkpoint, tmp_path_factory, "centered", "--smooth-keys", "0.5", "--center-keys")


@pytest.fixture(scope="module")
def config(checkpoint, request):
    """A VllmConfig of the checkpoint with the test module's `DTYPE` cache and `BS` blocks (the impl and builder unit
    tests build vLLM objects inside it)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    import kvx_vllm

    kvx_vllm.register()
    return VllmConfig(model_config=ModelConfig(model=checkpoint, dtype="bfloat16"),
                      cache_config=CacheConfig(cache_dtype=request.module.DTYPE, block_size=request.module.BS))


def kvx_impl(config, num_heads: int, head_size: int, num_kv_heads: int, *, sliding_window=None, sinks=None):
    """The plugin's attention impl as vLLM builds it for one layer inside `config`."""
    from vllm.config import set_current_vllm_config

    from kvx_vllm.backend import KvxAttentionImpl

    with set_current_vllm_config(config):
        return KvxAttentionImpl(num_heads, head_size, head_size ** -0.5, num_kv_heads, None, sliding_window,
                                config.cache_config.cache_dtype, sinks=sinks)

