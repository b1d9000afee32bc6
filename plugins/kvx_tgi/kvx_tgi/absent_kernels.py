"""Refusing stand-ins for kernel packages TGI imports for models the KVX backend does not serve.

TGI's `models/__init__` imports every flash model in one `try` block: one missing kernel package anywhere
(the MoE layers' `moe_kernels`, the vision encoders' `flash_attn_2_cuda`) turns *all* flash models off, and
TGI silently serves dense models through transformers instead, without the KV cache. When such a package
is not installed, `register()` puts a module of that name in place whose every function raises KvxError
UNSUPPORTED with the reason, so dense decoders import and serve, and a model that needs the kernel fails at
its first call, saying why. Installed packages are never shadowed.
"""
from __future__ import annotations

import importlib.util
import sys
import types

from kvx_core.errors import KvxError, Status

ABSENT = {
    "moe_kernels": "TGI's MoE kernels (moe_kernels) are not installed; the KVX TGI backend serves dense models",
    "moe_kernels.fused_moe": "TGI's MoE kernels (moe_kernels) are not installed; the KVX TGI backend serves dense "
                             "models",
    "flash_attn_2_cuda": "flash-attn is not installed: vision encoders (non-causal attention) are not served by the "
                         "KVX TGI backend",
}


def refusing_module(name: str, reason: str) -> types.ModuleType:
    """A module whose every public attribute is a function raising KvxError(UNSUPPORTED, reason)."""
    mod = types.ModuleType(name, f"KVX TGI: not installed ({reason})")

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def refuse(*args, **kwargs):
            raise KvxError(Status.UNSUPPORTED, f"{name}.{attr}: {reason}")

        refuse.__name__ = attr
        return refuse

    mod.__getattr__ = __getattr__
    return mod


def _installed(name: str) -> bool:
    top = name.split(".")[0]
    if isinstance(sys.modules.get(top), types.ModuleType) and getattr(sys.modules[top], "__file__", None):
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def register() -> list[str]:
    """Register stand-ins for the absent packages of `ABSENT`; returns their names."""
    done = []
    for name, reason in ABSENT.items():
        if name not in sys.modules and not _installed(name):
            sys.modules[name] = refusing_module(name, reason)
            done.append(name)
    return done
