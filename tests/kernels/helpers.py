"""Helpers shared by the kernel tests: adversarial inputs and filled caches (CUDA-graph capture: `kvx_core.ops.graphs`).
(Pool / table builders and the FP64 attention oracle: `oracle.py`.)"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.ops import reference


def adversarial(t: int, h: int, d: int, seed: int = 0) -> torch.Tensor:
    """FP32 `[t, h, d]`: per-group magnitudes 1e-30..1e30, E2M1/E4M3 ties, zeros, -0, subnormals, NaN, inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    mag = 10.0 ** (torch.rand(t, h, d // 16, 1, generator=g) * 60 - 30)
    x = (x.view(t, h, d // 16, 16) * mag).view(t, h, d)
    x[0, 0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.0, 0, 1e-45, -1e-40,
                                 448 * 6, 464 * 6, 2.0 ** -10 * 6, 3e38])
    x[0, 0, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6] * 2) * -1.0
    if t > 1:
        x[1, 0, 3] = float("nan")
        x[1, h - 1, d - 1] = float("inf")
    if t > 2:
        x[2, 0] = 0.0                                 # all-zero row (int: constant, NVFP4: s == 0)
        x[2, h - 1] = 1.5                             # constant row
    if t > 3:
        x[3, 0] = torch.linspace(-3e38, 3e38, d)      # int range overflows FP32 / FP16
        x[3, h - 1, :16] = 2.0 ** -140                # FP32 subnormal group (MXFP4 byte 0 / 1)
        x[3, h - 1, 16:32] = -float("inf")
    if t > 4:
        x[4, 0] = torch.randn(d, generator=g) * 1e-4  # tiny: NVFP4 scale underflow guard at g = 1
    return x


def filled_cache(name, device, nb=12, bs=4, h=2, d=64, page_buffer=False, seed=0) -> PagedKVCache:
    """A one-layer cache whose every slot holds a token (the first 5 adversarial, the rest random), written by the
    torch reference in a random slot order; per-head global scales where the format has them."""
    c = PagedKVCache(name, num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=h, head_dim=d,
                     device=device, page_buffer=page_buffer, per_head_global_scale=True)
    if c.layers[0].k_global is not None:
        c.set_global_scales(0, torch.tensor([0.5, 2.0 ** -7] * (h // 2)), torch.tensor([3.3, 1.0] * (h // 2)))
    t = nb * bs
    g = torch.Generator().manual_seed(seed)
    k = adversarial(t, h, d, seed)
    k[5:] = torch.randn(t - 5, h, d, generator=g) * 3  # mostly finite so decoded rows are comparable
    v = torch.randn(t, h, d, generator=g)
    reference.write_kv(c.descriptor(0), WriteDesc(KvIoDesc(k.to(device), v.to(device)),
                                                  SlotMapping(torch.randperm(t, generator=g).to(device))))
    return c


def packed_tables(device):
    """A PACKED table of 4 ragged sequences (13, 0, 1 and 9 tokens at block size 4) over 12 blocks, and its lengths."""
    lens = torch.tensor([13, 0, 1, 9], dtype=torch.int32)
    bt = torch.tensor([[0, 2, 4, 6], [0, 0, 0, 0], [11, 0, 0, 0], [10, 9, 8, 0]], dtype=torch.int32)
    return BlockTable.packed(bt.to(device)), SeqLens(lens.to(device))


def close_attention(got, ref, tol=2e-2) -> None:
    """(out, lse) pairs: the same NaN rows (caches holding NaN / inf tokens propagate them on every path), finite
    rows within `tol` relative norm, LSEs finite in the same places."""
    (o, lse), (ro, rl) = got, ref
    o, ro, lse, rl = o.float().cpu(), ro.float().cpu(), lse.cpu(), rl.cpu()
    nan = ro.isnan().any(-1)
    assert torch.equal(o.isnan().any(-1), nan) and torch.equal(lse.isnan(), rl.isnan())
    assert (o[~nan] - ro[~nan]).norm() / max(float(ro[~nan].norm()), 1e-6) < tol
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))


def spy_run_bound(monkeypatch) -> list:
    """Records each call of the bound decode fast path (`DecodePlan.run_bound`), which still runs."""
    from kvx_core.ops import decode as decode_ops

    calls, real = [], decode_ops.DecodePlan.run_bound
    monkeypatch.setattr(decode_ops.DecodePlan, "run_bound", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


HOST_READS = frozenset({"__int__", "__bool__", "__float__", "__index__", "item", "tolist", "unique"})
"""Tensor functions that read device values on the host (or size their output by them): each is a host sync on a
GPU."""


class _HostReads(TorchFunctionMode):
    """Counts the `HOST_READS` calls made inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


def host_reads(fn) -> int:
    """How many times `fn()` reads device values on the host (`HOST_READS`)."""
    with _HostReads() as reads:
        fn()
    return reads.count
