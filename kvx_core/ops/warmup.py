"""Compile a layer's prefill kernels before serving: Triton compiles a kernel at its first launch with a new set of
compile-time arguments, and the split variant of the prefill (and its merge) first runs at a step of few queries over
a long cached prefix: in vLLM the first prefix-cache hit, which then waited for the compiler (vLLM's JIT monitor
logged `_prefill_kernel` and `_merge_kernel` compiled while serving in every KVX run on the H200, 2026-11-28; one such
compile landed inside a timed decode pass and made that benchmark row invalid). The split count itself no longer
selects a kernel (neither kernel specializes on it, `triton/merge.py`), so one split and one unsplit launch per layer
configuration compile everything a prefill of that configuration launches."""
from __future__ import annotations

import torch

from ..codec import format_of
from ..descriptors import BlockTable, CacheDesc, SeqLens
from .dispatch import plan_prefill


def warm_up_prefill(cache: CacheDesc, *, num_qo_heads: int, q_dtype: torch.dtype, sm_scale: float | None = None,
                    softcap: float | None = None, window: int | None = None, causal: bool = False,
                    queries_after: bool = True) -> int:
    """Run the prefill kernel of `cache`'s layout and format once unsplit and once split (S = 2) for one query over the
    cache's first block, with the options a step of this layer plans (vLLM's split prefill: `causal=False`,
    `queries_after=True` over the cached prefix), into scratch outputs: the cache is only read. Returns the launches
    made: 0 where no kernel serves this cache or query dtype (the reference then serves every step: nothing to
    compile)."""
    device = cache.k.tensor.device
    table = BlockTable.packed(torch.zeros(1, 1, dtype=torch.int32, device=device))
    lens = SeqLens(torch.full((1,), cache.block_size, dtype=torch.int32, device=device))
    q = torch.zeros(1, num_qo_heads, cache.head_dim, dtype=q_dtype, device=device)
    runs = 0
    for splits in (1, 2):
        plan = plan_prefill(torch.tensor([0, 1], dtype=torch.int32), table, lens, fmt=format_of(cache),
                            num_qo_heads=num_qo_heads, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
                            block_size=cache.block_size, q_dtype=q_dtype, device=device, causal=causal,
                            sm_scale=sm_scale, softcap=softcap, window=window, queries_after=queries_after,
                            num_splits=splits, check=False)
        if plan.kernel is None:
            return 0
        plan.run(q, cache, out=torch.empty_like(q),
                 lse=torch.empty(1, num_qo_heads, dtype=torch.float32, device=device))
        runs += 1
    return runs

