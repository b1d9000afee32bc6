"""Torch oracle of the attention kernel tests: quantized pools built with the formats' encode, and FP64
attention over the formats' decode of the same pools.

The FP64 attention itself is `kvx_core.ops.attention.attend`, the one core shared with the CPU reference
(`ops.attention`, itself tested against hand-made cases in tests/cache/test_attention.py). Everything else
here stays independent of the kernels and of the reference's gather: K/V come from `TensorFormat.decode` on
the pools read by hand through the block table, q is rotated and the output rotated back with the formats'
own `rotate_q` / `unrotate_output`."""
from __future__ import annotations

import math

import torch

from kvx_core.formats import CacheFormat
from kvx_core.ops.attention import attend


def make_pools(fmt: CacheFormat, num_blocks: int, hkv: int, bs: int, d: int, device="cpu", seed=0,
               k_gs=None, v_gs=None, scale=1.0):
    """Random K/V encoded block by block -> (k_data, k_scales, v_data, v_scales), HND pools."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(num_blocks, bs, hkv, d, generator=g) * scale
    v = torch.randn(num_blocks, bs, hkv, d, generator=g) * scale
    # a few outlier channels, as real keys have
    k[..., : max(1, d // 32)] *= 4.0
    kd, ksc = fmt.encode_k(k, k_gs)
    vd, vsc = fmt.encode_v(v, v_gs)
    # [nb, bs, H, x] -> HND [nb, H, bs, x]

    def hnd(t):
        return t.permute(0, 2, 1, 3).contiguous().to(device)

    return hnd(kd), hnd(ksc), hnd(vd), hnd(vsc)


def make_table(seq_lens, bs, num_blocks, device="cpu", seed=0):
    """Random (non-contiguous) block table int32 [B, max_blocks] for `seq_lens`."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    need = [math.ceil(int(L) / bs) for L in seq_lens]
    mb = max(1, max(need) if need else 1)
    perm = torch.randperm(num_blocks, generator=g)
    assert sum(need) <= num_blocks
    bt = torch.zeros(len(seq_lens), mb, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    return bt.to(device)


def dense_kv(fmt, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_len, b):
    """Decode sequence b's first seq_len tokens -> K, V float64 [L, H, D] (K in the rotated domain, V stored domain)."""
    bs = k_data.shape[2]
    t = torch.arange(seq_len)
    blk = block_table[b].cpu().long()[t // bs]
    off = t % bs
    kd = k_data.cpu()[blk, :, off]  # [L, H, Dk]
    ks = k_scales.cpu()[blk, :, off]
    vd = v_data.cpu()[blk, :, off]
    vs = v_scales.cpu()[blk, :, off]
    kgs = None if k_gs is None else k_gs.cpu()
    vgs = None if v_gs is None else v_gs.cpu()
    k = fmt.decode_k(kd, ks, kgs if fmt.k.uses_global_scale else None).double()
    v = fmt.decode_v(vd, vs, vgs if fmt.v.uses_global_scale else None).double()
    return k, v


def ref_decode(q, fmt, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_lens,
               sm_scale=None, softcap=None, window=None, rows_per_seq=1):
    """FP64 decode attention over the formats' decode of the pools -> (out [B,Hq,D] f64, lse [B,Hq] f64).
    `rows_per_seq = R`: query row r is at position `L - R + r % R` of sequence `r // R` (its last R tokens), causal;
    a row at a negative position attends nothing (0, -inf)."""
    bsz, hq, d = q.shape
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(bsz, hq, d, dtype=torch.float64)
    lse = torch.full((bsz, hq), float("-inf"), dtype=torch.float64)
    for r in range(bsz):
        b = r // rows_per_seq
        L = int(seq_lens[b])
        pos = L - rows_per_seq + r % rows_per_seq
        if pos < 0:
            continue
        k, v = dense_kv(fmt, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, L, b)
        qq = fmt.rotate_q(q[r:r + 1].cpu().double())  # [1, Hq, D], K's (rotated) domain
        o, lse[r:r + 1] = attend(qq, k, v, torch.tensor([pos]), sm_scale, softcap, window, causal=True)
        out[r] = fmt.unrotate_output(o[0])
    return out, lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP64 (out, lse) of attention whose head-h denominators gain exp(sinks[h]) (a logit with no value), from the
    same attention without them, by the definition: p_i = exp(s_i) / (exp(sink) + sum_j exp(s_j)), where
    sum_j exp(s_j) = exp(lse), both terms taken under the common shift m = max(lse, sink)."""
    s = sinks.double().cpu()[None, :].expand_as(lse)
    m = torch.maximum(lse.double(), s)
    keys, sink = torch.exp(lse.double() - m), torch.exp(s - m)
    return out.double() * (keys / (keys + sink))[..., None], m + torch.log(keys + sink)


def windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None,
             scale: float) -> torch.Tensor:
    """FP64 sliding-window attention written out here (not `attend`): q [T, Hq, D] at positions `q_pos` over k/v
    [L, Hkv, D] at positions 0..L-1 (GQA: query head h reads KV head h // (Hq / Hkv)); key j is seen iff
    `pos - window <= j <= pos` (window None: `j <= pos`); rows with no key give 0."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().cpu().repeat_interleave(g, dim=1), v.double().cpu().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,lhd->thl", q.double().cpu(), kk) * scale
    j, pos = torch.arange(k.shape[0]), q_pos.cpu()
    first = torch.zeros_like(pos) if window is None else pos - window
    seen = (j[None, :] <= pos[:, None]) & (j[None, :] >= first[:, None])
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(s, dim=-1).nan_to_num(0.0), vv)
