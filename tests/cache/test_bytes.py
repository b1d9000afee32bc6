"""Byte accounting vs hand-computed numbers: bytes per token, capacity vs BF16, page size and its
16-byte region alignment, blocks for a byte budget."""
from itertools import pairwise

import pytest

from kvx_core.cache import PagedKVCache, blocks_for_budget, bytes_per_token, capacity_ratio_vs_bf16, page_bytes
from kvx_core.formats import get_format, list_formats


def bytes_per_elem(base: str, d: int) -> float:
    """Average stored bytes per K/V element, payload + scale pool (K and V averaged for k8v4)."""
    return {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": (d + 4) / d,
            "int4": (d / 2 + 4) / d, "nvfp4": 0.5625, "mxfp4": 0.5625, "mxfp4_32": 0.53125,
            "k8v4": (1 + 0.5625) / 2}[base]


def _base(name: str) -> str:
    return name.removesuffix("_rot").removesuffix("_floor")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt", list_formats())
def test_bytes_per_token_and_capacity_ratio(fmt, d):
    bpe = bytes_per_elem(_base(fmt), d)
    f = get_format(fmt)
    # K + V, 4 KV heads, 3 layers (all quantities are exact binary fractions)
    assert bytes_per_token(f, 4, d, 3) == 2 * bpe * d * 4 * 3
    assert bytes_per_token(f, 1, d) == 2 * bpe * d
    assert capacity_ratio_vs_bf16(f, d) == pytest.approx(2 / bpe, rel=1e-12)
    cache = PagedKVCache(fmt, num_layers=3, num_blocks=1, block_size=1, num_kv_heads=4, head_dim=d)
    assert cache.bytes_per_token == 2 * bpe * d * 4 * 3


def test_capacity_ratio_headline_numbers():
    assert capacity_ratio_vs_bf16(get_format("nvfp4"), 128) == pytest.approx(32 / 9)  # ~3.56x
    assert capacity_ratio_vs_bf16(get_format("mxfp4_32"), 128) == pytest.approx(64 / 17)  # ~3.76x
    assert capacity_ratio_vs_bf16(get_format("int4"), 128) == pytest.approx(64 / 17)
    assert capacity_ratio_vs_bf16(get_format("int8"), 64) == pytest.approx(32 / 17)
    assert capacity_ratio_vs_bf16(get_format("k8v4"), 128) == pytest.approx(2 / 0.78125)  # 2.56x
    assert capacity_ratio_vs_bf16(get_format("fp8_e4m3"), 64) == 2.0


# (format, block_size, kv heads, head_dim) -> page bytes, by hand: regions K data | V data | K scales |
# V scales, each starting at a multiple of 16, the page rounded up to 16.
PAGES = {
    ("nvfp4", 16, 2, 64): 1024 + 1024 + 128 + 128,  # 2*16*32 payload, 2*16*4 scale bytes
    ("bf16", 1, 1, 64): 128 + 128,
    ("fp8_e4m3", 1, 1, 64): 64 + 64,  # no scale pool
    ("int8", 1, 1, 64): 160,  # 64 | 64 | 4 @128 -> next @144 | 4 -> 148 -> 160
    ("int4", 1, 1, 64): 96,  # 32 | 32 | 4 @64 -> @80 | 4 -> 84 -> 96
    ("int4", 3, 1, 64): 224,  # 96 | 96 | 12 @192 -> @208 | 12 -> 220 -> 224
    ("mxfp4_32", 1, 1, 64): 96,  # 32 | 32 | 2 @64 -> @80 | 2 -> 82 -> 96
    ("k8v4", 1, 1, 64): 112,  # 64 (fp8 K) | 32 @64 -> 96 | K scales 0 | 4 @96 -> 100 -> 112
    ("k8v4_rot", 3, 2, 128): 768 + 384 + 48,  # 768 | 384 @768 -> 1152 | 0 | 2*3*8=48 @1152 -> 1200
}


@pytest.mark.parametrize("key", list(PAGES), ids=lambda k: "-".join(map(str, k)))
def test_page_bytes_hand_computed(key):
    fmt, bs, h, d = key
    assert page_bytes(get_format(fmt), bs, h, d) == PAGES[key]


@pytest.mark.parametrize("fmt", list_formats())
def test_page_buffer_regions_are_16_byte_aligned_and_disjoint(fmt):
    f = get_format(fmt)
    for bs, h, d in ((1, 1, 64), (3, 3, 64), (16, 2, 128), (5, 1, 128)):
        pb = page_bytes(f, bs, h, d)
        assert pb % 16 == 0
        cache = PagedKVCache(fmt, num_layers=1, num_blocks=2, block_size=bs, num_kv_heads=h, head_dim=d,
                             page_buffer=True)
        p = cache.layers[0]
        base = p.k_data.untyped_storage().data_ptr()
        assert p.k_data.untyped_storage().nbytes() == 2 * pb
        spans = []
        for t, tf, scales in ((p.k_data, f.k, False), (p.v_data, f.v, False), (p.k_scales, f.k, True),
                              (p.v_scales, f.v, True)):
            want = h * bs * (tf.scale_dim(d) if scales else tf.payload_dim(d) * tf.torch_data_dtype.itemsize)
            if t is None:
                assert want == 0
                continue
            off = t.data_ptr() - base
            assert off % 16 == 0 and t.stride(0) * t.element_size() == pb  # one page per block id
            assert t[0].numel() * t.element_size() == want and t[0].is_contiguous()
            spans.append((off, off + want))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in pairwise(spans)) and spans[-1][1] <= pb
        assert pb - sum(e - s for s, e in spans) < 16 * 4  # only alignment padding


def test_blocks_for_budget_hand_computed():
    f = get_format("nvfp4")
    budget = 10 * 2**20
    # page 2304 B per layer (see PAGES), 4 layers -> 9216 B per block id; 10 MiB // 9216 = 1137
    n = blocks_for_budget(f, budget, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
    assert n == 1137 and n * 9216 <= budget < (n + 1) * 9216
    cache = PagedKVCache(f, num_layers=4, num_blocks=n, block_size=16, num_kv_heads=2, head_dim=64, page_buffer=True)
    assert cache.nbytes == n * 9216 <= budget
    assert blocks_for_budget(f, 9215, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64) == 0
    # BF16: 4 layers x (K+V) x 16 tokens x 2 heads x 64 x 2 B = 32768 B per block id -> 320 blocks,
    # 32/9 x fewer than NVFP4 up to the budget's rounding
    bf = blocks_for_budget(get_format("bf16"), budget, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
    assert bf == 320 and n / bf == pytest.approx(32 / 9, rel=1e-3)
