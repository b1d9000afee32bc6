"""The KVX attention backend, installed as `text_generation_server.layers.attention` (see `kvx_tgi.install`).

It exports what TGI's model files import from that module by name: `attention` (prefill), `paged_attention`
(decode), `KVCache`, `get_kv_scales`, `Seqlen` (TGI's own class, set by `install`) and `SUPPORTS_WINDOWING`.

Both functions read every K/V from the KVX pools (`KVCache.store` ran first in each layer): prefill
attends each new token causally over its sequence's cached prefix and the new tokens (the "cache route":
chunked prefill and prefix reuse read stored KV exactly as later decode steps do); decode attends the
one new query over its sequence. TGI's `block_tables` (int32 `[batch, max_blocks]`), `Seqlen`
(`input_lengths + cache_lengths` KV tokens, `cu_seqlen_q` query rows) map through `kvx_adapters.tgi`.

A step plans once (FlashInfer's plan/run split): all layers of one forward share TGI's `Seqlen` and block
table objects, so the first layer plans (`dispatch.plan_prefill` / `plan_decode`: int32 tables, splits,
work list) and the others run the same plan over their own caches. Decode plans are sync-free; plans
made while a CUDA graph is captured are kept for the graph's lifetime, since the graph replays their
buffers (TGI captures into one shared memory pool, so a freed buffer would be handed to the next graph).
Plans run over each cache's bound layer (`KVCache.layer`): a decode launches decode + merge and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvx_adapters.tgi import block_tables_from_tgi, seq_lens_from_tgi
from kvx_core.errors import KvxError, Status
from kvx_core.ops.dispatch import AttentionPlan, plan_decode, plan_prefill

from . import config
from .kv_cache import KVCache, KVScales, get_kv_scales

SUPPORTS_WINDOWING = False
"""TGI refuses sliding-window models whose inputs exceed the window when this is False (`models.get_model`)."""


@dataclass
class _Step:
    """The plan of the forward in progress, keyed by TGI's per-forward objects (held, so ids stay unique)."""

    kind: str
    seqlen: Any
    block_tables: torch.Tensor
    params: tuple
    plan: AttentionPlan


_step: _Step | None = None
_graph_plans: list[AttentionPlan] = []


def _refuse(window_size_left: int, causal: bool = True) -> None:
    if window_size_left is not None and window_size_left != -1:
        raise KvxError(Status.UNSUPPORTED, f"sliding-window attention (window_size_left={window_size_left}) is not "
                                           "served by the KVX TGI backend; serve this model without KVX_FORMAT")
    if not causal:
        raise KvxError(Status.UNSUPPORTED, "non-causal attention (vision encoders) is not served by the KVX TGI "
                                           "backend, which serves decoder self-attention over the KV cache")


def _sync_free(device: torch.device) -> bool:
    """Whether plans skip their host-syncing table checks: on CUDA, where TGI owns its tables and decode may be under
    graph capture (a decode plan over a bound layer then launches the kernels alone)."""
    return device.type == "cuda"


def _plan(kind: str, query: torch.Tensor, kv_cache: KVCache, block_tables: torch.Tensor, seqlen,
          softmax_scale: float, softcap: float | None, max_s: int | None) -> AttentionPlan:
    """This step's plan: made by the step's first layer, reused by the others."""
    global _step
    desc = kv_cache.desc
    params = (kind, float(softmax_scale), softcap, query.shape[1], query.dtype, query.device, kv_cache.format.name,
              desc.num_kv_heads, desc.head_dim, desc.block_size)  # layers of other geometry get their own plan
    s = _step
    if s is not None and s.seqlen is seqlen and s.block_tables is block_tables and s.params == params:
        return s.plan
    table = block_tables_from_tgi(block_tables)
    check = not _sync_free(query.device)
    lens = seq_lens_from_tgi(seqlen.input_lengths, seqlen.cache_lengths, check=check)
    geometry = dict(fmt=kv_cache.format, num_qo_heads=query.shape[1], num_kv_heads=desc.num_kv_heads,
                    head_dim=desc.head_dim, block_size=desc.block_size, q_dtype=query.dtype, device=query.device,
                    sm_scale=float(softmax_scale), softcap=softcap or None, check=check)
    if kind == "decode":
        plan = plan_decode(table, lens, max_seq_len=max_s, **geometry)
        if query.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _graph_plans.append(plan)
    else:
        # TGI's `Seqlen.max_k`: the batch's longest cache + input length (a host int), which sizes the key splits
        # of a short chunk over a long cached prefix as vLLM's `max_seq_len` does (checked by `plan_prefill`)
        plan = plan_prefill(seqlen.cu_seqlen_q, table, lens, causal=True, max_seq_len=getattr(seqlen, "max_k", None),
                            **geometry)
    _step = _Step(kind, seqlen, block_tables, params, plan)
    return plan


def attention(*, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
              kv_scales: KVScales, seqlen, block_tables: torch.Tensor, softmax_scale: float,
              window_size_left: int = -1, causal: bool = True, softcap: float | None = None) -> torch.Tensor:
    """Prefill (TGI's `attention`): `[T, Hq, D]` new queries over their sequences' cached K/V (the new tokens'
    K/V were stored by `kv_cache.store`; `key`/`value` are not read again)."""
    _refuse(window_size_left, causal)
    plan = _plan("prefill", query, kv_cache, block_tables, seqlen, softmax_scale, softcap, None)
    out = torch.empty_like(query)
    plan.run(query, kv_cache.layer, out=out, want_lse=False)
    return out


def paged_attention(query: torch.Tensor, kv_cache: KVCache, kv_head_mapping: torch.Tensor, softmax_scale: float,
                    block_tables: torch.Tensor, seqlen, max_s: int, *, kv_scales: KVScales,
                    softcap: float | None = None, window_size_left: int | None = -1) -> torch.Tensor:
    """Decode (TGI's `paged_attention`): one query row per sequence over its cached K/V; `max_s` bounds the
    lengths (the plan's split sizes; under CUDA graphs TGI passes its max total tokens)."""
    _refuse(window_size_left)
    plan = _plan("decode", query, kv_cache, block_tables, seqlen, softmax_scale, softcap, max_s)
    out = torch.empty_like(query)
    plan.run(query, kv_cache.layer, out=out, want_lse=False)
    return out


# + Seqlen (install)
__all__ = ["SUPPORTS_WINDOWING", "KVCache", "KVScales", "attention", "get_kv_scales", "paged_attention"]


def __getattr__(name: str):
    if name == "Seqlen":  # set by `install` (TGI's class); reaching here means TGI's attention is not replaced
        raise AttributeError(f"kvx_tgi.attention.Seqlen: call kvx_tgi.install() first ({config.FORMAT_ENV})")
    raise AttributeError(name)
