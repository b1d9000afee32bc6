"""Triton dequantizing gather vs `reference.gather_kv` (bit-identical), the CacheDesc dispatch, and the bound
(sync-free) gather."""
import pytest
import torch

from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format, list_formats
from kvx_core.ops import dispatch, reference
from kvx_core.ops.bound_gather import gather_bound
from kvx_core.ops.triton import gather_pools

from .helpers import filled_cache, host_reads

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


BOUND = [n for n in ALL if not get_format(n).rotate]


def _bound_args(lens: torch.Tensor, max_len: int):
    """cu_seqlens of `min(lens, max_len)` (int32, on the lengths' device) and their total."""
    n = lens.to(torch.int64).clamp(max=max_len)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(n, 0)
    return cu, int(n.sum())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", BOUND)
def test_bound_gather_is_the_reference_bit_for_bit(name, out_dtype, device, kernels_here):
    """`gather_bound` over a bound layer (ragged lengths 5, 0, 13, 1, 9; adversarial tokens: zeros, subnormals, huge,
    NaN / inf) writes what `reference.gather_kv` returns, bit for bit, in rows `cu_seqlens[b] ..`, and leaves the
    output's rows past the total as they were; also with `max_len` cutting sequences short."""
    c = filled_cache(name, device)
    layer = dispatch.bind(c.descriptor(0))
    bt, lens = _table(c.block_size, device)
    for max_len in (13, 7):
        cu, total = _bound_args(lens, max_len)
        ref = reference.gather_kv(c.descriptor(0), GatherDesc(BlockTable.packed(bt), SeqLens(lens), max_len),
                                  out_dtype=out_dtype)
        out = tuple(torch.full((total + 3, 2, 64), 7.0, dtype=out_dtype, device=device) for _ in range(2))
        gather_bound(layer, bt, lens, cu, max_len, out)
        assert _eq(out[0][:total], ref.key) and _eq(out[1][:total], ref.value)
        assert bool((out[0][total:] == 7).all()) and bool((out[1][total:] == 7).all())


def test_bound_gather_launches_one_kernel_and_reads_nothing_on_the_host(device, monkeypatch, kernels_here):
    """The bound gather is one kernel launch and no host read of device values (each would be a host sync on a GPU:
    `helpers.HOST_READS`), where `gather_pools` pays its checks' syncs."""
    from kvx_core.ops.triton import gather as gather_mod

    c = filled_cache("nvfp4", device)
    layer = dispatch.bind(c.descriptor(0))
    bt, lens = _table(c.block_size, device)
    cu, total = _bound_args(lens, 13)
    out = tuple(torch.empty(total, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    launches = []

    class Counted:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(grid)

    monkeypatch.setattr(gather_mod, "_gather_kernel", Counted())
    assert host_reads(lambda: gather_bound(layer, bt, lens, cu, 13, out)) == 0
    assert launches == [(1, 5, 4)]  # cdiv(13, 32) token tiles, 5 sequences, K and V of 2 heads
    p = c.layers[0]
    assert host_reads(lambda: gather_pools(p.k_data, p.k_scales, p.v_data, p.v_scales, bt, lens, c.format,
                                           p.k_global, p.v_global, out_dtype=torch.bfloat16)) > 0


def test_bound_gather_refusals_change_nothing(device, kernels_here):
    """Rotated layers (their values need the rotation back) and malformed arguments are refused with a KvxError
    naming what to pass; the output is untouched."""
    bt, lens = _table(4, device)
    cu, total = _bound_args(lens, 13)
    rot = dispatch.bind(filled_cache("nvfp4_rot", device).descriptor(0))
    out = tuple(torch.zeros(total, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    with pytest.raises(KvxError) as e:
        gather_bound(rot, bt, lens, cu, 13, out)
    assert e.value.status == Status.UNSUPPORTED and "gather_kv" in e.value.message
    layer = dispatch.bind(filled_cache("int4", device).descriptor(0))
    bad = [
        ((bt.to(torch.int64), lens, cu, 13, out), "block_table"),
        ((bt, lens[:3], cu, 13, out), "seq_lens"),
        ((bt, lens, cu[:-1], 13, out), "cu_seqlens"),
        ((bt, lens, cu, 13.0, out), "max_len"),
        ((bt, lens, cu, -1, out), "max_len"),
        ((bt, lens, cu, 13, (out[0], out[1][:, :1])), "out"),
        ((bt, lens, cu, 13, (out[0], out[1].to(torch.int32))), "out"),
        ((bt, lens, cu, 13, out[0]), "out"),
        ((bt, lens, cu, 13, (out[0], out[0])), "overlap"),
        ((bt, lens, cu, 13, (out[0], _alias(layer.v_data, out[1]))), "V data pool"),
        ((bt, lens, cu, 13, (_alias(layer.k_scales, out[0]), out[1])), "K scales pool"),
    ]
    pools = [t.clone() for t in (layer.k_data, layer.k_scales, layer.v_data, layer.v_scales)]
    for args, what in bad:
        with pytest.raises(KvxError) as e:
            gather_bound(layer, *args)
        assert e.value.status == Status.INVALID_ARGUMENT and what in e.value.message, (what, e.value.message)
        assert not out[0].any() and not out[1].any()
    assert all(torch.equal(a, b) for a, b in zip(pools, (layer.k_data, layer.k_scales, layer.v_data, layer.v_scales),
                                                 strict=True))


def _alias(pool: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed as `like` whose first elements are `pool`'s first bytes (a gather into it would
    write into the cache)."""
    t = torch.empty(0, dtype=like.dtype, device=like.device)
    return t.set_(pool.untyped_storage(), pool.storage_offset() * pool.element_size() // like.element_size(),
                  like.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("name", BOUND)
def test_bound_gather_gpu_realistic(name):
    """The bound gather on CUDA at a serving size (ragged lengths up to 4000 over 600 pages of 16 x 8 x 128): BF16
    rows equal the reference's BF16 gather bit for bit."""
    c = filled_cache(name, "cuda", nb=600, bs=16, h=8, d=128, seed=2)
    lens = torch.tensor([1, 777, 0, 4000, 2999], dtype=torch.int32, device="cuda")
    bt = torch.randint(0, 600, (5, 250), device="cuda", dtype=torch.int32)
    cu, total = _bound_args(lens, 4000)
    ref = reference.gather_kv(c.descriptor(0), GatherDesc(BlockTable.packed(bt), SeqLens(lens), 4000),
                              out_dtype=torch.bfloat16)
    out = tuple(torch.empty(total, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    gather_bound(dispatch.bind(c.descriptor(0)), bt, lens, cu, 4000, out)
    assert _eq(out[0], ref.key) and _eq(out[1], ref.value)
