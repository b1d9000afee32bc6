"""KVTC calibration: per layer group, for K and for V, a mean, a PCA basis and a bit allocation over component ranges.

A token's feature vector for a group is its K (or V) across the group's layers and KV heads, `[layers_per_group *
num_kv_heads * head_dim]`. Calibration fits, on K/V collected from the model over calibration text (attention-sink
tokens left out: they are stored raw and their outliers would tilt the basis), the mean and the PCA basis (float64
eigendecomposition of the covariance, components by decreasing variance), then allocates bits to ranges of
`range_size` consecutive components by dynamic programming: each range gets one of `KINDS` (dropped, 2/4/8-bit
integers with a per-component fp16 min and step, or FP8 E4M3 with a per-component scale), minimising the reconstruction
error measured on the calibration data itself (the basis is orthonormal, so component-space error is feature-space
error) under a byte budget per token (`bytes_per_token = features * 2 / ratio`, the same ratio for K and V of every
group). Saved as a safetensors file whose metadata holds the JSON parameters and an identity hash over everything.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import Status, int_value, require
from ..jsonsafe import finite_number, loads_object
from ..tensor_file import TensorSpecs, content_hash, read_tensor_file, write_tensor_file
from .quant import KINDS, RangeKind, dequantize_range, fp8_scales, quantize_range, range_bytes
from .rope import rotate

VERSION = 1
SIDES = ("k", "v")
TENSORS = ("mean", "basis", "variance", "fp8_scale")
KIND_NAMES = tuple(str(k) for k in KINDS)
MAX_CALIBRATION_BYTES = 1 << 34
"""The largest calibration file read, 16 GiB (a 405B-class model, 126 layers x 8 KV heads x 128, in groups of 6
layers is ~6 GiB): a larger one is refused before it is opened."""
MAX_POSITION = 1 << 53
"""Token positions (a buffer's `token_start + token_count`, a calibration's sink / recent counts) stay below 2^53:
RoPE angles are computed from float64 positions, exact up to there."""
UINT32_MAX = 2**32 - 1  # a buffer header's geometry fields are u32
BASIS_TOLERANCE = 1e-3
"""How far a basis column's squared length may be from 1 (float32 columns of an eigendecomposition are within 1e-5)."""


@dataclass(frozen=True)
class SideCalibration:
    """One group's K or V: mean `[F]`, basis `[F, C]` (orthonormal columns, decreasing variance), variances `[C]`,
    FP8 scales `[C]` and the component ranges `(start, stop, kind)` that are kept (ranges past the last are dropped)."""

    mean: torch.Tensor
    basis: torch.Tensor
    variance: torch.Tensor
    fp8_scale: torch.Tensor
    ranges: tuple[tuple[int, int, str], ...]

    @property
    def kept(self) -> int:
        """Components the codec projects onto (the end of the last kept range)."""
        return max((b for _, b, _ in self.ranges), default=0)

    def bytes_per_token(self) -> int:
        return sum(range_bytes(RangeKind.parse(kind), b - a) for a, b, kind in self.ranges)


@dataclass(frozen=True)
class Calibration:
    """The whole model's KVTC parameters (see the module doc)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layers_per_group: int
    sink_tokens: int
    recent_tokens: int
    ratio: float
    range_size: int
    model: dict  # the model fingerprint (kvx_core.transfer.ModelFingerprint as a dict) or {}
    rope_theta: float | None  # keys are coded with this RoPE removed (`rope.py`); None: as stored
    groups: tuple[dict[str, SideCalibration], ...]  # per group: {"k": ..., "v": ...}

    @property
    def features(self) -> int:
        return self.layers_per_group * self.num_kv_heads * self.head_dim

    def params(self) -> dict:
        """The JSON parameters (everything but the tensors)."""
        return {"version": VERSION, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "layers_per_group": self.layers_per_group,
                "sink_tokens": self.sink_tokens, "recent_tokens": self.recent_tokens, "ratio": self.ratio,
                "range_size": self.range_size, "model": self.model, "rope_theta": self.rope_theta,
                "ranges": [{s: [list(r) for r in g[s].ranges] for s in SIDES} for g in self.groups]}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, g in enumerate(self.groups):
            for s in SIDES:
                c = g[s]
                for name in TENSORS:
                    out[f"g{i}.{s}.{name}"] = getattr(c, name).contiguous()
        return out

    @cached_property
    def identity(self) -> str:
        """sha256 over the parameters and every tensor's bytes: what a compressed buffer names its calibration by.
        Computed once (a calibration is immutable): every compress, decompress and KVTC store lookup compares it."""
        return content_hash(self.params(), self.tensors())

    def save(self, path: str) -> str:
        """Write the safetensors file (no pickle); returns the identity. Refuses to overwrite an existing file."""
        ident = self.identity
        write_tensor_file(path, self.tensors(), {"kvx_kvtc": json.dumps(self.params()), "identity": ident})
        return ident


def load_calibration(path: str) -> Calibration:
    """Read a calibration file (KvxError INVALID_ARGUMENT / INCOMPATIBLE for foreign, damaged or newer files).

    Its identity hash is no proof (anyone can recompute it), so everything is checked: the file size against
    `MAX_CALIBRATION_BYTES` and every declared tensor shape against the parameters' geometry before any tensor is
    read (`_check_params`, `_tensor_specs`), then the hash, then the tensors' meaning (`_check_tensors`)."""
    meta, tensors = read_tensor_file(path, max_bytes=MAX_CALIBRATION_BYTES,
                                     expect=lambda m: _tensor_specs(_check_params(m, path)))
    p = _check_params(meta, path)
    groups = tuple({s: SideCalibration(*(tensors[f"g{i}.{s}.{n}"] for n in TENSORS),
                                       ranges=tuple(tuple(r) for r in rg[s])) for s in SIDES}
                   for i, rg in enumerate(p["ranges"]))
    cal = Calibration(p["num_layers"], p["num_kv_heads"], p["head_dim"], p["layers_per_group"], p["sink_tokens"],
                      p["recent_tokens"], p["ratio"], p["range_size"], p["model"], p["rope_theta"], groups)
    require(cal.identity == meta.get("identity"), Status.INVALID_ARGUMENT,
            f"{path}: the identity hash does not match the contents (damaged or edited)")
    _check_tensors(cal, path)
    return cal


def _int(p: dict, key: str, lo: int, hi: int, path: str) -> int:
    """`p[key]` when it is an integer (not a bool or a float) in [lo, hi]; KvxError otherwise."""
    v = int_value(p.get(key))
    require(v is not None and lo <= v <= hi, Status.INVALID_ARGUMENT,
            f"{path}: {key} must be an integer in [{lo}, {hi}], got {p.get(key)!r}")
    return v


def _check_params(meta: dict[str, str], path: str) -> dict:
    """The calibration parameters of a file's metadata, each checked for type and range, and the ranges of each
    group side for their structure: what `calibrate` writes (KvxError otherwise)."""
    require("kvx_kvtc" in meta, Status.INVALID_ARGUMENT, f"{path}: not a KVX KVTC calibration (no kvx_kvtc metadata)")
    p = loads_object(meta["kvx_kvtc"], f"{path}: the kvx_kvtc metadata")
    version = int_value(p.get("version"))
    require(version == VERSION, Status.INCOMPATIBLE,
            f"{path}: calibration version {p.get('version')!r}, this KVX reads version {VERSION}")
    keys = set(Calibration.__dataclass_fields__) - {"groups"} | {"version", "ranges"}
    require(set(p) == keys, Status.INVALID_ARGUMENT,
            f"{path}: calibration parameters {sorted(p)}, expected {sorted(keys)}")
    out = _check_settings(p, {k: _int(p, k, 1, UINT32_MAX, path) for k in ("num_layers", "num_kv_heads", "head_dim")},
                          path)
    lpg, rs = out["layers_per_group"], out["range_size"]
    features = lpg * out["num_kv_heads"] * out["head_dim"]
    ranges = p["ranges"]
    require(isinstance(ranges, list) and len(ranges) == out["num_layers"] // lpg, Status.INVALID_ARGUMENT,
            f"{path}: calibration ranges must list one entry per group of layers ({out['num_layers'] // lpg})")
    out["ranges"] = [{s: _check_ranges(g.get(s) if isinstance(g, dict) else None, features, rs,
                                       f"{path}: group {i} {s}") for s in SIDES} for i, g in enumerate(ranges)]
    return out


def _check_settings(p: dict, geometry: dict[str, int], what: str) -> dict:
    """`geometry` (num_layers, num_kv_heads, head_dim) with the settings in `p` checked against it (KvxError
    otherwise): layers_per_group dividing the layers, sink and recent token counts in [0, MAX_POSITION], range_size
    a multiple of 4, a finite ratio >= 1, rope_theta null or finite > 0 (with an even head_dim), the model {} or its
    fingerprint. `calibrate` checks its arguments and `load_calibration` a file's parameters with it."""
    out = dict(geometry)
    out["layers_per_group"] = lpg = _int(p, "layers_per_group", 1, geometry["num_layers"], what)
    require(geometry["num_layers"] % lpg == 0, Status.INVALID_ARGUMENT,
            f"{what}: layers_per_group {lpg} does not divide the {geometry['num_layers']} layers")
    out["sink_tokens"] = _int(p, "sink_tokens", 0, MAX_POSITION, what)
    out["recent_tokens"] = _int(p, "recent_tokens", 0, MAX_POSITION, what)
    out["range_size"] = rs = _int(p, "range_size", 4, UINT32_MAX, what)
    require(rs % 4 == 0, Status.INVALID_ARGUMENT, f"{what}: range_size {rs} is not a multiple of 4")
    out["ratio"] = finite_number(p["ratio"])
    require(out["ratio"] is not None and out["ratio"] >= 1, Status.INVALID_ARGUMENT,
            f"{what}: ratio must be a finite number >= 1, got {p['ratio']!r}")
    theta = p["rope_theta"]
    out["rope_theta"] = None if theta is None else finite_number(theta)
    even = geometry["head_dim"] % 2 == 0
    require(theta is None or (out["rope_theta"] is not None and out["rope_theta"] > 0 and even),
            Status.INVALID_ARGUMENT, f"{what}: rope_theta must be null or a finite number > 0 (with an even "
            f"head_dim), got {theta!r}")
    out["model"] = _check_model(p["model"], geometry, what)
    return out


def _check_ranges(ranges: object, features: int, range_size: int, what: str) -> list[tuple[int, int, str]]:
    """A group side's kept ranges `[start, stop, kind]`: increasing, each one of `calibrate`'s ranges of
    `range_size` components (`start` a multiple of it, `stop` the next one or the end), a kind that stores bytes."""
    require(isinstance(ranges, list), Status.INVALID_ARGUMENT, f"{what}: ranges must be a list")
    out, prev = [], -1
    for r in ranges:
        ok = isinstance(r, list) and len(r) == 3 and isinstance(r[2], str)
        a, b = (int_value(r[0]), int_value(r[1])) if ok else (None, None)
        ok = ok and a is not None and b is not None and prev < a < features and a % range_size == 0 \
            and b == min(a + range_size, features) and r[2] in KIND_NAMES and r[2] != "drop"
        require(ok, Status.INVALID_ARGUMENT, f"{what}: range {r!r} is not a kept range of {range_size} of the "
                f"{features} components (start, stop, one of {', '.join(KIND_NAMES[1:])}) after the previous one")
        out.append((a, b, r[2]))
        prev = a
    return out


def _check_model(model: object, geometry: dict[str, int], path: str) -> dict:
    """The model fingerprint a calibration names: {} or a `ModelFingerprint` as a dict, of the calibration's
    geometry."""
    fields = {"architecture": str, "num_layers": int, "num_kv_heads": int, "head_dim": int, "rope": dict,
              "config_sha256": str, "tokenizer_sha256": str}
    require(isinstance(model, dict) and (not model or set(model) == set(fields)), Status.INVALID_ARGUMENT,
            f"{path}: model must be {{}} or a model fingerprint with {sorted(fields)}")
    for k, t in fields.items() if model else ():
        require(type(model[k]) is t, Status.INVALID_ARGUMENT, f"{path}: model {k} must be a {t.__name__}")
    for k in geometry if model else ():
        require(model[k] == geometry[k], Status.INVALID_ARGUMENT,
                f"{path}: model {k} {model[k]} disagrees with the calibration's {geometry[k]}")
    return dict(model)


def _tensor_specs(p: dict) -> TensorSpecs:
    """The tensors a calibration of parameters `p` holds: per group and side, mean `[F]`, basis `[F, F]`,
    variance and FP8 scales `[F]`, float32 (`F`: the group's features)."""
    f = p["layers_per_group"] * p["num_kv_heads"] * p["head_dim"]
    shapes = {"mean": (f,), "basis": (f, f), "variance": (f,), "fp8_scale": (f,)}
    return {f"g{i}.{s}.{n}": ("F32", shapes[n]) for i in range(len(p["ranges"])) for s in SIDES for n in TENSORS}


def _check_tensors(cal: Calibration, path: str) -> None:
    """The meaning of each group side's tensors: all finite, variances >= 0, FP8 scales > 0, and the basis columns
    of unit length (an orthonormal basis, within `BASIS_TOLERANCE`), so no forged tensor turns finite K/V into NaN
    or inf."""
    for i, g in enumerate(cal.groups):
        for s in SIDES:
            problem = _side_problem(g[s])
            require(problem is None, Status.INVALID_ARGUMENT, f"{path}: group {i} {s} holds {problem}")


def _side_problem(c: SideCalibration) -> str | None:
    """What is wrong with one group side's tensors (the first failing check), or None."""
    if not all(bool(torch.isfinite(t).all()) for t in (c.mean, c.basis, c.variance, c.fp8_scale)):
        return "non-finite values"
    if not bool((c.variance >= 0).all()):
        return "negative variances"
    if not bool((c.fp8_scale > 0).all()):
        return "FP8 scales <= 0"
    if not bool((((c.basis.double() ** 2).sum(0) - 1).abs() <= BASIS_TOLERANCE).all()):
        return "basis columns not of unit length"
    return None


def group_features(kv: Sequence[torch.Tensor], group: int, layers_per_group: int) -> torch.Tensor:
    """`[tokens, F]` features of one group from per-layer `[tokens, H, D]` tensors (layer-major, then head, dim)."""
    layers = kv[group * layers_per_group:(group + 1) * layers_per_group]
    return torch.cat([x.reshape(x.shape[0], -1) for x in layers], dim=1)


def _range_table(y: torch.Tensor, scale: torch.Tensor,
                 range_size: int) -> list[tuple[int, int, list[int], list[float]]]:
    """Per range of `range_size` components of the calibration projections `y [M, C]`: (start, stop, bytes per token
    of each kind, the kind's measured squared error over the calibration rows)."""
    c = y.shape[1]
    table = []
    for a in range(0, c, range_size):
        b = min(a + range_size, c)
        seg = y[:, a:b]
        costs, errs = [], []
        for kind in KINDS:
            costs.append(range_bytes(kind, b - a))
            if kind.bits == 0:
                errs.append(float((seg.double() ** 2).sum()))
            else:
                meta, packed = quantize_range(seg, kind, scale[a:b])
                rec = dequantize_range(meta, packed, kind, b - a, scale[a:b])
                errs.append(float(((rec - seg).double() ** 2).sum()))
        table.append((a, b, costs, errs))
    return table


def _allocate(projections: Sequence[tuple[torch.Tensor, torch.Tensor]], range_size: int,
              budget: int) -> list[tuple[tuple[int, int, str], ...]]:
    """Kinds for the ranges of every `(y, scale)` projection (K and V of a group) minimising their summed measured
    squared error within one `budget` of bytes per token (dynamic programming over ranges x bytes)."""
    tables = [_range_table(y, scale, range_size) for y, scale in projections]
    flat = [row for t in tables for row in t]
    inf = math.inf
    best = [0.0] + [inf] * budget  # best[spent] after the ranges so far
    choice: list[list[int]] = []
    for _, _, rc, re_ in flat:
        nxt = [inf] * (budget + 1)
        pick = [-1] * (budget + 1)
        for spent, e in enumerate(best):
            if e == inf:
                continue
            for ki, (cost, err) in enumerate(zip(rc, re_, strict=True)):
                s2 = spent + cost
                if s2 <= budget and e + err < nxt[s2]:
                    nxt[s2], pick[s2] = e + err, ki * (budget + 1) + spent
        best = nxt
        choice.append(pick)
    spent = min(range(budget + 1), key=lambda s: best[s])
    kinds = []
    for pick in reversed(choice):
        ki, spent = divmod(pick[spent], budget + 1)
        kinds.append(ki)
    kinds.reverse()
    out, at = [], 0
    for t in tables:
        ks = kinds[at:at + len(t)]
        at += len(t)
        out.append(tuple((a, b, str(KINDS[k])) for (a, b, _, _), k in zip(t, ks, strict=True) if KINDS[k].bits > 0))
    return out


def calibrate(windows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], *, layers_per_group: int = 1,
              ratio: float = 16.0, range_size: int = 16, sink_tokens: int = 4, recent_tokens: int = 64,
              model: dict | None = None, rope_theta: float | None = None, joint: bool = False,
              progress: Callable[[int], None] | None = None) -> Calibration:
    """Fit the calibration from `windows[w][layer] = (K, V)`, each `[tokens, H, D]` (one forward of the model over a
    window of calibration text, token i at position i; the first `sink_tokens` of each window are left out of the
    fit). `rope_theta`: remove the model's (default, full-width) RoPE from keys before coding them. `joint`: K and V
    of a group share one byte budget (twice the per-side one) instead of one budget each. `progress(group)` after
    each layer group (a group's fit takes seconds to minutes on a CPU)."""
    require(len(windows) > 0 and len(windows[0]) > 0, Status.INVALID_ARGUMENT, "calibrate: no K/V given")
    num_layers = len(windows[0])
    require(windows[0][0][0].dim() == 3, Status.INVALID_ARGUMENT, "calibrate: K/V must be [tokens, H, D]")
    _, h, d = windows[0][0][0].shape
    settings = _check_settings({"layers_per_group": layers_per_group, "ratio": ratio, "range_size": range_size,
                                "sink_tokens": sink_tokens, "recent_tokens": recent_tokens, "model": model or {},
                                "rope_theta": rope_theta},
                               {"num_layers": num_layers, "num_kv_heads": h, "head_dim": d}, "calibrate")
    for w in windows:
        n = w[0][0].shape[0]
        require(len(w) == num_layers and all(tuple(x.shape) == (n, h, d) for pair in w for x in pair),
                Status.INVALID_ARGUMENT, f"calibrate: every window must hold {num_layers} layers of K/V [T, {h}, {d}]")
        require(n > sink_tokens, Status.INVALID_ARGUMENT,
                f"calibrate: a window of {n} tokens has none after the {sink_tokens} sink tokens")

    def prepared(x: torch.Tensor, side: int) -> torch.Tensor:
        pos = torch.arange(sink_tokens, x.shape[0])
        x = x[sink_tokens:].float()
        return rotate(x, pos, rope_theta, inverse=True) if side == 0 and rope_theta else x

    per_side = [[torch.cat([prepared(w[layer][i], i) for w in windows]) for layer in range(num_layers)]
                for i in range(2)]
    groups = []
    for g in range(num_layers // layers_per_group):
        fits = {}
        for s, kv in zip(SIDES, per_side, strict=True):
            x = group_features(kv, g, layers_per_group).double()
            require(x.shape[0] >= 2, Status.INVALID_ARGUMENT, "calibrate: fewer than 2 tokens after the sinks")
            mean = x.mean(0)
            cov = (x - mean).T @ (x - mean) / (x.shape[0] - 1)
            var, vec = torch.linalg.eigh(cov)
            order = torch.argsort(var, descending=True)
            var, basis = var[order].clamp_min(0), vec[:, order]
            y = ((x - mean) @ basis).float()
            fits[s] = (mean, basis, var, y, fp8_scales(y))
        features = fits["k"][0].numel()
        if joint:  # K and V of the group share one budget
            ranges = _allocate([(fits[s][3], fits[s][4]) for s in SIDES], range_size, int(2 * features * 2 / ratio))
        else:
            ranges = [_allocate([(fits[s][3], fits[s][4])], range_size, int(features * 2 / ratio))[0] for s in SIDES]
        groups.append({s: SideCalibration(fits[s][0].float(), fits[s][1].float(), fits[s][2].float(), fits[s][4], r)
                       for s, r in zip(SIDES, ranges, strict=True)})
        if progress is not None:
            progress(g)
    return Calibration(num_layers, h, d, layers_per_group, sink_tokens, recent_tokens, settings["ratio"], range_size,
                       settings["model"], settings["rope_theta"], tuple(groups))
