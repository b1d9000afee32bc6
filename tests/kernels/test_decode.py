"""paged_decode (Triton) vs a float64 torch oracle over the formats' decode of the same pools."""
import math

import pytest
import torch

from kvx_core.formats import get_format, list_formats
from kvx_core.ops.decode import decode_pools

from .oracle import make_pools, make_table, ref_decode

ALL = list_formats()


def _run(name, device, lens, hkv=2, qh=4, d=64, bs=16, q_dtype=torch.bfloat16, splits=None, block_n=None,
         softcap=None, window=None, seed=0, gs=True):
    fmt = get_format(name)
    need = sum(math.ceil(L / bs) for L in lens)
    nb = need + 3
    kg = (torch.rand(hkv, generator=torch.Generator().manual_seed(seed)) + 0.5
          if (gs and fmt.k.uses_global_scale) else None)
    vg = (torch.rand(hkv, generator=torch.Generator().manual_seed(seed + 7)) + 0.5
          if (gs and fmt.v.uses_global_scale) else None)
    kd, ks, vd, vs = make_pools(fmt, nb, hkv, bs, d, device=device, seed=seed, k_gs=kg, v_gs=vg)
    bt = make_table(lens, bs, nb, device=device, seed=seed)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hkv * qh, d, generator=torch.Generator().manual_seed(seed + 3)).to(q_dtype).to(device)
    kgd = None if kg is None else kg.to(device)
    vgd = None if vg is None else vg.to(device)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    o, lse = decode_pools(q, kd, ks, vd, vs, kgd, vgd, bt, sl, fmt, softcap=softcap, window=window,
                          num_splits=splits, block_n=block_n, out=out)
    ro, rl = ref_decode(q, fmt, kd, ks, vd, vs, kg, vg, bt, sl, softcap=softcap, window=window)
    return o.cpu().double(), lse.cpu().double(), ro, rl


def _check(o, lse, ro, rl, tol=1e-2, lse_tol=2e-2):
    assert not torch.isnan(o).any()
    assert (o - ro).norm() / ro.norm().clamp_min(1e-30) < tol
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - rl[fin]).abs().max() < lse_tol if fin.any() else True


@pytest.mark.parametrize("name", ALL)
def test_decode_formats(name, device):
    """Every format, ragged lengths incl. 1, GQA 4, two splits, multi-page tiles."""
    o, lse, ro, rl = _run(name, device, [37, 1, 70], splits=2, block_n=32)
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "int8", "nvfp4", "mxfp4_32", "int4_rot"])
def test_decode_empty_sequence(name, device):
    """A length-0 sequence yields a zero output and lse = -inf; its neighbours are unaffected."""
    o, lse, ro, rl = _run(name, device, [0, 5, 17], splits=3, block_n=16)
    assert torch.all(o[0] == 0) and torch.all(torch.isneginf(lse[0]))
    _check(o[1:], lse[1:], ro[1:], rl[1:])


@pytest.mark.parametrize("qh,hkv", [(1, 2), (2, 2), (8, 1), (5, 1)])
@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int4"])
def test_decode_gqa_ratios(qh, hkv, name, device):
    o, lse, ro, rl = _run(name, device, [20, 33], hkv=hkv, qh=qh, block_n=16)
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("bs,block_n", [(16, 64), (32, 16), (64, 32), (256, 64)])
@pytest.mark.parametrize("name", ["fp16", "mxfp4", "k8v4"])
def test_decode_block_sizes(bs, block_n, name, device):
    o, lse, ro, rl = _run(name, device, [bs + 3, 2 * bs - 1], bs=bs, block_n=block_n, q_dtype=torch.float16, splits=2)
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["bf16", "fp8_e5m2", "int8", "nvfp4_rot", "mxfp4_32_rot"])
def test_decode_head_dims(d, name, device):
    o, lse, ro, rl = _run(name, device, [45, 9], d=d, block_n=16, splits=1)
    _check(o, lse, ro, rl)


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int8"])
def test_decode_softcap_window(name, device):
    o, lse, ro, rl = _run(name, device, [50, 3, 40], softcap=5.0, window=17, splits=2, block_n=16)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_gpu_large(name, d):
    """Realistic shapes on the GPU: default tiles and split heuristics, GQA 32/8."""
    lens = [1, 17, 1000, 4097, 3000]
    o, lse, ro, rl = _run(name, "cuda", lens, hkv=8, qh=4, d=d, bs=16, seed=d)
    _check(o, lse, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "int4", "nvfp4", "mxfp4_32_rot", "k8v4"])
@pytest.mark.parametrize("bs", [16, 64, 128, 256])
def test_decode_gpu_block_sizes(name, bs):
    o, lse, ro, rl = _run(name, "cuda", [bs * 5 + 1, 700], hkv=8, qh=4, d=128, bs=bs, seed=bs)
    _check(o, lse, ro, rl)
