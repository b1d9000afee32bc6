"""The KV-cache calibration file: per layer the key smoothing and centering vectors and the K / V global scales a
quantized cache uses, saved next to the model (`<checkpoint>/kvx_kv_calibration.kvxcal`; `default_file` also finds
the older name `kvx_kv_calibration.kvx`) and loaded by the engine plugins. The file is
safetensors, but not named `*.safetensors`: vLLM and TGI load every `*.safetensors` file of a checkpoint directory
without an index as weights (a vLLM CPU run failed to load SmolLM2 with one beside it).

Contents (safetensors, no pickle): tensors `layer.{i}.k_smoothing` and `layer.{i}.k_center` (FP32 `[H_kv, D]`,
each all layers or none; `ops.smoothing`: the cache stores `(K - c) / s`) and `layer.{i}.{format}.k_global` /
`v_global` (FP32 `[1]` or `[H_kv]`, for each cache format the scales were fitted for, on the sides whose tensor
format has a global scale: fp8_*, nvfp4, k8v4 and their `_rot` variants); metadata `kvx_kv_calibration` (JSON:
version, geometry, the model fingerprint or {}, alpha, the scale rule, the formats and, from version 2, `center`),
`identity` (`tensor_file.content_hash`, so a damaged or edited file is refused) and, optionally, `sample` (JSON: the
calibration sample's size, for `kvx calibrate-kv inspect`; informational, outside the identity so that KVX releases
that predate it still read the file, and checked like everything else when read). Scales are fitted on the values
as the format stores them (keys minus the centering vector, divided by the smoothing vector, rotated for `_rot`),
and smoothing on the centered keys, so a file's vectors and scales belong together: they are written and read
together.

Versions: 2 added key centering. A calibration with centering is written as version 2 (`"center": true`); one
without is written as version 1, byte for byte as before, so KVX releases that predate centering still read it and
refuse a centered file by its version (instead of serving keys stored as K - c as K). Both are read.

Rules: "checkpoint" (the checkpoint's `k_scale` / `v_scale`, amax / 448, mapped by `global_scale_for_amax`),
"amax" and "mse" (`SampleObserver.global_scales` on calibration text). Every check runs when the object is built
(from a file or in code), so a `KvCalibration` that exists is whole and valid, and `for_format` refuses a format
it holds no scales for instead of leaving the format's default scale 1.0 in place.
"""
from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from .cache import PagedKVCache
from .enums import QuantFormat
from .errors import KvxError, Status, require
from .formats import CacheFormat, get_format, list_formats
from .jsonsafe import loads_object
from .tensor_file import content_hash, read_tensor_file, write_tensor_file

VERSION = 2
"""The newest version this KVX reads and writes (version 1, without centering, is read and written too)."""
FILENAME = "kvx_kv_calibration.kvxcal"
LEGACY_FILENAME = "kvx_kv_calibration.kvx"
"""The default name before calibration files got their own extension (bundles are `.kvxb`): still read when a
checkpoint has no `FILENAME`."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""What engines load from a checkpoint directory as weights: a calibration beside the weights must not end so."""
META_KEY = "kvx_kv_calibration"
MAX_FILE_BYTES = 256 << 20
"""A calibration file larger than this is refused before it is read: the vectors of a 126-layer x 8 KV head x
head_dim 128 model (Llama-3.1-405B) take 1 MiB, so 256 MiB leaves room for any model while a forged file cannot make
an engine that loads it at startup allocate more."""
RULES = ("checkpoint", "amax", "mse")
SAMPLE_KEY = "sample"
SAMPLE_FIELDS = {"tokens": int, "windows": int, "window_len": int, "text": str}
"""The `sample` metadata's fields (each optional): integers >= 1, and the text's name (at most `MAX_SAMPLE_TEXT`
characters)."""
MAX_SAMPLE_TEXT = 4096

KEY_VECTORS = {"smoothing": "k_smoothing", "center": "k_center"}
"""The per-layer key vectors a calibration may hold: its attribute -> the tensor name (`layer.{i}.<name>`), which is
also the `PagedKVCache` / `QuantDesc` field it sets."""


class LayerValues(NamedTuple):
    """One layer's values for one format (None where absent): what a cache of that format is served with."""

    k_smoothing: torch.Tensor | None  # FP32 [H, D]
    k_center: torch.Tensor | None  # FP32 [H, D]
    k_global: torch.Tensor | None  # FP32 [1] or [H]
    v_global: torch.Tensor | None

    def apply(self, cache: PagedKVCache, layer: int) -> None:
        """Set them on a `PagedKVCache`'s `layer` (before it holds K/V; a side without a scale keeps 1.0)."""
        cache.set_key_smoothing(layer, self.k_smoothing)
        cache.set_key_center(layer, self.k_center)
        if self.k_global is not None or self.v_global is not None:
            cache.set_global_scales(layer, 1.0 if self.k_global is None else self.k_global,
                                    1.0 if self.v_global is None else self.v_global)


def _short(value: object) -> str:
    """A value from a file, for a one-line message (a forged file's values may be megabytes long)."""
    return reprlib.repr(value)


def _check_vector(t: object, shape: tuple[tuple[int, ...], ...], what: str, positive: bool = True) -> None:
    """FP32, one of `shape`, finite and (`positive`) > 0: smoothing divides keys and a global scale divides values;
    a centering vector is subtracted, any finite value serves."""
    require(isinstance(t, torch.Tensor), Status.INVALID_ARGUMENT, f"{what}: expected a tensor, got {type(t).__name__}")
    require(t.dtype == torch.float32 and tuple(t.shape) in shape, Status.INVALID_ARGUMENT,
            f"{what} must be FP32 of shape {' or '.join(map(str, shape))}, got {t.dtype} {tuple(t.shape)}")
    require(bool(torch.isfinite(t).all()) and (not positive or bool((t > 0).all())), Status.INVALID_ARGUMENT,
            f"{what} must be finite{' and > 0' if positive else ''}")


@dataclass(frozen=True)
class KvCalibration:
    """A model's KV-cache calibration (see the module doc); checked on construction."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    model: dict  # kvx_core.transfer.ModelFingerprint as a dict, or {} when the checkpoint had none
    alpha: float | None  # the smoothing exponent, None: no smoothing
    rule: str | None  # how the scales were fitted (RULES), None: no scales
    smoothing: tuple[torch.Tensor, ...] | None  # per layer FP32 [H, D]
    scales: dict[str, tuple[tuple[torch.Tensor, ...], ...]] = field(default_factory=dict)
    """format name -> per layer (k_global, v_global), each FP32 [1] or [H] (None for a side without a global scale)"""
    center: tuple[torch.Tensor, ...] | None = None  # per layer FP32 [H, D] key centering, None: keys not centered
    sample: dict | None = field(default=None, compare=False)
    """What the vectors and scales were fitted on (`SAMPLE_FIELDS`), None when not recorded; not in the identity."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            require(type(v) is int and v >= 1, Status.INVALID_ARGUMENT,
                    f"calibration {name} must be an int >= 1, got {_short(v)}")
        require(isinstance(self.model, dict), Status.INVALID_ARGUMENT, "calibration model must be a dict")
        require((self.alpha is None) == (self.smoothing is None), Status.INVALID_ARGUMENT,
                "calibration alpha and smoothing vectors come together")
        require(self.alpha is None or (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
                                       and 0.0 < self.alpha <= 1.0),
                Status.INVALID_ARGUMENT, f"calibration alpha must be in (0, 1], got {_short(self.alpha)}")
        require((self.rule is None) == (not self.scales), Status.INVALID_ARGUMENT,
                "calibration rule and global scales come together")
        require(self.rule is None or self.rule in RULES, Status.INVALID_ARGUMENT,
                f"calibration rule must be one of {RULES}, got {_short(self.rule)}")
        require(self.smoothing is not None or self.center is not None or bool(self.scales), Status.INVALID_ARGUMENT,
                "a calibration holds key smoothing, key centering or global scales; this one holds none of them")
        _check_sample(self.sample)
        h, d = self.num_kv_heads, self.head_dim
        for attr, name in KEY_VECTORS.items():
            vectors = getattr(self, attr)
            if vectors is None:
                continue
            require(len(vectors) == self.num_layers, Status.INVALID_ARGUMENT,
                    f"{name} for {len(vectors)} layers, the calibration has {self.num_layers}")
            for i, t in enumerate(vectors):
                _check_vector(t, ((h, d),), f"layer {i} {name}", positive=attr != "center")
        for name, layers in self.scales.items():
            require(name in list_formats(), Status.INVALID_ARGUMENT, f"global scales for unknown format {name!r}")
            fmt = get_format(name)
            require(fmt.uses_global_scale, Status.INVALID_ARGUMENT,
                    f"{name} has no global scale; the calibration holds scales for it")
            require(len(layers) == self.num_layers, Status.INVALID_ARGUMENT,
                    f"{name}: global scales for {len(layers)} layers, the calibration has {self.num_layers}")
            for i, pair in enumerate(layers):
                for side, tf, g in zip("kv", (fmt.k, fmt.v), pair, strict=True):
                    what = f"layer {i} {name}.{side}_global"
                    if tf.uses_global_scale:
                        _check_vector(g, ((1,), (h,)), what)
                    else:
                        require(g is None, Status.INVALID_ARGUMENT, f"{what}: {tf.name} has no global scale")

    # ------------------------------------------------------------ use
    def check_geometry(self, num_layers: int, num_kv_heads: int, head_dim: int, source: str) -> None:
        """INCOMPATIBLE unless the served model (`source`, for the message) has this calibration's geometry."""
        require((self.num_layers, self.num_kv_heads, self.head_dim) == (num_layers, num_kv_heads, head_dim),
                Status.INCOMPATIBLE, f"{source} is calibrated for {self.num_layers} layers x {self.num_kv_heads} KV "
                f"heads x head_dim {self.head_dim}, the model has {num_layers} x {num_kv_heads} x {head_dim}")

    def check_model(self, fingerprint: dict | None, source: str) -> None:
        """INCOMPATIBLE when the file names a model and the served one (`fingerprint`, None when it cannot be
        computed) is not it: a file made for another checkpoint or tokenizer is never applied."""
        if not self.model:
            return
        require(fingerprint is not None, Status.INCOMPATIBLE,
                f"{source} names the model it was calibrated on, and the served model's fingerprint (its "
                "config.json and tokenizer.json) cannot be computed to compare")
        require(fingerprint == self.model, Status.INCOMPATIBLE,
                f"{source} was calibrated on another model than the one served (fingerprints differ)")

    def for_format(self, fmt: CacheFormat, heads: tuple[int, int] | None = None) -> list[LayerValues]:
        """Per layer `LayerValues` to serve `fmt` with, for KV heads `heads` = (start, stop) only when given (a
        tensor-parallel rank's: the rows of every per-head vector; a `[1]` global scale serves every head as it is).
        Refused: a head range outside the calibration's (OUT_OF_RANGE), smoothing or centering for an unquantized
        format, and a format with a global scale the file holds no scales for (its default 1.0, or a checkpoint's
        scale of untransformed keys, would not be this calibration)."""
        start, stop = (0, self.num_kv_heads) if heads is None else heads
        require(type(start) is int and type(stop) is int and 0 <= start < stop <= self.num_kv_heads,
                Status.OUT_OF_RANGE, f"KV heads {_short(heads)} (start, stop) of a calibration for "
                f"{self.num_kv_heads} KV heads")
        held = [name for attr, name in KEY_VECTORS.items() if getattr(self, attr) is not None]
        require(not held or fmt.quant != QuantFormat.NONE, Status.INVALID_ARGUMENT,
                f"{fmt.name} is not quantized: the calibration's {' and '.join(held)} have nothing to flatten")
        uses = fmt.uses_global_scale
        require(not uses or fmt.name in self.scales, Status.INCOMPATIBLE,
                f"the calibration holds global scales for {', '.join(sorted(self.scales)) or 'no format'}, not for "
                f"{fmt.name}; recalibrate with that format (kvx calibrate-kv --formats {fmt.name})")
        pairs = self.scales[fmt.name] if uses else [(None, None)] * self.num_layers
        none = (None,) * self.num_layers
        values = [LayerValues(s, c, k, v)
                  for s, c, (k, v) in zip(self.smoothing or none, self.center or none, pairs, strict=True)]
        if heads is None:
            return values
        return [LayerValues(*(None if t is None else t if t.shape == (1,) else t[start:stop].contiguous() for t in lv))
                for lv in values]

    def apply(self, cache: PagedKVCache) -> None:
        """Set every layer's key smoothing, key centering and global scales of a `PagedKVCache` (before it holds
        K/V). Everything is checked first (geometry, format, per-head scales need a per-head cache), so a refusal
        changes nothing."""
        self.check_geometry(cache.num_layers, cache.num_kv_heads, cache.head_dim, "the calibration")
        values = self.for_format(cache.format)
        width = cache.layers[0].k_global.numel() if cache.layers[0].k_global is not None else None
        require(all(g is None or g.numel() in (1, width) for lv in values for g in (lv.k_global, lv.v_global)),
                Status.INVALID_ARGUMENT, f"the calibration holds per-KV-head global scales; the cache keeps {width} "
                "per layer (create it with per_head_global_scale=True)")
        for layer, lv in enumerate(values):
            lv.apply(cache, layer)

    # ------------------------------------------------------------ file
    def params(self) -> dict:
        """The metadata JSON: version 1 without centering (as KVX wrote before centering), 2 with it."""
        p = {"version": 1, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
             "head_dim": self.head_dim, "model": self.model, "alpha": self.alpha, "rule": self.rule,
             "formats": sorted(self.scales)}
        if self.center is not None:
            p.update(version=VERSION, center=True)
        return p

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for attr, name in KEY_VECTORS.items():
            for i, t in enumerate(getattr(self, attr) or ()):
                out[f"layer.{i}.{name}"] = t
        for name, layers in self.scales.items():
            for i, pair in enumerate(layers):
                for side, g in zip("kv", pair, strict=True):
                    if g is not None:
                        out[f"layer.{i}.{name}.{side}_global"] = g
        return out

    @property
    def identity(self) -> str:
        return content_hash(self.params(), self.tensors())

    def save(self, path: str, *, overwrite: bool = False) -> str:
        """Write the file atomically (an existing one only with `overwrite`); returns the identity."""
        ident = self.identity
        meta = {META_KEY: json.dumps(self.params()), "identity": ident}
        if self.sample is not None:
            meta[SAMPLE_KEY] = json.dumps(self.sample, sort_keys=True)
        write_tensor_file(path, self.tensors(), meta, overwrite=overwrite)
        return ident


def _check_sample(sample: object) -> None:
    """None, or a dict of `SAMPLE_FIELDS` with values of their type: integers >= 1 (not bool), a short text name."""
    if sample is None:
        return
    require(isinstance(sample, dict), Status.INVALID_ARGUMENT,
            f"calibration sample must be a dict, got {_short(sample)}")
    for key, value in sample.items():
        kind = SAMPLE_FIELDS.get(key)
        require(kind is not None, Status.INVALID_ARGUMENT,
                f"calibration sample field {_short(key)}: expected one of {', '.join(SAMPLE_FIELDS)}")
        ok = (type(value) is int and value >= 1) if kind is int else (type(value) is str
                                                                       and len(value) <= MAX_SAMPLE_TEXT)
        require(ok, Status.INVALID_ARGUMENT, f"calibration sample {key} {_short(value)}: expected "
                f"{'an integer >= 1' if kind is int else f'a string of at most {MAX_SAMPLE_TEXT} characters'}")


def default_file(folder: str) -> str | None:
    """The calibration file of a checkpoint directory: `FILENAME`, else `LEGACY_FILENAME`, else None (also when
    `folder` is no directory)."""
    for name in (FILENAME, LEGACY_FILENAME):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def load_kv_calibration(path: str) -> KvCalibration:
    """Read and check a calibration file: KvxError INVALID_ARGUMENT for a foreign, damaged, edited or malformed
    file, INCOMPATIBLE for another version. The file is untrusted (anyone can recompute its identity hash): its size
    is capped (`MAX_FILE_BYTES`) before it is read, `num_layers` is checked against the tensors present before any
    per-layer list is built, and every value's type, shape and range before it is used."""
    meta, tensors = read_tensor_file(path, max_bytes=MAX_FILE_BYTES)
    require(META_KEY in meta, Status.INVALID_ARGUMENT,
            f"{path}: not a KVX KV-cache calibration (no {META_KEY} metadata)")
    try:
        p = loads_object(meta[META_KEY], f"the {META_KEY} metadata")
        version = p.get("version")
        require(type(version) is int, Status.INVALID_ARGUMENT, f"version {_short(version)}: expected an integer")
        require(version in (1, VERSION), Status.INCOMPATIBLE,
                f"calibration version {_short(version)}, this KVX reads versions 1 to {VERSION}")
        n = p["num_layers"]
        require(type(n) is int and n >= 1, Status.INVALID_ARGUMENT, f"num_layers {_short(n)}: expected an integer >= 1")
        require(n <= len(tensors), Status.INVALID_ARGUMENT,
                f"num_layers {n}: the file holds {len(tensors)} tensors, and every layer has at least one")
        formats = p["formats"]
        require(isinstance(formats, list) and all(isinstance(f, str) for f in formats)
                and len(set(formats)) == len(formats), Status.INVALID_ARGUMENT,
                f"formats {_short(formats)}: expected a list of distinct format names")
        centered = False if version == 1 else p["center"]  # version 1 predates centering
        require(isinstance(centered, bool), Status.INVALID_ARGUMENT,
                f"center {_short(centered)}: expected true or false")
        held = {"smoothing": p["alpha"] is not None, "center": centered}
        vector_names = {attr: [f"layer.{i}.{name}" for i in range(n)] for attr, name in KEY_VECTORS.items()
                        if held[attr]}
        expected = {x for layer_names in vector_names.values() for x in layer_names}
        scales = {}
        for fmt in scale_formats(formats):
            name = fmt.name
            names = [[f"layer.{i}.{name}.{s}_global" if tf.uses_global_scale else None
                      for s, tf in zip("kv", (fmt.k, fmt.v), strict=True)] for i in range(n)]
            expected |= {x for pair in names for x in pair if x}
            scales[name] = tuple(tuple(tensors.get(x) if x else None for x in pair) for pair in names)
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        require(not missing and not extra, Status.INVALID_ARGUMENT,
                f"tensors do not match the metadata (missing {missing[:3]}, unexpected {extra[:3]})")
        vectors = {attr: tuple(tensors[x] for x in vector_names[attr]) if attr in vector_names else None
                   for attr in KEY_VECTORS}
        sample = loads_object(meta[SAMPLE_KEY], f"the {SAMPLE_KEY} metadata") if SAMPLE_KEY in meta else None
        cal = KvCalibration(n, p["num_kv_heads"], p["head_dim"], p["model"], p["alpha"], p["rule"],
                            vectors["smoothing"], scales, vectors["center"], sample)
    except KvxError as e:
        raise KvxError(e.status, f"{path}: {e.message}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{path}: malformed calibration metadata ({type(e).__name__}: {e})") from None
    require(cal.identity == meta.get("identity"), Status.INVALID_ARGUMENT,
            f"{path}: the identity hash does not match the contents (damaged or edited)")
    return cal


def fingerprint_dict(fingerprint) -> dict:
    """A `ModelFingerprint` as the dict a calibration records ({} for None)."""
    return {} if fingerprint is None else asdict(fingerprint)


def global_formats() -> list[str]:
    """The cache formats with a global scale (what a calibration can hold scales for)."""
    return [n for n in list_formats() if get_format(n).uses_global_scale]


def scale_formats(formats: list[str]) -> list[CacheFormat]:
    """The named formats, each of which must have a global scale (INVALID_ARGUMENT otherwise)."""
    fmts = [get_format(n) for n in formats]
    plain = [f.name for f in fmts if not f.uses_global_scale]
    require(not plain, Status.INVALID_ARGUMENT,
            f"{', '.join(plain)} take no global scale; formats with one: {', '.join(global_formats())}")
    return fmts


def from_checkpoint_amax(amax: torch.Tensor, formats: list[str], *, num_kv_heads: int, head_dim: int,
                         model: dict) -> KvCalibration:
    """Scales (rule "checkpoint") from a checkpoint's per-layer amax `[L, 2, 1|H]` (`amax_from_checkpoint`). No
    smoothing or centering: the checkpoint's scales describe the keys as the model makes them. `_rot` formats are
    refused: the scales describe unrotated values."""
    from .calibration import global_scale_for_amax

    fmts = scale_formats(formats)
    rotated = [f.name for f in fmts if f.rotate]
    require(not rotated, Status.INVALID_ARGUMENT,
            f"checkpoint k_scale / v_scale describe unrotated K/V, not {', '.join(rotated)}; calibrate those on text")
    scales = {f.name: tuple((global_scale_for_amax(f.k, a[0]), global_scale_for_amax(f.v, a[1])) for a in amax)
              for f in fmts}
    return KvCalibration(int(amax.shape[0]), num_kv_heads, head_dim, model, None, "checkpoint", None, scales)


def from_samples(obs, formats: list[str], *, rule: str | None, alpha: float | None, model: dict,
                 center: bool = False, sample: dict | None = None,
                 progress: Callable[[str], None] | None = None) -> KvCalibration:
    """From calibration K/V (`calibration.SampleObserver`): centering vectors (`key_center`, when `center`),
    smoothing vectors (`key_smoothing` of the centered keys, when `alpha`; `calibration.key_transform`) and, when
    `rule` ("amax" / "mse"), each format's scales fitted on the values as it stores them (`stored_values`).
    `progress(what)` is called after each format's layer (a long fit reports where it is)."""
    from .calibration import key_transform, stored_values

    fmts = scale_formats(formats) if rule is not None else []
    require(rule is None or rule in RULES[1:], Status.INVALID_ARGUMENT,
            f"text calibration rule must be amax or mse, got {rule!r}")
    k0 = obs.values(0)[0]
    smooth, centers = key_transform(obs, alpha, center)
    scales = {}
    for f in fmts:
        step = None if progress is None else (lambda layer, name=f.name: progress(f"{name} layer {layer}"))
        scales[f.name] = tuple(stored_values(obs, smooth, f.rotate, centers).global_scales(f, rule, step))
    return KvCalibration(obs.num_layers, int(k0.shape[1]), int(k0.shape[2]), model, alpha, rule,
                         None if smooth is None else tuple(smooth), scales, None if centers is None else tuple(centers),
                         sample)
