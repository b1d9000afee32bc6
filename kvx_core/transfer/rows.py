"""Raw token rows of a cache, by slot: the stored bytes of K/V payloads and scales, no decoding.

A bundle carries a sequence's rows exactly as its cache stores them, so a cache of the same format takes them
back bit for bit whatever its layout or block size; only the global scales and the key transform (smoothing,
centering) live per layer.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import operator
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import format_of
from ..descriptors import (
    CacheDesc,
    PoolDesc,
    QuantDesc,
    TensorDesc,
    all_finite,
    check_key_center,
    check_key_smoothing,
    finite_positive,
)
from ..enums import Memory
from ..errors import Status, require
from ..formats import CacheFormat
from ..ops import smoothing
from ..ops.checks import cache_global_scales
from ..ops.reference import side_pools
from ..scale_layout import GROUP, Interleave4Rows
from . import kernels
from .views import StorageViews


@dataclass(frozen=True)
class KeyTransform:
    """A per-layer key-transform vector a cache may carry (`ops.smoothing`): its bundle tensor (FP32 [H, D]), the
    header flag `cache.<header>` saying the bundle carries it, how to read it off a cache, and the check of its
    values that `QuantDesc` applies (`check(v, heads, head_dim, device, what=)`: a bundle's vector passes it too),
    and that check's value rule as a device bool (`valid(v)`: no host sync, for checks batched over layers)."""

    tensor: str
    header: str
    what: str
    of: Callable[[CacheDesc], torch.Tensor | None]
    check: Callable[..., None]
    valid: Callable[[torch.Tensor], torch.Tensor]


KEY_TRANSFORMS: tuple[KeyTransform, ...] = (
    KeyTransform("k_smoothing", "key_smoothing", "key smoothing", smoothing.of, check_key_smoothing, finite_positive),
    KeyTransform("k_center", "key_centering", "key centering", smoothing.center_of, check_key_center, all_finite),
)
"""The key transforms in bundle tensor order: rows of a cache with them hold `(K - c) / s` (then rotated in `_rot`
formats), so they mean K only with the same vectors."""

LAYER_TENSORS = ("k_global", "v_global", *(t.tensor for t in KEY_TRANSFORMS))
"""Per-layer tensors: FP32 [H] global scales (formats with one) and the FP32 [H, D] key-transform vectors."""


def key_transforms(cache: CacheDesc) -> frozenset[str]:
    """The tensor names of the key transforms `cache` has (`KEY_TRANSFORMS`)."""
    return frozenset(t.tensor for t in KEY_TRANSFORMS if t.of(cache) is not None)


_BOUND = "_kvx_transfer_bound"
"""The attribute of a `CacheDesc` holding its `Binding` (what `binding` checked and derived from it)."""

_IMMUTABLE = (int, enum.Enum, type(None), torch.Tensor, TensorDesc, PoolDesc, QuantDesc)
"""Kinds of descriptor fields a binding keeps by identity: immutable values (and tuples of exact ints), and the
objects whose own state the binding reads (tensors, sub-descriptors). Any other kind (a list, a float) is not
bound: that descriptor is validated on every call."""


def _fields(cache: CacheDesc) -> tuple[list, list[torch.Tensor]] | None:
    """(Every object `CacheDesc.validate` and `format_of` read of `cache`, its tensors): None where a
    sub-descriptor is not of its own type (validation refuses it, or a subclass may read more)."""
    q, p, k, v = cache.quant, cache.pool, cache.k, cache.v
    descs = [k, v, *((q.k_scales, q.v_scales) if type(q) is QuantDesc else ())]
    if any(type(d) is not TensorDesc for d in descs[:2]) or any(d is not None and type(d) is not TensorDesc
                                                                 for d in descs[2:]) \
            or not (q is None or type(q) is QuantDesc) or not (p is None or type(p) is PoolDesc):
        return None
    objs = [cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim, k, v, p, q]
    tensors = []
    for d in descs:
        if d is not None:
            objs += [d.dtype, d.layout, d.memory, d.shape, d.stride, d.tensor, d.data_ptr]
            tensors.append(d.tensor)
    if q is not None:
        objs += [q.format, q.group_size, q.k_data_dtype, q.v_data_dtype, q.flags, q.k_global_scale, q.v_global_scale,
                 q.k_smoothing, q.k_center]
        tensors += objs[-4:]
    if p is not None:
        objs += [p.memory, p.bytes_per_block, p.primary, p.secondary]
        tensors += objs[-2:]
    return objs, [t for t in tensors if isinstance(t, torch.Tensor)]


def _pinned(cache: CacheDesc) -> bool:
    """Whether a descriptor of `cache` says HOST_PINNED (the one memory type a host tensor's pinning decides)."""
    q, p = cache.quant, cache.pool
    memories = [cache.k.memory, cache.v.memory, *(d.memory for d in ((q.k_scales, q.v_scales) if q else ()) if d),
                *((p.memory,) if p is not None else ())]
    return Memory.HOST_PINNED in memories


def _state(tensors: list[torch.Tensor], pinned: bool) -> tuple:
    """What validation reads of `tensors` that may change in place (`set_`, `resize_`, `.data =`): storage pointer,
    dtype, device, shape and strides; and, where `pinned` (`_pinned`), whether each is pinned."""
    return tuple((t.data_ptr(), t.dtype, t.device, t.shape, t.stride(), pinned and t.is_pinned()) for t in tensors)


@functools.cache
def _field_getter(cls: type) -> Callable[[object], tuple]:
    """All dataclass fields of a descriptor class, read in one call (a tuple)."""
    names = [f.name for f in dataclasses.fields(cls)]
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else (lambda d: (get(d),))


def _descriptors(cache: CacheDesc) -> list:
    """`cache` and its sub-descriptors (of their own types: `_fields` passed)."""
    q = cache.quant
    subs = [cache.k, cache.v, q, cache.pool, *((q.k_scales, q.v_scales) if q is not None else ())]
    return [cache, *(d for d in subs if d is not None)]


class Binding:
    """One cache descriptor as checked once for every call while it stays the same (issue 36): `validate()` and
    `format_of` passed for its fields and tensor state, and what was derived from it (`derive`). Only the
    descriptor's own structure is kept: values read from pools, scales and key-transform vectors are checked per call
    (they may change between requests), and so is all of a bundle. A descriptor with a field of a kind it cannot
    keep (`_IMMUTABLE`) is not bound (`holds` is never true: validated on every call)."""

    def __init__(self, cache: CacheDesc, fields: tuple[list, list[torch.Tensor]] | None, fmt: CacheFormat):
        self.fmt, self.derived = fmt, {}
        bindable = fields is not None and all(
            isinstance(o, _IMMUTABLE) or (type(o) is tuple and all(type(x) is int for x in o)) for o in fields[0])
        self.pinned = bindable and _pinned(cache)
        self.tensors = fields[1] if bindable else None
        self.state = _state(self.tensors, self.pinned) if bindable else ()
        # each descriptor's fields by identity: the same objects, so the same sub-descriptors and tensors
        self.fields = [(d, _field_getter(type(d))(d)) for d in _descriptors(cache)] if bindable else None

    def holds(self, cache: CacheDesc) -> bool:
        """Whether `cache` and its sub-descriptors now hold the objects, and its tensors the state, this binding
        checked (a few C-level calls per descriptor: a bundle of 32 layers checks all of them per call)."""
        kept = self.fields
        if kept is None or kept[0][0] is not cache:
            return False
        for d, values in kept:
            if not all(map(operator.is_, _field_getter(type(d))(d), values)):
                return False
        return self.state == _state(self.tensors, self.pinned)

    def derive(self, name: str, build: Callable[[], object]) -> object:
        """`build()`, derived once per binding (issue 32's bind: pool views and kernel arguments depend only on the
        layer's tensors and layouts, not on the request). Only views and arguments, never values."""
        if name not in self.derived:
            self.derived[name] = build()
        return self.derived[name]


_CALL: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvx_transfer_call", default=None)
"""Within one export or import (`one_call`): {id(descriptor): (descriptor, its binding)} already checked."""


@contextlib.contextmanager
def one_call() -> Iterator[None]:
    """One export or import: each descriptor's binding is checked once (`binding`), not at each of the call's steps
    (slots, scales, rows: three times per layer, ~5 us each); nothing else runs between them that could change it."""
    token = _CALL.set({})
    try:
        yield
    finally:
        _CALL.reset(token)


def checked_once(fn: Callable) -> Callable:
    """`fn` run as `one_call` (an export or import entry point)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with one_call():
            return fn(*args, **kwargs)
    return call


def binding(cache: CacheDesc) -> Binding:
    """`cache` validated (`CacheDesc.validate`, `format_of`, the global scales' types and shapes) once per state of
    its fields and pool tensors, not per layer and call: the binding kept on the descriptor is reused while every
    field is the same object and every tensor keeps its storage, dtype, device, shape and strides; any change (a
    pool re-allocated or resized, a field reassigned) validates it again. The key-transform vectors' values are not
    checked here (`LayerSet.check_slots` checks them per call). Inside `one_call`, checked once per call."""
    memo = _CALL.get()
    if memo is not None and id(cache) in memo:
        return memo[id(cache)][1]
    held = _binding(cache)
    if memo is not None:
        memo[id(cache)] = (cache, held)  # the descriptor kept: its id is not reused during the call
    return held


def _binding(cache: CacheDesc) -> Binding:
    """`binding` outside a call's memo."""
    held = cache.__dict__.get(_BOUND)
    if held is not None and held.holds(cache):
        return held
    fields = _fields(cache)
    cache.validate()
    fmt = format_of(cache)
    cache_global_scales(cache, fmt, None, None, "read_rows", check_values=False, build=False)
    held = Binding(cache, fields, fmt)
    cache.__dict__[_BOUND] = held
    return held


def bound(cache: CacheDesc, name: str, build: Callable[[], object]) -> object:
    """`binding(cache).derive(name, build)`: views and kernel arguments of a checked descriptor, derived again
    whenever it changed."""
    return binding(cache).derive(name, build)


def _sides(cache: CacheDesc, held: Binding) -> tuple:
    """`side_pools` of K and V (the 5-D block views rows are read and stored through) of `cache` bound as `held`:
    a layer's views are the same every call while its pools are."""
    return held.derive("sides", lambda: (side_pools(cache, held.fmt, "k"), side_pools(cache, held.fmt, "v")))


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` contiguous on `device`: itself where it is already (no tensor op per layer), else a copy."""
    return t if t.device == device and t.is_contiguous() else t.to(device).contiguous()


def check_slots(cache: CacheDesc, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each slot, after checking they are distinct and inside the cache: smallest, largest and
    whether the sorted slots ever repeat are read back together (one host sync, not one per value)."""
    return _checked_slots(cache, slots)[1:]


def host_slot_facts(slots: np.ndarray) -> tuple[int, int, int]:
    """(smallest, largest, repeats) of non-empty int64 slots in host memory: increasing slots (as a fresh sequence's
    often are) are distinct without a sort."""
    if (slots[1:] > slots[:-1]).all():
        return int(slots[0]), int(slots[-1]), 0
    ordered = np.sort(slots)
    return int(ordered[0]), int(ordered[-1]), int((ordered[1:] == ordered[:-1]).sum())


def _checked_slots(cache: CacheDesc, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`check_slots`, with the checked slots as int64 on the cache's device first. Slots in host memory for a CUDA
    cache are checked on the host and then moved without blocking: checked on the GPU, their upload and the read-back
    would queue behind a bundle's host-to-device copies on the copy engine (an import starts those first:
    `HostBundle.prefetch`), which made a 16k-token NVFP4 import wait 3.5 ms there on an H200."""
    require(isinstance(slots, torch.Tensor) and slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64),
            Status.INVALID_ARGUMENT, "slots must be a 1-D int32/int64 tensor")
    dev = cache.k.tensor.device
    on_host = slots.device.type == "cpu" and dev.type == "cuda"
    s = slots.to(dtype=torch.int64) if on_host else slots.to(device=dev, dtype=torch.int64)
    capacity = cache.num_blocks * cache.block_size
    if not s.numel():
        lo, hi, repeats = 0, 0, 0
    elif on_host:
        lo, hi, repeats = host_slot_facts(s.numpy())
    else:  # smallest, largest, repeats of the sorted slots: one host sync
        lo, hi, repeats = torch.stack([s.min(), s.max(), (s.sort().values.diff() == 0).sum()]).tolist()
    require(not s.numel() or (lo >= 0 and hi < capacity), Status.OUT_OF_RANGE,
            f"slots must lie in [0, {capacity}) (num_blocks x block_size of the cache)")
    require(repeats == 0, Status.INVALID_ARGUMENT, "slots must not repeat")
    if on_host:
        s = s.pin_memory().to(dev, non_blocking=True)
    return s, s // cache.block_size, s % cache.block_size


class GlobalScales:
    """How each layer's FP32 `[H]` K / V global scales are built as `cache_global_scales` builds them (values unchecked;
    for layers `LayerSet.check_slots` checked, their types and shapes included), worked out once for a list of layers so
    that building them is a fixed number of tensor ops per bundle, not a chain per scale: scales already FP32 `[H]` and
    contiguous on the cache's device are used as they are, the others are stacked by kind (shape, dtype, device) and
    converted at once; absent ones (1.0) are rows of one `ones` tensor, made here and never written. Calling it reads
    the scales' current values."""

    def __init__(self, caches: Sequence[CacheDesc], formats: Sequence[CacheFormat]):
        self.caches, self.formats = caches, formats
        self.fixed: list[list[torch.Tensor | None]] = [[None, None] for _ in caches]
        self.numbers: list[tuple[int, int]] = []  # Python numbers: built per call, one at a time
        groups: dict[tuple, list[tuple[int, int, torch.Tensor | None]]] = {}
        for i, (cache, fmt) in enumerate(zip(caches, formats, strict=True)):
            q, dev, heads = cache.quant, cache.k.tensor.device, cache.num_kv_heads
            for j, (which, tf) in enumerate((("k", fmt.k), ("v", fmt.v))):
                g = getattr(q, f"{which}_global_scale") if q is not None else None
                if not tf.uses_global_scale:
                    continue
                if not isinstance(g, torch.Tensor) and g is not None:
                    self.numbers.append((i, j))
                elif g is not None and g.dtype == torch.float32 and g.device == dev and tuple(g.shape) == (heads,) \
                        and g.is_contiguous():
                    self.fixed[i][j] = g
                else:
                    key = (heads, dev) if g is None else (heads, dev, g.shape, g.dtype, g.device)
                    groups.setdefault(key, []).append((i, j, g))
        self.groups = []  # (heads, device, members, their scales): stacked and converted per call
        for (heads, dev, *_), members in groups.items():
            if members[0][2] is None:
                for (i, j, _), row in zip(members, torch.ones(len(members), heads, dtype=torch.float32,
                                                              device=dev).unbind(0), strict=True):
                    self.fixed[i][j] = row
            else:
                self.groups.append((heads, dev, [(i, j) for i, j, _ in members], [g for _, _, g in members]))

    @property
    def constant(self) -> bool:
        """Whether every scale is a tensor the layers hold (or the kept 1.0 rows): the same tensors every call."""
        return not self.groups and not self.numbers

    def __call__(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        if self.constant:
            return [(k, v) for k, v in self.fixed]
        out = [list(pair) for pair in self.fixed]
        for i, j in self.numbers:
            out[i][j] = cache_global_scales(self.caches[i], self.formats[i], None, None, "read_rows",
                                            check_values=False)[j]
        for heads, dev, members, scales in self.groups:
            n = len(members)
            built = torch.stack(scales).to(device=dev, dtype=torch.float32).reshape(n, -1).expand(n, heads).contiguous()
            for (i, j), row in zip(members, built.unbind(0), strict=True):
                out[i][j] = row
        return [(k, v) for k, v in out]


def read_rows(cache: CacheDesc, slots: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor] | None = None,
              scales: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """The stored rows of `slots` ([T] token slots, in sequence order): `{name: [T, H, X]}` (payload in its stored
    dtype, scales as bytes) plus the layer's global scales `{k_global, v_global: fp32 [H]}` where the format has
    them. Copies, on the cache's device. `where`: `LayerSet.check_slots`' answer for this cache (which validated it and
    checked its slots: layers read without a validation and a host sync each); `scales`: the layer's
    `GlobalScales` answer (built here when None)."""
    if where is None:
        cache.validate()
    held = binding(cache)
    fmt = held.fmt
    blk, off = check_slots(cache, slots) if where is None else where
    out = {}
    for which, p in zip(("k", "v"), _sides(cache, held), strict=True):
        out[f"{which}_data"] = p.data[blk, off].flatten(-2).contiguous()
        if p.scales is not None:
            out[f"{which}_scales"] = p.scales[blk, off].flatten(-2).contiguous()
    # no host sync: a read copies what is stored
    kg, vg = cache_global_scales(cache, fmt, None, None, "read_rows", check_values=False) if scales is None else scales
    out.update({name: g for name, g in (("k_global", kg), ("v_global", vg)) if g is not None})
    for t in KEY_TRANSFORMS:
        v = t.of(cache)
        if v is not None:
            out[t.tensor] = v.to(device=cache.k.tensor.device, dtype=torch.float32, copy=True)
    return out


def read_chunk(cache: CacheDesc, slots: torch.Tensor, specs: Sequence,
               where: tuple[torch.Tensor, torch.Tensor] | None = None,
               scales: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
               into: tuple[StorageViews, int] | None = None, fmt: CacheFormat | None = None) -> torch.Tensor:
    """A layer's chunk payload: uint8 `[bytes]` on the cache's device, the tensors `read_rows` gives packed in the
    order of `specs` (the bundle header's `TensorSpec`s, `format_specs` order). On a kernel device
    (`kernels.use_kernels`) one gather kernel writes every tensor straight into the chunk; else torch gathers and
    joins them. `where`, `scales` as for `read_rows`; `into`: (views of a device buffer, byte offset) where the
    kernel writes the chunk (an exporter's staging for all its layers: one view per tensor), else a new tensor;
    `fmt`: the cache's format as `LayerSet.check_slots` gave it (derived here when None)."""
    if not kernels.use_kernels(cache.k.tensor.device):
        rows = read_rows(cache, slots, where=where, scales=scales)
        return torch.cat([rows[s.name].reshape(-1).view(torch.uint8) for s in specs])
    if where is None:
        cache.validate()
        check_slots(cache, slots)
    chunk, moves = _chunk_moves(cache, slots, specs, scales, into, fmt)
    _plan_layers(cache, slots, [moves], scatter=False)()
    return chunk


def read_chunks(caches: Sequence[CacheDesc], slots: torch.Tensor, specs: Sequence, into: StorageViews, stride: int,
                scales: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
                formats: Sequence[CacheFormat]) -> list[torch.Tensor]:
    """`read_chunk` of every layer of `caches` (on a kernel device, checked by `LayerSet.check_slots` with `slots`, its
    answer) into `into` at byte offsets `0, stride, 2 * stride, ...`: the gathers of every layer of one geometry in
    one launch (`ops.triton.rows.plan_layer_rows`). Returns each layer's chunk."""
    chunks, moves = [], []
    for i, (cache, gs, fmt) in enumerate(zip(caches, scales, formats, strict=True)):
        chunk, m = _chunk_moves(cache, slots, specs, gs, (into, i * stride), fmt)
        chunks.append(chunk)
        moves.append(m)
    if caches:
        _plan_layers(caches[0], slots, moves, scatter=False)()
    return chunks


def _chunk_moves(cache: CacheDesc, slots: torch.Tensor, specs: Sequence,
                 scales: tuple[torch.Tensor | None, torch.Tensor | None] | None,
                 into: tuple[StorageViews, int] | None, fmt: CacheFormat | None) -> tuple[torch.Tensor, object]:
    """(The chunk `read_chunk` fills, the layer's moves into it as `plan_layer_rows` takes them) for a checked
    `cache` on a kernel device."""
    from ..ops.triton.rows import _INT

    held = binding(cache)
    fmt = held.fmt if fmt is None else fmt
    dev, t = cache.k.tensor.device, slots.numel()
    size = sum(s.nbytes(t) for s in specs)
    views, pos = into if into is not None else (StorageViews(torch.empty(size, dtype=torch.uint8, device=dev)), 0)
    chunk, parts = views.view(pos, torch.uint8, (size,)), {}
    for s in specs:  # each tensor's bytes as the 1-D integer view the kernel takes (its start and element width)
        n = s.nbytes(t)
        dtype = _INT[s.dtype.itemsize] if s.name not in LAYER_TENSORS else torch.uint8
        parts[s.name] = views.view(pos, dtype, (n // dtype.itemsize,))
        require(parts[s.name] is not None, Status.INTERNAL_ERROR, f"read_chunk: {s.name} is not aligned in the chunk")
        pos += n
    kg, vg = cache_global_scales(cache, fmt, None, None, "read_rows", check_values=False) if scales is None else scales
    layer = {"k_global": kg, "v_global": vg, **{k.tensor: k.of(cache) for k in KEY_TRANSFORMS}}
    flat = [(layer[n], parts[n]) for n in LAYER_TENSORS if n in parts]  # FP32 (`QuantDesc` validation)
    return chunk, _layer_moves(cache, held, parts, flat)


def _pool_rows(cache: CacheDesc, held: Binding) -> tuple:
    """The pools of `cache` as the row kernel addresses them (`ops.triton.rows.PoolRows`): K payload, K scales,
    V payload, V scales (those the format has), derived once per binding (`held`, `binding(cache)`)."""
    from ..ops.triton.rows import block_rows, interleaved_rows

    def build() -> tuple:
        out = []
        for which, p in zip(("k", "v"), _sides(cache, held), strict=True):
            out.append((f"{which}_data", block_rows(p.data)))
            if p.scales is not None:
                out.append((f"{which}_scales", interleaved_rows(p.scales.pool, GROUP)
                            if isinstance(p.scales, Interleave4Rows) else block_rows(p.scales)))
        return tuple(out)
    return held.derive("pool_rows", build)


def _layer_moves(cache: CacheDesc, held: Binding, rows: dict[str, torch.Tensor], flat: list = ()):
    """The moves between the pools of `cache` (bound as `held`) and `rows` (`{name: contiguous [T, H, X]}` on the
    cache's device, every pool of the format), as `ops.triton.rows.plan_layer_rows` takes a layer."""
    from ..ops.triton.rows import LayerRows

    return LayerRows(cache.block_size, [(pool, rows[name]) for name, pool in _pool_rows(cache, held)], list(flat))


def _plan_layers(first: CacheDesc, slots: torch.Tensor, moves: list, *, scatter: bool) -> Callable[[], None]:
    """`ops.triton.rows.plan_layer_rows` of layers' `moves` for `slots` already checked (moved to the device of
    `first`, the first layer's cache, as int64 where they are not)."""
    from ..ops.triton.rows import plan_layer_rows

    dev = first.k.tensor.device
    if slots.device != dev or slots.dtype != torch.int64:
        slots = slots.to(device=dev, dtype=torch.int64)
    return plan_layer_rows(slots, moves, scatter=scatter)


def format_specs(fmt, num_kv_heads: int, head_dim: int, transforms: Collection[str] = ()
                 ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """`{name: (dtype, per-token row shape or per-layer shape)}` of what a cache of format `fmt` stores for
    `num_kv_heads` x `head_dim` with the key transforms `transforms` (tensor names, `key_transforms`): the tensors
    `read_rows` returns and a bundle of that format declares."""
    out = {}
    for which, tf in (("k", fmt.k), ("v", fmt.v)):
        out[f"{which}_data"] = (tf.torch_data_dtype, (num_kv_heads, tf.payload_dim(head_dim)))
        if tf.scale_dim(head_dim):
            out[f"{which}_scales"] = (torch.uint8, (num_kv_heads, tf.scale_dim(head_dim)))
    for which, tf in (("k", fmt.k), ("v", fmt.v)):
        if tf.uses_global_scale:
            out[f"{which}_global"] = (torch.float32, (num_kv_heads,))
    out.update({t.tensor: (torch.float32, (num_kv_heads, head_dim))
                for t in KEY_TRANSFORMS if t.tensor in transforms})
    return out


def write_rows(cache: CacheDesc, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
    """Store rows `read_rows` gave (of a cache of the same format and geometry) at `slots`, after checking them all.
    The caller checks the layer's global scales and key transforms match (rows mean something only under the scales
    and transform they were encoded with)."""
    store = prepare_write_rows(cache, slots, rows)
    store()


def prepare_write_rows(cache: CacheDesc, slots: torch.Tensor, rows: dict[str, torch.Tensor],
                       where: tuple[torch.Tensor, torch.Tensor] | None = None, fmt: CacheFormat | None = None):
    """Check a `write_rows` call completely and return the store (a callable that cannot fail on its inputs).
    `where`, `fmt`: as for `read_chunk`."""
    if where is None:
        cache.validate()
    held = binding(cache)
    blk, off = check_slots(cache, slots) if where is None else where
    _check_rows(cache, held.fmt if fmt is None else fmt, slots.numel(), rows)
    if kernels.use_kernels(cache.k.tensor.device):  # one scatter kernel; the rows staged on the device first
        return _plan_layers(cache, slots, [_staged_moves(cache, held, rows)], scatter=True)
    pools = _sides(cache, held)
    moves = [(p, rows[f"{w}_data"], rows.get(f"{w}_scales")) for w, p in zip(("k", "v"), pools, strict=True)]

    def store() -> None:
        for p, data, scales in moves:
            p.data[blk, off] = data.to(p.data.device).reshape(-1, *p.data.shape[2:])
            if p.scales is not None:
                p.scales[blk, off] = scales.to(p.data.device).reshape(-1, *p.scales.shape[2:])
    return store


def prepare_write_layers(caches: Sequence[CacheDesc], slots: torch.Tensor, rows: Sequence[dict[str, torch.Tensor]],
                         wheres: Sequence[tuple[torch.Tensor, torch.Tensor]], formats: Sequence[CacheFormat]):
    """`prepare_write_rows` of several layers (checked by `LayerSet.check_slots`, whose answers `slots`, `wheres` and
    `formats` are): on a kernel device the scatters of every layer of one geometry in one launch
    (`ops.triton.rows.plan_layer_rows`); the store runs them all."""
    if not caches:
        return lambda: None
    if not kernels.use_kernels(caches[0].k.tensor.device):
        stores = [prepare_write_rows(c, slots, r, where=w, fmt=f)
                  for c, r, w, f in zip(caches, rows, wheres, formats, strict=True)]

        def store() -> None:
            for s in stores:
                s()
        return store
    moves = []
    for cache, layer, fmt in zip(caches, rows, formats, strict=True):
        held = binding(cache)
        _check_rows(cache, fmt, slots.numel(), layer)
        moves.append(_staged_moves(cache, held, layer))
    return _plan_layers(caches[0], slots, moves, scatter=True)


def _check_rows(cache: CacheDesc, fmt: CacheFormat, tokens: int, rows: dict[str, torch.Tensor]) -> None:
    """`rows` hold every per-token tensor a cache of `fmt` stores, of its dtype and shape for `tokens` tokens."""
    for name, (dtype, shape) in format_specs(fmt, cache.num_kv_heads, cache.head_dim).items():
        if name in LAYER_TENSORS:
            continue
        t = rows.get(name)
        require(isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == (tokens, *shape),
                Status.INVALID_ARGUMENT, f"rows[{name!r}] must be {dtype} {(tokens, *shape)}")


def _staged_moves(cache: CacheDesc, held: Binding, rows: dict[str, torch.Tensor]):
    """`_layer_moves` of a scatter: the rows contiguous on the cache's device first."""
    dev = cache.k.tensor.device
    return _layer_moves(cache, held, {n: on_device(t, dev) for n, t in rows.items() if n not in LAYER_TENSORS})
