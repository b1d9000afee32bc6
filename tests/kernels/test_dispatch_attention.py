"""`ops.dispatch.paged_decode` / `paged_prefill` on a cache descriptor: the kernel path (forced on CPU under
the interpreter, natural on CUDA) agrees with `ops.attention`, falls back to it where the kernels do not
serve the call, and refuses bad tables with OUT_OF_RANGE."""
import pytest
import torch

from kvx_core.descriptors import BlockTable, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.errors import KvxError, Status
from kvx_core.ops import attention, dispatch, reference
from kvx_core.ops.graphs import capture

from .helpers import close_attention, filled_cache, packed_tables


def _forbid_reference(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the reference ran: the kernel path was expected")
    monkeypatch.setattr(attention, "paged_decode", boom)
    monkeypatch.setattr(attention, "paged_prefill", boom)


@pytest.mark.parametrize("name", ["bf16", "int8", "nvfp4", "k8v4_rot"])
def test_dispatch_attention_kernel_path(name, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    c = filled_cache(name, device, page_buffer=True, seed=3)  # one buffer per layer, pools are strided page views
    desc = c.descriptor(0)
    table, lens = packed_tables(device)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 4, 64, generator=g).to(torch.bfloat16).to(device)
    qo = torch.tensor([0, 5, 5, 6, 9], dtype=torch.int32)
    qp = torch.randn(9, 4, 64, generator=g).to(torch.bfloat16).to(device)
    ref_d = attention.paged_decode(q, desc, table, lens, softcap=20.0)
    ref_p = attention.paged_prefill(qp, qo, desc, table, lens, window=6)
    _forbid_reference(monkeypatch)
    close_attention(dispatch.paged_decode(q, desc, table, lens, softcap=20.0), ref_d)
    close_attention(dispatch.paged_prefill(qp, qo, desc, table, lens, window=6), ref_p)


def test_dispatch_attention_checks(device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    c = filled_cache("int4", device, seed=2)
    desc = c.descriptor(0)
    table, lens = packed_tables(device)
    q = torch.randn(4, 4, 64).to(torch.bfloat16).to(device)
    bad = BlockTable.packed(table.indices.clone())
    bad.indices[3, 1] = 12  # the cache has 12 blocks; block 1 of sequence 3 (9 tokens, 4 per block) is in use
    with pytest.raises(KvxError) as e:
        dispatch.paged_decode(q, desc, bad, lens)
    assert e.value.status == Status.OUT_OF_RANGE
    with pytest.raises(KvxError) as e:
        dispatch.paged_prefill(q, torch.tensor([0, 1, 2, 3, 5]), desc, table, lens)
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError) as e:  # sequence 1 caches 0 tokens but gets 1 new query token
        dispatch.paged_prefill(q, torch.tensor([0, 1, 2, 3, 4]), desc, table, lens)
    assert e.value.status == Status.INVALID_ARGUMENT and "new tokens" in str(e.value)
    short = SeqLens(torch.tensor([13, 0, 1, 17], dtype=torch.int32, device=device))  # 17 > 4 blocks x 4 tokens
    with pytest.raises(KvxError) as e:
        dispatch.paged_decode(q, desc, table, short)
    assert e.value.status == Status.OUT_OF_RANGE


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "k8v4", "nvfp4_rot"])
def test_dispatch_attention_gpu(name, monkeypatch):
    """Realistic shapes on the GPU: the natural dispatch takes the kernels (no forcing). Finite data: with
    scores near the fp32 overflow edge the NaN pattern depends on accumulation order (the CPU test above
    covers NaN propagation)."""
    c = filled_cache(name, "cuda", nb=300, bs=16, h=8, d=128, page_buffer=True, seed=5)
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(2, 300 * 16, 8, 128, generator=g).cuda()
    reference.write_kv(c.descriptor(0), WriteDesc(KvIoDesc(k, v), SlotMapping(torch.arange(300 * 16, device="cuda"))))
    desc = c.descriptor(0)
    lens = SeqLens(torch.tensor([1, 777, 0, 800, 500], dtype=torch.int32, device="cuda"))
    table = BlockTable.packed(torch.randint(0, 300, (5, 50), device="cuda", dtype=torch.int32))
    q = torch.randn(5, 32, 128, device="cuda", dtype=torch.bfloat16)
    qo = torch.tensor([0, 1, 33, 33, 97, 98], dtype=torch.int32)
    qp = torch.randn(98, 32, 128, device="cuda", dtype=torch.bfloat16)
    ref_d = attention.paged_decode(q, desc, table, lens)
    ref_p = attention.paged_prefill(qp, qo, desc, table, lens)
    _forbid_reference(monkeypatch)
    close_attention(dispatch.paged_decode(q, desc, table, lens, max_seq_len=800, check=False), ref_d)
    close_attention(dispatch.paged_prefill(qp, qo, desc, table, lens), ref_p)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "int8", "nvfp4", "k8v4"])
def test_dispatch_decode_step_cuda_graph(name):
    """One engine decode step through the sync-free dispatch (write each sequence's new token, then attend),
    captured in a CUDA graph and replayed with new inputs: equal to the same step run eagerly."""
    c = filled_cache(name, "cuda", nb=128, bs=16, h=8, d=128, page_buffer=True, seed=8)
    desc = c.descriptor(0)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 128 * 16, 8, 128, generator=g).cuda()
    reference.write_kv(desc, WriteDesc(KvIoDesc(k, v), SlotMapping(torch.arange(128 * 16, device="cuda"))))
    lens = torch.tensor([100, 257, 31, 500], dtype=torch.int32)
    perm = torch.randperm(128, generator=g).to(torch.int32)
    bt = torch.zeros(4, 32, dtype=torch.int32)
    i = 0
    for b, n in enumerate(lens.tolist()):
        nblk = (n + 15) // 16
        bt[b, :nblk] = perm[i:i + nblk]
        i += nblk
    slots = (bt[torch.arange(4), (lens - 1) // 16].long() * 16 + (lens - 1) % 16).cuda()
    table, seq = BlockTable.packed(bt.cuda()), SeqLens(lens.cuda())
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        dispatch.write_kv(desc, WriteDesc(KvIoDesc(kn, vn), SlotMapping(slots)), check=False)
        return dispatch.paged_decode(q, desc, table, seq, max_seq_len=500, check=False)

    graph, (o_g, lse_g) = capture(step)
    pools = [t for t in vars(c.layers[0]).values() if isinstance(t, torch.Tensor)]
    snapshot = [t.clone() for t in pools]
    for t in (q, kn, vn):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    after_graph = [t.clone() for t in pools]
    for t, s0 in zip(pools, snapshot, strict=True):
        t.copy_(s0)
    o_e, lse_e = step()
    assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after_graph, pools, strict=True))
    assert not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(after_graph, snapshot, strict=True))
