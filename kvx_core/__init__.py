"""KVX: a standard for paged, quantized LLM KV caches.

The public API: descriptors, the format registry, `PagedKVCache`, and the dispatching ops (GPU kernels on
CUDA pools, the torch reference otherwise). Names resolve lazily on first use so that `import kvx_core`
stays cheap (no torch, no triton) for tools that only need a submodule.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("CacheDesc", "TensorDesc", "BlockTable", "SlotMapping", "SeqLens", "QuantDesc", "ScaleDesc",
                     "WriteDesc", "GatherDesc", "KvIoDesc"), "descriptors"),
    **dict.fromkeys(("get_format", "list_formats"), "formats"),
    "PagedKVCache": "cache",
    **dict.fromkeys(("plan_decode", "plan_prefill", "bind", "write_kv", "gather_kv", "paged_decode",
                     "paged_prefill"), "ops.dispatch"),
    **dict.fromkeys(("KvxError", "Status"), "errors"),
}

__all__ = list(_EXPORTS)

def __getattr__(name: str) -> Any:
    """Resolve a public name on first use (PEP 562) and cache it on the package."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvx_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
