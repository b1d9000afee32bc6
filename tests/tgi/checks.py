"""What the TGI tests compare: teacher-forced perplexity, the block count warmup must give, and the KVX cache
read back against the K/V TGI handed to `KVCache.store` (recorded by a spy on the real method)."""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from kvx_core.descriptors import BlockTable, GatherDesc, SeqLens
from kvx_core.ops import reference

PPL_BOUND = {
    "bf16": 0.0, "fp16": 0.01, "fp8_e4m3": 0.02, "fp8_e5m2": 0.06, "int8": 0.02, "k8v4": 0.03, "k8v4_rot": 0.03,
    "nvfp4": 0.20, "nvfp4_rot": 0.20, "int4": 0.30, "int4_rot": 0.12,
    "mxfp4": 0.50, "mxfp4_floor": 0.50, "mxfp4_32": 0.55, "mxfp4_32_floor": 0.55, "mxfp4_rot": 0.30,
    "mxfp4_32_rot": 0.35,
}
"""Allowed relative perplexity increase over the BF16 run (512 tokens of the demo text, 4 chunks of 128, every
query attending K/V read back from the cache). Measured on CPU: fp8_e4m3 +0.2%, fp8_e5m2 +2.4%, int8 +0.7%,
k8v4 +0.5%, nvfp4 +8.6%, nvfp4_rot +9.9%, int4 +16.1%, int4_rot +5.1%, mxfp4 +36.3%, mxfp4_rot +13.5%,
mxfp4_32 +38%: the bounds leave about 2x (the 4-bit MX formats ~1.4x) over those; a broken cache path gives
perplexities in the hundreds. fp16 is exact storage of bf16 activations (TGI computes in bf16)."""


def perplexity(logprobs: list[float]) -> float:
    """exp(-mean) over the scored prompt tokens (TGI reports no logprob for the first)."""
    scored = logprobs[1:]
    return math.exp(-sum(scored) / len(scored))


def expected_blocks(fmt, cache_bytes: int, layers: int, block_size: int, kv_heads: int, head_dim: int) -> int:
    """Blocks a cache of `cache_bytes` holds at the format's pinned bytes per (token, KV head)."""
    per_block = layers * block_size * kv_heads * fmt.bytes_per_token_head(head_dim)
    return int(cache_bytes // per_block)


class StoreSpy:
    """Records what TGI passes to each layer's `KVCache.store` (wraps the real method; install with monkeypatch)."""

    def __init__(self) -> None:
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = defaultdict(list)

    def wrap(self, original):
        def store(cache, *, key, value, slots, kv_scales):
            if key.is_cuda and torch.cuda.is_current_stream_capturing():  # graph capture: dummy inputs, and
                return original(cache, key=key, value=value, slots=slots, kv_scales=kv_scales)  # replays skip Python
            # in the model's dtype: the write rotates (the _rot formats) and encodes from it
            self.calls[id(cache)].append((slots.detach().cpu().clone(), key.detach().cpu().clone(),
                                          value.detach().cpu().clone()))
            return original(cache, key=key, value=value, slots=slots, kv_scales=kv_scales)

        return store

    def stored(self, cache, slots: list[int], required: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(positions, K, V): the last K/V seen written to each of `slots` in `cache` (`[T, H, D]`, as TGI passed
        them). The first `required` slots must have been seen; later ones may have been written by CUDA-graph
        replays, which run no Python."""
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for s, k, v in self.calls[id(cache)]:
            for i, slot in enumerate(s.tolist()):
                rows[slot] = (k[i], v[i])
        missing = [s for s in slots[:required] if s not in rows]
        assert not missing, f"no store() call wrote slots {missing[:8]}"
        pos = [t for t, s in enumerate(slots) if s in rows]
        return pos, torch.stack([rows[slots[t]][0] for t in pos]), torch.stack([rows[slots[t]][1] for t in pos])


def slots_of(blocks: list[int], block_size: int, n: int) -> list[int]:
    """The slot of each of a request's first `n` tokens over its blocks (the router's rule)."""
    return [blocks[t // block_size] * block_size + t % block_size for t in range(n)]


def cache_mismatches(caches, spy: StoreSpy, blocks: list[int], n: int, required: int | None = None) -> list[str]:
    """Layers whose first `n` tokens, gathered back through KVX from the request's blocks, differ from the
    format's encode -> decode of the K/V TGI stored for those tokens (keys minus the layer's centering vector and
    divided by its smoothing vector first, in FP32 rounded to K's dtype, multiplied by s and plus c after, when it
    has them: decode(encode((K - c) / s)) * s + c; exact equality). The first `required`
    (default all) must have been written by eager steps the spy saw; others are compared when seen."""
    bad = []
    for i, cache in enumerate(caches):
        desc = cache.desc
        table = BlockTable.packed(torch.tensor([blocks], dtype=torch.int32, device=desc.k.tensor.device))
        got = reference.gather_kv(desc, GatherDesc(table, SeqLens(torch.tensor([n], device=table.indices.device)),
                                                   n), out_dtype=torch.float32)
        pos, k, v = spy.stored(cache, slots_of(blocks, desc.block_size, n), n if required is None else required)
        fmt, pools = cache.format, cache.cache.layers[0]
        gk = None if pools.k_global is None else pools.k_global.cpu()
        gv = None if pools.v_global is None else pools.v_global.cpu()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fmt.name)
        if dtype is not None:  # identity formats store the activations in their dtype
            k, v = k.to(dtype), v.to(dtype)
        # key centering and smoothing (a KV calibration): (K - c) / s stored, read back times s plus c
        sk, ck = (None if t is None else t.cpu() for t in (pools.k_smoothing, pools.k_center))
        if sk is not None or ck is not None:
            kf = k.float() - (0 if ck is None else ck)
            k = (kf if sk is None else kf / sk).to(k.dtype)
        want_k = fmt.unrotate_output(fmt.decode_k(*fmt.encode_k(k, gk), gk))  # gather returns the model's domain
        if sk is not None:
            want_k = want_k * sk
        if ck is not None:
            want_k = want_k + ck
        want_v = fmt.decode_v(*fmt.encode_v(v, gv), gv, unrotate=True)
        if not (torch.equal(got.key.cpu()[pos].float(), want_k.float()) and
                torch.equal(got.value.cpu()[pos].float(), want_v.float())):
            bad.append(f"layer {i}")
    return bad
