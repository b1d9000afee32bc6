"""`ops.dispatch.plan_decode` / `plan_prefill`: a plan made once per step and run per layer (each layer its own
cache) gives what the one-shot dispatch gives for that layer, writes into caller-provided outputs, reuses its
workspace, refuses a layer that does not match it (and changes nothing), and captures in a CUDA graph."""
import pytest
import torch

from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.errors import KvxError, Status
from kvx_core.ops import attention, dispatch
from kvx_core.ops.graphs import capture

from .helpers import filled_cache

FORMATS = ["int8", "nvfp4", "k8v4_rot", "int4_rot"]


def _step(device, hkv=2):
    lens = torch.tensor([13, 0, 1, 9], dtype=torch.int32)
    bt = torch.tensor([[0, 2, 4, 6], [0, 0, 0, 0], [11, 0, 0, 0], [10, 9, 8, 0]], dtype=torch.int32)
    return BlockTable.packed(bt.to(device)), SeqLens(lens.to(device))


def _layers(name, device, n=2, **kw):
    return [filled_cache(name, device, seed=10 + i, **kw).descriptor(0) for i in range(n)]


def _same(a, b):
    """Bit-identical, NaN where NaN (the caches hold NaN tokens)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _plan_kw(name, desc, q):
    return dict(fmt=name, num_qo_heads=q.shape[1], num_kv_heads=desc.num_kv_heads, head_dim=desc.head_dim,
                block_size=desc.block_size, q_dtype=q.dtype, device=q.device)


@pytest.mark.parametrize("name", FORMATS)
def test_decode_plan_runs_every_layer_like_the_one_shot_dispatch(name, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layers = _layers(name, device)
    table, lens = _step(device)
    g = torch.Generator().manual_seed(1)
    plan = dispatch.plan_decode(table, lens, max_seq_len=13, softcap=20.0, **_plan_kw(name, layers[0],
                                torch.empty(4, 4, 64, dtype=torch.bfloat16, device=device)))
    assert plan.kernel is not None
    workspace = plan.kernel.mid_o.data_ptr()
    for desc in layers:
        q = torch.randn(4, 4, 64, generator=g).to(torch.bfloat16).to(device)
        out = torch.full_like(q, 7.0)
        lse = torch.full((4, 4), 7.0, device=device)
        o, lse_t = plan.run(q, desc, out=out, lse=lse)
        assert o is out and lse_t is lse
        ro, rl = dispatch.paged_decode(q, desc, table, lens, softcap=20.0)
        _same(out, ro)
        _same(lse, rl)
        ref = attention.paged_decode(q, desc, table, lens, softcap=20.0)[0].float()
        fin = ref.isfinite().all(-1)
        err = (out.float()[fin] - ref[fin]).norm() / ref[fin].norm()
        assert err < 2e-2, err  # the kernels' bf16/fp32 accumulation against the FP64 reference
    assert plan.kernel.mid_o.data_ptr() == workspace


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_plan_runs_every_layer_like_the_one_shot_dispatch(name, device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    layers = _layers(name, device)
    table, lens = _step(device)
    qo = torch.tensor([0, 5, 5, 6, 9], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    plan = dispatch.plan_prefill(qo, table, lens, window=6, **_plan_kw(name, layers[0],
                                 torch.empty(9, 4, 64, dtype=torch.bfloat16, device=device)))
    assert plan.kernel is not None
    for desc in layers:
        q = torch.randn(9, 4, 64, generator=g).to(torch.bfloat16).to(device)
        out = torch.empty_like(q)
        assert plan.run(q, desc, out=out)[0] is out
        _same(out, dispatch.paged_prefill(q, qo, desc, table, lens, window=6)[0])


def test_plan_refuses_a_layer_it_was_not_made_for(device, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    table, lens = _step(device)
    desc = _layers("nvfp4", device, n=1)[0]
    q = torch.randn(4, 4, 64).to(torch.bfloat16).to(device)
    plan = dispatch.plan_decode(table, lens, max_seq_len=13, **_plan_kw("nvfp4", desc, q))
    out = torch.zeros_like(q)
    bad = [
        (lambda: plan.run(q, _layers("int4", device, n=1)[0], out=out), "plan was made for nvfp4"),
        (lambda: plan.run(q[:3], desc, out=out[:3]), "as planned"),
        (lambda: plan.run(q.float(), desc, out=out), "as planned"),
        (lambda: plan.run(q, desc, out=torch.zeros(4, 4, 32, device=device)), "out must be"),
        (lambda: plan.run(q, desc, out=out, lse=torch.zeros(4, 4, dtype=torch.float16, device=device)), "lse must"),
        (lambda: plan.run(q, _layers("nvfp4", device, n=1, bs=8)[0], out=out), "as planned"),
    ]
    for fn, match in bad:
        with pytest.raises(KvxError, match=match) as e:
            fn()
        assert e.value.status in (Status.INVALID_ARGUMENT, Status.OUT_OF_RANGE)
        assert torch.equal(out, torch.zeros_like(q))  # a refused run writes nothing


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "int8", "fp8_e4m3", "nvfp4_rot", "bf16"])
def test_decode_plan_made_once_replays_for_two_layers_in_a_cuda_graph(name):
    """The engine pattern: the metadata builder plans (outside the graph), the captured forward runs the plan
    for every layer into its output buffers; replays with new queries equal eager runs."""
    layers = _layers(name, "cuda", nb=64, bs=16, h=8, d=128, page_buffer=True)
    lens = SeqLens(torch.tensor([100, 1000, 1, 257], dtype=torch.int32, device="cuda"))
    table = BlockTable.packed(torch.randint(0, 64, (4, 64), dtype=torch.int32, device="cuda"))
    q = torch.randn(2, 4, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    plan = dispatch.plan_decode(table, lens, max_seq_len=1000, check=False, **_plan_kw(name, layers[0], q[0]))

    def forward():
        for i, desc in enumerate(layers):
            plan.run(q[i], desc, out=out[i])
        return out

    graph, _ = capture(forward)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    got = out.clone()
    for i, desc in enumerate(layers):
        _same(got[i], dispatch.paged_decode(q[i], desc, table, lens, check=False, max_seq_len=1000)[0])


def test_workspace_and_split_batch(device):
    """A persistent workspace sized by `workspace_size` serves every batch up to its maximum (plans are views of
    it, at one address); a too-small one is refused; `split_batch` plans splits as for the padded batch."""
    from kvx_core.ops.decode import plan_decode, workspace_size

    geo = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.bfloat16, device=device)
    n = workspace_size("nvfp4_rot", max_batch=16, max_seq_len=4096, **geo)
    ws = torch.empty(n, dtype=torch.float32, device=device)
    for batch in (1, 3, 16):
        for max_len in (1, 100, 4096):
            p = plan_decode("nvfp4_rot", batch=batch, max_seq_len=max_len, workspace=ws, **geo)
            assert p.mid_o.data_ptr() == ws.data_ptr() and p.rotated_out is not None
    with pytest.raises(KvxError, match="workspace") as e:
        plan_decode("nvfp4_rot", batch=16, max_seq_len=4096, workspace=ws[:n - 1], **geo)
    assert e.value.status == Status.INVALID_ARGUMENT
    padded = plan_decode("nvfp4", batch=5, max_seq_len=4096, split_batch=8, **geo)
    assert padded.num_splits == plan_decode("nvfp4", batch=8, max_seq_len=4096, **geo).num_splits
    assert padded.mid_o.shape[0] == 5
