"""NVFP4 TRT-LLM pools as KVX: pools filled by raw byte arithmetic of TRT-LLM's writer, read back through KVX.

The oracle writes K/V encoded with KVX's NVFP4 format where TRT-LLM's `quantizeAndWriteFP4KVCache`
(`unfusedAttentionKernels_2_template.h`) puts them: payload bytes at `getKVLocalIdx / 2`, K scales at `(h * T + t) *
S + j`, V scales interleaved by 4 tokens at `(r // 4) * 4 * S + j * 4 + r % 4` with `r = h * T + t`, each in the
block at the offsets table's entry plus the layer pointer (`attentionOp.cpp`: `layer * kv_factor * bytes_per_block`,
`bytes_per_block / 16` for the scale pool). Gathers must equal the NVFP4 decode of those codes exactly.
"""
from __future__ import annotations

import pytest
import torch

from kvx_core.descriptors import GatherDesc, SeqLens
from kvx_core.enums import QUANT_FLAG_V_SCALE_INTERLEAVE4
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.ops import dispatch
from kvx_trtllm import describe_trtllm_cache

from ..adapters.engine_ref import trtllm_offset, trtllm_write
from .oracle import check_attention

D, H, L = 32, 2, 2
S = D // 16
NVFP4 = get_format("nvfp4")


def _v_scale_index(r: torch.Tensor, j: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Byte of V scale (row r = h * T + t, group j) inside a block's plane: TRT-LLM's interleave, or linear."""
    return (r // 4) * 4 * S + j * 4 + r % 4 if interleaved else r * S + j


class Nvfp4Cache:
    """One TRT-LLM NVFP4 pool (L layers, H KV heads) with its block-scale pool, sequences `lens` in shuffled blocks;
    K/V random, encoded per layer with its own K and V global scales."""

    def __init__(self, t: int = 8, lens=(13, 5, 8), interleaved: bool = True, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.t, self.lens = t, list(lens)
        m = max(-(-n // t) for n in lens) + 1
        n_blocks = len(lens) * m + 3
        self.data = torch.zeros(n_blocks, L, 2, H * t * D // 2, dtype=torch.uint8)
        self.scales = torch.zeros(n_blocks, L, 2, H * t * S, dtype=torch.uint8)
        mem = torch.randperm(n_blocks, generator=g)[:len(lens) * m].view(len(lens), m)
        for s, n in enumerate(lens):
            mem[s, -(-n // t):] = -1
        self.offsets = torch.stack([trtllm_offset(mem, L, kv) for kv in (0, 1)], dim=1)  # [seqs, 2, M]
        self.quant_orig = torch.tensor([[1.0, 0.5, 2.0], [1.0, 0.25, 0.125]])  # per layer (Q, K, V)
        seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
        pos = torch.cat([torch.arange(n) for n in lens])
        self.oracle = []
        for layer in range(L):
            gk, gv = (self.quant_orig[layer, i].expand(H) for i in (1, 2))
            (kp, ks), (vp, vs) = (NVFP4.k.encode(torch.randn(seq.numel(), H, D, generator=g) * 3, gx)
                                  for gx in (gk, gv))
            trtllm_write(self.data.view(-1), None, self.offsets.view(len(lens), 1, 2, -1), layer, L, t, kp, vp,
                         seq, torch.zeros_like(seq), pos)
            self._write_scales(layer, seq, pos, ks, vs, interleaved)
            self.oracle.append((NVFP4.k.decode(kp, ks, gk), NVFP4.v.decode(vp, vs, gv)))

    def _write_scales(self, layer, seq, pos, ks, vs, interleaved):
        flat, t = self.scales.view(-1), self.t
        r = torch.arange(H).view(1, -1, 1) * t + (pos % t).view(-1, 1, 1)  # [n, H, 1]
        j = torch.arange(S).view(1, 1, -1)
        for kv, x, inter in ((0, ks, False), (1, vs, interleaved)):
            block = self.offsets[seq, kv, pos // t].to(torch.int64).view(-1, 1, 1) + layer * 2
            flat[block * H * t * S + _v_scale_index(r, j, inter)] = x

    def describe(self, **kw):
        args = dict(tokens_per_block=self.t, num_kv_heads=H, head_dim=D, scale_pools=self.scales,
                    kv_scale_quant_orig=self.quant_orig)
        args.update(kw)
        return describe_trtllm_cache(self.data, self.offsets, **args)

    def gather(self, x):
        return dispatch.gather_kv(x.cache, GatherDesc(x.table, SeqLens(torch.tensor(self.lens, dtype=torch.int32)),
                                                      max(self.lens)))


@pytest.mark.parametrize("layout", ["interleaved", "linear"])
def test_every_layer_gathers_the_decode_of_the_engine_codes(layout):
    e = Nvfp4Cache(interleaved=layout == "interleaved")
    layers = e.describe(v_scale_layout=layout, pool_pointers=torch.tensor(
        [[[e.data.data_ptr(), e.scales.data_ptr()], [0, 0]]]))
    for layer, (x, (k, v)) in enumerate(zip(layers, e.oracle, strict=True)):
        q = x.cache.quant
        assert bool(q.flags & QUANT_FLAG_V_SCALE_INTERLEAVE4) == (layout == "interleaved")
        bpb = H * e.t * D // 2  # zero copy, at the layer pointers of attentionOp.cpp
        assert x.cache.k.tensor.data_ptr() == e.data.data_ptr() + layer * 2 * bpb
        assert q.v_scales.tensor.data_ptr() == e.scales.data_ptr() + layer * 2 * bpb // 8
        assert torch.equal(q.k_global_scale, e.quant_orig[layer, 1].expand(H))
        assert torch.equal(q.v_global_scale, e.quant_orig[layer, 2].expand(H))
        out = e.gather(x)
        assert torch.equal(out.key, k) and torch.equal(out.value, v), layer


def test_reading_interleaved_v_scales_as_linear_would_be_caught():
    """The oracle tells the layouts apart: the same bytes described with the wrong V scale layout decode other V."""
    e = Nvfp4Cache()
    x = e.describe(v_scale_layout="linear")[0]
    out = e.gather(x)
    k, v = e.oracle[0]
    assert torch.equal(out.key, k) and not torch.equal(out.value, v)


def test_kernels_never_see_interleaved_scales(kernels_on_cpu, monkeypatch):
    """On a kernel device dispatch keeps linear NVFP4 pools on the kernels and sends interleaved ones to the
    reference, which still returns the oracle."""
    inter, lin = Nvfp4Cache(), Nvfp4Cache(interleaved=False)
    assert dispatch._kernel_pools(lin.describe(v_scale_layout="linear")[0].cache) is not None
    x = inter.describe()[1]
    assert dispatch._kernel_pools(x.cache) is None and x.bound is None
    out = inter.gather(x)
    assert torch.equal(out.key, inter.oracle[1][0]) and torch.equal(out.value, inter.oracle[1][1])


@pytest.mark.parametrize("layout", ["interleaved", "linear"])
def test_decode_as_an_engine_runs_it_equals_attention_over_the_oracle_kv(kernels_on_cpu, layout, monkeypatch):
    """On a kernel device (forced: the kernels under the interpreter) a step's sync-free plan run over `layer.bound or
    layer.cache`: linear V scales are bound (the kernels), interleaved ones are not (the reference); both equal the
    oracle."""
    e = Nvfp4Cache(interleaved=layout == "interleaved")
    x = e.describe(v_scale_layout=layout)[0]
    assert (x.bound is None) == (layout == "interleaved")
    lens = SeqLens(torch.tensor(e.lens, dtype=torch.int32))
    plan = dispatch.plan_decode(x.table, lens, fmt="nvfp4", num_qo_heads=2 * H, num_kv_heads=H, head_dim=D,
                                block_size=e.t, q_dtype=torch.bfloat16, device="cpu", max_seq_len=16, check=False)
    q = torch.randn(len(e.lens), 2 * H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out, _ = plan.run(q, x.bound or x.cache, want_lse=False)
    check_attention(out, q, *e.oracle[0], e.lens)


def test_decode_equals_attention_over_the_oracle_kv():
    e = Nvfp4Cache()
    x = e.describe()[0]
    lens = SeqLens(torch.tensor(e.lens, dtype=torch.int32))
    q = torch.randn(len(e.lens), 2 * H, D, generator=torch.Generator().manual_seed(1))
    out, _ = dispatch.paged_decode(q, x.cache, x.table, lens)
    check_attention(out, q, *e.oracle[0], e.lens, tol=1e-4)


@pytest.mark.parametrize("make,kw,status,words", [
    (dict(), {"scale_pools": None}, Status.INVALID_ARGUMENT, "scale_pools"),
    (dict(), {"secondary_pools": torch.zeros(1)}, Status.UNSUPPORTED, "secondary"),
    (dict(t=2), {}, Status.UNSUPPORTED, "block_size % 4"),
    (dict(), {"v_scale_layout": "swizzled"}, Status.INVALID_ARGUMENT, "v_scale_layout"),
    (dict(), {"kv_scale_quant_orig": [0.5, 2.0]}, Status.INVALID_ARGUMENT, "[num_layers=2, 3]"),
    (dict(), {"kv_scale_quant_orig": [[1.0, 0.5, 0.0]] * 2}, Status.INVALID_ARGUMENT, "finite and positive"),
    (dict(), {"kv_scale_orig_quant": [[1.0, 2.0, 2.0]] * 2}, Status.INVALID_ARGUMENT, "1 / kv_scale_quant_orig"),
    (dict(), {"head_dim": 24}, Status.INVALID_ARGUMENT, "multiple of 16"),
    (dict(), {"pool_pointers": torch.zeros(1, 2, dtype=torch.int64)}, Status.INVALID_ARGUMENT, "[1, 2, 2]"),
    (dict(), {"pool_pointers": torch.zeros(1, 2, 2, dtype=torch.int64)}, Status.INVALID_ARGUMENT, "base addresses"),
])
def test_what_cannot_be_described_exactly_is_refused(make, kw, status, words):
    e = Nvfp4Cache(**make)
    if "secondary_pools" in kw:
        kw = {"secondary_pools": torch.zeros_like(e.data)}
    with pytest.raises(KvxError) as err:
        e.describe(**kw)
    assert err.value.status == status and words in str(err.value), str(err.value)


def test_scale_pool_shape_and_flag_scope_are_checked():
    e = Nvfp4Cache()
    with pytest.raises(KvxError, match="scale pool 0 must be a contiguous"):
        e.describe(scale_pools=e.scales[:, :1])
    x = e.describe()[0]
    q = x.cache.quant
    q.format = get_format("mxfp4").quant  # the flag is defined for NVFP4 only
    with pytest.raises(KvxError, match="NVFP4 only") as err:
        e.gather(x)
    assert err.value.status == Status.INVALID_ARGUMENT
