"""Key smoothing and centering on the kernel paths of `ops.dispatch` (forced on CPU under the interpreter, natural on
CUDA): the fused write stores what the reference write stores, the gather kernel reads back what the reference
gather reads (decode * s + c, bit for bit), and decode / prefill with queries times s agree with the reference
attention over the keys read back, output and LSE (the kernels see q . (k - c); dispatch adds sm_scale * q . c)."""
import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.ops import attention, dispatch, reference

NB, BS, H, D = 8, 4, 2, 64


@pytest.mark.parametrize("transform", ["smooth", "center", "both"])
@pytest.mark.parametrize("name", ["nvfp4", "k8v4_rot", "int8", "fp8_e4m3", "int4", "mxfp4"])
def test_transformed_kernel_paths_match_the_reference(name, transform, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    g = torch.Generator().manual_seed(7)
    s = (torch.rand(H, D, generator=g) * 3 + 0.3)
    offset = torch.randn(H, D, generator=g) * 8  # what centering removes
    k = (torch.randn(NB * BS, H, D, generator=g) * torch.logspace(-1, 1.5, D) + offset).bfloat16().to(device)
    v = torch.randn(NB * BS, H, D, generator=g).bfloat16().to(device)
    slots = SlotMapping(torch.randperm(NB * BS, generator=g).to(device))
    caches = []
    for write in (dispatch.write_kv, reference.write_kv):
        c = PagedKVCache(name, num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D, device=device)
        c.set_key_smoothing(0, s if transform != "center" else None)
        c.set_key_center(0, offset + 0.5 if transform != "smooth" else None)
        write(c.descriptor(0), WriteDesc(KvIoDesc(k, v), slots))
        caches.append(c)
    for f in ("k_data", "v_data", "k_scales", "v_scales"):
        a, b = getattr(caches[0].layers[0], f), getattr(caches[1].layers[0], f)
        assert (a is None and b is None) or torch.equal(a, b), f
    desc = caches[0].descriptor(0)
    lens = SeqLens(torch.tensor([NB * BS, 9], dtype=torch.int32, device=device))
    table = BlockTable.packed(torch.tensor([list(range(NB)), [7, 6, 5, 0, 0, 0, 0, 0]], dtype=torch.int32).to(device))
    for dt in (torch.float32, torch.bfloat16):
        got = dispatch.gather_kv(desc, GatherDesc(table, lens, NB * BS), out_dtype=dt)
        ref = reference.gather_kv(desc, GatherDesc(table, lens, NB * BS), out_dtype=dt)
        assert torch.equal(got.key, ref.key) and torch.equal(got.value, ref.value)
    q = torch.randn(2, 2 * H, D, generator=g).bfloat16().to(device)
    ref_d = attention.paged_decode(q, desc, table, lens)
    qp = torch.randn(5, 2 * H, D, generator=g).bfloat16().to(device)
    qo = torch.tensor([0, 3, 5], dtype=torch.int32)
    ref_p = attention.paged_prefill(qp, qo, desc, table, lens)
    plan = dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=2 * H, num_kv_heads=H, head_dim=D, block_size=BS,
                                q_dtype=q.dtype, device=device)
    o_only = plan.run(q, desc, want_lse=False)  # an engine's decode: the same output, no LSE
    assert o_only[1] is None and torch.equal(o_only[0], plan.run(q, desc)[0])
    for got, want in ((dispatch.paged_decode(q, desc, table, lens), ref_d),
                      (dispatch.paged_prefill(qp, qo, desc, table, lens), ref_p)):
        o, ro = got[0].float().cpu(), want[0].float().cpu()
        assert float((o - ro).norm() / ro.norm()) < 3e-2  # + the bf16 rounding of q * s on logits up to ~100
        lse, rl = got[1].float().cpu(), want[1].float().cpu()
        # measured <= 0.1 on logits up to ~50 (the q * s rounding again); without the LSE's + sm_scale * q . c: ~12
        assert float((lse - rl).abs().max()) < 5e-3 * float(rl.abs().max()), float((lse - rl).abs().max())
