"""The run's KV-cache calibration file (`kvx_core.kv_calibration`) for TGI: `$KVX_KV_CALIBRATION`, else
`kvx_kv_calibration.kvxcal` (or the older `kvx_kv_calibration.kvx`) beside the checkpoint's weight files.

Loaded when TGI's model files read their layers' KV scales (`kv_cache.get_kv_scales`, during model load, before
any cache exists), checked there against the checkpoint (fingerprint and geometry, when its config.json and
tokenizer.json are present) and the run's format; a refusal is a KvxError at startup. Each layer's KV cache then
takes its key smoothing, key centering and global scales from it (`kv_cache.KVCache`), keyed by the layer index in
TGI's prefix.
"""
from __future__ import annotations

import os
import re

from kvx_core import config as kvx_config
from kvx_core.errors import Status, require
from kvx_core.kv_calibration import LayerValues, default_file, fingerprint_dict, load_kv_calibration
from kvx_core.transfer import checkpoint_fingerprint

from . import config

ENV = kvx_config.BY_NAME["kv_calibration"].env
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_loaded: dict[str, list[LayerValues]] = {}
"""Per file: every layer's values for the run's format (checked and computed once, at the first layer)."""


def _weights_dir(weights) -> str | None:
    """The directory of the checkpoint's (first) weight file, None when TGI routes no files."""
    files = sorted(str(f) for f in getattr(weights, "routing", {}).values())
    return os.path.dirname(files[0]) if files else None


def _path(weights) -> str | None:
    """The environment's file (which must exist), else the one beside the weights, else None."""
    path = kvx_config.value("kv_calibration")
    if path:
        require(os.path.isfile(path), Status.INVALID_ARGUMENT, f"{ENV}={path!r}: no such file")
        return path
    folder = _weights_dir(weights)
    return default_file(folder) if folder is not None else None


def active() -> bool:
    """Whether this process serves with a calibration (its caches then keep per-KV-head global scales)."""
    return bool(_loaded)


def layer_values(weights, prefix: str) -> LayerValues | None:
    """The layer of `prefix`'s `LayerValues` for the run's format, or None without a file."""
    path = _path(weights)
    if path is None:
        return None
    if path not in _loaded:
        cal = load_kv_calibration(path)
        folder = _weights_dir(weights)
        fp = checkpoint_fingerprint(folder) if folder is not None else None
        cal.check_model(None if fp is None else fingerprint_dict(fp), path)
        if fp is not None:
            cal.check_geometry(fp.num_layers, fp.num_kv_heads, fp.head_dim, path)
        _loaded[path] = cal.for_format(config.current().format)  # refused now, before any cache is built
    m = _LAYER.search(prefix)
    require(m is not None, Status.UNSUPPORTED, f"KV calibration {path}: no layer index in TGI's prefix {prefix!r}")
    i = int(m.group(1))
    values = _loaded[path]
    require(i < len(values), Status.INCOMPATIBLE, f"KV calibration {path} has {len(values)} layers, not layer {i}")
    return values[i]
