"""Render what the docs say about benchmark results from the results themselves, so that no number is copied by hand.

- `benchmarks/results/README.md` is a rendering of `benchmarks/results/index.yaml` (one entry per file: what it
  shows, the command, the machine, the commit, the file that supersedes it).
- In `docs/results.md`, each table between `<!-- results:NAME -->` and `<!-- /results -->` is rendered from the
  JSON lines it cites (`TABLES` below).
- `--figures`: the PNG figures (`FIGURES` below; needs matplotlib, the `plot` extra).

`tests/test_results_index.py` fails when the committed README or a marked table differs from its rendering, or when
a file in benchmarks/results/ has no index entry.

Usage: python benchmarks/render_results.py [--check] [--figures]
(no flag: rewrite README.md and the marked tables in place; --check: write nothing, exit 1 naming what differs)
"""
from __future__ import annotations

import argparse
import decimal
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvx_core import jsonsafe
from kvx_core.errors import KvxError, Status, int_value

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"

MAX_TEXT_BYTES = 1 << 20
"""index.yaml or docs/results.md larger than this is refused before it is read (each is under 100 KiB)."""
MAX_RESULT_BYTES = 16 << 20
"""A JSON-lines result file larger than this is refused before it is read (the largest is ~100 KiB)."""

MAX_FIELD = 1e15
"""A number in a result field beyond this (in magnitude) is refused: none measured is near it (the largest are byte
counts, ~1e10), and a table cell has no room for one."""
NOT_INDEXED = frozenset({"README.md", "index.yaml"})
"""The files of benchmarks/results/ that are the index itself, not results."""
ENTRY_KEYS = ("file", "what", "command", "gpu", "commit", "superseded_by")


@dataclass(frozen=True)
class Entry:
    file: str
    what: str
    command: str
    gpu: str
    commit: str
    superseded_by: str | None


@dataclass(frozen=True)
class Section:
    title: str
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class Index:
    header: str
    sections: tuple[Section, ...]

    def entries(self) -> list[Entry]:
        return [e for s in self.sections for e in s.entries]


def _bad(message: str) -> KvxError:
    return KvxError(Status.INVALID_ARGUMENT, message)


def _show(value: object) -> str:
    """`repr(value)` cut to a length an error line can carry (a forged value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load` that also refuses a mapping key given twice (safe_load silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str) or key in seen:
                raise _bad(f"index.yaml line {key_node.start_mark.line + 1}: key {_show(key)} "
                           + ("is given twice" if key in seen else "is not a string"))
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_capped(path: Path, cap: int) -> bytes:
    """The bytes of `path`, refusing a file over `cap` before reading it."""
    try:
        size = path.stat().st_size
        if size > cap:
            raise _bad(f"{path} is {size} bytes, over the {cap}-byte cap")
        return path.read_bytes()
    except OSError as e:
        raise _bad(f"cannot read {path}: {e.strerror or e}") from None


def _mapping(value: object, keys: tuple[str, ...], what: str) -> dict:
    """`value` as a mapping holding exactly `keys` (a missing or unknown key is refused, naming it)."""
    if not isinstance(value, dict):
        raise _bad(f"{what} must be a mapping, got {type(value).__name__}")
    missing, unknown = [k for k in keys if k not in value], sorted(set(value) - set(keys))
    if missing or unknown:
        raise _bad(f"{what}: missing keys {missing}, unknown keys {unknown}")
    return value


def _text(value: object, what: str, *, one_line: bool = True) -> str:
    """`value` as a non-empty string (a table cell holds no line break)."""
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"{what} must be a non-empty string, got {_show(value)}")
    if one_line and ("\n" in value or "\r" in value):
        raise _bad(f"{what} must be one line (it is a table cell)")
    return value


def _list(value: object, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise _bad(f"{what} must be a non-empty list")
    return value


def parse_index(text: str | bytes) -> Index:
    """index.yaml's text as an `Index`; every type, key and cross-reference checked (KvxError otherwise)."""
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise _bad(f"index.yaml is not valid YAML: {e}") from None
    except RecursionError:
        raise _bad("index.yaml nests too deeply") from None
    doc = _mapping(doc, ("header", "sections"), "index.yaml")
    sections = []
    for i, s in enumerate(_list(doc["sections"], "index.yaml sections")):
        s = _mapping(s, ("title", "entries"), f"section {i}")
        title = _text(s["title"], f"section {i} title")
        entries = []
        for j, e in enumerate(_list(s["entries"], f"section {_show(title)} entries")):
            where = f"section {_show(title)} entry {j}"
            e = _mapping(e, ENTRY_KEYS, where)
            sup = e["superseded_by"]
            entries.append(Entry(*(_text(e[k], f"{where} {k}") for k in ENTRY_KEYS[:5]),
                                 superseded_by=None if sup is None else _text(sup, f"{where} superseded_by")))
        sections.append(Section(title, tuple(entries)))
    index = Index(_text(doc["header"], "index.yaml header", one_line=False), tuple(sections))
    names = [e.file for e in index.entries()]
    for e in index.entries():
        if "/" in e.file or e.file in NOT_INDEXED:
            raise _bad(f"index entry {_show(e.file)}: not a result file name")
        if names.count(e.file) > 1:
            raise _bad(f"index entry {_show(e.file)} is given more than once")
        if e.superseded_by is not None and (e.superseded_by == e.file or e.superseded_by not in names):
            raise _bad(f"index entry {_show(e.file)}: superseded_by {_show(e.superseded_by)} names no other entry")
    return index


def load_index(results: Path) -> Index:
    return parse_index(_read_capped(results / "index.yaml", MAX_TEXT_BYTES))


def index_problems(index: Index, results: Path, drawing: frozenset[str] = frozenset()) -> list[str]:
    """Files of `results` (and the figures about to be drawn there) without an entry, and entries naming no file
    (an empty list when they match)."""
    present = ({p.name for p in results.iterdir() if p.is_file()} | drawing) - NOT_INDEXED
    listed = {e.file for e in index.entries()}
    return ([f"{name}: in {results.name}/ but not in index.yaml" for name in sorted(present - listed)]
            + [f"{name}: in index.yaml but not in {results.name}/" for name in sorted(listed - present)])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    line = lambda cells: "|" + "|".join(f" {_cell(c)} " if c else " " for c in cells) + "|"  # noqa: E731
    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(row) for row in rows]) + "\n"


def render_readme(index: Index) -> str:
    """README.md: the header, then one table per section; a superseded file's row says by which file."""
    out = [index.header.rstrip("\n") + "\n"]
    for s in index.sections:
        rows = [[f"`{e.file}`", (f"Superseded by `{e.superseded_by}`. " if e.superseded_by else "") + e.what,
                 e.command, e.gpu, e.commit] for e in s.entries]
        out.append(f"## {s.title}\n\n" + _table(["file", "shows", "command", "machine", "commit"], rows))
    return "\n".join(out)


# ---- JSON lines -> tables ------------------------------------------------------------------------------------------

def read_jsonl(name: str, results: Path) -> list[dict]:
    """The JSON objects of a results file, one per non-empty line, read strictly (`kvx_core.jsonsafe`)."""
    data = _read_capped(results / name, MAX_RESULT_BYTES)
    return [jsonsafe.loads_object(line, f"{name} line {n}")
            for n, line in enumerate(data.splitlines(), 1) if line.strip()]


def _finite(raw: object, what: str) -> float:
    """A JSON number within `MAX_FIELD` as a float."""
    value = jsonsafe.finite_number(raw)
    if value is None:
        raise _bad(f"{what} must be a finite number, got {_show(raw)}")
    if abs(value) > MAX_FIELD:
        raise KvxError(Status.OUT_OF_RANGE, f"{what} = {_show(value)} is beyond {MAX_FIELD:g}")
    return value


def _num(row: dict, key: str, what: str) -> float:
    return _finite(row.get(key), f"{what}: {key}")


def _count(row: dict, key: str, what: str) -> int:
    """An integer field (a float or a bool is refused, not truncated)."""
    value = int_value(row.get(key))
    if value is None or not 0 <= value <= MAX_FIELD:
        raise _bad(f"{what}: {key} must be a non-negative integer, got {_show(row.get(key))}")
    return value


def _str(row: dict, key: str, what: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise _bad(f"{what}: {key} must be a string, got {_show(value)}")
    return value


def _one(rows: list[dict], what: str, **match: str | int | dict) -> dict:
    """The one row of `rows` whose fields equal `match`, types included (`true` is no batch of 1; none or several
    rows: refused, naming `what`)."""
    found = [r for r in rows if all(type(r.get(k)) is type(v) and r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise _bad(f"{what}: {len(found)} rows match {match}, expected 1")
    return found[0]


def _fixed(x: float, digits: int, *, commas: bool = False, signed: bool = False) -> str:
    """`x` with `digits` decimals, a half rounded up as a reader of the file would (0.0605 -> 0.061; formatting
    the float rounds its binary value, 0.06049..., down), thousands separated by commas and a sign if asked."""
    q = decimal.Decimal(repr(x)).quantize(decimal.Decimal(1).scaleb(-digits), rounding=decimal.ROUND_HALF_UP)
    return format(q, ("+" if signed else "") + ("," if commas else "f"))


def _ratio(x: float) -> str:
    """A ratio as the docs write it: 2 decimals, 1 from 10x up."""
    return _fixed(x, 1 if x >= 10 else 2) + "x"


def _first_seen(rows: list[dict], key: str, what: str) -> list[str]:
    """The distinct string values of `key` in `rows`, in the order they first appear."""
    return list(dict.fromkeys(_str(r, key, what) for r in rows if key in r))


def table_vllm_kv_dtypes_h200(results: Path) -> str:
    """vLLM's own KV dtypes and KVX's: capacity, decode tok/s, prefill and TTFT, ratios vs `auto`."""
    name = "vllm_kv_dtypes_h200.jsonl"
    rows = read_jsonl(name, results)
    decode_cases = ((64, 8192), (64, 32768), (1, 32768))

    def cells(dtype: str) -> list[float | None]:
        pick = lambda **m: _one(rows, f"{name} {dtype}", kv_cache_dtype=dtype, **m)  # noqa: E731
        decodes = [pick(metric="decode", batch=b, ctx=c) for b, c in decode_cases]
        return ([_num(pick(metric="capacity"), "kv_tokens", name)]
                + [None if "skipped" in d else _num(d, "tok_s", name) for d in decodes]
                + [_num(pick(metric="prefill", batch=64, ctx=8192), "prefill_s", name),
                    _num(pick(metric="ttft", ctx=8192), "ttft_s", name)])

    base = cells("auto")
    digits = (0, 0, 0, 0, 2, 3)
    out = []
    for dtype in _first_seen(rows, "kv_cache_dtype", name):
        row = [dtype]
        for value, ref, n in zip(cells(dtype), base, digits, strict=True):
            if value is None:
                row.append("not run (1)")
            else:
                row.append(_fixed(value, n, commas=True) + ("" if dtype == "auto" else f" ({_ratio(value / ref)})"))
        out.append(row)
    return _table(["dtype", "KV tokens", "decode B64 8k tok/s", "decode B64 32k tok/s", "decode B1 32k tok/s",
                   "prefill 64x8k s", "TTFT 8k s"], out)


WRITE_LABELS = {"fp8_e4m3": "FP8", "int8": "INT8", "k8v4": "k8v4", "mxfp4": "MXFP4", "int4": "INT4",
                "mxfp4_32": "MXFP4-32", "nvfp4": "NVFP4", "nvfp4_rot": "NVFP4 (rot)", "bf16": "BF16"}
WRITE_TARGET_PCT = 70.0
"""The write's bandwidth target (% of copy bandwidth): cells at or above it are bold."""


def table_write_bandwidth_h100(results: Path) -> str:
    """The fused write at 32k tokens, % of copy bandwidth per format, CUDA and Triton; CUDA's best first."""
    name = "write_bandwidth_h100.jsonl"
    rows = [r for r in read_jsonl(name, results) if r.get("tokens") == 32768 and "skipped" not in r]
    pct = {(_str(r, "impl", name), _str(r, "format", name)): _num(r, "pct_copy_bw", name) for r in rows}
    fmts = sorted(_first_seen(rows, "format", name), key=lambda f: -pct.get(("kvx_cuda", f), -1.0))
    unknown = [f for f in fmts if f not in WRITE_LABELS]
    if unknown:
        raise _bad(f"{name}: formats without a column label: {unknown}")

    def cell(impl: str, fmt: str) -> str:
        if (impl, fmt) not in pct:
            return "-"
        text = _fixed(pct[impl, fmt], 1) + "%"
        return f"**{text}**" if pct[impl, fmt] >= WRITE_TARGET_PCT and impl == "kvx_cuda" else text

    return _table([""] + [WRITE_LABELS[f] for f in fmts],
                  [[label] + [cell(impl, f) for f in fmts]
                   for impl, label in (("kvx_cuda", "CUDA write"), ("kvx_triton", "Triton write"))])


def table_transfer_bundle_h100(results: Path) -> str:
    """Bundle export / import GB/s per path against a pinned copy of the same bytes in the same run."""
    name = "transfer_bundle_h100.jsonl"

    def row(r: dict) -> list[str]:
        n = lambda key: _num(r, key, name)  # noqa: E731
        s = lambda key: _str(r, key, name)  # noqa: E731
        return [f"{s('src')} -> {s('dst')}", s("path"), _fixed(n("bundle_bytes") / 1e6, 0) + " MB",
                _fixed(n("export_gbps"), 1), _fixed(n("import_gbps"), 1),
                f"{_fixed(n('copy_d2h_gbps'), 0)} / {_fixed(n('copy_h2d_gbps'), 0)}",
                f"{_fixed(n('export_x_copy'), 2)} / {_fixed(n('import_x_copy'), 2)}"]

    out = [row(r) for r in read_jsonl(name, results)]
    return _table(["bundle", "path", "bytes", "export GB/s", "import GB/s", "pinned copy D2H / H2D GB/s",
                   "export / import vs copy"], out)


TGI_ORDER = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "k8v4", "k8v4_rot", "nvfp4", "nvfp4_rot", "int4",
             "int4_rot", "mxfp4", "mxfp4_rot", "mxfp4_floor", "mxfp4_32", "mxfp4_32_rot", "mxfp4_32_floor")
"""The TGI table's row order: by bytes per token, the rotated and floor variants after their format."""


def _ppl_delta(r: dict, what: str) -> str:
    """A TGI run's perplexity and its change vs the bf16 run's."""
    p, ref = _num(r, "perplexity", what), _num(r, "bf16_perplexity", what)
    return f"{_fixed(p, 3)} ({_fixed(100 * (p / ref - 1), 1, signed=True)}%)"


def table_tgi_formats(results: Path) -> str:
    """TGI's blocks and perplexity per KVX format on CPU and H100 (the blocks must agree: same cache bytes)."""
    runs = {dev: read_jsonl(f"tgi_formats_{dev}.jsonl", results) for dev in ("cpu", "h100")}
    out = []
    for fmt in TGI_ORDER:
        cpu, gpu = (_one(runs[d], f"tgi_formats_{d}.jsonl", format=fmt) for d in ("cpu", "h100"))
        bf16 = _one(runs["cpu"], "tgi_formats_cpu.jsonl", format="bf16")
        blocks, size = _num(cpu, "blocks", fmt), _num(cpu, "block_size", fmt)
        if _num(gpu, "blocks", fmt) != blocks:
            raise _bad(f"TGI {fmt}: {blocks:.0f} blocks on CPU, {gpu['blocks']} on the H100")
        out.append([f"`{fmt}`", _fixed(blocks, 0), _fixed(blocks * size, 0, commas=True),
                    _ratio(blocks / _num(bf16, "blocks", "bf16")),
                    _ppl_delta(cpu, fmt), _ppl_delta(gpu, fmt)])
    return _table(["`KVX_FORMAT`", "blocks", "tokens", "vs bf16", "perplexity, CPU (vs bf16)",
                   "perplexity, H100 (vs bf16)"], out)


DECODE_COLUMNS = (("bf16", "BF16"), ("fp8_e4m3", "FP8"), ("int8", "INT8"), ("int4", "INT4"), ("nvfp4", "NVFP4"),
                  ("mxfp4", "MXFP4"), ("k8v4", "k8v4"))
DECODE_SHAPES = ((64, 32768), (64, 8192), (1, 32768))
"""The H100 decode table's shapes; the first is the headline (its KVX-format cells bold)."""
DECODE_FILES = {"k8v4": "decode_k8v4_cuda_vs_triton_h100.jsonl"}
"""Formats whose latest H100 run is not in decode_vs_flashinfer_h100.jsonl (k8v4: after its CUDA kernel)."""


def table_decode_vs_flashinfer_h100(results: Path) -> str:
    """KVX decode (`backend=auto`) over FlashInfer BF16 of the same run, with % of copy bandwidth; at B=1 the time."""
    files = {name: read_jsonl(name, results)
             for name in {"decode_vs_flashinfer_h100.jsonl", *DECODE_FILES.values()}}

    def cell(fmt: str, b: int, ctx: int, bold: bool) -> str:
        name = DECODE_FILES.get(fmt, "decode_vs_flashinfer_h100.jsonl")
        r = _one(files[name], f"{name} {fmt} {b}x{ctx}", impl="kvx", format=fmt, B=b, ctx=ctx,
                 variant={"backend": "auto"})
        ratio = _ratio(_num(r, "ratio_vs_fi_bf16", name))
        extra = _fixed(_num(r, "pct_copy_bw", name), 0) + "%"
        if b == 1:
            extra += f", {_fixed(1000 * _num(r, 'ms', name), 0)} us"
        return f"{f'**{ratio}**' if bold else ratio} ({extra})"

    rows = [[f"{b} x {ctx // 1024}k"] + [cell(fmt, b, ctx, i == 0 and fmt != "bf16") for fmt, _ in DECODE_COLUMNS]
            for i, (b, ctx) in enumerate(DECODE_SHAPES)]
    return _table(["B x ctx"] + [label for _, label in DECODE_COLUMNS], rows)


KVTC_ROWS = ((8.0, 32768), (16.0, 32768), (32.0, 32768), (16.0, 4096))
"""The KVTC throughput table's (target ratio, tokens): every ratio at 32k tokens, one at 4k (fixed costs)."""


def table_kvtc_throughput_h100(results: Path) -> str:
    """KVTC compress / decompress GB/s of BF16 K/V, end to end and on the device."""
    name = "kvtc_throughput_h100.jsonl"
    rows = read_jsonl(name, results)
    out = []
    for ratio, tokens in KVTC_ROWS:
        r = _one(rows, name, target_ratio=ratio, tokens=tokens)
        n = lambda key, r=r: _fixed(_num(r, key, name), 1)  # noqa: E731
        out.append([_fixed(ratio, 0) + "x", str(tokens), n("ratio_vs_bf16") + "x",
                    f"{n('compress_gbps')} / {n('device_compress_gbps')}",
                    f"{n('decompress_gbps')} / {n('device_decompress_gbps')}"])
    return _table(["target ratio", "tokens", "buffer vs BF16", "compress GB/s end to end / on the device",
                   "decompress GB/s end to end / on the device"], out)


def table_lm_head_accuracy_smollm2(results: Path) -> str:
    """SmolLM2's head in BF16 vs MXFP4, per text: KL, top-1 agreement, perplexity."""
    name = "lm_head_mxfp4_accuracy_smollm2_cpu.jsonl"

    def row(r: dict) -> list[str]:
        n = lambda key: _num(r, key, name)  # noqa: E731
        return [_str(r, "text", name).replace("_", "-"), _fixed(n("kl_mean"), 2),
                _fixed(100 * n("top1_agreement"), 1) + "%",
                f"{_fixed(n('ppl_bf16_head'), 2)} -> {_fixed(n('ppl_mxfp4_head'), 2)} "
                f"(+{_fixed(n('ppl_delta_pct'), 0)}%)"]

    return _table(["text", "KL(BF16 head || MXFP4 head)", "top-1 agreement", "perplexity BF16 head -> MXFP4 head"],
                  [row(r) for r in read_jsonl(name, results)])


GLOBAL_SCALE_ROWS = (("1.0 (default)", "none"), ("`--calibrate amax`", "amax"), ("`--calibrate mse`", "mse (NVFP4"),
                     ("`--calibrate mse --calibration-text` (another text)", "mse, calibrated on the second text"))
"""The global-scale table's rows: label, and how the rows' `scale_rule` starts (the file also holds the dropped
quarter-octave FP8 search, not in the table)."""
GLOBAL_SCALE_FORMATS = ("fp8_e4m3", "k8v4", "nvfp4", "nvfp4_rot")


def table_demo_global_scales_smollm2(results: Path) -> str:
    """`kvx demo` perplexity delta vs the BF16 cache per global-scale rule and format."""
    name = "demo_global_scales_smollm2_cpu.jsonl"
    rows = read_jsonl(name, results)
    out = []
    for label, rule in GLOBAL_SCALE_ROWS:
        picked = [r for r in rows if _str(r, "scale_rule", name).startswith(rule)]
        out.append([label] + [_fixed(_num(_one(picked, f"{name} {rule}", format=f), "ppl_delta_pct", name), 2,
                                     signed=True) + "%" for f in GLOBAL_SCALE_FORMATS])
    return _table(["scales", *GLOBAL_SCALE_FORMATS], out)


def _kvtc_label(r: dict, what: str) -> str:
    """A KVTC configuration as the table names it: the target, then what differs from the default (groups of 6
    layers, ranges of 16, RoPE removed from keys, separate K / V budgets)."""
    target = _fixed(_num(r, "target_ratio", what), 0) + "x"
    layers, ranges = _count(r, "layers_per_group", what), _count(r, "range_size", what)
    joint, rope_removed = r.get("joint", False), r.get("rope_removed")
    if not isinstance(joint, bool) or not isinstance(rope_removed, bool):
        raise _bad(f"{what}: joint / rope_removed must be true or false")
    if not rope_removed:
        return f"{target}, RoPE kept"
    if (layers, ranges) == (30, 32):
        return f"{target}, 30 layers in one group, `--joint`" if joint else \
            f"{target}, one group of all 30 layers, ranges of 32"
    if (layers, ranges) != (6, 16):
        raise _bad(f"{what}: no table label for {layers} layers per group, ranges of {ranges}")
    return f"{target}, K and V sharing one budget (`--joint`)" if joint else target


def table_kvtc_smollm2(results: Path) -> str:
    """KVTC ratio vs accuracy per configuration, in the file's order; the DEFLATE row of a run gives its second
    whole-prompt ratio."""
    name = "kvtc_smollm2_cpu.jsonl"
    rows = read_jsonl(name, results)
    texts = {}
    for r in rows:
        for text in ("demo_text", "second_text"):
            if not isinstance(r.get(text), dict):
                raise _bad(f"{name}: {text} must be an object")
        if not isinstance(r.get("deflate"), bool):
            raise _bad(f"{name}: deflate must be true or false")
        texts.setdefault(_kvtc_label(r, name), {})[r["deflate"]] = r
    out = []
    for label, runs in texts.items():
        if False not in runs:
            raise _bad(f"{name}: {label} has only a DEFLATE row")
        demo, second = runs[False]["demo_text"], runs[False]["second_text"]
        whole = [_fixed(_num(runs[d]["demo_text"], "ratio_vs_bf16", name), 1) + "x" for d in (False, True) if d in runs]
        pct = lambda t: _fixed(_num(t, "ppl_delta_pct", name), 1, signed=True) + "%"  # noqa: E731
        top1 = lambda t: _fixed(100 * _num(t, "top1_agreement", name), 1) + "%"  # noqa: E731
        out.append([label, _fixed(_num(demo, "coded_ratio_vs_bf16", name), 1) + "x", ", ".join(whole),
                    f"{pct(demo)} / {pct(second)}", f"{top1(demo)} / {top1(second)}"])
    return _table(["target", "coded tokens vs BF16", "whole 768-token prompt, + DEFLATE",
                   "ppl delta demo / second text", "top-1 agreement demo / second"], out)


LM_HEAD_M = (1, 4, 16, 32, 64)
"""The rows (tokens per GEMM) of the lm_head GEMM table (the file also has M = 2, 8)."""


def table_lm_head_mxfp4_h100(results: Path) -> str:
    """The MXFP4 lm_head GEMM (KVX, Marlin) vs BF16, gpt-oss's head and its TP=2 shard, in us."""
    name = "lm_head_mxfp4_h100.jsonl"
    rows = read_jsonl(name, results)
    out = []
    for m in LM_HEAD_M:
        full, shard = (_one(rows, f"{name} M={m}", m=m, shape=s) for s in ("gpt-oss head", "gpt-oss head TP=2 shard"))
        us = lambda r, key: _num(r, key, name)  # noqa: E731
        out.append([str(m)] + [_fixed(us(full, k), 1) for k in ("bf16_us", "mxfp4_us", "marlin_us")]
                   + [_ratio(us(full, "bf16_us") / us(full, "marlin_us")), _ratio(us(full, "speedup_vs_marlin")),
                      " / ".join(_fixed(us(shard, k), 1) for k in ("bf16_us", "mxfp4_us", "marlin_us"))])
    return _table(["M", "201088 x 2880: BF16 us", "KVX MXFP4 us", "Marlin MXFP4 us", "Marlin vs BF16", "KVX vs Marlin",
                   "TP=2 shard: BF16 / KVX / Marlin us"], out)


def table_vllm_lm_head_mxfp4_h100(results: Path) -> str:
    """vLLM's time per output token with the BF16 and the MXFP4 head, and the spread of all their runs."""
    name = "vllm_lm_head_mxfp4_h100.jsonl"
    rows = [r for r in read_jsonl(name, results) if r.get("metric") == "decode"]
    out = []
    for batch in dict.fromkeys(_count(r, "batch", name) for r in rows):
        pair = [_one(rows, f"{name} batch {batch}", batch=batch, lm_head=head) for head in ("none", "mxfp4")]
        runs = [_finite(v, f"{name}: tpot_ms_runs") for r in pair
                for v in _list(r.get("tpot_ms_runs"), f"{name}: tpot_ms_runs")]
        out.append([str(batch)] + [_fixed(_num(r, "tpot_ms", name), 2) for r in pair]
                   + [f"{_fixed(min(runs), 1)}-{_fixed(max(runs), 1)}"])
    return _table(["batch", "BF16 head ms / token", "MXFP4 head (Marlin) ms / token", "runs spread"], out)


TABLES: dict[str, Callable[[Path], str]] = {
    "demo_global_scales_smollm2": table_demo_global_scales_smollm2,
    "kvtc_smollm2": table_kvtc_smollm2,
    "kvtc_throughput_h100": table_kvtc_throughput_h100,
    "lm_head_accuracy_smollm2": table_lm_head_accuracy_smollm2,
    "lm_head_mxfp4_h100": table_lm_head_mxfp4_h100,
    "vllm_lm_head_mxfp4_h100": table_vllm_lm_head_mxfp4_h100,
    "decode_vs_flashinfer_h100": table_decode_vs_flashinfer_h100,
    "vllm_kv_dtypes_h200": table_vllm_kv_dtypes_h200,
    "write_bandwidth_h100": table_write_bandwidth_h100,
    "transfer_bundle_h100": table_transfer_bundle_h100,
    "tgi_formats": table_tgi_formats,
}
"""The marked tables of docs/results.md, by marker name, each rendered from the result files it names."""

MARKED = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results -->)", re.DOTALL)


def render_doc(text: str, results: Path) -> str:
    """`text` with every marked table replaced by its rendering (an unknown or unclosed marker is refused)."""
    opened = text.count("<!-- results:")
    if opened != len(MARKED.findall(text)) or opened != text.count("<!-- /results -->"):
        raise _bad("docs/results.md: a `<!-- results:NAME -->` marker has no `<!-- /results -->` (or the reverse)")

    def table(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise _bad(f"docs/results.md: no table renderer named {_show(m.group(2))} (known: {sorted(TABLES)})")
        return m.group(1) + TABLES[m.group(2)](results) + m.group(4)

    return MARKED.sub(table, text)


# ---- figures --------------------------------------------------------------------------------------------------------

def figure_decode_vs_context_h200(results: Path, dst: Path) -> None:
    """Decode time per step vs context, one panel per batch size, each KVX format against FlashInfer BF16 / FP8."""
    import matplotlib.pyplot as plt

    name = "decode_vs_flashinfer_h200.jsonl"
    rows = [r for r in read_jsonl(name, results) if r.get("bench") == "decode"]
    for r in rows:
        r.update(B=_num(r, "B", name), ctx=_num(r, "ctx", name), impl=_str(r, "impl", name),
                 format=_str(r, "format", name))
    batches = sorted({r["B"] for r in rows if len({x["ctx"] for x in rows if x["B"] == r["B"]}) > 1})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        for impl, fmt in dict.fromkeys((r["impl"], r["format"]) for r in rows):
            pts = sorted((r["ctx"], _num(r, "ms", name)) for r in rows
                         if r["B"] == b and r["impl"] == impl and r["format"] == fmt)
            style = dict(color="black", ls="--" if fmt == "bf16" else ":") if impl == "flashinfer" else {}
            ax.plot([c for c, _ in pts], [m for _, m in pts], marker="o", ms=3, lw=1.2,
                    label=f"FlashInfer {fmt}" if impl == "flashinfer" else fmt, **style)
        ax.set(xscale="log", yscale="log", title=f"B = {b:.0f}", xlabel="context (tokens)",
               ylabel="decode step (ms, lower is faster)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Decode vs FlashInfer 0.6.14, H200, GQA 32/8, D 128 ({name})", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def figure_vllm_decode_vs_context_h200(results: Path, dst: Path) -> None:
    """vLLM decode tok/s at B=64 vs context per KV dtype, KVX's (solid) against vLLM's own (dashed)."""
    import matplotlib.pyplot as plt

    name = "vllm_kv_dtypes_h200.jsonl"
    rows = [r for r in read_jsonl(name, results) if r.get("metric") == "decode" and r.get("batch") == 64
            and "skipped" not in r]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for dtype in _first_seen(rows, "kv_cache_dtype", name):
        pts = sorted((_num(r, "ctx", name), _num(r, "tok_s", name)) for r in rows if r["kv_cache_dtype"] == dtype)
        ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", ms=4,
                ls="-" if dtype.startswith("kvx_") else "--",
                label=dtype + (" (one context: 32k not run)" if len(pts) == 1 else ""))
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tok/s, B = 64 (higher is faster)")
    ax.set_title(f"vLLM 0.26 KV dtypes, H200, Llama-8B geometry, 8 layers\n({name})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def figure_capacity_vs_accuracy(results: Path, dst: Path) -> None:
    """Tokens per byte of cache vs perplexity increase per format: the demo (SmolLM2, 8 x 1024 tokens) and TGI."""
    import matplotlib.pyplot as plt

    demo = [r for r in read_jsonl("demo_default_cpu.jsonl", results)]
    tgi = {d: read_jsonl(f"tgi_formats_{d}.jsonl", results) for d in ("cpu", "h100")}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in demo:
        x, y = _num(r, "capacity_vs_bf16", "demo"), _num(r, "ppl_delta_pct", "demo")
        a.scatter(x, y, s=14)
        a.annotate(str(r.get("format")), (x, y), fontsize=7, xytext=(3, 2), textcoords="offset points")
    a.set_title("kvx demo, SmolLM2-135M, 8 x 1024 tokens\n(demo_default_cpu.jsonl)", fontsize=9)
    a.set(xlabel="tokens vs BF16",
          ylabel="perplexity vs BF16 cache (%)")
    for dev, marker in (("cpu", "o"), ("h100", "^")):
        bf16 = _one(tgi[dev], dev, format="bf16")
        for r in tgi[dev]:
            x = _num(r, "blocks", "tgi") / _num(bf16, "blocks", "tgi")
            y = 100 * (_num(r, "perplexity", "tgi") / _num(r, "bf16_perplexity", "tgi") - 1)
            b.scatter(x, y, s=14, marker=marker, color="C0" if dev == "cpu" else "C1")
            if dev == "cpu":
                b.annotate(str(r.get("format")), (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    b.scatter([], [], marker="o", color="C0", label="CPU")
    b.scatter([], [], marker="^", color="C1", label="H100")
    b.legend(fontsize=8)
    b.set_title("TGI server, SmolLM2-135M, 512 tokens\n(tgi_formats_cpu.jsonl, tgi_formats_h100.jsonl)", fontsize=9)
    b.set(xlabel="tokens vs BF16",
          ylabel="perplexity vs BF16 cache (%)")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


FIGURES: dict[str, Callable[[Path, Path], None]] = {
    "decode_vs_context_h200.png": figure_decode_vs_context_h200,
    "vllm_decode_vs_context_h200.png": figure_vllm_decode_vs_context_h200,
    "capacity_vs_accuracy.png": figure_capacity_vs_accuracy,
}
"""The figures `--figures` renders into benchmarks/results/, by file name (each listed in index.yaml)."""


def render_figures(results: Path) -> list[Path]:
    """Draw every figure of `FIGURES` into `results` from the result files there."""
    import matplotlib

    matplotlib.use("Agg")
    paths = []
    for fname, draw in FIGURES.items():
        draw(results, results / fname)
        paths.append(results / fname)
    return paths


# ---- command line ---------------------------------------------------------------------------------------------------

def rendered(results: Path, doc: Path, drawing: frozenset[str] = frozenset()) -> dict[Path, str]:
    """Each rendered text file's path and the text it should hold (nothing is written); `drawing`: the figures
    this run draws."""
    index = load_index(results)
    problems = index_problems(index, results, drawing)
    if problems:
        raise _bad("index.yaml does not match the results directory: " + "; ".join(problems))
    try:
        text = _read_capped(doc, MAX_TEXT_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(f"{doc} is not UTF-8") from None
    return {results / "README.md": render_readme(index), doc: render_doc(text, results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a rendered file differs")
    ap.add_argument("--figures", action="store_true", help="also render the PNG figures (needs matplotlib)")
    args = ap.parse_args(argv)
    try:
        texts = rendered(RESULTS, DOC, frozenset(FIGURES) if args.figures else frozenset())
        stale = [p for p, text in texts.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if args.check:
            for p in stale:
                print(f"{p} differs from its rendering: run python benchmarks/render_results.py",
                      file=sys.stderr)
            return 1 if stale else 0
        for p in stale:
            p.write_text(texts[p], encoding="utf-8")
        if args.figures:
            render_figures(RESULTS)
    except KvxError as e:
        print(f"render_results: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
