"""Safety of the ops entry points (issue 10: F1, F11, F8, F9 and writes with inputs that require grad).

Every write entry point (`ops.reference`, `ops.dispatch` on the kernel path, forced on CPU under the Triton
interpreter, and the raw Triton launcher) is all or nothing: a rejected write leaves all four pools (data and
scales) and the global scales byte-identical (oracle: `.clone()` before, `torch.equal` after). Kernel-path
block tables are range-checked on the caller's dtype before narrowing to int32; gather arguments are refused
with KvxError and a message naming the argument; Hadamard rotations are bit-identical whatever the batch.
"""
import copy
import functools
import math

import numpy as np
import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, CacheDesc, GatherDesc, KvIoDesc, ScaleDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import DType, Layout, ScaleGranularity
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format, hadamard, list_formats, rotate
from kvx_core.ops import attention, checks, dispatch, reference, triton as kernels

INV, OOR, UNS = Status.INVALID_ARGUMENT, Status.OUT_OF_RANGE, Status.UNSUPPORTED
NB, BS, H, D = 6, 4, 2, 64
ALL = list_formats()
GLOBAL = [n for n in ALL if get_format(n).k.uses_global_scale or get_format(n).v.uses_global_scale]
ROT = [n for n in ALL if get_format(n).rotate]


def _raises(status: Status, fn, match: str | None = None) -> KvxError:
    with pytest.raises(KvxError) as e:
        fn()
    assert e.value.status == status, e.value
    if match:
        assert match in e.value.message, e.value.message
    return e.value


def _cache(name: str, device: str = "cpu", page_buffer: bool = False, seed: int = 0) -> PagedKVCache:
    """A fresh one-layer cache whose every slot holds random tokens (so a stray store would show)."""
    return copy.deepcopy(_filled(name, device, page_buffer, seed))


@functools.cache
def _filled(name: str, device: str, page_buffer: bool, seed: int) -> PagedKVCache:
    c = PagedKVCache(name, num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D, device=device,
                     page_buffer=page_buffer, per_head_global_scale=True)
    if c.layers[0].k_global is not None:
        c.set_global_scales(0, torch.tensor([0.5, 2.0]), torch.tensor([3.0, 1.0]))
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, NB * BS, H, D, generator=g).to(device)
    reference.write_kv(c.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(torch.arange(NB * BS, device=device))))
    return c


def _pools(c: PagedKVCache) -> list[torch.Tensor]:
    """All four pools (data and scales) and both global scales of layer 0."""
    return [t for t in vars(c.layers[0]).values() if t is not None]


def _snapshot(c: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for t in _pools(c)]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_unchanged(c: PagedKVCache, snap: list[torch.Tensor]) -> None:
    for before, now in zip(snap, _pools(c), strict=True):
        assert _same_bytes(before, now), "a rejected call changed the cache"


# ----------------------------------------------------------------------------- F1: all-or-nothing writes
def _x(t=3, h=H, d=D, dtype=torch.float32, seed=1):
    return torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


# name -> (key, value, slots, status, structural): structural cases need no value read (rejected even with check=False)
def _bad_io():
    ok_slots = torch.tensor([5, 9, 2])
    return {
        "V head_dim": (_x(), _x(d=D // 2), ok_slots, INV, True),
        "K head_dim": (_x(d=D // 2), _x(), ok_slots, INV, True),
        "V heads": (_x(), _x(h=H + 1), ok_slots, INV, True),
        "K heads": (_x(h=1), _x(), ok_slots, INV, True),
        "V dtype": (_x(), _x(dtype=torch.float64), ok_slots, UNS, True),
        "K dtype": (_x(dtype=torch.float64), _x(), ok_slots, UNS, True),
        "V fewer tokens": (_x(), _x(t=2), ok_slots, INV, True),
        "V 2-D": (_x(), _x()[:, 0], ok_slots, INV, True),
        "slots float": (_x(), _x(), ok_slots.float(), INV, True),
        "slots 2-D": (_x(), _x(), ok_slots[None], INV, True),
        "V a list": (_x(), _x().tolist(), ok_slots, INV, True),
        "slots a list": (_x(), _x(), [5, 9, 2], INV, True),
        "slot out of range": (_x(), _x(), torch.tensor([5, 9, NB * BS]), OOR, False),
        "slot 2**32 + 2": (_x(), _x(), torch.tensor([5, 9, 2**32 + 2]), OOR, False),
        "duplicate slots": (_x(), _x(), torch.tensor([5, 9, 5]), INV, False),
    }


BAD_IO = list(_bad_io())
BAD_SCALES = {"0": 0.0, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "negative": -1.0, "1e39 (FP64)": 1e39}


def _bad_scale(value, which: str, dtype=torch.float32) -> torch.Tensor:
    g = torch.tensor([1.0, 1.0], dtype=torch.float64)
    g[1 if which == "v" else 0] = value
    return g.to(dtype)


def _write(entry: str, c: PagedKVCache, key, value, slots, kg=None, vg=None, check=True):
    """One write through `entry`; `kg` / `vg` replace the cache's global scales when given."""
    desc = c.descriptor(0)
    if kg is not None:
        desc.quant.k_global_scale = kg
    if vg is not None:
        desc.quant.v_global_scale = vg
    w = WriteDesc(KvIoDesc(key, value), SlotMapping(slots))
    if entry == "reference":
        return reference.write_kv(desc, w)
    if entry == "dispatch":
        return dispatch.write_kv(desc, w, check=check)
    p = c.layers[0]
    return kernels.write_pools(key, value, slots, p.k_data, p.k_scales, p.v_data, p.v_scales, c.format,
                            p.k_global if kg is None else kg, p.v_global if vg is None else vg, check=check)


@pytest.fixture
def kernel_path(monkeypatch, device):
    """`ops.dispatch` takes the kernels on CPU pools, as it does on CUDA pools: under the Triton interpreter, which
    only a machine without CUDA runs (TRITON_INTERPRET is fixed when the kernels load). Tests that launch a kernel
    take `kernel_device` instead and run on the GPU machine's CUDA pools; the checks that refuse before any launch
    are these tests' subject, and their CUDA-pool versions are the `*_gpu` tests at the end of this module."""
    if device != "cpu":
        pytest.skip("CPU pools on the kernel path need the Triton interpreter (a machine without CUDA)")
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)


@pytest.fixture
def kernel_device(monkeypatch, device) -> str:
    """The device whose pools take the kernel path: CUDA on the GPU machine, CPU (interpreter) elsewhere."""
    if device == "cpu":
        monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    return device


ENTRIES = ["reference", "dispatch", "launcher"]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", BAD_IO)
@pytest.mark.parametrize("name", ALL)
def test_rejected_write_changes_nothing(name, case, entry, kernel_path):
    c = _cache(name)
    key, value, slots, status, _ = _bad_io()[case]
    snap = _snapshot(c)
    _raises(status, lambda: _write(entry, c, key, value, slots))
    _assert_unchanged(c, snap)


@pytest.mark.parametrize("entry", ["dispatch", "launcher"])
@pytest.mark.parametrize("case", [n for n, v in _bad_io().items() if v[4]])
@pytest.mark.parametrize("name", ["bf16", "fp8_e5m2", "int4", "mxfp4_32", "nvfp4", "k8v4_rot"])
def test_sync_free_write_still_refuses_malformed_arguments(name, case, entry, kernel_path):
    """check=False skips only the value checks (host syncs); malformed arguments are still refused first."""
    c = _cache(name)
    key, value, slots, status, _ = _bad_io()[case]
    snap = _snapshot(c)
    _raises(status, lambda: _write(entry, c, key, value, slots, check=False))
    _assert_unchanged(c, snap)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", list(BAD_SCALES))
@pytest.mark.parametrize("name", GLOBAL)
def test_invalid_global_scale_rejected_before_any_store(name, bad, which, entry, kernel_path):
    """F1: a V (or K) global scale of 0 / NaN / inf / < 0 / beyond FP32 used to be refused after K was stored."""
    c = _cache(name)
    tf = getattr(c.format, which)
    if not tf.uses_global_scale:
        pytest.skip(f"{name}: {which} has no global scale")
    snap = _snapshot(c)
    g = _bad_scale(BAD_SCALES[bad], which, torch.float64 if bad.startswith("1e39") else torch.float32)
    if entry != "launcher" and g.dtype != torch.float32:
        g = g.float()  # a descriptor's scale is FP32 (1e39 is +inf there)
    kw = {f"{which}g": g}
    _raises(INV, lambda: _write(entry, c, _x(), _x(), torch.tensor([5, 9, 2]), **kw),
            match=f"{which}_global_scale" if entry != "launcher" else f"{which.upper()} global scale")
    _assert_unchanged(c, snap)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "nvfp4", "k8v4"])
def test_global_scale_of_wrong_shape_rejected(name, which, entry, kernel_path):
    c = _cache(name)
    snap = _snapshot(c)
    g = torch.ones(H + 1)
    for check in (True, False):
        if entry == "reference" and not check:
            continue
        _raises(INV, lambda: _write(entry, c, _x(), _x(), torch.tensor([5, 9, 2]), check=check, **{f"{which}g": g}))
    _assert_unchanged(c, snap)


def _v10_cache(dtype=torch.float8_e4m3fn) -> CacheDesc:
    k = torch.randn(NB, BS, H, D).to(dtype)
    return CacheDesc.from_torch(k, torch.randn(NB, BS, H, D).to(dtype), block_size=BS, num_kv_heads=H, head_dim=D,
                                k_layout=Layout.NHD, v_layout=Layout.NHD)


def _v10_scales():
    def per_tensor(v, dt=torch.float32):
        return ScaleDesc.from_torch(torch.tensor([v], dtype=dt), ScaleGranularity.PER_TENSOR)

    return {
        **{bad: per_tensor(v) for bad, v in BAD_SCALES.items() if not bad.startswith("1e39")},
        "float16": per_tensor(0.5, torch.float16),
        "F32 descriptor over float64": ScaleDesc(DType.F32, ScaleGranularity.PER_TENSOR, torch.tensor([0.5]).double()),
        "tensor is a list": ScaleDesc(DType.F32, ScaleGranularity.PER_TENSOR, [0.5]),
        "PER_TENSOR with 3 values": ScaleDesc.from_torch(torch.ones(3), ScaleGranularity.PER_TENSOR),
        "PER_HEAD with H + 1 values": ScaleDesc.from_torch(torch.ones(H + 1), ScaleGranularity.PER_HEAD),
        "PER_BLOCK": ScaleDesc.from_torch(torch.ones(1), ScaleGranularity.PER_BLOCK),
        "per-head NaN": ScaleDesc.from_torch(torch.tensor([1.0, math.nan]), ScaleGranularity.PER_HEAD),
    }


@pytest.mark.parametrize("write_kv", [reference.write_kv, dispatch.write_kv], ids=["reference", "dispatch"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", list(_v10_scales()))
def test_invalid_v10_fp8_scale_rejected_before_any_store(bad, which, write_kv, kernel_path):
    """F1 for v1.0 FP8 caches: the scale comes with the write descriptor (`WriteDesc.k_scale` / `v_scale`)."""
    desc = _v10_cache()
    snap = [desc.k.tensor.clone(), desc.v.tensor.clone()]
    ok = ScaleDesc.from_torch(torch.tensor([0.5]), ScaleGranularity.PER_TENSOR)
    scales = {"k_scale": ok, "v_scale": ok, f"{which}_scale": _v10_scales()[bad]}
    w = WriteDesc(KvIoDesc(_x(), _x()), SlotMapping(torch.tensor([5, 9, 2])), **scales)
    _raises(INV, lambda: write_kv(desc, w), match=f"write.{which}_scale")
    assert _same_bytes(snap[0], desc.k.tensor) and _same_bytes(snap[1], desc.v.tensor)


def test_v10_fp8_scales_round_trip():
    """The accepted v1.0 path: per-tensor K and per-head V scales are used by write and gather alike."""
    desc = _v10_cache(torch.float8_e5m2)
    ks = ScaleDesc.from_torch(torch.tensor([0.25]), ScaleGranularity.PER_TENSOR)
    vs = ScaleDesc.from_torch(torch.tensor([2.0, 0.5]), ScaleGranularity.PER_HEAD)
    k, v = _x(t=4), _x(t=4, seed=2)
    reference.write_kv(desc, WriteDesc(KvIoDesc(k, v), SlotMapping(torch.tensor([0, 1, 2, 3])), ks, vs))
    out = reference.gather_kv(desc, GatherDesc(BlockTable.packed(torch.tensor([[0]])), SeqLens(torch.tensor([4])), 4),
                              k_scale=ks, v_scale=vs)
    fmt = get_format("fp8_e5m2")
    assert torch.equal(out.key, fmt.k.decode(*fmt.k.encode(k, 0.25), 0.25))
    assert torch.equal(out.value, fmt.v.decode(*fmt.v.encode(v, torch.tensor([2.0, 0.5])), torch.tensor([2.0, 0.5])))


@pytest.mark.parametrize("entry", ["reference", "dispatch"])
@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4"])
def test_scale_descriptor_for_a_cache_that_takes_none_is_refused(name, entry, kernel_path):
    """A v1.0 scale on a non-FP8 or v1.1 cache used to be ignored silently."""
    c = _cache(name)
    snap = _snapshot(c)
    s = ScaleDesc.from_torch(torch.tensor([0.5]), ScaleGranularity.PER_TENSOR)
    w = WriteDesc(KvIoDesc(_x(), _x()), SlotMapping(torch.tensor([5, 9, 2])), v_scale=s)
    fn = reference.write_kv if entry == "reference" else dispatch.write_kv
    _raises(INV, lambda: fn(c.descriptor(0), w), match="v1.0 FP8 caches only")
    _assert_unchanged(c, snap)
    gd = GatherDesc(BlockTable.packed(torch.tensor([[0]])), SeqLens(torch.tensor([2])), 2)
    gather = reference.gather_kv if entry == "reference" else dispatch.gather_kv
    _raises(INV, lambda: gather(c.descriptor(0), gd, k_scale=s), match="v1.0 FP8 caches only")


@pytest.mark.parametrize("entry", ENTRIES)
def test_rejected_write_on_page_buffer_changes_nothing(entry, kernel_path):
    """Pools that are regions of one page buffer (vLLM's layout): the V scale failure leaves every byte."""
    c = _cache("nvfp4", page_buffer=True)
    page = torch.empty(0, dtype=torch.uint8).set_(c.layers[0].k_data.untyped_storage())  # the whole buffer
    before = page.clone()
    _raises(INV, lambda: _write(entry, c, _x(), _x(), torch.tensor([5, 9, 2]), vg=torch.tensor([1.0, 0.0])))
    assert torch.equal(page, before)


# ----------------------------------------------------------------------------- writes never track gradients
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", ["bf16", "fp32", "int8", "nvfp4_rot"])
def test_write_with_inputs_that_require_grad(name, entry, kernel_device):
    c, twin = _cache(name, kernel_device), _cache(name, kernel_device)
    k, v = _x(seed=3).to(kernel_device).requires_grad_(), _x(seed=4).to(kernel_device).requires_grad_()
    slots = torch.tensor([5, 9, 2], device=kernel_device)
    _write(entry, c, k, v, slots)
    _write(entry, twin, k.detach(), v.detach(), slots)
    for t, ref in zip(_pools(c), _pools(twin), strict=True):
        assert not t.requires_grad and t.grad_fn is None
        assert _same_bytes(t, ref)


@pytest.mark.parametrize("gather_kv", [reference.gather_kv, dispatch.gather_kv], ids=["reference", "dispatch"])
def test_gather_into_an_out_that_requires_grad(gather_kv, kernel_device):
    c, dev = _cache("int8", kernel_device), kernel_device
    gd = _gd(BlockTable.packed(torch.tensor([[0, 1]], device=dev)), (6,), 6, dev)
    out = KvIoDesc(torch.zeros(6, H, D, device=dev, requires_grad=True),
                   torch.zeros(6, H, D, device=dev, requires_grad=True))
    got = gather_kv(c.descriptor(0), gd, out)
    ref = reference.gather_kv(c.descriptor(0), gd)
    assert torch.equal(got.key.detach(), ref.key) and torch.equal(got.value.detach(), ref.value)
    assert all(not t.requires_grad for t in _pools(c))


# ----------------------------------------------------------------------------- F11: no narrowing before the checks
def _decode_args(table: torch.Tensor, lens):
    return torch.randn(len(lens), 4, D), BlockTable.packed(table), SeqLens(torch.tensor(lens, dtype=torch.int64))


def test_kernel_table_checks_block_ids_on_the_callers_dtype():
    """int64 block id 2**32 + 1 narrowed first used to read block 1; checked first it is OUT_OF_RANGE."""
    desc = _cache("int8").descriptor(0)
    for bad in (2**32 + 1, -(2**32) + 1, NB, -1):
        table = torch.tensor([[0, bad], [3, 0]], dtype=torch.int64)  # sequence 0 (5 tokens) uses entry [0, 1]
        _, bt, lens = _decode_args(table, [5, 3])
        _raises(OOR, lambda: checks.kernel_table(desc, bt, lens, check=True), match=f"= {bad} is outside")
    # an unused entry (past the sequence's length) is never read: accepted, as the reference accepts it
    _, bt, lens = _decode_args(torch.tensor([[0, 1], [3, 2**40]], dtype=torch.int64), [5, 3])
    t32, l32 = checks.kernel_table(desc, bt, lens, check=True)
    assert t32.dtype == l32.dtype == torch.int32 and t32.is_contiguous()
    assert t32[:, 0].tolist() == [0, 3] and t32[0, 1] == 1 and l32.tolist() == [5, 3]


def test_kernel_table_checks_seq_lens_before_narrowing():
    desc = _cache("int8").descriptor(0)
    q, bt, lens = _decode_args(torch.tensor([[0, 1]], dtype=torch.int64), [2**32 + 5])  # narrows to 5
    _raises(OOR, lambda: checks.kernel_table(desc, bt, lens, check=True))
    _raises(OOR, lambda: attention.paged_decode(q, desc, bt, lens))


def test_narrow_int32_refuses_values_that_do_not_fit():
    assert checks.narrow_int32(torch.tensor([0, 2**31 - 1, -(2**31)]), "x", check=True).dtype == torch.int32
    for v in (2**31, -(2**31) - 1, 2**32 + 1):
        _raises(INV, lambda: checks.narrow_int32(torch.tensor([0, v]), "qo_indptr", check=True), match="qo_indptr")


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("bad", [2**32 + 1, 2**33, -(2**32)])
def test_dispatch_attention_refuses_wide_block_ids_like_the_reference(op, bad, monkeypatch):
    desc = _cache("nvfp4").descriptor(0)
    q, table, lens = _decode_args(torch.tensor([[0, bad], [3, 0]], dtype=torch.int64), [5, 3])
    qo = torch.tensor([0, 1, 2])

    def run(mod):
        if op == "decode":
            return mod.paged_decode(q, desc, table, lens)
        return mod.paged_prefill(q, qo, desc, table, lens)

    _raises(OOR, lambda: run(attention))
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    monkeypatch.setattr(attention, "paged_decode", None)  # the kernel path must refuse it itself
    monkeypatch.setattr(attention, "paged_prefill", None)
    _raises(OOR, lambda: run(dispatch))


def test_dispatch_prefill_checks_qo_indptr_before_narrowing(monkeypatch):
    """[0, 2**32 + 1, 2] narrowed first is [0, 1, 2], a valid split; on int64 it is not non-decreasing."""
    desc = _cache("int8").descriptor(0)
    q, table, lens = _decode_args(torch.tensor([[0, 1], [3, 0]]), [5, 3])
    qo = torch.tensor([0, 2**32 + 1, 2])
    _raises(INV, lambda: attention.paged_prefill(q, qo, desc, table, lens), match="qo_indptr")
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    _raises(INV, lambda: dispatch.paged_prefill(q, qo, desc, table, lens), match="qo_indptr")
    for bad in (qo.float(), qo[None], [0, 1, 2]):
        _raises(INV, lambda: dispatch.paged_prefill(q, bad, desc, table, lens), match="qo_indptr")
        _raises(INV, lambda: attention.paged_prefill(q, bad, desc, table, lens), match="qo_indptr")


@pytest.mark.parametrize("paged", [attention, dispatch], ids=["reference", "dispatch"])
def test_attention_refuses_non_descriptor_arguments(paged, kernel_path):
    desc = _cache("int8").descriptor(0)
    q, table, lens = _decode_args(torch.tensor([[0, 1], [3, 0]]), [5, 3])
    _raises(INV, lambda: paged.paged_decode(q, desc, table.indices, lens), match="block table")
    _raises(INV, lambda: paged.paged_decode(q, desc, table, lens.lengths), match="seq_lens")
    _raises(INV, lambda: paged.paged_decode(q, None, table, lens), match="cache")
    _raises(INV, lambda: paged.paged_decode(q.numpy(), desc, table, lens), match="query")


BAD_OPTIONS = [{"window": 2.5}, {"window": "3"}, {"window": True}, {"softcap": math.nan}, {"softcap": -1.0},
               {"sm_scale": math.inf}, {"sm_scale": "0.1"}, {"sm_scale": torch.tensor(0.1)}]


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("opt", BAD_OPTIONS, ids=str)
@pytest.mark.parametrize("paged", [attention, dispatch], ids=["reference", "dispatch"])
def test_attention_options_are_checked(paged, opt, op, kernel_path):
    """A float window was compared by the reference and truncated by the kernels; other bad options crashed."""
    desc = _cache("int8").descriptor(0)
    q, table, lens = _decode_args(torch.tensor([[0, 1], [3, 0]]), [5, 3])
    key = next(iter(opt))
    if op == "decode":
        _raises(INV, lambda: paged.paged_decode(q, desc, table, lens, **opt), match=key)
    else:
        _raises(INV, lambda: paged.paged_prefill(q, torch.tensor([0, 1, 2]), desc, table, lens, **opt), match=key)


def test_decode_max_seq_len_is_checked(kernel_path):
    desc = _cache("int8").descriptor(0)
    q, table, lens = _decode_args(torch.tensor([[0, 1], [3, 0]]), [5, 3])
    for bad in ("8", 8.5, -1):
        _raises(INV, lambda: dispatch.paged_decode(q.bfloat16(), desc, table, lens, max_seq_len=bad, check=False),
                match="max_seq_len")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4", "k8v4_rot"])
def test_dispatch_wide_block_ids_gpu(name):
    """The natural kernel path on CUDA pools: int64 ids that wrap to valid blocks are refused, not read."""
    desc = _cache(name, device="cuda").descriptor(0)
    table = BlockTable.packed(torch.tensor([[0, 2**32 + 1], [3, 0]], device="cuda"))
    lens = SeqLens(torch.tensor([5, 3], device="cuda"))
    q = torch.randn(2, 4, D, device="cuda", dtype=torch.bfloat16)
    _raises(OOR, lambda: dispatch.paged_decode(q, desc, table, lens))
    _raises(OOR, lambda: dispatch.paged_prefill(q, torch.tensor([0, 1, 2]), desc, table, lens))
    _raises(OOR, lambda: dispatch.gather_kv(desc, GatherDesc(table, lens, 8)))
    _raises(INV, lambda: dispatch.paged_prefill(q, torch.tensor([0, 2**32 + 1, 2]), desc,
                                                BlockTable.packed(torch.tensor([[0, 1], [3, 0]], device="cuda")), lens))
    ok = BlockTable.packed(torch.tensor([[0, 1], [3, 2**40]], device="cuda"))  # 2**40: unused entry, never read
    ref = attention.paged_decode(q, desc, ok, lens)
    got = dispatch.paged_decode(q, desc, ok, lens)
    assert (got[0].float() - ref[0].float()).abs().max() < 5e-2


# ----------------------------------------------------------------------------- F8: gather arguments
def _gd(table=None, lens=(6, 3), max_seq_len=8, device="cpu") -> GatherDesc:
    table = BlockTable.packed(torch.tensor([[0, 1], [4, 0]], device=device)) if table is None else table
    return GatherDesc(table, SeqLens(torch.tensor(lens, device=device)), max_seq_len)


def _ragged(indices: torch.Tensor) -> BlockTable:
    return BlockTable.ragged(indices, torch.tensor([0, 5]), 2)


GATHERS = [reference.gather_kv, dispatch.gather_kv]


def _bad_gathers(c: PagedKVCache):
    """name -> (call(gather_kv, desc), status, message fragment)."""
    ok = KvIoDesc(torch.zeros(9, H, D), torch.zeros(9, H, D))
    p = c.layers[0]
    return {
        "float max_seq_len": (lambda g, d: g(d, _gd(max_seq_len=2.5)), INV, "max_seq_len must be an int"),
        "str max_seq_len": (lambda g, d: g(d, _gd(max_seq_len="8")), INV, "max_seq_len must be an int"),
        "bool max_seq_len": (lambda g, d: g(d, _gd(max_seq_len=True)), INV, "max_seq_len must be an int"),
        "negative max_seq_len": (lambda g, d: g(d, _gd(max_seq_len=-1)), INV, "max_seq_len must be in"),
        "max_seq_len beyond uint32": (lambda g, d: g(d, _gd(max_seq_len=2**32)), INV, "max_seq_len must be in"),
        "huge max_seq_len": (lambda g, d: g(d, _gd(max_seq_len=2**70)), INV, "max_seq_len must be in"),
        "RAGGED [1, n]": (lambda g, d: g(d, _gd(_ragged(torch.tensor([[0, 0, 0, 0, 1]])), (5,))), INV, "must be 1-D"),
        "RAGGED [n, 1]": (lambda g, d: g(d, _gd(_ragged(torch.tensor([[0], [0], [0], [0], [1]])), (5,))), INV,
                          "must be 1-D"),
        "RAGGED float indices": (lambda g, d: g(d, _gd(_ragged(torch.tensor([0.0, 0, 0, 0, 1])), (5,))), INV, "S32"),
        "RAGGED bool indices": (lambda g, d: g(d, _gd(_ragged(torch.tensor([0, 0, 0, 0, 1]).bool()), (5,))), INV,
                                "S32"),
        "RAGGED float indptr": (lambda g, d: g(d, _gd(BlockTable.ragged(torch.tensor([0, 0, 0, 0, 1]),
                                                                        torch.tensor([0.0, 5.0]), 2), (5,))), INV,
                                "indptr"),
        "PACKED transposed": (lambda g, d: g(d, _gd(_reshaped(torch.tensor([[0, 1], [4, 0]]), (2, 2), (1, 4)))), INV,
                              "must be 1-D or [2, 2]"),
        "PACKED float": (lambda g, d: g(d, _gd(BlockTable.packed(torch.tensor([[0.0, 1], [4, 0]])))), INV, "S32"),
        "PACKED indices list": (lambda g, d: g(d, _gd(BlockTable(BlockTable.packed(torch.zeros(1, 1)).format,
                                                                 [[0, 1]], 1, 2), (6,))), INV, "must be a Tensor"),
        "seq_lens list": (lambda g, d: g(d, GatherDesc(BlockTable.packed(torch.tensor([[0, 1]])), [6], 8)), INV,
                          "seq_lens"),
        "gather not a GatherDesc": (lambda g, d: g(d, (1, 2, 3)), INV, "gather must be a GatherDesc"),
        "cache not a CacheDesc": (lambda g, d: g(None, _gd()), INV, "cache must be a CacheDesc"),
        "block id 2**32 + 1": (lambda g, d: g(d, _gd(BlockTable.packed(torch.tensor([[0, 2**32 + 1], [4, 0]])))),
                               OOR, None),
        "out too small": (lambda g, d: g(d, _gd(), KvIoDesc(torch.zeros(8, H, D), torch.zeros(8, H, D))), INV,
                          "holds 8 tokens"),
        "out wrong head_dim": (lambda g, d: g(d, _gd(), KvIoDesc(torch.zeros(9, H, 2 * D), torch.zeros(9, H, 2 * D))),
                               INV, "head_dim"),
        "out int dtype": (lambda g, d: g(d, _gd(), KvIoDesc(torch.zeros(9, H, D, dtype=torch.int32),
                                                            torch.zeros(9, H, D, dtype=torch.int32))), UNS, "dtype"),
        "out on meta": (lambda g, d: g(d, _gd(), KvIoDesc(torch.zeros(9, H, D, device="meta"),
                                                          torch.zeros(9, H, D, device="meta"))), INV, "meta"),
        "out a tuple": (lambda g, d: g(d, _gd(), (ok.key, ok.value)), INV, "gather out must be a KvIoDesc"),
        "out key is out value": (lambda g, d: g(d, _gd(), KvIoDesc(ok.key, ok.key)), INV, "overlap"),
        "out over the cache's V pool": (lambda g, d: g(d, _gd(), KvIoDesc(ok.key, _pool_view(p.v_data))), INV,
                                        "V pool"),
        "out_dtype str": (lambda g, d: g(d, _gd(), out_dtype="float32"), INV, "out_dtype"),
        "out_dtype int8": (lambda g, d: g(d, _gd(), out_dtype=torch.int8), UNS, "out_dtype"),
        "out_dtype against out": (lambda g, d: g(d, _gd(), ok, out_dtype=torch.float16), INV, "out_dtype"),
    }


def _reshaped(t: torch.Tensor, declared: tuple[int, int], shape: tuple[int, int]) -> BlockTable:
    """A PACKED table that declares `declared` [seqs, max_blocks] over indices of another 2-D `shape`."""
    return BlockTable(BlockTable.packed(t).format, t.reshape(shape), *declared)


def _pool_view(data: torch.Tensor) -> torch.Tensor:
    """A float32 [9, H, D] (zero-stride) view of the first bytes of a pool, as a careless caller might pass."""
    return data.view(torch.uint8).reshape(-1)[:D * 4].view(torch.float32).as_strided((9, H, D), (0, 0, 1))


@pytest.mark.parametrize("gather_kv", GATHERS, ids=["reference", "dispatch"])
@pytest.mark.parametrize("case", list(_bad_gathers(_cache("int8"))))
def test_gather_arguments_are_checked_up_front(case, gather_kv, kernel_path):
    """F8: float max_seq_len was NotImplementedError, RAGGED [1, n] IndexError, [n, 1] a 'scales shape' error."""
    c = _cache("nvfp4")
    fn, status, match = _bad_gathers(c)[case]
    snap = _snapshot(c)
    _raises(status, lambda: fn(gather_kv, c.descriptor(0)), match=match)
    _assert_unchanged(c, snap)


@pytest.mark.parametrize("gather_kv", GATHERS, ids=["reference", "dispatch"])
def test_gather_accepts_numpy_ints_and_non_contiguous_tables(gather_kv, kernel_device):
    dev = kernel_device
    c = _cache("mxfp4", dev)
    desc = c.descriptor(0)
    ref = reference.gather_kv(desc, _gd(device=dev))
    got = gather_kv(desc, _gd(max_seq_len=np.int64(8), device=dev))
    assert torch.equal(got.key, ref.key) and torch.equal(got.value, ref.value)
    wide = torch.tensor([[0, 9, 1, 9], [4, 9, 0, 9]], device=dev)[:, ::2]  # non-contiguous [2, 2]
    assert not wide.is_contiguous()
    got = gather_kv(desc, _gd(BlockTable.packed(wide), device=dev))
    assert torch.equal(got.key, ref.key) and torch.equal(got.value, ref.value)
    got = gather_kv(desc, GatherDesc(BlockTable.packed(wide), SeqLens(torch.tensor([6, 0, 3, 0], device=dev)[::2]), 8))
    assert torch.equal(got.key, ref.key) and torch.equal(got.value, ref.value)
    out = KvIoDesc(torch.zeros(9, H, 2 * D, device=dev)[:, :, ::2], torch.zeros(9, H, D, device=dev))  # strided
    got = gather_kv(desc, _gd(device=dev), out)
    assert torch.equal(got.key, ref.key) and torch.equal(got.value, ref.value)


def test_gather_launcher_checks_its_arguments(device):
    c = _cache("nvfp4", device)
    p = c.layers[0]
    t = functools.partial(torch.tensor, device=device)
    z = functools.partial(torch.zeros, device=device)
    bt, lens = t([[0, 1], [4, 0]]), t([6, 3])
    args = (p.k_data, p.k_scales, p.v_data, p.v_scales)
    snap = _snapshot(c)

    def g(*a, **k):
        return kernels.gather_pools(*args, *a, c.format, p.k_global, p.v_global, **k)

    _raises(INV, lambda: g(bt, lens, max_seq_len=2.5), match="max_seq_len")
    _raises(OOR, lambda: g(t([[0, 2**32 + 1], [4, 0]]), lens), match="outside")
    _raises(INV, lambda: g(bt, lens.float()), match="seq_lens")
    _raises(INV, lambda: g(bt, lens, out=(z(8, H, D), z(8, H, D))), match="out must be")
    _raises(INV, lambda: g(bt, lens, out=(z(9, H, D), _pool_view(p.k_data))), match="K pool")
    _raises(INV, lambda: kernels.gather_pools(*args, bt, lens, c.format, p.k_global, t([1.0, math.nan])),
            match="V global scale")
    _raises(UNS, lambda: kernels.gather_pools(*args, bt, lens, "no_such_format"), match="unknown KVX cache format")
    _raises(INV, lambda: kernels.gather_pools(*args, bt, lens, 3), match="fmt must be")
    _assert_unchanged(c, snap)


# ----------------------------------------------------------------------------- F9: batch-invariant rotation
@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_rotate_rows_are_batch_invariant_and_accurate(d, dtype):
    x = torch.randn(64, 3, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64).to(dtype)
    full = rotate(x)
    for n in (1, 3, 8):
        assert torch.equal(rotate(x[:n]), full[:n])
        assert torch.equal(rotate(x[n:n + 1, 1:2]), full[n:n + 1, 1:2])
    ref = x.double() @ hadamard(d, torch.float64)
    tol = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 5e-2}[dtype]
    assert (full.double() - ref).abs().max() <= tol * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("d", [2, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_rotate_keeps_finite_rows_finite_and_non_finite_rows_poisoned(d, dtype):
    """docs/formats.md §16.7: finite inputs saturate (no inf/NaN from the butterfly's D-fold sums or the cast to
    the output dtype), a NaN or inf input still poisons its row, and rows stay batch-invariant."""
    big = torch.finfo(dtype).max
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64).to(dtype)
    x[0], x[1], x[2, ::2] = big, -big, big
    x[3, 0], x[4, -1], x[5, 0] = float("nan"), float("inf"), -float("inf")
    for out_dtype in {dtype, torch.float16, torch.float32}:
        y = rotate(x, out_dtype)
        assert y.dtype == out_dtype and y[[0, 1, 2, 6, 7]].isfinite().all(), (dtype, out_dtype)
        assert (~y[3:6].isfinite()).any(-1).all(), (dtype, out_dtype)
        for i in range(8):
            assert torch.equal(rotate(x[i:i + 1], out_dtype).nan_to_num(0.0), y[i:i + 1].nan_to_num(0.0))


@pytest.mark.parametrize("h,d", [(1, 128), (2, 64)])
@pytest.mark.parametrize("name", ROT)
def test_rot_write_and_gather_are_batch_invariant(name, h, d):
    """F9: the bytes written for a token, and the values gathered from the same bytes, do not depend on how
    many tokens share the call (a batch of 1 and of 8 differed by ~4e-7 with a matmul rotation)."""
    n_tok = 64

    def mk():
        return PagedKVCache(name, num_layers=1, num_blocks=n_tok // BS, block_size=BS, num_kv_heads=h, head_dim=d,
                            per_head_global_scale=False)

    x = torch.randn(2, n_tok, h, d, generator=torch.Generator().manual_seed(7)) * 3
    whole = mk()
    whole.write(0, x[0], x[1], torch.arange(n_tok))
    for batch in (1, 3, 8):
        part = mk()
        for i in range(0, n_tok, batch):
            j = min(i + batch, n_tok)
            part.write(0, x[0, i:j], x[1, i:j], torch.arange(i, j))
        for a, b in zip(_pools(whole), _pools(part), strict=True):
            assert _same_bytes(a, b), f"batch {batch}: written bytes differ"
    table = torch.arange(n_tok // BS)[None]
    fk, fv = whole.gather(0, table, torch.tensor([n_tok]))
    for n in (1, 3, 8, 64):
        k, v = whole.gather(0, table, torch.tensor([n]))
        assert torch.equal(k, fk[:n]) and torch.equal(v, fv[:n]), f"gather of {n} tokens differs"


@pytest.mark.parametrize("name", ["nvfp4_rot", "k8v4_rot"])
def test_rot_kernel_paths_are_batch_invariant(name, kernel_device):
    """The kernels' write and gather rotate with the same row-wise butterfly as the reference."""
    dev = kernel_device
    c, ref = _cache(name, dev), _cache(name, dev)
    x = torch.randn(2, 8, H, D, generator=torch.Generator().manual_seed(5)).to(dev)
    for i in range(8):
        dispatch.write_kv(c.descriptor(0), WriteDesc(KvIoDesc(x[0, i:i + 1], x[1, i:i + 1]),
                                                     SlotMapping(torch.tensor([i], device=dev))))
    reference.write_kv(ref.descriptor(0), WriteDesc(KvIoDesc(x[0], x[1]), SlotMapping(torch.arange(8, device=dev))))
    for a, b in zip(_pools(c), _pools(ref), strict=True):
        assert _same_bytes(a, b)
    table = BlockTable.packed(torch.tensor([[0, 1]], device=dev))
    full = dispatch.gather_kv(c.descriptor(0), _gd(table, (8,), 8, dev))
    one = dispatch.gather_kv(c.descriptor(0), _gd(table, (1,), 8, dev))
    assert torch.equal(one.key, full.key[:1]) and torch.equal(one.value, full.value[:1])


# ----------------------------------------------------------------------------- the same on CUDA pools (GPU machine)
@pytest.mark.gpu
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", ["fp8_e4m3", "nvfp4", "k8v4_rot"])
def test_rejected_write_changes_nothing_gpu(name, entry):
    """F1 on the natural kernel path: a bad V global scale or a duplicate slot stores nothing."""
    c = _cache(name, device="cuda")
    snap = _snapshot(c)
    x, slots = _x().cuda(), torch.tensor([5, 9, 2], device="cuda")
    _raises(INV, lambda: _write(entry, c, x, x, slots, vg=torch.tensor([1.0, 0.0], device="cuda")))
    _raises(INV, lambda: _write(entry, c, x, x, torch.tensor([5, 9, 5], device="cuda")))
    _assert_unchanged(c, snap)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotate_batch_invariant_gpu(d):
    x = torch.randn(512, 8, d, generator=torch.Generator().manual_seed(d)).cuda()
    full = rotate(x)
    for n in (1, 3, 8, 64):
        assert torch.equal(rotate(x[:n]), full[:n])
