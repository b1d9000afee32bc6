"""What a KV bundle's header and layer tensors must mean: checked by every reader (`bundle.BundleReader`, hence
import, convert, `kvx bundle verify | inspect`, the store and KVTC encoding refuse the same bundles).

A forger recomputes every checksum, so checksums only prove the bytes are the writer's; these checks stand between
a checksum-valid bundle and wrong KV: the model fingerprint's fields and types, a cache geometry that fits the
model, the tensor list of the declared format and key transforms, token ids that match their count and their hash;
per layer, global scales finite and > 0 and key-transform vectors under `QuantDesc`'s own rule. Also the token-id
rule every KVX entry point applies (`token_list`): integers in [0, 2**32), never truncated.
"""
from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import get_type_hints

import torch

from ..descriptors import finite_positive
from ..errors import KvxError, Status, int_value
from ..formats import CacheFormat, get_format
from ..formats.base import is_int
from ..ops.checks import global_scale
from .rows import KEY_TRANSFORMS, LAYER_TENSORS, format_specs

MAX_HEAD_DIM = 1024
"""A bundle declaring a larger head_dim is refused before its format checks it (a `_rot` format's check builds the
head_dim x head_dim Hadamard matrix); served models use at most 256."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


def rejected(what: str) -> KvxError:
    """The error of a bundle refused for `what`."""
    return KvxError(Status.INVALID_ARGUMENT, f"KVX bundle rejected: {what}")


def short(value: object) -> str:
    """`repr(value)` cut to 80 characters (forged fields can be megabytes long)."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


@dataclass(frozen=True)
class ModelFingerprint:
    """What must agree for KV to mean the same thing in two engines: the attention geometry, RoPE and hashes of
    the model config and tokenizer (`handoff.fingerprint_from_files`)."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: dict
    config_sha256: str
    tokenizer_sha256: str

    @classmethod
    def from_json(cls, obj: object) -> ModelFingerprint:
        """The fingerprint a bundle header's `model` holds; KvxError unless every field is present with its type
        (counts: positive integers)."""
        if not isinstance(obj, dict):
            raise rejected(f"header field model must be an object, got {short(obj)}")
        hints = get_type_hints(cls)
        for f in fields(cls):
            v, t = obj.get(f.name), hints[f.name]
            if not (is_int(v) and v > 0 if t is int else isinstance(v, t)):
                raise rejected(f"header field model.{f.name} must be "
                               f"{'a positive integer' if t is int else 'a JSON ' + t.__name__}, got {short(v)}")
        return cls(**{f.name: obj[f.name] for f in fields(cls)})


def token_list(token_ids: Iterable, what: str = "token ids") -> list[int]:
    """`token_ids` as Python ints in [0, 2**32) (u32: what `tokens.ids_sha256` and store keys hash). A float, a
    bool or anything else that is not an integer is refused, never truncated (`int(1.5)` is another token)."""
    try:
        given = list(token_ids)
    except TypeError:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be a sequence of integers, got "
                                                f"{type(token_ids).__name__}") from None
    # plain ints (what engines pass) checked in C (types, min, max): the checks per id in Python, each building its
    # error message, took 7 ms of a 4096-token import on the GPU machine's host (bench_pd --profile-phases)
    if set(map(type, given)) <= {int} and (not given or (min(given) >= 0 and max(given) < 2**32)):
        return given
    ids = [int_value(t) for t in given]
    for i, (t, v) in enumerate(zip(given, ids, strict=True)):
        if v is None:
            raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be integers, got {short(t)} at position {i}")
        if not 0 <= v < 2**32:
            raise KvxError(Status.INVALID_ARGUMENT, f"{what} must lie in [0, 2**32), got {v} at position {i}")
    return ids


def token_bytes(token_ids: Iterable) -> bytes:
    """Token ids as u32 little-endian (what `tokens.ids_sha256` and store keys hash), checked by `token_list`."""
    ids = token_list(token_ids)
    return struct.pack(f"<{len(ids)}I", *ids)


def token_hash(token_ids: Iterable) -> str:
    """`tokens.ids_sha256` of a bundle of `token_ids`."""
    return hashlib.sha256(token_bytes(token_ids)).hexdigest()


def header_transforms(header: dict) -> frozenset[str]:
    """The key transforms (tensor names) a bundle header declares; a flag absent (a bundle written before it) reads
    as False."""
    cache = header["cache"]
    for t in KEY_TRANSFORMS:
        if not isinstance(cache.get(t.header, False), bool):
            raise rejected(f"cache.{t.header} is not a bool")
    return frozenset(t.tensor for t in KEY_TRANSFORMS if cache.get(t.header, False))


def _check_tokens(tokens: dict, count: int) -> None:
    """`tokens.ids` (optional): `count` u32 ids whose sha256 is `tokens.ids_sha256`; without ids, the hash is
    absent or a sha256 (a bundle may name its tokens by hash only)."""
    ids, digest = tokens.get("ids"), tokens.get("ids_sha256")
    if ids is None:
        if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise rejected(f"tokens.ids_sha256 must be a sha256 hex digest, got {short(digest)}")
        return
    if not isinstance(ids, list) or len(ids) != count:
        raise rejected(f"tokens.ids must be a list of tokens.count = {count} ids, got "
                       f"{len(ids) if isinstance(ids, list) else short(ids)}")
    try:
        checked = token_list(ids, "tokens.ids")
    except KvxError as e:
        raise rejected(e.message) from None
    if digest != token_hash(checked):
        raise rejected("tokens.ids_sha256 is not the sha256 of tokens.ids")


def check_header(header: dict, specs: Sequence) -> CacheFormat:
    """The format of a bundle whose header passed `bundle.parse_specs` (giving `specs`), after checking what the
    header means: the model, a geometry that fits it, the format's tensors, the tokens."""
    model = ModelFingerprint.from_json(header.get("model"))
    cache = header["cache"]
    if not isinstance(cache, dict):
        raise rejected(f"header field cache must be an object, got {short(cache)}")
    name = cache.get("format")
    if not isinstance(name, str):
        raise rejected(f"cache.format must be a format name, got {short(name)}")
    fmt = get_format(name)
    heads, kv, dim = cache.get("num_kv_heads"), cache.get("kv_heads"), cache.get("head_dim")
    if not (isinstance(kv, list) and len(kv) == 2 and all(is_int(h) for h in kv)
            and 0 <= kv[0] < kv[1] <= model.num_kv_heads and is_int(heads) and heads == kv[1] - kv[0]
            and is_int(dim) and dim == model.head_dim and cache["num_layers"] == model.num_layers):
        raise rejected(f"cache geometry (layers {short(cache['num_layers'])}, KV heads {short(kv)} = "
                       f"{short(heads)}, head_dim {short(dim)}) does not fit its model ({model.num_layers} layers, "
                       f"{model.num_kv_heads} KV heads x {model.head_dim})")
    if dim > MAX_HEAD_DIM:
        raise rejected(f"head_dim {dim} exceeds {MAX_HEAD_DIM}")
    fmt.check_head_dim(dim)
    want = {n: (dt, sh, n not in LAYER_TENSORS)
            for n, (dt, sh) in format_specs(fmt, heads, dim, header_transforms(header)).items()}
    got = {s.name: (s.dtype, s.shape, s.per_token) for s in specs}
    if got != want:
        raise rejected(f"its tensors {sorted(got)} do not match what format {fmt.name} stores (with the key "
                       f"transforms its header declares): {sorted(want)}")
    tokens = header["tokens"]
    _check_tokens(tokens, tokens["count"])
    return fmt


def check_layer(layer: int, tensors: dict[str, torch.Tensor], fmt: CacheFormat) -> None:
    """One layer's per-layer tensors (shapes already checked) by the rules of a cache's own: global scales finite
    and > 0, a smoothing vector finite and > 0, a centering vector finite (one host sync each)."""
    for which, tf in (("k", fmt.k), ("v", fmt.v)):
        g = tensors.get(f"{which}_global")
        if g is not None:
            global_scale(tf, g, g.numel(), g.device, f"KVX bundle rejected: layer {layer}'s {which}_global")
    for t in KEY_TRANSFORMS:
        v = tensors.get(t.tensor)
        if v is not None:
            t.check(v, *v.shape, v.device, what=f"KVX bundle rejected: layer {layer}'s {t.tensor}")


def read_flags(flags: Sequence[torch.Tensor]) -> list[bool]:
    """Device booleans (0-d or 1-d, one device) read back in order, flattened, with one host sync: what a bundle's
    checks batched over its layers cost on a GPU, where a check per layer would stall the copies once per layer."""
    return torch.cat([f.reshape(-1) for f in flags]).tolist() if flags else []


def check_layers(layers: Sequence[dict[str, torch.Tensor]], fmt: CacheFormat) -> None:
    """`check_layer` of every layer with one host sync and a fixed number of tensor ops: each value rule applied
    once to one tensor's values of every layer stacked (the layers of a bundle share its tensor list); where one
    fails, the layers are checked alone in order, for the first failing layer's message."""
    rules = {**{f"{w}_global": finite_positive for w in "kv"}, **{t.tensor: t.valid for t in KEY_TRANSFORMS}}
    flags = [rule(torch.stack([tensors[name] for tensors in layers]))
             for name, rule in rules.items() if layers and name in layers[0]]
    if not all(read_flags(flags)):
        for i, tensors in enumerate(layers):
            check_layer(i, tensors, fmt)
        raise KvxError(Status.INTERNAL_ERROR, "a layer's values failed the batched check, not check_layer")
