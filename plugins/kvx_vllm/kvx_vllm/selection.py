"""How a `kvx_*` cache dtype selects the KVX backend, with one flag and no `--attention-backend`.

- `CUSTOM` is registered as the KVX backend (its `get_name()` is "CUSTOM").
- On CPU, vLLM's platform always answers `CPU_ATTN`'s path: that path is overridden with this
  module's `CPUAttentionBackend` attribute, resolved per lookup (PEP 562 `__getattr__`): the KVX
  backend when the current config's cache dtype is `kvx_*`, else vLLM's own `CPUAttentionBackend`
  unchanged, so every non-KVX run is vLLM's.
"""
from __future__ import annotations

from typing import Any

from .dtypes import is_kvx_dtype

KVX_BACKEND_PATH = "kvx_vllm.backend.KvxAttentionBackend"
CPU_DISPATCH_PATH = f"{__name__}.CPUAttentionBackend"


def register_backends() -> None:
    """Register KVX as `CUSTOM` and put the dispatcher behind `CPU_ATTN` (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, KVX_BACKEND_PATH)
    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_DISPATCH_PATH)


def current_cache_dtype() -> str | None:
    """The cache dtype of the vLLM config being built or run (None outside one)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return None if cfg is None or cfg.cache_config is None else cfg.cache_config.cache_dtype


def __getattr__(name: str) -> Any:
    if name != "CPUAttentionBackend":
        raise AttributeError(name)
    if is_kvx_dtype(current_cache_dtype()):
        from .backend import KvxAttentionBackend

        return KvxAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend
