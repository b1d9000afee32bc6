"""The float64 attention the TRT-LLM bridge tests compare decodes with (written here, not taken from kvx_core)."""
from __future__ import annotations

import torch


def check_attention(out: torch.Tensor, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int],
                    tol: float = 2e-2) -> None:
    """`out [S, Hq, D]` == softmax attention (scale D^-1/2) of each sequence's query over its rows of `key` / `value`
    (`[sum(lens), H, D]`, ragged in sequence order), query head h reading KV head h // (Hq / H)."""
    group, start = q.shape[1] // key.shape[1], 0
    for s, n in enumerate(lens):
        k = key[start:start + n].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = value[start:start + n].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), k) / q.shape[-1] ** 0.5, dim=-1)
        torch.testing.assert_close(out[s].double(), torch.einsum("hn,nhd->hd", p, v), rtol=tol, atol=tol)
        start += n
