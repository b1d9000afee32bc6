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

Off CUDA (vLLM CPU, the CI path) the new-token attention is KVX's FP64 reference core (`ops.attention.attend`),
per request: the same math, for testing the route on small models.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

from kvx_core.descriptors import CacheDesc
from kvx_core.ops import attention
from kvx_core.ops.dispatch import AttentionPlan


def _new_tokens_attention_cuda(query, key, value, cu_seqlens, max_query_len, sm_scale, softcap, window):
    """FlashAttention (the version vLLM picks for this GPU) over each request's new tokens, causally, with the
    layer's window as vLLM's FlashAttention backend passes it (`window_size = (window_left, 0)`)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    out, lse = flash_attn_varlen_func(q=query.contiguous(), k=key, v=value, cu_seqlens_q=cu_seqlens,
                                      max_seqlen_q=max_query_len, cu_seqlens_k=cu_seqlens,
                                      max_seqlen_k=max_query_len, softmax_scale=sm_scale,
                                      causal=True, softcap=softcap or 0.0, return_softmax_lse=True,
                                      window_size=(-1, -1) if window is None else (window, 0),
                                      fa_version=get_flash_attn_version(head_size=query.shape[-1]))
    return out, lse


def _new_tokens_attention_reference(query, key, value, starts: list[int], sm_scale, softcap, window):
    """The same attention with KVX's FP64 reference core, request by request (off CUDA)."""
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    for q0, q1 in pairwise(starts):
        if q1 > q0:
            o, lse_t = attention.attend(query[q0:q1], key[q0:q1], value[q0:q1], torch.arange(q1 - q0), sm_scale,
                                        softcap, window, True)
            out[q0:q1], lse[:, q0:q1] = o.to(out.dtype), lse_t.t().float()
    return out, lse


@dataclass
class SplitPrefill:
    """One prefill step's plan: run by every layer over its own pages and this step's new K/V."""

    prefix: AttentionPlan  # KVX, causal=False, queries after each request's cached prefix, with the window
    cu_seqlens: torch.Tensor  # vLLM's query_start_loc (int32, device)
    starts: list[int]  # the same on the host
    max_query_len: int
    sm_scale: float
    softcap: float | None
    window: int | None = None  # window_left of a sliding-window layer (`backend.window_of`)

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: CacheDesc,
            out: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`out [T, Hq, D]` = attention of the step's `query [T, Hq, D]` over its new `key`/`value [T, Hkv, D]`
        and the cached prefixes in `cache` (the new tokens are already written; the prefix plan does not read
        them), with the layer's attention `sinks` (FP32 `[Hq]` on the device, checked: `attention.sink_values`)."""
        if query.is_cuda:
            new_out, new_lse = _new_tokens_attention_cuda(query, key, value, self.cu_seqlens, self.max_query_len,
                                                          self.sm_scale, self.softcap, self.window)
        else:
            new_out, new_lse = _new_tokens_attention_reference(query, key, value, self.starts, self.sm_scale,
                                                               self.softcap, self.window)
        prefix_out = torch.empty_like(query)
        prefix_lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        self.prefix.run(query, cache, out=prefix_out, lse=prefix_lse)
        merged_lse = None if sinks is None else torch.empty_like(new_lse)  # [Hq, T], as vLLM's LSEs
        merge_attn_states(out, prefix_out, prefix_lse.t().contiguous(), new_out, new_lse, output_lse=merged_lse)
        if sinks is not None:
            out.copy_(attention.apply_sinks(out, merged_lse.t(), sinks)[0])
        return out
