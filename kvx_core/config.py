"""Every KVX setting in one table: its type, default, environment variable, engine keys and deprecated spellings.

One spelling per setting: the environment variable `KVX_<NAME>` (in every engine that reads the setting), and in
vLLM, whose configuration is a JSON document, also `--additional-config '{"kvx": {"<name>": ...}}'`. An
engine key, where given, wins over the environment. Older spellings are still read, with a DeprecationWarning naming
the new one; an old and a new spelling given with different values is refused rather than one silently winning.

Values from the environment or an engine's JSON are outside input: each is parsed by its type (no `int()`
truncation, booleans only from `BOOL_WORDS`) and a bad one is a KvxError(INVALID_ARGUMENT) naming the variable or
key. An empty environment variable counts as unset. Settings are read when an engine binds, plans or constructs,
never per step; the kernel backends (`once`) are read once per process.

`kvx config` prints each setting's effective value and where it came from; docs/guide/configuration.md is
`render_markdown()` of this table (a test checks the committed file matches).
"""
from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

from .errors import KvxError, Status

BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
"""The words a boolean environment variable may hold (case-insensitive); anything else is refused."""
BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
"""Binary units of a byte count (`512MiB`, `2g`), case-insensitive."""
MAX_BYTES = 1 << 60
"""A byte count above this (an exabyte) is refused: no cache is that large, and a typo should not pass as a cap."""
VLLM_KEY = "additional_config.kvx."
"""Where vLLM takes a setting: `--additional-config '{"kvx": {"<name>": ...}}'`."""
VLLM_EXTRA = "kv_connector_extra_config."
"""vLLM's `--kv-transfer-config` connector section, the connector settings' deprecated home."""


@dataclass(frozen=True)
class Setting:
    """One setting: `kind` is its type (path, bool, choice, bytes, count or format), `engines` who reads it."""

    name: str
    kind: str
    default: Any
    engines: tuple[str, ...]
    doc: str
    choices: tuple[str, ...] = ()
    vllm: bool = False  # vLLM takes it as additional_config.kvx.<name>
    deprecated: tuple[str, ...] = ()  # older engine keys

    @property
    def env(self) -> str:
        return "KVX_" + self.name.upper()

    @property
    def keys(self) -> tuple[str, ...]:
        """The engine keys of the current spelling."""
        return (VLLM_KEY + self.name,) if self.vllm else ()


_BACKENDS = ("auto", "cuda", "triton")
SETTINGS: tuple[Setting, ...] = (
    Setting("format", "format", None, ("tgi",),
            "The KV-cache format TGI serves (any KVX format but fp32; `_rot` for the Hadamard-rotated variant). vLLM "
            "takes it as `--kv-cache-dtype kvx_<format>` with `rotate`."),
    Setting("rotate", "bool", False, ("vllm",),
            "Hadamard rotation of K/V (and Q) for kvx_nvfp4, kvx_mxfp4, kvx_int4 and kvx_k8v4 in vLLM (TGI: the "
            "`_rot` format names).", vllm=True),
    Setting("prefill", "choice", "split", ("vllm",),
            "How vLLM steps with new prompt tokens attend: `split` (new tokens over their own unquantized K/V, merged "
            "with the cached prefix, which requests with many new tokens read dequantized once per layer on CUDA), "
            "`split_fused` (the same, every cached prefix on KVX's fused prefill kernel: no dense prefix buffer) or "
            "`cache` (everything over the quantized pages: bit-identical prefix reuse, slower prefill).",
            choices=("split", "split_fused", "cache"), vllm=True),
    Setting("lm_head", "choice", None, ("vllm",),
            "Quantize vLLM's output projection after loading (`mxfp4`); unset keeps it as loaded.",
            choices=("mxfp4",), vllm=True),
    Setting("kv_calibration", "path", None, ("vllm", "tgi"),
            "The KV-cache calibration file (`kvx calibrate-kv`) to serve with; unset, the engines look for "
            "`kvx_kv_calibration.kvxcal` beside the checkpoint. `kvx_*` cache dtypes only.", vllm=True),
    Setting("kv_cache_memory", "bytes", None, ("tgi",),
            "Caps TGI's KV cache at this many bytes in total (`536870912`, `512MiB`, `2GiB`); unset, TGI's "
            "free-memory rule sizes it."),
    Setting("store", "path", None, ("vllm", "trtllm"),
            "The bundle store directory the KV connectors export to and import from (a path every instance "
            "reaches; `/dev/shm/kvx` for memory speed).", vllm=True,
            deprecated=(VLLM_EXTRA + "kvx_store",)),
    Setting("store_prefix_block", "count", None, ("vllm",),
            "Tokens per block of the store's prefix lookup: a prompt loads the stored entry sharing the longest "
            "prefix with it in whole blocks. Unset: the store's recorded block, 256 for a new store; another value "
            "than a store recorded is refused.", vllm=True),
    Setting("store_max_bytes", "bytes", None, ("vllm",),
            "Caps the store's entry files at this many bytes (`8GiB`); least recently used entries are evicted to "
            "make room. Unset: no cap.", vllm=True),
    Setting("transport", "choice", "store", ("vllm",),
            "How vLLM's KV connector hands prompts' KV over: `store` (the `store` directory: one host, offload) or "
            "`nixl` (the producer publishes each prompt marked `do_remote_decode` in a NIXL buffer and returns a "
            "ticket in its `kv_transfer_params`; the consumer READs it: across hosts). `nixl` takes no `store`.",
            choices=("store", "nixl"), vllm=True),
    Setting("nixl_buffer", "bytes", 1 << 30, ("vllm",),
            "The NIXL transport's registered buffer per worker (a producer's is cut into `nixl_slots` slots, "
            "each holding one prompt's bundle; a consumer reads one bundle at a time into its own).", vllm=True),
    Setting("nixl_slots", "count", 8, ("vllm",),
            "Prompts a NIXL producer keeps published at once; a prompt finding every slot held is not published "
            "(its consumer computes it).", vllm=True),
    Setting("nixl_hold_s", "count", 60, ("vllm",),
            "Seconds a NIXL producer keeps a published prompt for its consumer; the consumer's READ releases it "
            "sooner. A ticket read after its slot was reused is refused by the bundle checks.", vllm=True),
    Setting("nixl_memory", "choice", "host", ("vllm",),
            "Where the NIXL transport's buffers are: `host` (pinned host memory) or `device` (the GPU memory of the "
            "worker's caches, `nixl_buffer` bytes beyond vLLM's `gpu_memory_utilization`: lower it to make room; "
            "bundles then move GPU to GPU). `device` is refused without CUDA.", choices=("host", "device"),
            vllm=True),
    Setting("role", "choice", "both", ("trtllm",),
            "What the TensorRT-LLM connector does: `both`, `producer` (exports only) or `consumer` (imports only). "
            "vLLM takes its own `kv_role`.", choices=("both", "producer", "consumer")),
    Setting("kvtc", "path", None, ("vllm", "trtllm"),
            "A `kvx kvtc calibrate` file: the connectors store KVTC-coded entries (~16x smaller, lossy).", vllm=True,
            deprecated=(VLLM_EXTRA + "kvx_kvtc",)),
    Setting("kv_scales", "path", None, ("trtllm",),
            "A JSON list of TensorRT-LLM's per-layer FP8 `kv_scale_quant_orig`, which its connector API does not "
            "pass; FP8 caches are refused without it."),
    Setting("decode_backend", "choice", "auto", ("all",),
            "The decode kernel on CUDA: `auto` (CUDA where it serves the call, else Triton), `cuda` (refuse what it "
            "cannot serve) or `triton`. Read once per process.", choices=_BACKENDS),
    Setting("write_backend", "choice", "auto", ("all",),
            "The quantize-and-write kernel on CUDA, as `decode_backend`. Read once per process.", choices=_BACKENDS),
    Setting("cuda_cache", "path", "~/.cache/kvx/cuda", ("all",),
            "Where CUDA kernels compiled by nvcc for this GPU are kept."),
    Setting("cache_dir", "path", None, ("kvx demo",),
            "Where `kvx demo` keeps its model; unset, `$XDG_CACHE_HOME/kvx`, else `~/.cache/kvx`."),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


class Resolved(NamedTuple):
    """A setting's effective value and where it came from ("default", "env KVX_X" or an engine key)."""

    value: Any
    source: str


def parse_bytes(text: str, what: str) -> int:
    """`123`, `64MiB`, `2GiB`, `512k` -> bytes (binary units); INVALID_ARGUMENT naming `what` otherwise."""
    m = re.fullmatch(r"\s*([0-9]{1,20})\s*([a-zA-Z]*)\s*", text, re.ASCII)
    unit = m.group(2).lower() if m else None
    n = int(m.group(1)) * BYTE_UNITS[unit] if m and unit in BYTE_UNITS else 0
    if not 0 < n <= MAX_BYTES:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be a positive byte count of at most 2**60 such as "
                                                f"536870912, 512MiB or 2GiB, got {text!r}")
    return n


def _choices(s: Setting) -> tuple[str, ...]:
    if s.kind == "format":
        from .formats import list_formats  # torch: only when a format is asked for

        return tuple(list_formats())
    return s.choices


def _parse(s: Setting, raw: object, what: str, from_env: bool) -> Any:
    """`raw` (an environment string, or a JSON value of an engine key) as `s`'s type; an engine key's null stands
    for "unset" where that is the default."""
    def bad(expected: str) -> KvxError:
        return KvxError(Status.INVALID_ARGUMENT, f"{what} must be {expected}, got {raw!r}")

    if raw is None and not from_env and s.default is None:
        return None
    if s.kind == "bool":
        if from_env:
            if raw.lower() not in BOOL_WORDS:
                raise bad(f"one of {', '.join(BOOL_WORDS)}")
            return BOOL_WORDS[raw.lower()]
        if not isinstance(raw, bool):
            raise bad("true or false")
        return raw
    if s.kind == "bytes":  # a string with an optional unit, or (JSON) an integer
        if isinstance(raw, str):
            return parse_bytes(raw, what)
        if type(raw) is int and 0 < raw <= MAX_BYTES:
            return raw
        raise bad("a positive byte count of at most 2**60 (an integer, or a string such as 8GiB)")
    if s.kind == "count":
        n = raw if type(raw) is int else int(raw) if from_env and re.fullmatch(r"[0-9]{1,18}", raw, re.ASCII) else 0
        if not 0 < n <= MAX_BYTES:
            raise bad("a positive integer")
        return n
    if s.kind == "path":
        if not isinstance(raw, str) or not raw:
            raise bad("a non-empty path")
        return raw
    choices = _choices(s)
    if not isinstance(raw, str) or raw not in choices:
        raise bad(f"one of {', '.join(choices)}")
    return raw


def resolve(name: str, given: Mapping[str, object] | None = None,
            environ: Mapping[str, str] | None = None) -> Resolved:
    """`name`'s value: an engine key in `given` (engine key -> JSON value, the keys the engine found set), else its
    environment variable, else the default; a deprecated spelling counts as its setting's with a warning."""
    s = BY_NAME[name]
    given = given or {}
    environ = os.environ if environ is None else environ
    found: list[tuple[str, Any]] = []  # (source, value) of each spelling given, the current ones first
    for key in s.keys:
        if key in given:
            found.append((key, _parse(s, given[key], key, from_env=False)))
    for old in (k for k in s.deprecated if k in given):
        warnings.warn(f"{old} is deprecated: use {' or '.join((*s.keys, s.env))}", DeprecationWarning, stacklevel=3)
        found.append((old, _parse(s, given[old], old, from_env=False)))
    if environ.get(s.env):
        found.append((f"env {s.env}", _parse(s, environ[s.env], s.env, from_env=True)))
    values = {src: v for src, v in found if not src.startswith("env ")}
    if len(set(map(repr, values.values()))) > 1:
        raise KvxError(Status.INVALID_ARGUMENT, f"{name} is given twice with different values ("
                       + ", ".join(f"{k}={v!r}" for k, v in values.items()) + f"): keep only {s.keys[0]}")
    if found:
        return Resolved(found[0][1], found[0][0])
    return Resolved(s.default, "default")


def value(name: str, given: Mapping[str, object] | None = None) -> Any:
    """`resolve(name, given).value`."""
    return resolve(name, given).value


@functools.cache
def once(name: str) -> Any:
    """`name`'s value from the environment, read at the first call of the process (kernel choices consult it on
    every call: they must not see it change, nor pay for reading it)."""
    return value(name)


def vllm_given(additional: object, extra: Mapping[str, object]) -> dict[str, object]:
    """vLLM's `additional_config` (its "kvx" object) and `kv_connector_extra_config` as engine keys for `resolve`.
    Refused: an `additional_config` or "kvx" that is no object, a key spelling "kvx" another way, unknown keys
    under "kvx" and unknown `kvx*` keys in `extra`: each would otherwise be ignored."""
    def refuse(message: str) -> NoReturn:
        raise KvxError(Status.INVALID_ARGUMENT, message)

    if additional is None:
        additional = {}
    if not isinstance(additional, Mapping):
        refuse('--additional-config must be a JSON object such as {"kvx": {"rotate": true}}, '
               f"got {type(additional).__name__} {additional!r}")
    near = sorted(repr(k) for k in additional if isinstance(k, str) and k != "kvx" and k.strip().casefold() == "kvx")
    if near:
        refuse(f'--additional-config key {near[0]} is not read (keys are case-sensitive); did you mean "kvx"?')
    section = additional.get("kvx", {})
    if not isinstance(section, Mapping):
        refuse(f'--additional-config "kvx" must be an object such as {{"rotate": true}}, got {section!r}')
    known = sorted(s.name for s in SETTINGS if s.vllm)
    unknown = sorted(map(repr, set(section) - set(known)))
    if unknown:
        refuse(f"unknown --additional-config kvx option(s) {', '.join(unknown)}; known: {', '.join(map(repr, known))}")
    old = {k.removeprefix(VLLM_EXTRA) for s in SETTINGS for k in s.deprecated}
    stray = sorted(repr(k) for k in extra if isinstance(k, str) and k.startswith("kvx") and k not in old)
    if stray:
        refuse(f"kv_connector_extra_config key(s) {', '.join(stray)} are not read; KVX settings go under "
               f"--additional-config '{{\"kvx\": {{...}}}}' (known: {', '.join(known)})")
    return {**{VLLM_KEY + k: v for k, v in section.items()}, **{VLLM_EXTRA + k: v for k, v in extra.items()}}


def effective(given: Mapping[str, object] | None = None,
              environ: Mapping[str, str] | None = None) -> dict[str, Resolved]:
    """Every setting resolved (what `kvx config` prints)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `kvx config` names the source instead
        return {s.name: resolve(s.name, given, environ) for s in SETTINGS}


def _type_text(s: Setting) -> str:
    if s.kind == "choice":
        return " \\| ".join(f"`{c}`" for c in s.choices)
    return {"format": "KVX format", "bytes": "byte count", "count": "positive integer"}.get(s.kind, s.kind)


def render_markdown() -> str:
    """docs/guide/configuration.md: the table as a user reads it."""
    lines = [
        "# Configuration",
        "",
        "<!-- generated from kvx_core/config.py by `kvx config --markdown`; edit the table there, not this file -->",
        "",
        "Every KVX setting has one name. Set it as the environment variable `KVX_<NAME>` (in every engine that",
        'reads the setting: the "read by" column) or, in vLLM, under',
        """`--additional-config '{"kvx": {"<name>": ...}}'`, which wins over the environment (a JSON null there""",
        "means unset where unset is the default). An empty environment variable counts as unset. Booleans in the",
        f"environment are one of {', '.join(f'`{w}`' for w in BOOL_WORDS)}. A bad value is refused at",
        "startup with a message naming the variable or key. `kvx config` prints each setting's effective value and",
        "its source (`--json` for a program).",
        "",
        "| setting | environment | vLLM key | type | default | read by | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        vllm = " ".join(f"`{k}`" for k in s.keys) or "-"
        default = "unset" if s.default is None else f"`{str(s.default).lower() if s.kind == 'bool' else s.default}`"
        lines.append(f"| `{s.name}` | `{s.env}` | {vllm} | {_type_text(s)} | {default} | {', '.join(s.engines)} "
                     f"| {s.doc} |")
    lines += ["", "## Deprecated spellings", "",
              "Still read, with a DeprecationWarning naming the new spelling; an old and a new spelling given with",
              "different values is refused.", "",
              "| old spelling | use |", "|---|---|"]
    lines += [f"| `{old}` | `{s.keys[0] if s.keys else s.env}` / `{s.env}` |" for s in SETTINGS for old in s.deprecated]
    return "\n".join(lines) + "\n"
