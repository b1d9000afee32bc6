"""Layouts (spec §4.2): conversion round trips among every layout, detection, and zero-copy views.

Every tensor here is built from a logical `[N, B, H, D]` tensor X by hand (the spec's dim orders),
independently of kvx_core.layouts, and the library's answers are checked against X.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvx_core.enums import Layout
from kvx_core.errors import KvxError, Status
from kvx_core.layouts import Geometry, block_view, canonical_strides, convert, detect_layout, from_logical, logical_view

from .helpers import ALL_LAYOUTS, PERMS, build, divisors

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL = ALL_LAYOUTS


@st.composite
def geometries(draw):
    n = draw(st.integers(1, 4))
    b = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    h = draw(st.integers(1, 4))
    d = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    return n, b, h, d


def packs(d):
    return st.sampled_from(divisors(d))


DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])


@SETTINGS
@given(data=st.data(), geom=geometries(), src=st.sampled_from(ALL), dst=st.sampled_from(ALL), dtype=DTYPES)
def test_convert_round_trip(data, geom, src, dst, dtype):
    n, b, h, d = geom
    x = torch.randn(geom).to(dtype)
    ps, pd = data.draw(packs(d)), data.draw(packs(d))
    perm = data.draw(st.sampled_from(PERMS))
    pad = data.draw(st.integers(0, 1))
    s = build(x, src, ps, perm, pad)
    out = convert(s, src, dst, pd)
    g = Geometry(n, b, h, d)
    assert out.is_contiguous() and out.dtype == dtype
    assert tuple(out.stride()) == canonical_strides(dst, g, pd)
    assert torch.equal(out, build(x, dst, pd))  # CUSTOM converts to a contiguous logical-order tensor
    back = convert(out, dst, src, ps)
    assert torch.equal(back, build(x, src, ps))
    assert torch.equal(convert(s, src, Layout.NHD), x)


@SETTINGS
@given(data=st.data(), geom=geometries(), layout=st.sampled_from(ALL), dtype=DTYPES)
def test_block_and_logical_views_are_zero_copy(data, geom, layout, dtype):
    n, b, h, d = geom
    x = torch.randn(geom).to(dtype)
    p = data.draw(packs(d)) if layout == Layout.HND_PACKED else 1
    t = build(x, layout, p, data.draw(st.sampled_from(PERMS)), data.draw(st.integers(0, 1)))
    bv = block_view(t, layout)
    assert bv.shape == (n, b, h, d // p, p)
    assert bv.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert torch.equal(bv.reshape(n, b, h, d), x)
    # write through the 5-D view: the original tensor sees it where the spec's dim order says
    i = tuple(data.draw(st.integers(0, e - 1)) for e in (n, b, h, d))
    dp, pp = divmod(i[3], p)
    bv[i[0], i[1], i[2], dp, pp] = 7.0
    expect_at = {Layout.NHD: i, Layout.CUSTOM: i, Layout.HND: (i[0], i[2], i[1], i[3]),
                 Layout.HND_PACKED: (i[0], i[2], dp, i[1], pp)}[layout]
    assert float(t[expect_at]) == 7.0
    x[i] = 7.0
    # a strided [N, B, H, D] view exists iff (D/pack, pack) merge: always for pack 1 or D/pack 1, else only
    # when the D/pack stride is pack * the pack stride (canonical HND_PACKED with block_size 1)
    if not (p == 1 or d // p == 1 or bv.stride(3) == p * bv.stride(4)):
        with pytest.raises(KvxError) as ei:
            logical_view(t, layout)
        assert ei.value.status == Status.UNSUPPORTED
        return
    lv = logical_view(t, layout)
    assert lv.shape == (n, b, h, d) and torch.equal(lv, x)
    assert lv.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    lv[i] = -3.0
    assert float(t[expect_at]) == -3.0


@pytest.mark.parametrize("geom", [(2, 4, 2, 8), (3, 1, 3, 4), (1, 16, 8, 64), (2, 3, 5, 6)])
def test_detect_layout(geom):
    n, b, h, d = geom
    g = Geometry(*geom)
    x = torch.randn(geom)
    assert detect_layout(build(x, Layout.NHD), g) == Layout.NHD
    assert detect_layout(build(x, Layout.HND), g) == Layout.HND
    assert detect_layout(build(x, Layout.HND, pad=1), g) == Layout.HND  # strides honored, still HND
    for p in divisors(d):
        assert detect_layout(build(x, Layout.HND_PACKED, p), g) == Layout.HND_PACKED
        assert detect_layout(build(x, Layout.HND_PACKED, p, pad=1), g) == Layout.HND_PACKED
    for perm in PERMS[1:]:
        t = build(x, Layout.CUSTOM, perm=perm)
        if any(e > 1 for e in t.shape) and not t.is_contiguous():
            assert detect_layout(t, g) == Layout.CUSTOM, perm
    assert detect_layout(build(x, Layout.NHD, pad=1), g) == Layout.CUSTOM


def test_detect_layout_when_heads_equal_block_size():
    """[N, H, B, D] == [N, B, H, D] when H == B: shape and canonical strides are the same, so a
    canonical tensor is named NHD (the caller must pass the layout to mean HND)."""
    g = Geometry(2, 4, 4, 8)
    t = torch.zeros(2, 4, 4, 8)
    assert detect_layout(t, g) == Layout.NHD
    assert detect_layout(t.permute(0, 2, 1, 3), g) == Layout.CUSTOM


@pytest.mark.parametrize("geom", [(2, 4, 2, 8), (3, 1, 3, 4), (2, 3, 5, 6), (1, 2, 2, 1)])
def test_from_logical(geom):
    x = torch.randn(geom)
    layout, t = from_logical(x)
    assert layout == Layout.NHD and t is x
    hnd = build(x, Layout.HND)  # memory in HND order, exposed in logical order (as vLLM does)
    layout, t = from_logical(hnd.permute(0, 2, 1, 3))
    n, b, h, d = geom
    if b > 1 and h > 1:
        assert layout == Layout.HND
        assert t.shape == hnd.shape and t.stride() == hnd.stride() and t.data_ptr() == hnd.data_ptr()
    assert torch.equal(convert(t, layout, Layout.NHD), x)
    custom = build(x, Layout.CUSTOM, perm=(3, 2, 1, 0))
    layout, t = from_logical(custom)
    if d > 1 and (b > 1 or h > 1):
        assert layout == Layout.CUSTOM and t is custom
    assert torch.equal(convert(t, layout, Layout.NHD), x)


def test_logical_view_of_packed_special_cases():
    """HND_PACKED has a strided 4-D view when pack == 1 or block_size == 1."""
    x = torch.randn(2, 1, 3, 8)
    assert torch.equal(logical_view(build(x, Layout.HND_PACKED, 4), Layout.HND_PACKED), x)
    y = torch.randn(2, 4, 3, 8)
    assert torch.equal(logical_view(build(y, Layout.HND_PACKED, 1), Layout.HND_PACKED), y)
    with pytest.raises(KvxError) as ei:
        logical_view(build(y, Layout.HND_PACKED, 2), Layout.HND_PACKED)
    assert ei.value.status == Status.UNSUPPORTED
