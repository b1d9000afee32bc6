"""What one layer's decode / write launches on the engines' hot path (`check=False`, page-buffer caches as vLLM
binds them): the kernels and nothing else. A launch counter replaces the kernel launchers (they would run under the
interpreter here) and a torch dispatch mode records every torch op that is not a view: each such op is a kernel, an
allocation or a host sync per layer and step, which a CUDA graph would capture as an extra node."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvx_core.codec import format_of
from kvx_core.descriptors import BlockTable, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.enums import BlockTableFormat
from kvx_core.formats import registry
from kvx_core.ops import decode as decode_ops, dispatch, rotation, write as write_ops

from .helpers import filled_cache
from .test_kv_offsets_kernels import _trtllm


class TorchOps(TorchDispatchMode):
    """The torch ops dispatched inside the mode, views (aliases of their input) left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in ("detach", "alias"):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernel launchers called (they do not run)."""
    calls: list[str] = []

    def stub(name):
        return lambda *a, **k: calls.append(name)

    monkeypatch.setattr(dispatch, "_kernel_device", lambda device: True)
    monkeypatch.setattr(decode_ops.triton_decode, "launch_decode", stub("decode"))
    # one library call (the merge rotates `_rot` outputs back)
    monkeypatch.setattr(decode_ops.cuda_decode, "launch_args", stub("decode+merge"))
    monkeypatch.setattr(decode_ops, "merge_splits", stub("merge"))
    monkeypatch.setattr(write_ops.triton_write, "launch_write", stub("write"))
    monkeypatch.setattr(write_ops.cuda_write, "launch_layer", stub("write"))

    def rotate(x, out=None):  # the fused Hadamard kernel on CUDA (torch ops on the CPU)
        calls.append("rotate")
        return x if out is None else out

    monkeypatch.setattr(registry, "rotate", rotate)
    monkeypatch.setattr(decode_ops, "rotate", rotate)
    monkeypatch.setattr(rotation, "rotate", rotate)  # what ops.rotation.rotate_kv launches
    return calls


def _bound_setup(name, device):
    c = filled_cache(name, device, page_buffer=True, h=2)
    desc = c.descriptor(0)
    table = BlockTable.packed(torch.tensor([[0, 2, 4, 6], [1, 3, 0, 0]], dtype=torch.int32, device=device))
    lens = SeqLens(torch.tensor([13, 6], dtype=torch.int32, device=device))
    plan = dispatch.plan_decode(table, lens, fmt=name, num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
                                q_dtype=torch.bfloat16, device=device, max_seq_len=16, check=False)
    return c, desc, plan


def _decode(plan) -> list[str]:
    """The launches of a decode: one library call on CUDA (decode + merge), two on Triton."""
    return ["decode+merge"] if plan.kernel.backend == "cuda" else ["decode", "merge"]


@pytest.mark.parametrize("name", ["nvfp4", "int8", "fp8_e4m3", "mxfp4", "k8v4"])
def test_decode_run_launches_decode_and_merge_only(name, launches, device):
    _, desc, plan = _bound_setup(name, device)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    plan.run(q, desc, out=out, want_lse=False)  # first run: anything bound lazily is bound here
    launches.clear()
    with TorchOps() as mode:
        plan.run(q, desc, out=out, want_lse=False)
    assert launches == _decode(plan) and mode.ops == [], (launches, mode.ops)


@pytest.mark.parametrize("name", ["nvfp4", "int8", "fp8_e4m3", "k8v4"])
def test_write_launches_the_write_only(name, launches, device):
    desc = filled_cache(name, device, page_buffer=True, h=2).descriptor(0)
    k = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=device)
    slots = SlotMapping(torch.tensor([5, -1, 7], device=device))  # vLLM's padding convention
    w = WriteDesc(KvIoDesc(k, k.clone()), slots)
    dispatch.write_kv(desc, w, check=False)
    launches.clear()
    with TorchOps() as mode:
        dispatch.write_kv(desc, w, check=False)
    assert launches == ["write"] and mode.ops == [], (launches, mode.ops)





@pytest.mark.parametrize("name", ["nvfp4", "int8", "fp8_e4m3", "mxfp4", "k8v4", "nvfp4_rot"])
def test_bound_layer_decode_and_write_launch_their_kernels_only(name, launches, device):
    """A layer bound once: decode = decode + merge (+ the q / output rotations of `_rot` formats), write = write."""
    _, desc, plan = _bound_setup(name, device)
    layer = dispatch.bind(desc)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    k = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=device)
    w = WriteDesc(KvIoDesc(k, k.clone()), SlotMapping(torch.tensor([5, -1, 7], device=device)))
    plan.run(q, layer, out=out, want_lse=False)
    dispatch.write_kv(layer, w, check=False)
    launches.clear()
    with TorchOps() as mode:
        plan.run(q, layer, out=out, want_lse=False)
    rot = name.endswith("_rot")
    want = _decode(plan)
    if rot and plan.kernel.backend != "cuda":  # Triton: q rotated before the decode, the output after the merge (the
        want = ["rotate", *want, "rotate"]  # CUDA library rotates both itself, in its one call)
    assert launches == want and mode.ops == [], \
        (launches, mode.ops)
    launches.clear()
    with TorchOps() as mode:
        dispatch.write_kv(layer, w, check=False)
    # `_rot` formats too: the CUDA write rotates the rows in its kernel, the Triton write inside its own launcher
    assert launches == ["write"] and mode.ops == [], (launches, mode.ops)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_offsets_bound_layer_decode_launches_decode_and_merge_only(dtype, launches, device):
    """TRT-LLM's hot path: a layer bound for its KV_OFFSETS table under a sync-free KV_OFFSETS plan."""
    layer, lens, _ = _trtllm(device, dtype)
    bound = dispatch.bind(layer.cache, table_format=BlockTableFormat.KV_OFFSETS)
    plan = dispatch.plan_decode(layer.table, lens, fmt=format_of(layer.cache), num_qo_heads=4, num_kv_heads=2,
                                head_dim=64, block_size=4, q_dtype=torch.bfloat16, device=device, max_seq_len=16,
                                check=False)
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    plan.run(q, bound, out=out, want_lse=False)
    launches.clear()
    with TorchOps() as mode:
        plan.run(q, bound, out=out, want_lse=False)
    assert launches == _decode(plan) and mode.ops == [], (launches, mode.ops)
