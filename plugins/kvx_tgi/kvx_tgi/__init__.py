"""KVX cache formats for TGI's Python model server (text-generation-inference).

`install(format=...)` (or the `kvx-tgi-server` launcher, with `KVX_FORMAT`) puts the KVX attention backend in
place of `text_generation_server.layers.attention` before TGI's model modules are imported (they bind
`attention`, `paged_attention`, `KVCache`, `Seqlen` by name at import), so every layer's KV cache is a KVX
data + scale pool pair and TGI's own batching, block tables, slots and gRPC service drive it. See `config`
for what is served and refused, `memory` for warmup sizing and `cpu_layers` for the CPU-only layers.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from kvx_core.errors import KvxError, Status

from . import config

_ATTENTION = "text_generation_server.layers.attention"


def _check_not_imported() -> None:
    """TGI's model files bind the attention names at import: too late once any of them is imported."""
    late = sorted(m for m in sys.modules if m.startswith("text_generation_server.models.")
                  or m == "text_generation_server.models")
    if late:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"kvx_tgi.install() must run before TGI's models are imported ({late[0]} already is): "
                       "call it first, or start the server with kvx-tgi-server")


def _replace_attention() -> None:
    """Register `kvx_tgi.attention` under TGI's name; TGI's pure-Python submodules (`common`) stay reachable."""
    import text_generation_server.layers as layers
    from text_generation_server.utils.import_utils import SYSTEM

    if SYSTEM not in ("cuda", "cpu"):
        raise KvxError(Status.UNSUPPORTED, f"TGI system {SYSTEM!r}: the KVX backend is verified on CUDA and plain "
                                           "CPU only")
    from . import absent_kernels, attention, kv_cache

    absent_kernels.register()
    attention.__path__ = [str(Path(layers.__file__).parent / "attention")]
    sys.modules[_ATTENTION] = attention
    sys.modules[_ATTENTION + ".kv_cache"] = kv_cache
    layers.attention = attention
    attention.Seqlen = importlib.import_module(_ATTENTION + ".common").Seqlen
    if SYSTEM == "cpu":
        from . import cpu_layers

        cpu_layers.enable()


def install(format: str | None = None) -> config.RunConfig:
    """Serve TGI's KV caches in KVX `format` (default `$KVX_FORMAT`); returns the run's settings.

    Needs TGI's `ATTENTION` (`paged` or `flashdecoding`) and `PREFIX_CACHING` in the environment, as TGI's
    launcher sets them. Call once per process before TGI's models are imported; calling again only switches
    the format of caches built afterwards (a model's caches are rebuilt at its warmup). KvxError on refusal.
    """
    run = config.resolve(format)
    if sys.modules.get(_ATTENTION) is not importlib.import_module("kvx_tgi.attention"):
        _check_not_imported()
        _replace_attention()
    from text_generation_server.models import globals as tgi_globals

    if tgi_globals.ATTENTION != run.attention or tgi_globals.BLOCK_SIZE != run.block_size:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"TGI was imported with ATTENTION={tgi_globals.ATTENTION} (BLOCK_SIZE "
                       f"{tgi_globals.BLOCK_SIZE}), the environment now says ATTENTION={run.attention}: one process "
                       "serves one ATTENTION")
    config.set_current(run)
    import text_generation_server.models as tgi_models  # the model files bind the KVX attention names now

    if not tgi_models.FLASH_ATTENTION:  # TGI logged and swallowed the import error: surface it
        try:
            importlib.import_module("text_generation_server.models.flash_causal_lm")
            reason = "see TGI's log"
        except Exception as e:  # noqa: BLE001  (any import failure is the reason)
            reason = f"{type(e).__name__}: {e}"
        raise KvxError(Status.UNSUPPORTED, f"TGI's flash models did not import with the KVX backend ({reason})")
    from text_generation_server.utils.import_utils import SYSTEM

    from . import memory

    memory.enable()
    if SYSTEM == "cpu":
        from . import cpu_layers

        cpu_layers.enable_device()
    return run


__all__ = ["install"]
