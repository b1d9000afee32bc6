"""Bad input to `PagedKVCache`, `BlockAllocator` and `AmaxObserver` (issue 10, F5 and F6): every rejected
call raises KvxError with the right status and changes nothing.

Oracles: the pools and global scales are cloned before a rejected call and compared with torch.equal after;
the allocator's whole state is deep-copied and compared; byte sizes are computed here by hand from the
format definitions; Python ints are what ids must come back as.
"""
import copy

import numpy as np
import pytest
import torch

from kvx_core.allocator import BlockAllocator
from kvx_core.cache import PagedKVCache, blocks_for_budget, bytes_per_token, capacity_ratio_vs_bf16, page_bytes
from kvx_core.calibration import AmaxObserver, amax_from_checkpoint, global_scale_for_amax
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format

H, D, BS, NB = 2, 32, 4, 4
INVALID, RANGE, UNSUPPORTED = Status.INVALID_ARGUMENT, Status.OUT_OF_RANGE, Status.UNSUPPORTED


def _raises(status: Status | tuple[Status, ...], fn, *args, **kwargs) -> KvxError:
    with pytest.raises(KvxError) as e:
        fn(*args, **kwargs)
    assert e.value.status in (status if isinstance(status, tuple) else (status,)), e.value
    return e.value


def _cache(fmt="nvfp4", **kw) -> PagedKVCache:
    args = dict(num_layers=2, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D) | kw
    return PagedKVCache(fmt, **args)


def _snapshot(cache: PagedKVCache) -> list[torch.Tensor]:
    """Every pool and global scale of every layer, cloned (random bytes first, so any stray write shows)."""
    out = []
    for p in cache.layers:
        for t in (p.k_data, p.v_data, p.k_scales, p.v_scales, p.k_global, p.v_global):
            if t is not None:
                out.append(t.clone())
    return out


def _unchanged(cache: PagedKVCache, before: list[torch.Tensor]) -> None:
    after = _snapshot(cache)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _filled(fmt="nvfp4", **kw) -> PagedKVCache:
    """A cache holding written tokens and non-default global scales."""
    cache = _cache(fmt, **kw)
    if cache.layers[0].k_global is not None:
        for layer in range(cache.num_layers):
            cache.set_global_scales(layer, 0.5 + layer, 2.0)
    gen = torch.Generator().manual_seed(1)
    for layer in range(cache.num_layers):
        k, v = torch.randn(6, H, D, generator=gen), torch.randn(6, H, D, generator=gen)
        cache.write(layer, k, v, torch.arange(6))
    return cache


# ----------------------------------------------------------------------------------- global scales
BAD_SCALES = [
    (float("nan"), INVALID), (float("inf"), INVALID), (-float("inf"), INVALID), (0.0, INVALID), (-1.0, INVALID),
    (0, INVALID), (True, INVALID), ("1", INVALID), ([1.0], INVALID), (torch.tensor(2), INVALID),
    (torch.tensor([1.0, 1.0, 1.0]), INVALID), (torch.ones(H, 1), INVALID), (torch.tensor([1.0, float("nan")]), INVALID),
    (torch.tensor(1e300, dtype=torch.float64), INVALID),  # inf in FP32
    (torch.tensor(1e-50, dtype=torch.float64), INVALID),  # 0 in FP32
    (torch.ones(1, device="meta"), INVALID),
]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4", "k8v4_rot"])
@pytest.mark.parametrize("bad, status", BAD_SCALES, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("side", ["k", "v"])
def test_rejected_global_scales_change_nothing(fmt, per_head, bad, status, side):
    """Reproducer: set_global_scales(0, 3.0, nan) raised after storing K's 3.0."""
    cache = _filled(fmt, per_head_global_scale=per_head)
    before = _snapshot(cache)
    k, v = (bad, 3.0) if side == "k" else (3.0, bad)
    _raises(status, cache.set_global_scales, 0, k, v)
    _unchanged(cache, before)


def test_per_head_scales_need_a_per_head_cache():
    cache = _filled("nvfp4")
    before = _snapshot(cache)
    e = _raises(INVALID, cache.set_global_scales, 1, torch.tensor([1.0, 2.0]), 1.0)
    assert "per_head_global_scale=True" in e.message
    _unchanged(cache, before)
    per_head = _filled("nvfp4", per_head_global_scale=True)
    per_head.set_global_scales(1, torch.tensor([1.0, 2.0]), torch.tensor(4.0, dtype=torch.float64))
    assert per_head.layers[1].k_global.tolist() == [1.0, 2.0] and per_head.layers[1].v_global.tolist() == [4.0, 4.0]


def test_global_scales_for_a_format_without_them():
    cache = _filled("int8")
    _raises(INVALID, cache.set_global_scales, 0, 1.0, 1.0)
    _raises(INVALID, _cache, "int8", global_scales=[(1.0, 1.0)] * 2)


# --------------------------------------------------------------------------------------- layer ids
BAD_LAYERS = [(2, RANGE), (5, RANGE), (-1, RANGE), (-2, RANGE), (2 ** 63, RANGE), (True, INVALID), (False, INVALID),
              (0.0, INVALID), (1.5, INVALID), ("0", INVALID), (None, INVALID), (torch.tensor(0.0), INVALID),
              (torch.tensor([0]), INVALID), (torch.tensor(True), INVALID), (np.float64(0), INVALID)]


def _layer_calls(cache: PagedKVCache):
    k = torch.randn(2, H, D)
    return {
        "descriptor": lambda layer: cache.descriptor(layer),
        "set_global_scales": lambda layer: cache.set_global_scales(layer, 3.0, 3.0),
        "write": lambda layer: cache.write(layer, k, k, torch.tensor([8, 9])),
        "gather": lambda layer: cache.gather(layer, torch.tensor([[0, 1]]), torch.tensor([6])),
    }


@pytest.mark.parametrize("method", ["descriptor", "set_global_scales", "write", "gather"])
@pytest.mark.parametrize("layer, status", BAD_LAYERS, ids=lambda v: repr(v)[:16])
def test_bad_layer_ids_are_refused(method, layer, status):
    """Reproducer: layer 5 of a small cache gave IndexError, layer -1 silently meant the last."""
    cache = _filled("nvfp4")
    before = _snapshot(cache)
    _raises(status, _layer_calls(cache)[method], layer)
    _unchanged(cache, before)


@pytest.mark.parametrize("layer", [1, np.int64(1), torch.tensor(1), np.array(1)])
def test_integer_scalar_layer_ids_are_layer_one(layer):
    cache = _filled("nvfp4")
    assert cache.descriptor(layer).k.tensor.data_ptr() == cache.layers[1].k_data.data_ptr()
    cache.set_global_scales(layer, 7.0, 8.0)
    assert float(cache.layers[1].k_global) == 7.0 and float(cache.layers[0].k_global) == 0.5


# ------------------------------------------------------------------------------------- constructor
BAD_CTOR = [
    (dict(fmt=None), UNSUPPORTED), (dict(fmt=5), UNSUPPORTED), (dict(fmt="nvfp5"), UNSUPPORTED),
    (dict(num_blocks=2.5), INVALID), (dict(num_blocks=0), INVALID), (dict(num_blocks=-1), INVALID),
    (dict(num_blocks=True), INVALID), (dict(num_blocks="4"), INVALID), (dict(num_blocks=None), INVALID),
    (dict(num_blocks=2 ** 62), RANGE), (dict(num_blocks=2 ** 40), RANGE), (dict(num_blocks=10 ** 30), RANGE),
    (dict(num_layers=0), INVALID), (dict(num_layers=1.0), INVALID), (dict(num_layers=2 ** 50), RANGE),
    (dict(block_size=0), INVALID), (dict(block_size=4.0), INVALID), (dict(block_size=2 ** 62), RANGE),
    (dict(num_kv_heads=0), INVALID), (dict(num_kv_heads=-2), INVALID), (dict(num_kv_heads=[2]), INVALID),
    (dict(head_dim=0), INVALID), (dict(head_dim=24), INVALID), (dict(head_dim=32.0), INVALID),
    (dict(head_dim=2 ** 40), RANGE),
    (dict(device="nope"), INVALID), (dict(device=None), INVALID), (dict(device=0), INVALID),
    (dict(device="meta"), UNSUPPORTED),
    (dict(page_buffer="yes"), INVALID), (dict(page_buffer=1), INVALID), (dict(per_head_global_scale=None), INVALID),
    (dict(global_scales=5), INVALID), (dict(global_scales=[(1.0, 1.0)]), INVALID),
    (dict(global_scales=[(1.0,), (1.0,)]), INVALID), (dict(global_scales=[(1.0, 1.0), (1.0, float("nan"))]), INVALID),
    (dict(global_scales="ab"), INVALID), (dict(global_scales=[None, None]), INVALID),
]


@pytest.mark.parametrize("page_buffer", [False, True])
@pytest.mark.parametrize("override, status", BAD_CTOR, ids=lambda v: repr(v)[:40])
def test_bad_constructor_arguments_are_refused_before_allocating(override, status, page_buffer, monkeypatch):
    """Reproducers: num_blocks=2**62 MemoryError, fmt=None AttributeError, num_blocks=2.5 TypeError.
    Nothing is allocated for a refused cache (torch.zeros would raise an AssertionError)."""
    args = dict(fmt="nvfp4", page_buffer=page_buffer) | override
    fmt = args.pop("fmt")
    zeros = torch.zeros

    def no_pool(*a, **kw):
        assert isinstance(a[0], int) and a[0] <= 2 ** 20, f"tried to allocate {a}"
        return zeros(*a, **kw)

    monkeypatch.setattr(torch, "zeros", no_pool)
    _raises(status, _cache, fmt, **args)


def test_oversized_cache_names_its_byte_count():
    """int8, H=1, D=32, 4 tokens per block: K and V payload 4*32 bytes each, scales 4*4 bytes each."""
    per_block = 2 * 4 * 32 + 2 * 4 * 4
    e = _raises(RANGE, PagedKVCache, "int8", num_layers=3, num_blocks=2 ** 62, block_size=4, num_kv_heads=1,
                head_dim=32)
    assert str(3 * 2 ** 62 * per_block) in e.message and "blocks_for_budget" in e.message


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), MemoryError()])
def test_allocation_failure_is_a_kvx_error(error, monkeypatch):
    """Last line: the device has less free memory than in total."""
    def fail(*a, **kw):
        raise error

    monkeypatch.setattr(torch, "zeros", fail)
    _raises(RANGE, _cache, "nvfp4")


def test_integer_scalar_sizes_are_accepted():
    cache = PagedKVCache(np.str_("int4"), num_layers=np.int64(1), num_blocks=torch.tensor(3), block_size=np.int32(4),
                         num_kv_heads=np.int64(H), head_dim=np.int64(D))
    assert (cache.num_blocks, cache.block_size, cache.head_dim) == (3, 4, D)
    assert all(type(v) is int for v in (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_kv_heads))


# ------------------------------------------------------------------------------ write / gather args
def _bad_data_calls(cache: PagedKVCache):
    k = torch.randn(2, H, D)
    table, lens = torch.tensor([[0, 1]]), torch.tensor([6])
    return [
        (INVALID, lambda: cache.write(0, [1.0], k, torch.tensor([8, 9]))),
        (INVALID, lambda: cache.write(0, k, None, torch.tensor([8, 9]))),
        (INVALID, lambda: cache.write(0, k, k, [8, 9])),
        (INVALID, lambda: cache.write(0, k, k, torch.tensor([8.0, 9.0]))),
        (INVALID, lambda: cache.write(0, k, k[:, :1], torch.tensor([8, 9]))),  # V with the wrong head count
        ((INVALID, UNSUPPORTED), lambda: cache.write(0, k, k.to(torch.int32), torch.tensor([8, 9]))),
        (RANGE, lambda: cache.write(0, k, k, torch.tensor([8, NB * BS]))),
        (INVALID, lambda: cache.gather(0, [[0, 1]], lens)),
        (INVALID, lambda: cache.gather(0, table, [6])),
        (INVALID, lambda: cache.gather(0, table, None)),
        (INVALID, lambda: cache.gather(0, table.float(), lens)),
        (INVALID, lambda: cache.gather(0, table, lens.float())),
        (INVALID, lambda: cache.gather(0, table, lens, 2.5)),
        (INVALID, lambda: cache.gather(0, table, lens, "6")),
        (INVALID, lambda: cache.gather(0, table, lens, True)),
        (INVALID, lambda: cache.gather(0, table, lens, -1)),
        (INVALID, lambda: cache.gather(0, table, lens, out_dtype="float32")),
        (RANGE, lambda: cache.gather(0, torch.tensor([[0, NB]]), lens)),
    ]


@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "bf16", "k8v4_rot"])
def test_bad_write_and_gather_arguments_change_nothing(fmt):
    cache = _filled(fmt)
    before = _snapshot(cache)
    for status, call in _bad_data_calls(cache):
        _raises(status, call)
    _unchanged(cache, before)


# ------------------------------------------------------------------------------- module functions
@pytest.mark.parametrize("call, status", [
    (lambda: page_bytes("nvfp4", 0, 1, 32), INVALID), (lambda: page_bytes("nvfp4", 4, -1, 32), INVALID),
    (lambda: page_bytes(None, 4, 1, 32), UNSUPPORTED), (lambda: page_bytes("nvfp4", 4.0, 1, 32), INVALID),
    (lambda: page_bytes("int4", 4, 1, 31), INVALID),
    (lambda: blocks_for_budget("nvfp4", 1 << 20, num_layers=None, block_size=4, num_kv_heads=1, head_dim=32), INVALID),
    (lambda: blocks_for_budget("nvfp4", 1 << 20, num_layers=2, block_size=0, num_kv_heads=1, head_dim=32), INVALID),
    (lambda: blocks_for_budget("nvfp4", -1, num_layers=2, block_size=4, num_kv_heads=1, head_dim=32), INVALID),
    (lambda: blocks_for_budget("nvfp4", 1.5e6, num_layers=2, block_size=4, num_kv_heads=1, head_dim=32), INVALID),
    (lambda: bytes_per_token("nvfp4", 0, 32), INVALID), (lambda: bytes_per_token("nvfp4", 1, 32, 0), INVALID),
    (lambda: bytes_per_token(3, 1, 32), UNSUPPORTED), (lambda: capacity_ratio_vs_bf16("nvfp4", 0), INVALID),
    (lambda: capacity_ratio_vs_bf16(None, 64), UNSUPPORTED),
])
def test_sizing_functions_refuse_bad_geometry(call, status):
    _raises(status, call)


def test_sizing_functions_take_format_names():
    f = get_format("nvfp4")
    assert page_bytes("nvfp4", 16, 2, 64) == page_bytes(f, 16, 2, 64)
    assert blocks_for_budget("nvfp4", 10 ** 6, num_layers=2, block_size=16, num_kv_heads=2, head_dim=64) == \
        10 ** 6 // (2 * page_bytes(f, 16, 2, 64))
    assert capacity_ratio_vs_bf16("nvfp4", 128) == capacity_ratio_vs_bf16(f, 128)


# ------------------------------------------------------------------------------------- allocator
def _alloc_state(a: BlockAllocator):
    return copy.deepcopy(vars(a))


def _used_allocator() -> BlockAllocator:
    """Blocks 0, 1 in use (1 twice), 2 cached under key "p", 3 free after use, 4.. never used."""
    a = BlockAllocator(8)
    assert a.allocate(4) == [0, 1, 2, 3]
    a.share([1])
    a.register(2, "p")
    a.free([2, 3])
    return a


BAD_IDS = [(1.0, INVALID), (0.0, INVALID), (True, INVALID), (False, INVALID), ("0", INVALID), (None, INVALID),
           (torch.tensor(0.0), INVALID), (torch.tensor([0]), INVALID), (torch.tensor(True), INVALID),
           (np.float64(0), INVALID), (np.array([0]), INVALID), ([0], INVALID), (8, RANGE), (-1, RANGE),
           (2 ** 64, RANGE), (np.int64(-1), RANGE)]


@pytest.mark.parametrize("bad, status", BAD_IDS, ids=lambda v: repr(v)[:20])
@pytest.mark.parametrize("op", ["free", "share", "register", "ref_count"])
def test_bad_block_ids_change_nothing(op, bad, status):
    """Reproducers: free([1.0]) was accepted and allocate(1) then returned 1.0; free([0, 99]) must free nothing."""
    a = _used_allocator()
    before = _alloc_state(a)
    calls = {"free": lambda: a.free([0, bad]), "share": lambda: a.share([0, bad]),
             "register": lambda: a.register(bad, "q"), "ref_count": lambda: a.ref_count(bad)}
    _raises(status, calls[op])
    assert _alloc_state(a) == before
    got = a.allocate(5)
    assert got == [3, 4, 5, 6, 7] and all(type(b) is int for b in got)
    a.check_invariants()


@pytest.mark.parametrize("ids", [[torch.tensor(0)], [np.int64(0)], torch.tensor([0]), np.array([0], dtype=np.int32)])
def test_integer_scalar_ids_are_ints(ids):
    """Reproducer: free([torch.tensor(0)]) on a used block said "double free"."""
    a = BlockAllocator(4)
    a.allocate(2)
    a.free(ids)
    assert a.ref_count(torch.tensor(0)) == 0 and a.ref_count(np.int16(1)) == 1
    got = a.allocate(1)
    assert got == [0] and type(got[0]) is int
    a.check_invariants()


def test_rejected_free_share_register_change_nothing():
    a = _used_allocator()
    before = _alloc_state(a)
    _raises(INVALID, a.free, [0, 0])  # block 0 holds one reference
    _raises(INVALID, a.free, [1, 1, 1])  # block 1 holds two
    _raises(INVALID, a.free, [0, 3])  # 3 is free
    _raises(INVALID, a.free, [0, 2])  # 2 is cached (ref 0)
    _raises(INVALID, a.share, [0, 5])  # 5 was never allocated
    _raises(INVALID, a.register, 0, ["unhashable"])
    _raises(INVALID, a.register, 3, "q")  # not in use
    _raises(INVALID, a.register, 0, "p")  # key held by block 2
    _raises(INVALID, a.lookup, {"unhashable": 1})
    for bad in (5, "01", None, 1.0):
        _raises(INVALID, a.free, bad)
        _raises(INVALID, a.share, bad)
    assert _alloc_state(a) == before


@pytest.mark.parametrize("n", [1.5, "2", None, True, -1, torch.tensor(1.0), [1], 2.0])
def test_bad_counts_are_refused(n):
    """Reproducer: allocate(1.5 | "2" | None) raised TypeError."""
    a = _used_allocator()
    before = _alloc_state(a)
    _raises(INVALID, a.allocate, n)
    if n is not None:
        _raises(INVALID, a.evict, n)
    assert _alloc_state(a) == before


def test_integer_scalar_counts():
    a = _used_allocator()
    assert a.evict(np.int64(1)) == [2] and a.allocate(torch.tensor(2)) == [2, 3]


@pytest.mark.parametrize("n", [2.5, True, 0, -3, "4", None, torch.tensor(4.0)])
def test_allocator_size_must_be_a_positive_int(n):
    _raises(INVALID, BlockAllocator, n)


def test_huge_allocator_is_lazy():
    a = BlockAllocator(2 ** 62)
    assert a.allocate(3) == [0, 1, 2] and a.num_free == 2 ** 62 - 3
    a.free([1])
    assert a.allocate(2) == [1, 3]
    a.check_invariants()


# ----------------------------------------------------------------------------------- calibration
def test_observer_rejects_bad_input_and_folds_nothing():
    """A batch whose V is bad must not fold its K into the amax either."""
    obs = AmaxObserver(2, num_kv_heads=2, per_head=True)
    k = torch.randn(4, 2, 8)
    obs.observe(0, k, k)
    before = obs.amax.clone()
    big = k * 100
    bad_v = k.clone()
    bad_v[0, 0, 0] = float("nan")
    for status, call in [
        (INVALID, lambda: obs.observe(0, big, bad_v)), (INVALID, lambda: obs.observe(0, big, k[:, :1])),
        (INVALID, lambda: obs.observe(0, big, [1.0])), (INVALID, lambda: obs.observe(0, big, k.long())),
        (RANGE, lambda: obs.observe(2, big, k)), (RANGE, lambda: obs.observe(-1, big, k)),
        (INVALID, lambda: obs.observe(True, big, k)), (INVALID, lambda: obs.observe(0.0, big, k)),
    ]:
        _raises(status, call)
    assert torch.equal(obs.amax, before)


def test_observer_saturates_fp64_beyond_fp32():
    obs = AmaxObserver(1)
    x = torch.zeros(2, 1, 8, dtype=torch.float64)
    x[1, 0, 3] = -1e300
    obs.observe(0, x, x)
    assert float(obs.amax[0, 0, 0]) == torch.finfo(torch.float32).max
    k_g, _ = obs.global_scales(get_format("nvfp4"))[0]
    assert torch.isfinite(k_g).all()


@pytest.mark.parametrize("args", [(0,), (1.5,), (True,), (2, 0, True), (2, 2, "yes")])
def test_observer_constructor(args):
    _raises(INVALID, AmaxObserver, *args)


def test_calibration_helpers_refuse_non_tensors():
    _raises(INVALID, global_scale_for_amax, get_format("nvfp4").k, 3.0)
    _raises(INVALID, amax_from_checkpoint, {"model.layers.0.self_attn.k_scale": 0.5}, 1)
    _raises(INVALID, amax_from_checkpoint, {}, 0)
    _raises(INVALID, amax_from_checkpoint, [("model.layers.0.k_scale", torch.ones(1))], 1)
