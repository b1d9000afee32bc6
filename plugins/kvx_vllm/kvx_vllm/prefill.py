"""Split prefill: a step with new prompt tokens as two attentions merged by their log-sum-exps.

Each request's new tokens attend (1) to themselves, causally, over their unquantized K/V (vLLM's FlashAttention
varlen kernel on CUDA) and (2) to the request's cached prefix, over the quantized pages (a KVX non-causal plan
over `seq_len - query_len` tokens per request); vLLM's `merge_attn_states` combines the two. A fresh prompt's
prefix is empty (KVX returns 0 and lse -inf for those rows, which the merge passes through).

Why: attention over the quantized pages (KVX's prefill kernel) runs at 0.2-0.35x FlashInfer's BF16 prefill on
Hopper (benchmarks/results/prefill_vs_flashinfer_h100.jsonl), so a 64x8k prefill all from the pages took longer
than vLLM's own; here only the cached prefix of a chunked or prefix-hit prompt is read quantized. Decode steps
still read only the pages.

What it changes: a prompt's tokens see each other's exact K/V in the step that computes them, and the quantized
K/V of earlier chunks or of a prefix-cache hit, so logprobs of a prompt computed in one step and of the same
prompt over a cached prefix agree within the format's error, not bit for bit. `{"kvx": {"prefill": "cache"}}`
attends everything over the pages instead (bit-identical prefix reuse, slower prefill).

Key smoothing and centering (a KV calibration's `k_smoothing` s and `k_center` c; the pages hold `(K - c) / s`):
the new tokens attend over their own K/V as the model made them, untransformed, and the prefix plan over the pages
the KVX way: on the kernels, queries times s against the stored keys, whose logits are `q . (k - c)` and whose LSE
`dispatch.AttentionPlan.run` corrects by `sm_scale * q . c` (`ops.smoothing.center_lse`, in place in the `lse` this
module passes); on the reference, keys read back times s plus c. Either way both LSEs are of the logits `q . k`, so
they share one scale and merge as without the transform (the outputs need no correction: the shift cancels in the
softmax). Not with a logit soft cap: a calibration that centers keys is refused at startup for such a model.

Attention sinks (gpt-oss: one logit per query head joins each row's softmax denominator, `kvx_core.ops.attention`)
are counted once: both pieces are computed without them and `attention.apply_sinks` joins them to the merged output
and LSE (one more rounding of the output, in its dtype).

Sliding-window layers (`window` = window_left = vLLM's `sliding_window - 1`): the new tokens attend to themselves
within the window (FlashAttention's `window_size = (window, 0)`, as vLLM's FlashAttention backend), and the prefix plan
places each request's queries right after its prefix (`plan_prefill(queries_after=True)`), so query i of a request
with prefix P sees prefix keys from `P + i - window` on; neither piece reads blocks before that (vLLM has freed them).

Dense prefixes (`DensePrefix`, CUDA): KVX's fused prefill over 4-bit pages runs at 0.2-0.35x FlashInfer's BF16
prefill on the H200, but dequantizing the prefix once per layer (`kvx_core.ops.bound_gather.gather_bound`: one
launch, no host sync) into dense 16-bit K/V and attending over it with a dense kernel beats FlashInfer's BF16 pages
(1.23-1.31x at a 4096-token chunk over an 8k prefix, benchmarks/results/prefill_dequant_pass_h200.jsonl). The
builder gives this route the requests with at least `DENSE_MIN_QUERY` new tokens whose prefixes fit its reserved
buffer (`dense_rows`); the others (decode rows of a mixed batch, short extends) stay on the fused kernel, which reads
each page once for few queries, and the step merges the new tokens' attention with each prefix piece in turn. The
dense piece is FlashAttention, non-causal, over each request's gathered prefix (the queries follow it); a request
outside the route has an empty piece there, zeroed with lse -inf (`empty`) before the merge, as vLLM does for empty
context chunks. Not for rotated formats or key-transformed layers (their values need a second pass: `gather_bound`
refuses them) nor sliding windows (FlashAttention's window counts from the end of K, not from queries placed after
it): the builder keeps those on the fused kernel.

Off CUDA (vLLM CPU, the CI path) the new-token attention is KVX's FP64 reference core (`ops.attention.attend`),
per request: the same math, for testing the route on small models; a dense piece gathers with KVX's checked gather
and attends with the same core.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

from kvx_core.descriptors import BlockTable, CacheDesc, GatherDesc, SeqLens
from kvx_core.ops import attention
from kvx_core.ops.bound_gather import gather_bound
from kvx_core.ops.dispatch import AttentionPlan, BoundLayer, gather_kv

DENSE_MIN_QUERY = 128
"""Fewest new tokens of a request whose cached prefix the dense route serves: the gather writes the prefix as 16-bit
K/V (4x-8x the bytes of 4-bit pages) once per layer, which pays off over many queries (a 512-token chunk over an 8k
prefix: 3.5x the fused kernel's speed on the H200) and not for a decode row's one query. Between 1 and 512 queries
not measured: 128 is a guess on that curve, stated as such."""


def _varlen_attention(query, key, value, cu_q: torch.Tensor, q_starts: list[int], max_q: int, cu_k: torch.Tensor,
                      max_k: int, sm_scale: float, softcap: float | None, window: int | None, causal: bool):
    """(out `[T, Hq, D]`, lse `[Hq, T]`) of each request's queries (rows `cu_q[b]..`) over its keys (rows `cu_k[b]..`):
    `causal`, the request's new tokens over their own K/V with the layer's window as vLLM's FlashAttention backend
    passes it (`window_size = (window_left, 0)`); else every key precedes the queries (a gathered prefix). On CUDA
    FlashAttention (the version vLLM picks for this GPU); elsewhere KVX's FP64 reference core, request by request
    (rows of a request without keys: 0, lse -inf)."""
    if query.is_cuda:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        return flash_attn_varlen_func(q=query.contiguous(), k=key, v=value, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                                      cu_seqlens_k=cu_k, max_seqlen_k=max(max_k, 1), softmax_scale=sm_scale,
                                      causal=causal, softcap=softcap or 0.0, return_softmax_lse=True,
                                      window_size=(-1, -1) if window is None else (window, 0),
                                      fa_version=get_flash_attn_version(head_size=query.shape[-1]))
    out = torch.zeros_like(query)
    lse = torch.full((query.shape[1], query.shape[0]), float("-inf"), dtype=torch.float32, device=query.device)
    for (q0, q1), (k0, k1) in zip(pairwise(q_starts), pairwise(cu_k.tolist()), strict=True):
        if q1 > q0 and k1 > k0:
            at = torch.arange(q1 - q0) if causal else torch.full((q1 - q0,), k1 - k0)  # the queries' positions
            o, lse_t = attention.attend(query[q0:q1], key[k0:k1], value[k0:k1], at, sm_scale, softcap, window, True)
            out[q0:q1], lse[:, q0:q1] = o.to(out.dtype), lse_t.t().float()
    return out, lse


def dense_rows(query_lens: list[int], prefix_bounds: list[int], capacity: int) -> list[bool]:
    """Which requests of a step the dense route serves: at least `DENSE_MIN_QUERY` new tokens and a cached prefix,
    taken in batch order while the prefixes' host upper bounds (vLLM's `seq_lens_cpu_upper_bound` less the new
    tokens) fit the buffer's `capacity` tokens."""
    rows, used = [], 0
    for q, p in zip(query_lens, prefix_bounds, strict=True):
        take = q >= DENSE_MIN_QUERY and 0 < p <= capacity - used
        used += p if take else 0
        rows.append(take)
    return rows


@dataclass
class DensePrefix:
    """The dense piece of a step: the prefixes of the requests `dense_rows` chose, gathered per layer into `k` / `v`
    (the builder's buffer, reused by every layer) at rows `cu_k[b]..`, attended by FlashAttention (non-causal: every
    prefix key precedes the request's queries)."""

    table: torch.Tensor  # int32 [n, max_blocks] on the device: the step's block table (vLLM's, narrowed)
    lens: torch.Tensor  # int32 [n] on the device: prefix tokens of the chosen requests, 0 for the others
    cu_k: torch.Tensor  # int32 [n + 1] on the device: each request's first row in k / v
    max_len: int  # host bound of `lens`
    k: torch.Tensor  # [rows, H_kv, D] in the query dtype
    v: torch.Tensor
    empty: torch.Tensor  # bool [T] on the device: query rows with no prefix in this piece

    def attend(self, query: torch.Tensor, cache: CacheDesc, bound: CacheDesc | BoundLayer, cu_q: torch.Tensor,
               starts: list[int], max_query_len: int, sm_scale: float, softcap: float | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out `[T, Hq, D]`, lse `[Hq, T]`) of each query over its request's gathered prefix; rows of requests
        outside the piece 0 with lse -inf."""
        if isinstance(bound, BoundLayer):
            gather_bound(bound, self.table, self.lens, self.cu_k, self.max_len, (self.k, self.v))
        else:  # off the kernels: the checked gather packs the sequences back to back, as cu_k places them
            got = gather_kv(cache, GatherDesc(BlockTable.packed(self.table), SeqLens(self.lens), self.max_len),
                            out_dtype=self.k.dtype)
            rows = got.key.shape[0]
            self.k[:rows], self.v[:rows] = got.key, got.value
        out, lse = _varlen_attention(query, self.k, self.v, cu_q, starts, max_query_len, self.cu_k, self.max_len,
                                     sm_scale, softcap, None, causal=False)
        out.masked_fill_(self.empty[:, None, None], 0.0)  # an empty piece's rows are undefined (vLLM's rule)
        lse.masked_fill_(self.empty[None, :], float("-inf"))
        return out, lse


@dataclass
class SplitPrefill:
    """One prefill step's plan: run by every layer over its own pages and this step's new K/V."""

    prefix: AttentionPlan | None  # KVX, causal=False, queries after each request's cached prefix, with the window;
    # None when the dense piece holds every request's prefix
    cu_seqlens: torch.Tensor  # vLLM's query_start_loc (int32, device)
    starts: list[int]  # the same on the host
    max_query_len: int
    sm_scale: float
    softcap: float | None
    window: int | None = None  # window_left of a sliding-window layer (`backend.window_of`)
    dense: DensePrefix | None = None  # the prefixes served dense (their rows' lengths are 0 in `prefix`)

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: CacheDesc,
            out: torch.Tensor, sinks: torch.Tensor | None = None, bound: CacheDesc | BoundLayer | None = None,
            ) -> torch.Tensor:
        """`out [T, Hq, D]` = attention of the step's `query [T, Hq, D]` over its new `key`/`value [T, Hkv, D]`
        and the cached prefixes in `cache` (the new tokens are already written; the prefix plans do not read
        them), with the layer's attention `sinks` (FP32 `[Hq]` on the device, checked: `attention.sink_values`).
        `bound`: the layer as the kernels take it (`dispatch.bind`), for the dense piece's gather."""
        part = _varlen_attention(query, key, value, self.cu_seqlens, self.starts, self.max_query_len,
                                 self.cu_seqlens, self.max_query_len, self.sm_scale, self.softcap, self.window,
                                 causal=True)
        pieces = []
        if self.prefix is not None:
            prefix_out = torch.empty_like(query)
            prefix_lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
            self.prefix.run(query, cache, out=prefix_out, lse=prefix_lse)
            pieces.append((prefix_out, prefix_lse.t().contiguous()))
        if self.dense is not None:
            pieces.append(self.dense.attend(query, cache, cache if bound is None else bound, self.cu_seqlens,
                                            self.starts, self.max_query_len, self.sm_scale, self.softcap))
        for i, (piece_out, piece_lse) in enumerate(pieces):  # the new tokens' part has a finite lse in every row
            last = i == len(pieces) - 1
            merged = out if last else torch.empty_like(query)
            merged_lse = None if last and sinks is None else torch.empty_like(part[1])  # [Hq, T], as vLLM's
            merge_attn_states(merged, piece_out, piece_lse, *part, output_lse=merged_lse)
            part = (merged, merged_lse)
        if not pieces:
            out.copy_(part[0])
        if sinks is not None:
            out.copy_(attention.apply_sinks(out, part[1].t(), sinks)[0])
        return out
