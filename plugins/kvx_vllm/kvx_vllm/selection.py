"""How a `kvx_*` cache dtype selects the KVX backend, with one flag and no `--attention-backend`.

- `CUSTOM` is registered as the KVX backend (its `get_name()` is "CUSTOM").
- The platform's default backend path (`CPU_ATTN` on CPU, `FLASH_ATTN` on CUDA: `default_backend_path`)
  is overridden with this module's `DefaultAttentionBackend` attribute, resolved per lookup (PEP 562
  `__getattr__`): the KVX backend when the current config's cache dtype is `kvx_*`, else vLLM's own class
  unchanged, so every non-KVX run is vLLM's.
"""
from __future__ import annotations

import importlib
from typing import Any

from .dtypes import is_kvx_dtype

KVX_BACKEND_PATH = "kvx_vllm.backend.KvxAttentionBackend"
DISPATCH_PATH = f"{__name__}.DefaultAttentionBackend"


def default_backend_path() -> tuple[str, str]:
    """(AttentionBackendEnum member, its vLLM class path) that the platform picks by default and that the
    plugin puts its dispatcher behind: CPU_ATTN on CPU, FLASH_ATTN on CUDA."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "CPU_ATTN", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    return "FLASH_ATTN", "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def register_backends() -> None:
    """Register KVX as `CUSTOM` and put the dispatcher behind the platform's default backend (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member, _ = default_backend_path()
    register_backend(AttentionBackendEnum.CUSTOM, KVX_BACKEND_PATH)
    register_backend(getattr(AttentionBackendEnum, member), DISPATCH_PATH)


def current_cache_dtype() -> str | None:
    """The cache dtype of the vLLM config being built or run (None outside one)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return None if cfg is None or cfg.cache_config is None else cfg.cache_config.cache_dtype


def __getattr__(name: str) -> Any:
    if name != "DefaultAttentionBackend":
        raise AttributeError(name)
    if is_kvx_dtype(current_cache_dtype()):
        from .backend import KvxAttentionBackend

        return KvxAttentionBackend
    module, cls = default_backend_path()[1].rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)
