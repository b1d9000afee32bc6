"""Export one sequence's KV from any KVX-described cache into a bundle, and import a bundle into any other.

Export reads the stored rows of the sequence's slots (`rows.read_rows`), layer by layer, so the bundle holds the
source format's exact bytes; any layout and block size. Import checks the bundle against the destination (model
fingerprint, layers, KV heads, head_dim, token ids), reads and verifies the whole bundle, converts every layer,
and only then writes: a bundle that fails anywhere leaves the destination untouched. Conversion: the same format
and global scales -> the rows are stored as they are (bit-identical); otherwise the rows are decoded in the
source format (undoing its rotation) and written through the destination's own encode (`ops.reference.write_kv`),
so the result is what writing the source's dequantized K/V into the destination gives.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import BinaryIO

import torch

from ..codec import format_of
from ..descriptors import CacheDesc, KvIoDesc, SlotMapping, WriteDesc
from ..errors import KvxError, Status, require
from ..formats import get_format, rotate
from ..ops.checks import cache_global_scales, check_write
from ..ops.reference import write_kv
from .bundle import BundleReader, BundleWriter, TensorSpec
from .rows import LAYER_TENSORS, check_slots, prepare_write_rows, read_rows, row_shapes


@dataclass(frozen=True)
class ModelFingerprint:
    """What must agree for KV to mean the same thing in two engines: the attention geometry, RoPE and hashes of
    the model config and tokenizer (`fingerprint_from_files`)."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: dict
    config_sha256: str
    tokenizer_sha256: str


def fingerprint_from_files(config_json: str, tokenizer_json: str) -> ModelFingerprint:
    """The fingerprint of a Hugging Face checkpoint from its config.json and tokenizer.json paths."""
    with open(config_json, "rb") as f:
        raw = f.read()
    cfg = json.loads(raw)
    with open(tokenizer_json, "rb") as f:
        tok = hashlib.sha256(f.read()).hexdigest()
    heads = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = {k: cfg[k] for k in ("rope_theta", "rope_scaling", "max_position_embeddings") if k in cfg}
    return ModelFingerprint((cfg.get("architectures") or ["?"])[0], int(cfg["num_hidden_layers"]), int(heads),
                            int(head_dim), rope, hashlib.sha256(raw).hexdigest(), tok)


def _token_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in token_ids)).hexdigest()


def export_bundle(out: BinaryIO, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                  token_ids: Sequence[int] | None = None) -> dict:
    """Write the bundle of one sequence: `caches[i]` is layer i's cache, `slots` the sequence's token slots in
    order (shared by every layer). Returns the header. Streams layer by layer."""
    require(len(caches) == model.num_layers and len(caches) > 0, Status.INVALID_ARGUMENT,
            f"export_bundle: {len(caches)} layer caches for a {model.num_layers}-layer model")
    first = caches[0]
    fmt = format_of(first)
    require(first.num_kv_heads == model.num_kv_heads and first.head_dim == model.head_dim, Status.INCOMPATIBLE,
            f"export_bundle: the cache has {first.num_kv_heads} KV heads x {first.head_dim}, the model "
            f"{model.num_kv_heads} x {model.head_dim}")
    require(token_ids is None or len(token_ids) == slots.numel(), Status.INVALID_ARGUMENT,
            f"export_bundle: {len(token_ids or [])} token ids for {slots.numel()} slots")
    shapes = row_shapes(first)
    specs = [TensorSpec(n, dt, sh, n not in LAYER_TENSORS) for n, (dt, sh) in shapes.items()]
    header = {"model": asdict(model),
              "tokens": {"count": int(slots.numel()),
                         "ids": None if token_ids is None else [int(t) for t in token_ids],
                         "ids_sha256": None if token_ids is None else _token_hash(token_ids)},
              "cache": {"format": fmt.name, "num_layers": len(caches), "num_kv_heads": first.num_kv_heads,
                        "head_dim": first.head_dim, "kv_heads": [0, first.num_kv_heads]},
              "tensors": [s.to_json() for s in specs], "created_by": "kvx"}
    w = BundleWriter(out, header)
    for i, cache in enumerate(caches):
        require(format_of(cache) == fmt and row_shapes(cache) == shapes, Status.INVALID_ARGUMENT,
                f"export_bundle: layer {i}'s cache differs from layer 0's in format or geometry")
        w.add_layer(read_rows(cache, slots))
    w.close()
    return header


def _check_compatible(header: dict, caches: Sequence[CacheDesc], model: ModelFingerprint,
                      token_ids: Sequence[int] | None) -> None:
    theirs = header.get("model")
    ours = asdict(model)
    if theirs != ours:
        diff = sorted(k for k in ours if not isinstance(theirs, dict) or theirs.get(k) != ours[k])
        raise KvxError(Status.INCOMPATIBLE, f"bundle of another model: {', '.join(diff)} differ")
    cache = header["cache"]
    require(cache.get("kv_heads") == [0, model.num_kv_heads], Status.UNSUPPORTED,
            f"bundle holds KV heads {cache.get('kv_heads')} of {model.num_kv_heads}: importing a tensor-parallel "
            "shard is not supported yet")
    require(len(caches) == cache["num_layers"], Status.INCOMPATIBLE,
            f"bundle has {cache['num_layers']} layers, {len(caches)} destination caches given")
    for i, c in enumerate(caches):
        require((c.num_kv_heads, c.head_dim) == (cache["num_kv_heads"], cache["head_dim"]), Status.INCOMPATIBLE,
                f"layer {i}: destination cache has {c.num_kv_heads} KV heads x {c.head_dim}, the bundle "
                f"{cache['num_kv_heads']} x {cache['head_dim']}")
    if token_ids is not None:
        tok = header["tokens"]
        require(tok.get("ids_sha256") == _token_hash(token_ids), Status.INCOMPATIBLE,
                "bundle holds the KV of other tokens than the ones given")


def _prepare(rows: dict[str, torch.Tensor], src_name: str, cache: CacheDesc, slots: torch.Tensor):
    """The store of one layer's bundled `rows` (source format `src_name`) into `cache` at `slots`, checked and
    converted now; the returned callable only stores."""
    src, dst = get_format(src_name), format_of(cache)
    if src == dst:
        kg, vg = cache_global_scales(cache, dst, None, None, "import_bundle")
        if all(g is None or torch.equal(g.cpu(), rows[n]) for n, g in (("k_global", kg), ("v_global", vg))):
            return prepare_write_rows(cache, slots, {k: v for k, v in rows.items() if k not in LAYER_TENSORS})
    kv = []
    for which, tf in (("k", src.k), ("v", src.v)):
        data = rows[f"{which}_data"]
        scales = rows.get(f"{which}_scales", torch.empty(*data.shape[:2], 0, dtype=torch.uint8))
        x = tf.decode(data, scales, rows.get(f"{which}_global"))
        kv.append(rotate(x) if src.rotate else x)
    dev = cache.k.tensor.device
    check_slots(cache, slots)
    write = WriteDesc(KvIoDesc(kv[0].to(dev), kv[1].to(dev)), SlotMapping(slots.to(dev)))
    check_write(cache, write)  # write_kv checks again; this one runs before any layer stores
    return lambda: write_kv(cache, write)


def import_bundle(src: BinaryIO, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                  token_ids: Sequence[int] | None = None) -> dict:
    """Read, verify and store a bundle into `caches` (layer i -> `caches[i]`) at `slots` (one per bundled token,
    in order). All or nothing: every check, the whole bundle's checksums and every layer's conversion happen
    before the first byte is stored. Returns the bundle header."""
    reader = BundleReader(src)
    header = reader.header
    _check_compatible(header, caches, model, token_ids)
    require(isinstance(slots, torch.Tensor) and slots.numel() == reader.tokens, Status.INVALID_ARGUMENT,
            f"import_bundle: slots must be a tensor of {reader.tokens} entries (one per bundled token)")
    fmt = header["cache"]["format"]
    stores = [_prepare(rows, fmt, cache, slots) for rows, cache in zip(reader.read_all(), caches)]
    for store in stores:
        store()
    return header
