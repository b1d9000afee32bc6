"""Triton dequantizing gather vs `reference.gather_kv` (bit-identical), and the CacheDesc dispatch."""
import pytest
import torch

from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.formats import list_formats
from kvx_core.ops import dispatch, reference
from kvx_core.ops.triton import gather_pools

from .helpers import filled_cache

ALL = list_formats()


def _table(bs, device):
    lens = torch.tensor([5, 0, 13, 1, 9], dtype=torch.int32)
    bt = torch.tensor([[3, 1, 0, 0], [0, 0, 0, 0], [0, 2, 4, 6], [11, 0, 0, 0], [10, 9, 8, 0]], dtype=torch.int32)
    return bt.to(device), lens.to(device)


def _eq(a, b):
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


@pytest.mark.parametrize("name", ALL)
def test_gather_bit_identical(name, device):
    c = filled_cache(name, device)
    bt, lens = _table(c.block_size, device)
    rk, rv = c.gather(0, bt, lens)  # reference
    p = c.layers[0]
    k, v = gather_pools(p.k_data, p.k_scales, p.v_data, p.v_scales, bt, lens, c.format, p.k_global, p.v_global,
                     out_dtype=torch.float32)
    assert k.dtype == rk.dtype and k.shape == rk.shape
    assert _eq(k, rk) and _eq(v, rv)


@pytest.mark.parametrize("name", ["bf16", "int4", "nvfp4_rot", "mxfp4_32", "fp8_e5m2"])
def test_gather_max_seq_len_out_dtype_page_buffer(name, device):
    c = filled_cache(name, device, page_buffer=True, seed=4)
    bt, lens = _table(c.block_size, device)
    desc = c.descriptor(0)
    gd = GatherDesc(BlockTable.packed(bt), SeqLens(lens), 7)
    ref = reference.gather_kv(desc, gd, out_dtype=torch.float16)
    p = c.layers[0]
    k, v = gather_pools(p.k_data, p.k_scales, p.v_data, p.v_scales, bt, lens, c.format, p.k_global, p.v_global,
                     max_seq_len=7, out_dtype=torch.float16)
    assert _eq(k, ref.key) and _eq(v, ref.value)


@pytest.mark.parametrize("name", ["int8", "nvfp4", "k8v4_rot", "fp16"])
def test_dispatch_matches_reference(name, device, monkeypatch):
    """`ops.dispatch` takes the Triton path (forced on CPU under the interpreter) and equals the reference."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    a, b = filled_cache(name, device, seed=1), filled_cache(name, device, seed=1)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(6, 2, 64, generator=g).to(device), torch.randn(6, 2, 64, generator=g).to(device)
    slots = torch.tensor([40, -1, 3, 17, -1, 46], device=device)
    dispatch.write_kv(a.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    reference.write_kv(b.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))
    for x, y in zip(vars(a.layers[0]).values(), vars(b.layers[0]).values(), strict=True):
        assert x is None or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    bt, lens = _table(a.block_size, device)
    gd = GatherDesc(BlockTable.packed(bt), SeqLens(lens), 100)
    got, ref = dispatch.gather_kv(a.descriptor(0), gd), reference.gather_kv(b.descriptor(0), gd)
    assert _eq(got.key, ref.key) and _eq(got.value, ref.value)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_gather_gpu_realistic(name):
    c = filled_cache(name, "cuda", nb=600, bs=16, h=8, d=128, seed=2)
    lens = torch.tensor([1, 777, 0, 4000, 2999], dtype=torch.int32, device="cuda")
    bt = torch.randint(0, 600, (5, 250), device="cuda", dtype=torch.int32)
    rk, rv = c.gather(0, bt, lens)
    p = c.layers[0]
    k, v = gather_pools(p.k_data, p.k_scales, p.v_data, p.v_scales, bt, lens, c.format, p.k_global, p.v_global,
                     out_dtype=torch.float32)
    assert _eq(k, rk) and _eq(v, rv)
