"""Triton paged prefill/extend attention vs `ops.attention.paged_prefill` (torch FP32 over the cache's decode)."""
import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.errors import KvxError, Status
from kvx_core.formats import list_formats
from kvx_core.ops import attention
from kvx_core.ops.triton import prefill_pools

ALL = list_formats()


def _setup(name, device, lens, q_lens, hkv=2, qh=4, d=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [(n + bs - 1) // bs for n in lens]
    nb = sum(need) + 2
    c = PagedKVCache(name, num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=hkv, head_dim=d,
                     device=device, per_head_global_scale=True)
    if c.layers[0].k_global is not None:
        c.set_global_scales(0, torch.rand(hkv, generator=g) * 0.01 + 0.002, torch.rand(hkv, generator=g) * 0.01 + 0.002)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n]
        i += n
    slots = torch.cat([(bt[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs) for b, n in enumerate(lens)])
    k = torch.randn(len(slots), hkv, d, generator=g)
    k[..., :2] *= 4.0
    v = torch.randn(len(slots), hkv, d, generator=g)
    c.write(0, k.to(device), v.to(device), slots.to(device))
    qo = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qo[-1]), hkv * qh, d, generator=g).to(torch.bfloat16)
    return c, q.to(device), qo.to(device), bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def _compare(name, device, lens, q_lens, causal=True, softcap=None, window_left=None, tol=1e-2, kernel=None, **kw):
    c, q, qo, bt, sl = _setup(name, device, lens, q_lens, **kw)
    p = c.layers[0]
    out = torch.full_like(q, float("nan"))
    o, lse = prefill_pools(q, qo, p.k_data, p.k_scales, p.v_data, p.v_scales, p.k_global, p.v_global, bt, sl,
                           c.format, causal=causal, softcap=softcap, window_left=window_left, out=out, **(kernel or {}))
    ro, rl = attention.paged_prefill(q.float(), qo, c.descriptor(0), BlockTable.packed(bt), SeqLens(sl),
                                     causal=causal, softcap=softcap, window=window_left)
    o, lse, ro, rl = o.float().cpu(), lse.cpu(), ro.cpu(), rl.cpu()
    assert not torch.isnan(o).any()
    err = (o - ro).norm() / ro.norm().clamp_min(1e-30)  # all-empty rows: both exactly 0
    assert err < tol, f"{name}: rel err {err:.3g}"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    fin = torch.isfinite(rl)
    assert ((lse[fin] - rl[fin]).abs() < 2e-2).all()


@pytest.mark.parametrize("name", ALL)
def test_prefill_formats(name, device):
    """Every format: a fresh prefill (no prefix), an extend over a prefix, and a 1-token extend."""
    _compare(name, device, lens=[20, 45, 9], q_lens=[20, 13, 1])


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int8"])
def test_prefill_softcap_window_noncausal(name, device):
    _compare(name, device, lens=[40, 33], q_lens=[17, 33], softcap=5.0, window_left=9)
    _compare(name, device, lens=[30, 7], q_lens=[12, 0], causal=False)


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int8", "mxfp4_32"])
def test_prefill_unmasked_tiles(name, device):
    """Small tiles so most key tiles lie below every row's causal limit and skip the score mask; rows of one
    program span several tokens (the mask starts at the program's first token), ragged tails, non-causal."""
    small = {"block_m": 16, "block_n": 16, "num_warps": 4}
    _compare(name, device, lens=[90, 51, 64], q_lens=[37, 51, 5], kernel=small)
    _compare(name, device, lens=[90, 40], q_lens=[37, 3], causal=False, kernel=small)
    _compare(name, device, lens=[90], q_lens=[37], window_left=20, kernel=small)


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int8", "k8v4_rot"])
def test_prefill_over_a_cached_prefix_only(name, device):
    """causal=False, no window: each query attends to all of its sequence's cached tokens, which need not include
    the queries (the vLLM plugin's split prefill: a chunk over its cached prefix). More queries than cached
    tokens, and an empty prefix (output 0, lse -inf)."""
    _compare(name, device, lens=[7, 0, 40], q_lens=[20, 9, 3], causal=False)
    _compare(name, device, lens=[0], q_lens=[5], causal=False)


def test_queries_beyond_the_cache_are_refused_when_positions_matter(device):
    """Causal or windowed prefill places the queries at the end of the cache: more queries than cached tokens is
    refused there (and only there)."""
    c, q, qo, bt, sl = _setup("int8", device, [7, 4], [9, 2])
    args = (q.float(), qo, c.descriptor(0), BlockTable.packed(bt), SeqLens(sl))
    for opts in ({"causal": True}, {"causal": False, "window": 3}):
        with pytest.raises(KvxError, match="9 new tokens but only 7 cached") as e:
            attention.paged_prefill(*args, **opts)
        assert e.value.status == Status.INVALID_ARGUMENT
    attention.paged_prefill(*args, causal=False)


@pytest.mark.parametrize("qh,hkv", [(1, 2), (8, 1), (5, 1)])
def test_prefill_gqa(qh, hkv, device):
    _compare("int4_rot", device, lens=[25, 18], q_lens=[9, 18], qh=qh, hkv=hkv)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("d", [128])
def test_prefill_gpu_realistic(name, d):
    _compare(name, "cuda", lens=[1000, 2600, 513, 70], q_lens=[1000, 512, 1, 64], hkv=8, qh=4, d=d, seed=d)
