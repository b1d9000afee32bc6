"""KVTC as a codec of KVX bundles: a bundle <-> a KVTC buffer, so bundles travel and rest KVTC-coded.
It lives in `transfer` (which builds on `kvtc`, the codec), so `kvtc` imports nothing from `transfer`.

`encode_bundle` decodes a bundle of any format to BF16 K/V and compresses them (the tokens' ids ride along);
`decode_bundle` decompresses a buffer into a BF16 bundle, which any engine imports into its own format
(`import_bundle` re-encodes). `BundleStore(root, kvtc=calibration)` stores its entries this way, so the vLLM and
TensorRT-LLM connectors exchange KVTC-coded KV with one option. The calibration must cover the whole model
(every layer and KV head); a tensor-parallel shard bundle is refused.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import BinaryIO

import torch

from ..errors import KvxError, Status, require
from ..formats import get_format
from ..kvtc.calibration import Calibration, load_calibration
from ..kvtc.codec import KvtcHeader, compress, decompress, model_hash, read_header
from .bundle import BundleReader
from .handoff import decode_rows, export_bundle
from .schema import ModelFingerprint


def encode_bundle(src: BinaryIO, cal: Calibration, *, deflate: bool = True) -> bytes:
    """A bundle (read and verified whole) -> the KVTC buffer of its K/V and token ids. KvxError INCOMPATIBLE for a
    bundle of another model than the calibration's, INVALID_ARGUMENT for a shard or another geometry."""
    reader = BundleReader(src)
    header = reader.header
    model = header.get("model")
    if cal.model and model != cal.model:
        raise KvxError(Status.INCOMPATIBLE, "KVTC: the bundle holds another model's KV than the calibration's")
    cache = header["cache"]
    require(cache.get("kv_heads") == [0, cal.num_kv_heads], Status.INVALID_ARGUMENT,
            f"KVTC: the bundle holds KV heads {cache.get('kv_heads')}, the calibration codes all {cal.num_kv_heads}")
    fmt = get_format(cache["format"])
    kv = [tuple(x.to(torch.bfloat16) for x in decode_rows(rows, fmt)) for rows in reader.read_all()]
    return compress(kv, cal, model=model, deflate=deflate, token_ids=header["tokens"].get("ids"))


def decode_bundle(buf: bytes, cal: Calibration, out: BinaryIO, *, model=None) -> dict:
    """A KVTC buffer -> a BF16 bundle written to `out`; returns its header. `model`: the fingerprint
    (`ModelFingerprint`) the bundle names, default the calibration's; the buffer must belong to it (INCOMPATIBLE)."""
    from ..cache import PagedKVCache

    if model is None:
        require(bool(cal.model), Status.INVALID_ARGUMENT, "KVTC: the calibration names no model; a bundle needs one")
        model = ModelFingerprint(**cal.model)
    hdr, kv, ids = decompress(buf, cal, model=asdict(model))
    n, bs = hdr.token_count, 16
    cache = PagedKVCache("bf16", num_layers=cal.num_layers, num_blocks=max(1, -(-n // bs)), block_size=bs,
                         num_kv_heads=cal.num_kv_heads, head_dim=cal.head_dim)
    slots = torch.arange(n)
    for layer, (k, v) in enumerate(kv):
        cache.write(layer, k.to(torch.bfloat16), v.to(torch.bfloat16), slots)
    return export_bundle(out, [cache.descriptor(i) for i in range(cal.num_layers)], slots, model=model,
                         token_ids=ids)


def entry_header(buf: bytes, cal: Calibration | None, model) -> tuple[KvtcHeader, dict]:
    """A stored KVTC entry's checked header and the parts of the BF16 bundle header it decodes to that a reader
    needs without decoding it (model, token count, cache geometry, the codec). KvxError UNSUPPORTED without a
    calibration, INCOMPATIBLE for another calibration or model."""
    hdr = read_header(buf)
    require(cal is not None, Status.UNSUPPORTED,
            f"the entry is KVTC-coded (calibration {hdr.calibration[:12]}...): open the store with that calibration "
            "(BundleStore(root, kvtc=load_calibration(path)); the connectors' kvtc setting, KVX_KVTC)")
    require(hdr.calibration == cal.identity, Status.INCOMPATIBLE,
            f"the entry was KVTC-coded with calibration {hdr.calibration[:12]}..., the store has "
            f"{cal.identity[:12]}...")
    require(hdr.model == model_hash(asdict(model)), Status.INCOMPATIBLE, "the KVTC entry belongs to another model")
    return hdr, {"codec": {"name": "kvtc", "calibration": hdr.calibration}, "model": asdict(model),
                 "tokens": {"count": hdr.token_count},
                 "cache": {"format": "bf16", "num_layers": hdr.num_layers, "num_kv_heads": hdr.num_kv_heads,
                           "head_dim": hdr.head_dim, "kv_heads": [0, hdr.num_kv_heads]}}


def calibration_for(path: str, model) -> Calibration:
    """The calibration file the connectors' `kvtc` setting names (`KVX_KVTC`, `kvx_core.config`), checked
    against the model it serves: its fingerprint (when the file names one) and geometry. KvxError otherwise."""
    cal = load_calibration(path)
    require(not cal.model or cal.model == asdict(model), Status.INCOMPATIBLE,
            f"{path} was calibrated on another model than the one served")
    require((cal.num_layers, cal.num_kv_heads, cal.head_dim) == (model.num_layers, model.num_kv_heads, model.head_dim),
            Status.INCOMPATIBLE, f"{path} codes {cal.num_layers} layers x {cal.num_kv_heads} KV heads x "
            f"{cal.head_dim}, the model has {model.num_layers} x {model.num_kv_heads} x {model.head_dim}")
    return cal
