"""An engine's layers bound once for bundle moves: the handoff's plan / run split (issue 36).

An export or import of one sequence touches every layer of the model. Done layer by layer per request, the Python of
it (each layer's agreement with the first, its pools as the row kernel addresses them, the launch groups and their
layer tables) took ~4 ms of host work per request on an H200's host, against ~1 ms of bytes at the copy rate for a
1k-token NVFP4 prompt of 32 layers. What of it follows from the layers alone -- their formats and geometry, whether
they agree, their global scales where the descriptors hold them as tensors, their pools and each layer's offset
from the first layer's -- is derived here once per state of the descriptors (`LayerSet`, kept on the first layer's
binding: any change to any layer's descriptor builds a new one) and reused request after request; a request adds its
slots and buffers, whose chunk offsets are arithmetic (layer i at `i * stride`). Values (slots, scales, key vectors,
a bundle's bytes) are checked per request, as before.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..descriptors import CacheDesc
from ..errors import Status, require
from ..formats import CacheFormat
from .rows import (
    KEY_TRANSFORMS,
    LAYER_TENSORS,
    Binding,
    GlobalScales,
    _checked_slots,
    _pool_rows,
    binding,
    format_specs,
    key_transforms,
)
from .views import StorageViews

_KEPT_SETS = 4
"""Layer sets kept per first layer (an engine exports and imports one list of layers; a few more in tests)."""


class CheckedLayers(NamedTuple):
    """What `LayerSet.check_slots` checked: the slots as int64 on the first layer's device (what every layer's
    kernel takes: moved once per bundle, since slots in host memory moved per layer cost a copy and a host sync per
    layer on a GPU), each layer's (block, offset) of them, and each layer's format."""

    slots: torch.Tensor
    wheres: list[tuple[torch.Tensor, torch.Tensor]]
    formats: list[CacheFormat]


class LayerSet:
    """`caches` (one per layer, in order) as bound by `bindings` (theirs, `rows.binding`): what an export or import
    derives from the layers alone, once."""

    def __init__(self, caches: Sequence[CacheDesc], bindings: tuple[Binding, ...]):
        self.caches, self.bindings = tuple(caches), bindings
        self.formats = [b.fmt for b in bindings]
        first = self.caches[0]
        self.device = first.k.tensor.device
        self.geometry = (first.num_kv_heads, first.head_dim)
        self.transforms = key_transforms(first)
        self.mismatch = self._mismatch()
        self.vectors = [(t.valid, v) for c in self.caches for t in KEY_TRANSFORMS if (v := t.of(c)) is not None]
        keys = [(c.num_blocks, c.block_size, c.k.tensor.device) for c in self.caches]
        firsts = {k: i for i, k in reversed(list(enumerate(keys)))}
        self.geometry_first = sorted(set(firsts.values()))  # one slot check per distinct geometry, in layer order
        self.geometry_of = [self.geometry_first.index(firsts[k]) for k in keys]
        self.scales = GlobalScales(self.caches, self.formats)
        self._groups: dict[tuple, list] = {}

    def _mismatch(self) -> str | None:
        """The message for the first layer that differs from layer 0 in format, geometry or key transforms (a
        bundle's layers agree in all three), or None."""
        fmt, has = self.formats[0], self.transforms
        for i, (cache, f) in enumerate(zip(self.caches, self.formats, strict=True)):
            if f != fmt or (cache.num_kv_heads, cache.head_dim) != self.geometry:
                return f"export_bundle: layer {i}'s cache differs from layer 0's in format or geometry"
            for t in KEY_TRANSFORMS:
                ours = t.tensor in has
                if (t.of(cache) is not None) != ours:
                    return (f"export_bundle: layer {i}'s cache {'lacks' if ours else 'has'} {t.what}, layer 0's "
                            f"{'has' if ours else 'lacks'} it (a bundle's layers all carry the same key transforms)")
        return None

    def check_slots(self, slots: torch.Tensor) -> CheckedLayers:
        """`rows.check_slots` of `slots` against every layer's own cache (one check per distinct geometry, each a
        host sync, the first layer's first: its slots are the ones every layer takes), and the key-transform vectors'
        values (one host sync for all of them)."""
        wheres, moved = [], slots
        for n, i in enumerate(self.geometry_first):
            checked, *where = _checked_slots(self.caches[i], slots)
            wheres.append(tuple(where))
            if n == 0:
                moved = checked
        if self.vectors and not all(torch.stack([valid(v).to(self.device) for valid, v in self.vectors]).tolist()):
            for cache in self.caches:
                cache.validate()  # raises, naming the first layer's vector that fails its rule
        return CheckedLayers(moved, [wheres[g] for g in self.geometry_of], self.formats)

    def _bound(self, scatter: bool, flat: tuple[int, ...]) -> list:
        """The row kernel's launch groups of every layer (`ops.triton.rows.bind_layer_rows`), made once per direction
        and list of flat tensors (their bytes: a gather also copies each layer's global scales and key vectors)."""
        from ..ops.triton.rows import LayerPools, bind_layer_rows

        key = (scatter, flat)
        if key not in self._groups:
            self._groups[key] = bind_layer_rows(
                [LayerPools(cache.block_size, [p for _, p in _pool_rows(cache, held)], list(flat))
                 for cache, held in zip(self.caches, self.bindings, strict=True)], scatter=scatter)
        return self._groups[key]

    def _flat_sources(self, names: Sequence[str]) -> list[list[torch.Tensor]]:
        """Per layer, its tensors `names` (of `rows.LAYER_TENSORS`) as a gather copies them: the global scales as
        `GlobalScales` gives them now, the key vectors contiguous."""
        if not names:
            return [[] for _ in self.caches]
        out = []
        for cache, (kg, vg) in zip(self.caches, self.scales(), strict=True):
            flat = {"k_global": kg, "v_global": vg, **{t.tensor: t.of(cache) for t in KEY_TRANSFORMS}}
            out.append([t if t.is_contiguous() else t.contiguous() for t in (flat[n] for n in names)])
        return out

    def plan_rows(self, slots: torch.Tensor, specs: Sequence, buf: StorageViews, stride: int, *, scatter: bool,
                  tokens: tuple[int, int, int] | None = None) -> Callable[[], None] | None:
        """The row kernel's launches moving every layer's rows of `slots` (checked: `check_slots`' int64 answer on
        the layers' device) between the pools and chunk payloads in `buf` at byte offsets `0, stride, 2 * stride,
        ...`, packed in the order of `specs` (the bundle's `TensorSpec`s, `format_specs(self.formats[0], ...)`
        order): a gather (`scatter=False`: an export's staging) also copies the global scales and key vectors; a
        scatter (an import's staged payloads) stores the per-token rows of the chunks' tokens [t0, t1) of `tokens`
        = (t0, t1, count), the chunks holding `count` (default: all of them). Only the launches run in the returned
        callable; None where the layers' formats or geometry differ: the per-layer path serves them."""
        from ..ops.triton.launch import check_device
        from ..ops.triton.rows import _INT, MAX_POOLS, plan_bound

        if self.mismatch is not None:
            return None
        t = int(slots.numel())
        t0, t1, count = (0, t, t) if tokens is None else tokens
        require(t1 - t0 == t and (scatter or t0 == 0), Status.INTERNAL_ERROR, "plan_rows: slots for other tokens")
        want = format_specs(self.formats[0], *self.geometry, self.transforms if not scatter else ())
        got = {s.name: s for s in specs}
        require(all(n in got and got[n].dtype == dt and tuple(got[n].shape) == sh for n, (dt, sh) in want.items()
                    if not scatter or n not in LAYER_TENSORS), Status.INTERNAL_ERROR,
                "plan_rows: the chunk's tensors are not the layers' format's")
        starts, pos = {}, 0
        for s in specs:
            starts[s.name] = pos + (s.nbytes(t0) if s.per_token else 0)
            pos += s.nbytes(count)
        require(pos <= stride or len(self.caches) == 1, Status.INTERNAL_ERROR, "plan_rows: chunks overlap")
        flat_names = () if scatter else tuple(n for n in LAYER_TENSORS if n in got)
        sources = self._flat_sources(flat_names)
        if sources and sources[0]:
            check_device(slots, *(f for layer in sources for f in layer))
        names = [n for n, _ in _pool_rows(self.caches[0], self.bindings[0])]
        launches = []
        for g in self._bound(scatter, tuple(got[n].nbytes(t) for n in flat_names)):
            at = g.layers[0] * stride
            rel = (np.asarray(g.layers, dtype=np.int64) - g.layers[0]) * stride
            chunks = []
            for n in names:
                width = got[n].dtype.itemsize
                view = buf.view(at + starts[n], _INT[width], (got[n].nbytes(t) // width,))
                require(view is not None, Status.INTERNAL_ERROR, f"plan_rows: {n} is not aligned in the chunk")
                chunks.append(view)
            first = sources[g.layers[0]]
            flat = [(src, buf.view(at + starts[n], torch.uint8, (got[n].nbytes(t),)))
                    for n, src in zip(flat_names, first, strict=True)]
            flat_offsets = np.zeros((len(g.layers), len(flat), 2), dtype=np.int64)
            if flat:
                srcs = np.array([[f.data_ptr() for f in sources[i]] for i in g.layers], dtype=np.int64)
                flat_offsets[:, :, 0] = srcs - srcs[0]
                flat_offsets[:, :, 1] = rel[:, None]
            launch = plan_bound(slots, g, chunks, np.repeat(rel[:, None], MAX_POOLS, axis=1), flat, flat_offsets,
                                scatter=scatter)
            if launch is not None:
                launches.append(launch)

        def run() -> None:
            for f in launches:
                f()
        return run


def layer_set(caches: Sequence[CacheDesc]) -> LayerSet:
    """The `LayerSet` of `caches`: each layer's binding checked (`rows.binding`, once per call inside `one_call`), and
    the set derived for exactly these bindings reused (kept on the first layer's, a few per first layer)."""
    require(len(caches) > 0, Status.INVALID_ARGUMENT, "a bundle moves at least one layer")
    bindings = tuple(binding(c) for c in caches)
    sets = bindings[0].derive("layer_sets", dict)
    key = tuple(map(id, bindings))
    held = sets.get(key)
    if held is None or not (len(held.bindings) == len(bindings) and all(map(operator.is_, held.bindings, bindings))
                            and all(map(operator.is_, held.caches, caches))):
        while len(sets) >= _KEPT_SETS:
            sets.pop(next(iter(sets)))
        held = sets[key] = LayerSet(caches, bindings)
    return held

