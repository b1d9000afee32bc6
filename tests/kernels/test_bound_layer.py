"""`dispatch.bind`: a layer bound once decodes and writes exactly as its descriptor does (the same kernels on the
same arguments: bit for bit), refuses what does not match its plan without touching anything, and is None where
the kernels cannot address the cache."""
from __future__ import annotations

import pytest
import torch

from kvx_core.codec import format_of
from kvx_core.descriptors import BlockTable, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat
from kvx_core.errors import KvxError, Status
from kvx_core.ops import attention, dispatch

from .helpers import filled_cache, spy_run_bound
from .test_kv_offsets_kernels import _close, _trtllm

NAMES = ["nvfp4", "int8", "k8v4_rot", "bf16", "mxfp4"]


def _plan(name, device, batch=2):
    table = BlockTable.packed(torch.tensor([[0, 2, 4, 6], [1, 3, 0, 0]][:batch], dtype=torch.int32).to(device))
    lens = SeqLens(torch.tensor([13, 6][:batch], dtype=torch.int32).to(device))
    return dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
                                q_dtype=torch.bfloat16, device=device, max_seq_len=16, check=False)


def _cache(name, device, smoothed):
    c = filled_cache(name, device, page_buffer=True, h=2, seed=5)
    if smoothed:  # a fresh cache with smoothing, filled by the descriptor path below
        c.set_key_smoothing(0, torch.rand(2, 64, generator=torch.Generator().manual_seed(2)) + 0.5)
    return c


@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_bound_decode_equals_the_descriptor_decode(name, smoothed, device, monkeypatch):
    if smoothed and name == "bf16":
        pytest.skip("key smoothing is for quantized formats")
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    c = _cache(name, device, smoothed)
    desc = c.descriptor(0)
    plan = _plan(name, device)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    want, _ = plan.run(q, desc, out=torch.empty_like(q), want_lse=False)
    want = want.clone()
    got, lse = plan.run(q, dispatch.bind(desc), out=torch.empty_like(q), want_lse=False)
    assert lse is None and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("invalid_slot", [-1, 9])
@pytest.mark.parametrize("name", NAMES)
def test_bound_write_equals_the_descriptor_write(name, invalid_slot, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    a, b = (filled_cache(name, device, page_buffer=True, h=2, seed=5) for _ in range(2))
    g = torch.Generator().manual_seed(4)
    k = (torch.randn(4, 2, 64, generator=g) * 4).to(torch.bfloat16).to(device)
    v = torch.randn(4, 2, 64, generator=g).to(torch.bfloat16).to(device)
    slots = torch.tensor([5, -1, 9, 30]).to(device)  # -1 and (with invalid_slot 9) 9 are padding
    w = WriteDesc(KvIoDesc(k, v), SlotMapping(slots, invalid_slot))
    dispatch.write_kv(a.descriptor(0), w, check=False)
    dispatch.write_kv(dispatch.bind(b.descriptor(0)), w, check=False)
    for pa, pb in zip(a.layers[0].__dict__.values(), b.layers[0].__dict__.values(), strict=True):
        if isinstance(pa, torch.Tensor):
            assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8))


def test_bound_refusals_change_nothing(device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    c = filled_cache("nvfp4", device, page_buffer=True, h=2, seed=5)
    layer = dispatch.bind(c.descriptor(0))
    before = [t.clone() for t in (c.layers[0].k_data, c.layers[0].v_data)]
    q = torch.randn(2, 4, 64).to(torch.bfloat16).to(device)
    out = torch.zeros_like(q)
    for bad_q in (q[:1], q.float(), q[:, :2]):
        with pytest.raises(KvxError) as e:
            _plan("nvfp4", device).run(bad_q, layer, out=out, want_lse=False)
        assert e.value.status == Status.INVALID_ARGUMENT and not out.any()
    with pytest.raises(KvxError) as e:  # a plan for another format
        _plan("int8", device).run(q, layer, out=out, want_lse=False)
    assert e.value.status == Status.INVALID_ARGUMENT and not out.any()
    k = torch.randn(3, 2, 64).to(torch.bfloat16).to(device)
    for w in (WriteDesc(KvIoDesc(k, k[:2]), SlotMapping(torch.tensor([1, 2, 3]).to(device))),
              WriteDesc(KvIoDesc(k[:, :1], k[:, :1]), SlotMapping(torch.tensor([1, 2, 3]).to(device))),
              WriteDesc(KvIoDesc(k, k), SlotMapping(torch.tensor([1, 2]).to(device)))):
        with pytest.raises(KvxError) as e:
            dispatch.write_kv(layer, w, check=False)
        assert e.value.status == Status.INVALID_ARGUMENT
    assert all(torch.equal(x, y) for x, y in zip(before, (c.layers[0].k_data, c.layers[0].v_data), strict=True))


def test_bind_is_none_where_the_kernels_do_not_run():
    c = filled_cache("nvfp4", "cpu", page_buffer=True, h=2)
    assert dispatch.bind(c.descriptor(0)) is None  # CPU pools without the kernel device: the reference serves them
    with pytest.raises(KvxError):
        dispatch.bind("not a cache")


def _offsets_plan(layer, lens, device, check=False):
    """A sync-free decode plan over a TRT-LLM layer's KV_OFFSETS table (as an engine makes one per step)."""
    c = layer.cache
    return dispatch.plan_decode(layer.table, lens, fmt="bf16", num_qo_heads=4, num_kv_heads=c.num_kv_heads,
                                head_dim=c.head_dim, block_size=c.block_size, q_dtype=torch.bfloat16, device=device,
                                max_seq_len=16, check=check)


def test_offsets_plan_over_a_layer_bound_for_packed_reads_the_right_v(device, monkeypatch):
    """A layer bound for PACKED tables holds V unshifted; a KV_OFFSETS plan (V one block after K) must not run its
    kernels on those views: it gives the reference's attention."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, lens, _ = _trtllm(device, torch.bfloat16, seed=3)
    bound = dispatch.bind(layer.cache)
    assert bound is not None and bound.table_format == BlockTableFormat.PACKED
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(device)
    want = attention.paged_decode(q, layer.cache, layer.table, lens)
    got, _ = _offsets_plan(layer, lens, device).run(q, bound, out=torch.empty_like(q), want_lse=False)
    _close((got, want[1]), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_offsets_bound_layer_takes_the_fast_path_and_equals_the_descriptor(dtype, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, lens, _ = _trtllm(device, dtype, seed=3)
    bound = dispatch.bind(layer.cache, table_format=BlockTableFormat.KV_OFFSETS)
    assert bound is not None and bound.table_format == BlockTableFormat.KV_OFFSETS
    plan = dispatch.plan_decode(layer.table, lens, fmt=format_of(layer.cache), num_qo_heads=4, num_kv_heads=2,
                                head_dim=64, block_size=4, q_dtype=torch.bfloat16, device=device, max_seq_len=16,
                                check=False)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(device)
    want, _ = plan.run(q, layer.cache, out=torch.empty_like(q), want_lse=False)
    want = want.clone()
    calls = spy_run_bound(monkeypatch)
    got, _ = plan.run(q, bound, out=torch.empty_like(q), want_lse=False)
    assert calls and torch.equal(got.view(torch.int16), want.view(torch.int16))
    _close((got, want), (attention.paged_decode(q, layer.cache, layer.table, lens)[0], want), tol=2e-2)


def test_packed_plan_over_an_offsets_bound_layer_runs_on_the_descriptor(device, monkeypatch):
    """The other direction: a PACKED plan must not read the shifted V of a layer bound for KV_OFFSETS."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    desc = _trtllm(device, torch.bfloat16, seed=3)[0].cache  # its block array read through a PACKED table
    bound = dispatch.bind(desc, table_format=BlockTableFormat.KV_OFFSETS)
    assert bound is not None
    plan = _plan("bf16", device)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    want, _ = plan.run(q, desc, out=torch.empty_like(q), want_lse=False)
    want = want.clone()
    calls = spy_run_bound(monkeypatch)
    got, _ = plan.run(q, bound, out=torch.empty_like(q), want_lse=False)
    assert not calls and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bind_for_offsets_is_none_where_v_is_not_one_block_after_k(device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    desc = filled_cache("nvfp4", device, page_buffer=True, h=2).descriptor(0)  # K and V: separate block arrays
    assert dispatch.bind(desc) is not None
    assert dispatch.bind(desc, table_format=BlockTableFormat.KV_OFFSETS) is None
    assert dispatch.bind(desc, table_format=BlockTableFormat.RAGGED) is None  # no kernels read RAGGED tables
    with pytest.raises(KvxError) as e:
        dispatch.bind(desc, table_format=2)
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("check", [False, True])
def test_write_into_an_offsets_bound_layer_is_refused(check, device, monkeypatch):
    """K and V of a KV_OFFSETS layer are one block array: a slot-mapped write would store V over K."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, _, _ = _trtllm(device, torch.bfloat16, seed=3)
    bound = dispatch.bind(layer.cache, table_format=BlockTableFormat.KV_OFFSETS)
    pool = layer.cache.k.tensor
    before = pool.clone()
    k = torch.randn(2, 2, 64).to(torch.bfloat16).to(device)
    with pytest.raises(KvxError) as e:
        dispatch.write_kv(bound, WriteDesc(KvIoDesc(k, k + 1), SlotMapping(torch.tensor([4, 9]).to(device))),
                          check=check)
    assert e.value.status == Status.INVALID_ARGUMENT and "layer_views" in str(e.value)
    assert torch.equal(pool.view(torch.int16), before.view(torch.int16))
