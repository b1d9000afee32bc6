"""Memory / device rules with real CUDA and pinned allocations, and the reference ops on a GPU.

Marked `gpu`: CI (no CUDA) deselects them with `-m "not gpu"`; run `pytest -m gpu tests/core` on the
GPU machine. Without CUDA they skip with a reason (never silently). The CPU suite covers the same
rules with descriptors whose `memory` / device fields are set by hand.
"""
from __future__ import annotations

import pytest
import torch

from kvx_core import block_tables as bt
from kvx_core.descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    PoolDesc,
    SeqLens,
    SlotMapping,
    WriteDesc,
    memory_of,
)
from kvx_core.enums import Layout, Memory
from kvx_core.errors import KvxError, Status
from kvx_core.ops.reference import gather_kv, write_kv

from .helpers import build

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")]
N, B, H, D = 6, 4, 2, 8


def _cache(k, v, **kw):
    return CacheDesc.from_torch(k, v, block_size=B, num_kv_heads=H, head_dim=D, **kw)


def test_memory_types_of_real_allocations():
    assert memory_of(torch.zeros(2)) == Memory.HOST
    assert memory_of(torch.zeros(2).pin_memory()) == Memory.HOST_PINNED
    assert memory_of(torch.zeros(2, device="cuda")) == Memory.DEVICE


@pytest.mark.parametrize("k_where,v_where", [("pinned", "host"), ("host", "pinned"), ("cuda", "host"),
                                             ("cuda", "pinned"), ("host", "cuda")])
def test_k_and_v_in_different_memories(k_where, v_where):
    def alloc(where):
        t = torch.randn(N, B, H, D)
        return t.pin_memory() if where == "pinned" else t.cuda() if where == "cuda" else t

    with pytest.raises(KvxError) as ei:
        _cache(alloc(k_where), alloc(v_where))
    assert ei.value.status == Status.INVALID_ARGUMENT and "memories" in ei.value.message
    _cache(alloc(k_where), alloc(k_where))  # the same memory twice is fine


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)")
def test_k_and_v_on_different_gpus():
    with pytest.raises(KvxError) as ei:
        _cache(torch.randn(N, B, H, D, device="cuda:0"), torch.randn(N, B, H, D, device="cuda:1"))
    assert ei.value.status == Status.INVALID_ARGUMENT and "devices" in ei.value.message


def test_io_on_host_for_a_device_cache():
    c = _cache(torch.randn(N, B, H, D, device="cuda"), torch.randn(N, B, H, D, device="cuda"))
    w = WriteDesc(KvIoDesc(torch.randn(2, H, D), torch.randn(2, H, D)), SlotMapping(torch.tensor([0, 1])))
    with pytest.raises(KvxError) as ei:
        write_kv(c, w)
    assert ei.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("layout,pack", [(Layout.NHD, 1), (Layout.HND, 1), (Layout.HND_PACKED, 4),
                                         (Layout.CUSTOM, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_ops_on_gpu_match_cpu(layout, pack, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, B, H, D, generator=gen).to(dtype)
    table = torch.tensor([[4, 1], [0, 5], [2, 3]])
    lens = torch.tensor([7, 0, 5])
    seq = torch.tensor([0] * 7 + [2] * 5 + [-1])
    pos = torch.tensor(list(range(7)) + list(range(5)) + [-1])
    slots = bt.slot_mapping(table, seq, pos, B)
    key, value = torch.randn(13, H, D, generator=gen), torch.randn(13, H, D, generator=gen)
    outs = []
    for dev in ("cpu", "cuda"):
        k = build(x.to(dev), layout, pack, (2, 0, 3, 1), 1)  # padded / transposed storage on `dev`
        v = build(x.to(dev), layout, pack)
        c = _cache(k, v, k_layout=layout, v_layout=layout, pool=PoolDesc(memory_of(k), 1, k))
        # slots and tables may stay on the host for a device cache
        write_kv(c, WriteDesc(KvIoDesc(key.to(dev), value.to(dev)), SlotMapping(slots)))
        ind, ip = bt.packed_to_ragged(table, lens, B)
        res = []
        for blocks in (BlockTable.packed(table.to(dev)), BlockTable.ragged(ind.to(dev), ip.to(dev), 2),
                       BlockTable.kv_offsets(bt.packed_to_kv_offsets(table.to(dev), beam_width=2))):
            out = gather_kv(c, GatherDesc(blocks, SeqLens(lens.to(dev)), 6))
            assert out.key.device.type == dev
            res.append((out.key.cpu(), out.value.cpu()))
        outs.append(res)
    want_k = torch.cat([key[:6], key[7:12]]).to(dtype)
    for (kc, vc), (kg, vg) in zip(*outs, strict=True):
        assert torch.equal(kc, kg) and torch.equal(vc, vg)
    assert torch.equal(outs[0][0][0], want_k)
