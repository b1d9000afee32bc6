"""Helpers shared by the core tests: build a tensor of any KVX layout from a logical
`[num_blocks, block_size, heads, head_dim]` tensor by hand (spec §4.2 dim orders), independently of
kvx_core.layouts."""
from __future__ import annotations

import torch

from kvx_core.enums import Layout

ALL_LAYOUTS = [Layout.NHD, Layout.HND, Layout.HND_PACKED, Layout.CUSTOM]
# memory orders for CUSTOM tensors (a transposed allocation, exposed in logical order)
PERMS = [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1), (0, 3, 1, 2), (1, 3, 0, 2)]


def inverse(perm):
    return tuple(sorted(range(len(perm)), key=perm.__getitem__))


def build(x: torch.Tensor, layout: Layout, pack: int = 1, perm=(0, 1, 2, 3), pad: int = 0) -> torch.Tensor:
    """A `layout` tensor holding logical X. CUSTOM is X stored in memory order `perm` and exposed in
    logical order; `pad` > 0 allocates every dim `pad` larger (zeros) and slices from offset `pad`
    (a non-canonical stride pattern with a storage offset). Deterministic: building equal X with
    equal arguments gives byte-identical storage."""
    n, b, h, d = x.shape
    if layout == Layout.NHD:
        mem, back = x, None
    elif layout == Layout.HND:
        mem, back = x.permute(0, 2, 1, 3), None
    elif layout == Layout.HND_PACKED:
        mem, back = x.reshape(n, b, h, d // pack, pack).permute(0, 2, 3, 1, 4), None
    else:
        mem, back = x.permute(*perm), inverse(perm)
    if pad:
        big = torch.zeros(tuple(s + pad for s in mem.shape), dtype=x.dtype, device=x.device)
        sl = tuple(slice(pad, pad + s) for s in mem.shape)
        big[sl] = mem
        out = big[sl]
    else:
        out = mem.clone(memory_format=torch.contiguous_format)  # always a fresh allocation
    return out.permute(*back) if back else out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of `t`'s storage, including bytes no element of the view reaches."""
    return torch.frombuffer(bytearray(t.untyped_storage()), dtype=torch.uint8)


def divisors(d: int) -> list[int]:
    return [p for p in range(1, d + 1) if d % p == 0]
