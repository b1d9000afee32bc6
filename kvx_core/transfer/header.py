"""The header of a sequence's bundle, built from the caches that export it: shared by the stream export
(`handoff.export_bundle`) and the host-memory export (`host.export_to_host`), so neither imports the other
for it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import torch

from ..descriptors import CacheDesc
from ..errors import Status, require
from .bundle import SEGMENT_BYTES, TensorSpec
from .layer_set import layer_set
from .rows import KEY_TRANSFORMS, LAYER_TENSORS, format_specs
from .schema import ModelFingerprint, token_hash, token_list


def head_range(kv_heads, model: ModelFingerprint, what: str) -> tuple[int, int]:
    """A checked half-open KV-head range of the model (default: all of its heads)."""
    a, b = (0, model.num_kv_heads) if kv_heads is None else kv_heads
    require(isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= model.num_kv_heads, Status.INVALID_ARGUMENT,
            f"{what}: kv_heads must be a range [start, stop) within the model's {model.num_kv_heads} KV heads, "
            f"got {kv_heads!r}")
    return a, b


def bundle_header(caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                  token_ids: Sequence[int] | None = None, kv_heads: tuple[int, int] | None = None,
                  segment_bytes: int = SEGMENT_BYTES) -> dict:
    """The header of the bundle of one sequence (`export_bundle`'s arguments), after checking every layer agrees;
    `segment_bytes`: the checksum segment size it declares."""
    require(len(caches) == model.num_layers and len(caches) > 0, Status.INVALID_ARGUMENT,
            f"export_bundle: {len(caches)} layer caches for a {model.num_layers}-layer model")
    first = caches[0]
    layers = layer_set(caches)  # each layer validated (once per descriptor state: `rows.binding`)
    fmt = layers.formats[0]
    a, b = head_range(kv_heads, model, "export_bundle")
    require(first.num_kv_heads == b - a and first.head_dim == model.head_dim, Status.INCOMPATIBLE,
            f"export_bundle: the cache has {first.num_kv_heads} KV heads x {first.head_dim}, KV heads [{a}, {b}) of "
            f"the model are {b - a} x {model.head_dim}")
    ids = None if token_ids is None else token_list(token_ids)
    require(isinstance(slots, torch.Tensor), Status.INVALID_ARGUMENT, "export_bundle: slots must be a tensor")
    require(ids is None or len(ids) == slots.numel(), Status.INVALID_ARGUMENT,
            f"export_bundle: {len(ids or [])} token ids for {slots.numel()} slots")
    geometry, transforms = layers.geometry, layers.transforms
    require(layers.mismatch is None, Status.INVALID_ARGUMENT, layers.mismatch or "")
    specs = [TensorSpec(n, dt, sh, n not in LAYER_TENSORS)
             for n, (dt, sh) in format_specs(fmt, *geometry, transforms).items()]
    return {"model": asdict(model),
            "tokens": {"count": int(slots.numel()), "ids": ids, "ids_sha256": None if ids is None else token_hash(ids)},
            "cache": {"format": fmt.name, "num_layers": len(caches), "num_kv_heads": first.num_kv_heads,
                      "head_dim": first.head_dim, "kv_heads": [a, b], **transform_flags(transforms)},
            "tensors": [s.to_json() for s in specs], "created_by": "kvx",
            "checksum": {"algorithm": "xxh64", "segment_bytes": segment_bytes}}


def transform_flags(transforms: frozenset[str]) -> dict[str, bool]:
    """The header's `cache.key_smoothing` / `cache.key_centering` for key transforms `transforms` (tensor names)."""
    return {t.header: t.tensor in transforms for t in KEY_TRANSFORMS}
