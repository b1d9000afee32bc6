"""`KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4`: V scale pools interleaved by 4 tokens (TRT-LLM's NVFP4 layout).

The expected byte positions are written out from TRT-LLM's writer (`quantizeAndWriteFP4KVCache`: `(r // 4) * 4 * S +
j * 4 + r % 4` with `r = h * T + t` inside a block), not taken from `kvx_core.scale_layout`.
"""
from __future__ import annotations

import pytest
import torch

from kvx_core.codec import format_of, quant_desc
from kvx_core.descriptors import BlockTable, CacheDesc, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import QUANT_FLAG_V_SCALE_INTERLEAVE4, Layout
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.ops import reference

D, H = 32, 2
S = D // 16
NVFP4 = get_format("nvfp4")


def _cache(n: int, t: int, fmt=NVFP4, flags: int = QUANT_FLAG_V_SCALE_INTERLEAVE4, scales=None):
    data = [torch.zeros(n, H, t, D // 2, dtype=torch.uint8) for _ in range(2)]
    scales = scales or [torch.zeros(n, H, t, S, dtype=torch.uint8) for _ in range(2)]
    g = torch.tensor([0.5, 2.0])
    q = quant_desc(fmt, D, scales[0], scales[1], g, g.clone(), flags=flags)
    return CacheDesc.from_torch(*data, block_size=t, num_kv_heads=H, head_dim=D, k_layout=Layout.HND,
                                v_layout=Layout.HND, quant=q), scales, g


def test_writes_store_v_scales_at_the_interleaved_bytes():
    """`write_kv` into a PACKED cache with interleaved V scales puts each scale byte where TRT-LLM's writer would,
    and `gather_kv` reads the encoded rows back."""
    n, t = 3, 8
    cache, scales, g = _cache(n, t)
    slots = torch.tensor([17, 3, 8, 9, 10, 11, 23, 0])
    k, v = (torch.randn(slots.numel(), H, D, generator=torch.Generator().manual_seed(i)) for i in range(2))
    reference.write_kv(cache, WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    ks, (vp, vs) = NVFP4.k.encode(k, g)[1], NVFP4.v.encode(v, g)
    blk, off = slots // t, slots % t
    r = torch.arange(H).view(1, -1, 1) * t + off.view(-1, 1, 1)
    j = torch.arange(S).view(1, 1, -1)
    plane = scales[1].view(n, H * t * S)
    assert torch.equal(plane[blk.view(-1, 1, 1), (r // 4) * 4 * S + j * 4 + r % 4], vs)
    assert torch.equal(scales[0][blk, :, off], ks)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # one sequence over blocks 2, 0, 1: slots 16.., 0.., 8..
    lens = SeqLens(torch.tensor([24], dtype=torch.int32))
    out = reference.gather_kv(cache, GatherDesc(BlockTable.packed(table), lens, 24))
    seq_slot = (table[0].repeat_interleave(t) * t + torch.arange(t).repeat(3)).tolist()
    pos = torch.tensor([seq_slot.index(s) for s in slots.tolist()])  # where each written slot lands in the sequence
    assert torch.equal(out.value[pos], NVFP4.v.decode(vp, vs, g))


@pytest.mark.parametrize("kw,status,words", [
    ({"t": 2}, Status.UNSUPPORTED, "block_size % 4"),
    ({"t": 8, "fmt": get_format("mxfp4")}, Status.INVALID_ARGUMENT, "NVFP4 only"),
    ({"t": 8, "flags": 1 << 3}, Status.UNSUPPORTED, "bits this KVX version does not know"),
])
def test_the_flag_is_checked_where_the_format_is_resolved(kw, status, words):
    cache, _, _ = _cache(2, **kw)
    with pytest.raises(KvxError) as err:
        format_of(cache)
    assert err.value.status == status and words in str(err.value), str(err.value)


def test_interleaved_planes_must_be_contiguous():
    """A V scale pool whose [block_size, S] planes are strided cannot carry the in-plane permutation."""
    wide = torch.zeros(2, H, 8, 2 * S, dtype=torch.uint8)
    cache, _, _ = _cache(2, 8, scales=[torch.zeros(2, H, 8, S, dtype=torch.uint8), wide[..., :S]])
    with pytest.raises(KvxError, match="contiguous") as err:
        format_of(cache)
    assert err.value.status == Status.INVALID_ARGUMENT
