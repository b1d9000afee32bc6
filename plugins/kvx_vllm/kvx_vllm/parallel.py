"""vLLM's parallelism as the plugin reads it: a worker's tensor-parallel rank, and the context-parallel settings that
the KVX backend and the `KvxConnector` refuse.

- Tensor parallelism: served (each rank's KV heads, `kvx_core.transfer.tp`); the rank is the worker's rank in its
  tensor-parallel group (`tp_rank`), which under data parallelism differs from its global rank.
- Context parallelism (`--decode-context-parallel-size` / `--prefill-context-parallel-size`, vLLM 0.26 and 0.32):
  each rank's cache holds only every N-th token of the sequence (interleaved by `cp_kv_cache_interleave_size`) and
  the ranks' partial attentions are merged by their log-sum-exp. The KVX backend attends each sequence over its
  consecutive tokens and hands vLLM no log-sum-exp (it declares neither `supports_dcp` nor `supports_pcp`), and
  the connector exports and imports a request's consecutive tokens block by block: both refuse it
  (`context_parallel`).
- Pipeline parallelism: each stage's backend serves its own layers (nothing in it spans layers); refused by the
  connector (a bundle holds every layer) and with a KV calibration file (`calibration`).
- Data parallelism: vLLM runs the DP ranks of a dense model as independent engines whose configs say DP=1
  (`ParallelConfig.reconfigure_for_independent_dp_rank`), and a MoE model's DP ranks each have their own
  scheduler, workers and KV cache; the plugin keeps its state per process (calibration files loaded, the run's
  format), the connector's NIXL agents are named per process (no fixed ports) and its bundle store takes writers
  of several engines (atomic renames), so nothing assumes one engine per host.
This module imports vLLM only inside `tp_rank` (`options` uses it and loads without vLLM).
"""
from __future__ import annotations

from typing import Any

CONTEXT_PARALLEL = ("decode_context_parallel_size", "prefill_context_parallel_size")
"""vLLM's `ParallelConfig` fields of context parallelism (the same names in 0.26 and 0.32)."""


def tp_rank(vllm_config: Any) -> int:
    """This worker's rank in its tensor-parallel group (0 without tensor parallelism). Called in a worker once vLLM
    has set up its groups (when it builds the model's layers or registers the KV caches)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def context_parallel(parallel_config: Any) -> str | None:
    """The run's context-parallel settings as flags (e.g. "--decode-context-parallel-size 2"), or None without
    context parallelism."""
    given = [(name, getattr(parallel_config, name, 1)) for name in CONTEXT_PARALLEL]
    flags = [f"--{name.replace('_', '-')} {size}" for name, size in given if size != 1]
    return " ".join(flags) or None
