"""The host cost of a bundle export / import on the kernel path (issue 36), counted on the CPU: per layer, the aten
calls torch's profiler sees and the kernel launches (Triton launches replaced by counters: no kernel runs, so the
count is the host work an engine pays per layer on a GPU); and the per-descriptor binding that keeps that cost low
(`transfer.rows.bound`) never serves views of tensors a descriptor no longer holds. No timing is asserted."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import TensorDesc
from kvx_core.transfer import ModelFingerprint, import_bundle
from kvx_core.transfer.host import export_to_host

from .. import interpret  # noqa: F401  (Triton's interpreter on the CPU)
from .test_transfer_kernels import _path

HEADS, DIM, TOKENS = 8, 128, 64
BUDGET = {  # aten calls per layer (export, import) counted by this test when pinned (torch 2.13); 30% headroom below
    ("bf16", "bf16"): (14, 28),
    ("nvfp4", "nvfp4"): (30, 58),
    ("bf16", "nvfp4"): (14, 38),
    ("int4", "int4"): (16, 36),
    ("fp8_e4m3", "fp8_e4m3"): (28, 56),
}
HEADROOM = 1.3


def _model(layers: int) -> ModelFingerprint:
    return ModelFingerprint("bench", layers, HEADS, DIM, {}, "0" * 64, "0" * 64)


def _caches(fmt: str, layers: int, seed: int = 0) -> PagedKVCache:
    """A `layers`-layer cache of `fmt` with per-tensor global scales (the engines' usual [] / [1] scale) holding
    TOKENS random tokens at slots 0 .. TOKENS - 1."""
    c = PagedKVCache(fmt, num_layers=layers, num_blocks=TOKENS // 16, block_size=16, num_kv_heads=HEADS,
                     head_dim=DIM)
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        if c.layers[layer].k_global is not None:
            c.set_global_scales(layer, torch.rand(1, generator=g) * 0.01 + 0.002,
                                torch.rand(1, generator=g) * 0.01 + 0.002)
        c.write(layer, torch.randn(TOKENS, HEADS, DIM, generator=g), torch.randn(TOKENS, HEADS, DIM, generator=g),
                torch.arange(TOKENS))
    return c


@pytest.fixture
def no_launch(monkeypatch) -> list[str]:
    """Every Triton launch of the transfer kernels counted and skipped (its host-side arguments still built)."""
    from kvx_core.ops.triton import convert, rows

    seen: list[str] = []

    class Counted:
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(self.name)

    monkeypatch.setattr(rows, "_rows_kernel", Counted("rows"))
    monkeypatch.setattr(convert, "_convert_kernel", Counted("convert"))
    return seen


def _cost(src_fmt: str, dst_fmt: str, layers: int, seen: list[str]) -> tuple[int, int, int, int]:
    """(export aten calls, export launches, import aten calls, import launches) of the second export / import of a
    `layers`-layer bundle (the first binds the descriptors). The bundle imported is the torch path's (the kernels
    do not run here); the exports write into a buffer of their own."""
    src, dst = _caches(src_fmt, layers), _caches(dst_fmt, layers, seed=1)
    srcs, dsts = [src.descriptor(i) for i in range(layers)], [dst.descriptor(i) for i in range(layers)]
    slots, model, out = torch.arange(TOKENS), _model(layers), {}
    with _path("torch"):
        host = export_to_host(srcs, slots, model=model)
    scratch = torch.empty_like(host)
    with _path("triton"):
        for name, fn in (("import", lambda: import_bundle(host, dsts, slots, model=model)),
                         ("export", lambda: export_to_host(srcs, slots, model=model, out=scratch))):
            fn()
            seen.clear()
            with profile(activities=[ProfilerActivity.CPU]) as p:
                fn()
            out[name] = (sum(e.count for e in p.key_averages() if e.key.startswith("aten::")), len(seen))
    return (*out["export"], *out["import"])


@pytest.mark.parametrize("pair", list(BUDGET), ids="->".join)
def test_the_host_work_per_layer_of_a_kernel_export_and_import_stays_in_budget(pair, no_launch):
    """Per layer (the difference between an 8- and a 4-layer bundle, so fixed per-bundle work cancels out): one
    launch each way, and no more aten calls than the pinned count plus 30%."""
    few, many = _cost(*pair, 4, no_launch), _cost(*pair, 8, no_launch)
    per_layer = [(b - a) / 4 for a, b in zip(few, many, strict=True)]
    export_calls, export_launches, import_calls, import_launches = per_layer
    assert (export_launches, import_launches) == (1, 1)
    budget_export, budget_import = BUDGET[pair]
    assert export_calls <= budget_export * HEADROOM, f"export: {export_calls} aten calls per layer"
    assert import_calls <= budget_import * HEADROOM, f"import: {import_calls} aten calls per layer"


def _torch_export(c: PagedKVCache) -> bytes:
    """The bundle of `c`'s tokens on the torch path (the oracle of the kernel path)."""
    with _path("torch"):
        return bytes(export_to_host([c.descriptor(i) for i in range(2)], torch.arange(TOKENS),
                                    model=_model(2)).numpy())


def test_a_descriptor_given_other_pools_is_bound_again():
    """A descriptor exported once through the kernels (its pool views kept on it) whose K / V then name another
    cache's pools exports the other cache's rows, not the first pools' (the binding follows the tensors)."""
    a, b = _caches("nvfp4", 2), _caches("nvfp4", 2, seed=5)
    descs, slots = [a.descriptor(i) for i in range(2)], torch.arange(TOKENS)
    with _path("triton"):
        assert bytes(export_to_host(descs, slots, model=_model(2)).numpy()) == _torch_export(a)
        for i, d in enumerate(descs):
            other = b.descriptor(i)
            d.k, d.v, d.quant = other.k, other.v, other.quant
            d.validate()
        assert bytes(export_to_host(descs, slots, model=_model(2)).numpy()) == _torch_export(b)


def test_a_descriptor_whose_pool_tensor_is_replaced_in_place_of_the_same_shape_is_bound_again():
    """Replacing a layer's K tensor with another one of the same shape and strides (a new allocation) rebinds it:
    the export carries the new tensor's rows."""
    a, b = _caches("bf16", 2), _caches("bf16", 2, seed=7)
    descs, slots = [a.descriptor(i) for i in range(2)], torch.arange(TOKENS)
    with _path("triton"):
        export_to_host(descs, slots, model=_model(2))
        for i, d in enumerate(descs):
            d.k = TensorDesc.from_torch(b.layers[i].k_data, d.k.layout, None)
            d.v = TensorDesc.from_torch(b.layers[i].v_data, d.v.layout, None)
            d.validate()
        assert bytes(export_to_host(descs, slots, model=_model(2)).numpy()) == _torch_export(b)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_global_scales_changed_between_exports_are_read_again(fmt):
    """Global scales are values, never kept by the binding: set new ones between two kernel exports of the same
    descriptors and the second bundle carries them (as the torch path's)."""
    c = _caches(fmt, 2)
    descs, slots = [c.descriptor(i) for i in range(2)], torch.arange(TOKENS)
    with _path("triton"):
        export_to_host(descs, slots, model=_model(2))
        for layer in range(2):
            c.set_global_scales(layer, torch.tensor([0.25 + layer]), torch.tensor([0.5 + layer]))
        assert bytes(export_to_host(descs, slots, model=_model(2)).numpy()) == _torch_export(c)


def test_layers_of_every_global_scale_shape_export_as_the_torch_path():
    """Layers whose global scales come as [] or [1] FP32 tensors, or absent (1.0), export as the torch path does
    (the batched scale build groups them by kind)."""
    c = _caches("nvfp4", 2)
    descs = [c.descriptor(i) for i in range(2)]
    descs[0].quant.k_global_scale = torch.tensor(0.125)
    descs[0].quant.v_global_scale = torch.tensor(0.0625)
    descs[1].quant.k_global_scale = descs[1].quant.v_global_scale = None
    slots, model = torch.arange(TOKENS), _model(2)
    with _path("torch"):
        want = bytes(export_to_host(descs, slots, model=model).numpy())
    with _path("triton"):
        assert bytes(export_to_host(descs, slots, model=model).numpy()) == want
