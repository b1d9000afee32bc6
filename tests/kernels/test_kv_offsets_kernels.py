"""The attention and gather kernels straight on TRT-LLM pools through KV_OFFSETS tables (its raw KVCacheIndex
offsets, K block e and V block e + 1 of a layer's block array): the kernel path (forced on CPU under the
interpreter, natural on CUDA) equals the reference over the same descriptors, and tables the kernels cannot read
(host blocks, another K/V pairing) go to the reference."""
import pytest
import torch

from kvx_adapters.trtllm import kv_offsets_from_packed
from kvx_core.descriptors import BlockTable, GatherDesc, SeqLens
from kvx_core.errors import KvxError, Status
from kvx_core.ops import attention, dispatch, reference
from kvx_trtllm import describe_trtllm_cache

T, H, D, LAYERS = 4, 2, 64, 3


def _trtllm(device, dtype, *, beams=1, seed=0, lens=(13, 1, 9)):
    """A filled pool `[blocks, layers, 2, H*T*D]` of `dtype`, offsets as TRT-LLM writes them (beams share all but
    their last block), and layer 1 of it described with its pool's table."""
    g = torch.Generator().manual_seed(seed)
    n = 40
    x = torch.randn(n, LAYERS, 2, H * T * D, generator=g) * 2
    pool = x.to(dtype).to(device)
    need = [-(-L // T) for L in lens]
    ids = torch.randperm(n, generator=g)[:len(lens) * beams * max(need)].view(len(lens) * beams, max(need))
    for s, k in enumerate(need):  # beams share all but the last used block
        for w in range(1, beams):
            ids[s * beams + w, :k - 1] = ids[s * beams, :k - 1]
    lens_rows = SeqLens(torch.tensor(lens, dtype=torch.int32).repeat_interleave(beams))
    offsets = kv_offsets_from_packed(ids, num_layers=LAYERS, seq_lens=lens_rows, tokens_per_block=T)  # [S*W, 1, 2, M]
    offsets = offsets.view(len(lens), beams, 2, -1).to(device)
    scales = [0.5, 1.5, 2.0] if dtype == torch.float8_e4m3fn else None
    layers = describe_trtllm_cache(pool, offsets.flatten(0, 1), tokens_per_block=T, num_kv_heads=H, head_dim=D,
                                   beam_width=beams, kv_scale_quant_orig=scales)
    return layers[1], SeqLens(torch.tensor(lens, dtype=torch.int32, device=device)), offsets


def _close(got, ref, tol=2e-2):
    (o, lse), (ro, rl) = got, ref
    o, ro = o.float().cpu(), ro.float().cpu()
    assert (o - ro).norm() / max(float(ro.norm()), 1e-6) < tol
    assert torch.allclose(lse.cpu(), rl.cpu(), atol=1e-2, rtol=1e-3)


def _forbid_reference(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the reference ran: the kernel path was expected")
    for mod, names in ((attention, ("paged_decode", "paged_prefill")), (reference, ("gather_kv",))):
        for name in names:
            monkeypatch.setattr(mod, name, boom)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kernels_read_trtllm_offsets_directly(dtype, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, lens, _ = _trtllm(device, dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, D, generator=g).to(torch.bfloat16).to(device)
    qo = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    qp = torch.randn(9, 4, D, generator=g).to(torch.bfloat16).to(device)
    gd = GatherDesc(layer.table, lens, 13)
    ref_d = attention.paged_decode(q, layer.cache, layer.table, lens)
    ref_p = attention.paged_prefill(qp, qo, layer.cache, layer.table, lens)
    ref_g = reference.gather_kv(layer.cache, gd)
    _forbid_reference(monkeypatch)
    _close(dispatch.paged_decode(q, layer.cache, layer.table, lens), ref_d)
    _close(dispatch.paged_prefill(qp, qo, layer.cache, layer.table, lens), ref_p)
    got = dispatch.gather_kv(layer.cache, gd)
    assert torch.equal(got.key, ref_g.key) and torch.equal(got.value, ref_g.value)


def test_beams_are_rows_of_the_decode(device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, lens, _ = _trtllm(device, torch.bfloat16, beams=2, seed=4)
    q = torch.randn(6, 4, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
    ref = attention.paged_decode(q, layer.cache, layer.table, lens)
    _forbid_reference(monkeypatch)
    _close(dispatch.paged_decode(q, layer.cache, layer.table, lens), ref)


@pytest.mark.parametrize("damage", ["host block", "unpaired V"])
def test_tables_the_kernels_cannot_read_go_to_the_reference(damage, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, lens, offsets = _trtllm(device, torch.bfloat16, seed=7)
    o = offsets.clone()
    if damage == "host block":
        o[0, 0, :, 1] |= torch.tensor(-2**31, dtype=torch.int32, device=device)  # bit 31: the secondary pool
    else:
        o[2, 0, 1, 0] = o[0, 0, 1, 0]  # V of sequence 2's first block is another block's V
    table = BlockTable.kv_offsets(o)
    q = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    ran = []
    real = attention.paged_decode
    monkeypatch.setattr(attention, "paged_decode", lambda *a, **k: ran.append(1) or real(*a, **k))
    if damage == "host block":  # this pool has no host pool: the reference refuses the host reference
        with pytest.raises(KvxError, match="secondary pool") as e:
            dispatch.paged_decode(q, layer.cache, table, lens)
        assert e.value.status == Status.INVALID_ARGUMENT
    else:
        got = dispatch.paged_decode(q, layer.cache, table, lens)
        _close(got, real(q, layer.cache, table, lens))
    assert ran  # the reference served the call


def test_malformed_offsets_are_a_kvx_error_on_the_kernel_path(device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layer, lens, offsets = _trtllm(device, torch.bfloat16, seed=9)
    bad = BlockTable(layer.table.format, offsets.reshape(3, 1, -1)[:, :, :5].contiguous(), 3,
                     layer.table.max_blocks_per_seq, beam_width=1, flags=layer.table.flags)
    q = torch.randn(3, 4, D).to(torch.bfloat16).to(device)
    with pytest.raises(KvxError) as e:
        dispatch.paged_decode(q, layer.cache, bad, lens)
    assert e.value.status == Status.INVALID_ARGUMENT

