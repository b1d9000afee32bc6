"""KVX plugin for vLLM: `--kv-cache-dtype kvx_nvfp4` (and kvx_mxfp4, kvx_int4, kvx_int8, kvx_k8v4).

`register` is the `vllm.general_plugins` entry point. vLLM calls it in every process (API server,
engine core, workers) before arguments are parsed, possibly more than once, so it is idempotent:
it checks the vLLM version, adds the `kvx_*` cache dtypes to vLLM's `CacheDType` and registers
the KVX attention backend (as `CUSTOM`, and on CPU behind `CPU_ATTN`'s path, which then delegates
to vLLM's own CPU backend for every non-KVX dtype).
"""
from __future__ import annotations

import os

from .dtypes import KVX_CACHE_DTYPES

_registered = False


def register() -> None:
    """Entry point: make vLLM accept `kvx_*` cache dtypes and route them to the KVX backend."""
    global _registered
    if _registered:
        return
    from .compat import check_vllm_version
    from .dtypes import add_cache_dtypes
    from .selection import register_backends

    check_vllm_version()
    add_cache_dtypes()
    register_backends()
    _registered = True
    from vllm.logger import init_logger

    init_logger("vllm.plugins.kvx").info("KVX plugin registered in pid %d: kv cache dtypes %s", os.getpid(),
                               ", ".join(KVX_CACHE_DTYPES))


__all__ = ["KVX_CACHE_DTYPES", "register"]
