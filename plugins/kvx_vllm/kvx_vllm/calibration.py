"""The run's KV-cache calibration (`kvx_core.kv_calibration`): which file, checked against the served model and
format at startup, and each layer's key smoothing, key centering and global scales for the backend's `CacheDesc`.

The file is `--additional-config '{"kvx": {"kv_calibration": PATH}}'`, else `<model dir>/kvx_kv_calibration.kvxcal`
(or, without one, the older name `kvx_kv_calibration.kvx`) when the model is a local directory holding one. It is
refused (ValueError at startup, before any K/V is written) when it is damaged, made for another model (fingerprint) or
geometry, holds no scales for a run format that has a global scale, centers keys for a model with a logit soft cap (tanh
is not shift invariant), or the run is pipeline-parallel (not verified: the file is checked against this stage's layers
only). The vLLM-native fp8 cache never reads it: naming it with a non-`kvx_*` dtype is refused (`options.options_of`).

Tensor parallelism: the file is checked against the model's total KV heads, then each rank's layers take the rows
of the heads that rank (its rank in its tensor-parallel group, `parallel.tp_rank`) holds
(`kvx_core.transfer.tp.tp_head_range`, vLLM's `QKVParallelLinear` partition: split when there are at least as many
KV heads as ranks, else each head replicated on `tp_size / total` consecutive ranks).
"""
from __future__ import annotations

import os
from typing import Any

from vllm.logger import init_logger

from kvx_core.errors import KvxError, Status, require
from kvx_core.formats import CacheFormat
from kvx_core.kv_calibration import KvCalibration, LayerValues, default_file, fingerprint_dict, load_kv_calibration
from kvx_core.transfer.tp import tp_head_range

from .options import options_of
from .parallel import tp_rank as worker_tp_rank

_loaded: dict[str, KvCalibration] = {}
"""Files loaded in this process, by path (every layer's impl and the connector ask; the file is read once)."""


def calibration_path(vllm_config: Any) -> str | None:
    """The file the run serves with: the option's path (ValueError when it is no file), else the model
    directory's (`kv_calibration.default_file`: the `.kvxcal` name, else the older `.kvx` one), else None."""
    path = options_of(vllm_config).kv_calibration
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f'KVX: --additional-config kvx "kv_calibration" {path!r}: no such file')
        return path
    return default_file(vllm_config.model_config.model)


def run_calibration(vllm_config: Any) -> KvCalibration | None:
    """The run's calibration, loaded and checked against the served model (ValueError naming the file and the
    problem), or None when the run has none."""
    path = calibration_path(vllm_config)
    if path is None:
        return None
    if path not in _loaded:
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"KVX: KV calibration {path} with pipeline parallelism is not served (not verified: "
                             "each stage would check the file against its own layers only); serve with "
                             "--pipeline-parallel-size 1")
        from .fingerprint import model_fingerprint

        mc = vllm_config.model_config
        try:
            fp = fingerprint_dict(model_fingerprint(vllm_config))
        except ValueError:
            fp = None  # check_model refuses a file that names a model
        try:
            cal = load_kv_calibration(path)
            cal.check_geometry(mc.get_num_layers(vllm_config.parallel_config), mc.get_total_num_kv_heads(),
                               mc.get_head_size(), path)
            cal.check_model(fp, path)
        except KvxError as e:
            raise ValueError(f"KVX: KV calibration refused: {e}") from None
        _loaded[path] = cal
        init_logger("vllm.plugins.kvx").info(
            "KVX KV calibration %s: %s layers, key smoothing %s, key centering %s, %s scales for %s", path,
            cal.num_layers, f"alpha {cal.alpha}" if cal.alpha else "off", "on" if cal.center is not None else "off",
            cal.rule or "no", ", ".join(sorted(cal.scales)) or "-")
    return _loaded[path]


def layer_values(vllm_config: Any, fmt: CacheFormat, num_kv_heads: int, softcap: float | None = None,
                 tp_rank: int | None = None) -> list[LayerValues] | None:
    """Per layer `LayerValues` for the run's format and the KV heads of tensor-parallel rank `tp_rank` (None: this
    process's), or None without a calibration; ValueError when the file cannot serve `fmt` (no scales for it,
    smoothing or centering of an unquantized format), when the rank's head range is not the `num_kv_heads` its
    attention layer was built with, or when the file centers keys while the model's attention has a logit soft cap
    `softcap` (the KVX attention would refuse it at the first step)."""
    cal = run_calibration(vllm_config)
    if cal is None:
        return None
    if softcap and cal.center is not None:
        raise ValueError(f"KVX: KV calibration refused: it centers keys (kvx calibrate-kv --center-keys) and this "
                         f"model caps its attention logits (soft cap {softcap}); tanh is not shift invariant, so "
                         "attention over centered keys would change: recalibrate without --center-keys")
    tp = vllm_config.parallel_config.tensor_parallel_size
    rank = worker_tp_rank(vllm_config) if tp_rank is None else tp_rank
    try:
        heads = tp_head_range(cal.num_kv_heads, tp, rank)
        require(heads[1] - heads[0] == num_kv_heads, Status.INCOMPATIBLE,
                f"tensor-parallel rank {rank} of {tp} holds KV heads {heads[0]}..{heads[1] - 1} of the file's "
                f"{cal.num_kv_heads} as vLLM partitions them, but its attention layer has {num_kv_heads} KV heads")
        return cal.for_format(fmt, heads=heads)
    except KvxError as e:
        raise ValueError(f"KVX: KV calibration refused for --kv-cache-dtype {vllm_config.cache_config.cache_dtype}: "
                         f"{e}") from None
