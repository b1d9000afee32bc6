"""`kvx kvtc calibrate OUT`, `kvx kvtc compress CAL BUNDLE OUT`, `kvx kvtc decompress CAL FILE OUT_BUNDLE`,
`kvx kvtc inspect FILE`: KVTC transform coding of KV caches (kvx_core.kvtc) from the command line.

Every argument and output path is checked before any work (numbers by their `type=` while parsing; the output's
directory, an existing name or dangling symlink, and cross-argument limits before a model or file is loaded).
Every output is a new file, written to a temporary file in its directory and linked into place only on success:
an existing file is never replaced and a refused input leaves nothing behind."""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict

from kvx_core.errors import KvxError, Status, require
from kvx_core.files import check_output, publish
from kvx_core.kvtc.calibration import MAX_POSITION, UINT32_MAX

from .args import bounded_float, bounded_int, open_input
from .demo_cmd import MAX_WINDOW_LEN, MAX_WINDOWS
from .filekind import expect_kind
from .progress import Progress

MAX_RATIO = 1e4
"""--ratio's upper bound: past it the byte budget of any model's group drops every component."""
MAX_RANGE_SIZE = 1 << 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kvtc", help="KVTC: calibrate, compress KV bundles, inspect compressed buffers",
                       description="calibrate: run the demo model (or --model) over calibration text and write the "
                                   "KVTC calibration OUT (safetensors); compress: a KVX bundle's KV -> a KVTC buffer "
                                   "OUT with calibration CAL; decompress: a KVTC buffer -> a BF16 KVX bundle any "
                                   "engine imports; inspect: print a KVTC buffer's header (checksum checked). Every "
                                   "output is a new file (an existing one is refused, never replaced). Exit 2 "
                                   "with one line, before any work, when an argument or input is refused.")
    p.add_argument("action", choices=("calibrate", "compress", "decompress", "inspect"))
    p.add_argument("paths", nargs="+",
                   help="calibrate: OUT; compress: CAL BUNDLE OUT; decompress: CAL FILE OUT_BUNDLE; inspect: FILE")
    p.add_argument("--model", default=None, help="calibrate: a checkpoint directory (default: the demo's SmolLM2)")
    p.add_argument("--windows", type=bounded_int(1, MAX_WINDOWS), default=4,
                   help="calibrate: windows of calibration text (default 4)")
    p.add_argument("--window-len", type=bounded_int(2, MAX_WINDOW_LEN), default=1024,
                   help="calibrate: tokens per window (default 1024)")
    p.add_argument("--ratio", type=bounded_float(1.0, MAX_RATIO), default=16.0,
                   help=f"calibrate: target ratio vs BF16 of coded tokens, in [1, {MAX_RATIO:g}] (default 16)")
    p.add_argument("--layers-per-group", type=bounded_int(1, UINT32_MAX), default=6,
                   help="calibrate: layers coded together; must divide the model's layers (default 6)")
    p.add_argument("--range-size", type=bounded_int(4, MAX_RANGE_SIZE), default=16,
                   help="calibrate: components per quantized range, a multiple of 4 (default 16)")
    p.add_argument("--sink", type=bounded_int(0, MAX_WINDOW_LEN), default=4,
                   help="calibrate: first tokens kept raw (attention sinks), fewer than --window-len (default 4)")
    p.add_argument("--recent", type=bounded_int(0, MAX_POSITION), default=64,
                   help="calibrate: last tokens of a buffer kept raw (default 64)")
    p.add_argument("--no-rope-removal", action="store_true",
                   help="calibrate: code keys with their RoPE (default: removed when the model's RoPE is the "
                        "default form)")
    p.add_argument("--joint", action="store_true", help="calibrate: K and V of a group share one byte budget")
    p.add_argument("--deflate", action="store_true", help="compress: DEFLATE the coded body (lossless)")
    p.add_argument("--json", action="store_true", help="inspect: print JSON")
    p.add_argument("--progress", action="store_true",
                   help="calibrate: progress on stderr also when it is not a terminal (default: only on a terminal)")
    p.set_defaults(run=run)


def _paths(args: argparse.Namespace, n: int, usage: str) -> list[str]:
    if len(args.paths) != n:
        raise KvxError(Status.INVALID_ARGUMENT, f"kvtc {args.action} takes {usage}")
    return args.paths


def _calibrate(args: argparse.Namespace) -> int:
    (out,) = _paths(args, 1, "OUT")
    check_output(out)
    require(args.range_size % 4 == 0, Status.INVALID_ARGUMENT,
            f"--range-size {args.range_size} is not a multiple of 4")
    require(args.sink < args.window_len, Status.INVALID_ARGUMENT,
            f"--sink {args.sink} leaves no token of a {args.window_len}-token window to calibrate on")
    from kvx_core.kvtc import calibrate
    from kvx_core.kvtc.rope import rope_theta_of
    from kvx_core.transfer import checkpoint_fingerprint
    from kvx_demo.kvtc_eval import collect_kv
    from kvx_demo.model import load_model, read_checkpoint_config
    from kvx_demo.text import load_windows

    if args.model is not None:  # its config, before the weights load
        _check_groups(read_checkpoint_config(args.model), args.layers_per_group)
    lm = load_model(args.model)
    _check_groups(lm.config, args.layers_per_group)
    fp = checkpoint_fingerprint(str(lm.source)) if lm.source.is_dir() else None
    model = {} if fp is None else asdict(fp)
    start = time.perf_counter()
    enabled = True if args.progress else None
    seen = Progress("kvtc calibrate: K/V of window", args.windows, enabled=enabled)
    kv = collect_kv(lm.model, load_windows(lm.tokenizer, args.windows, args.window_len), seen.step)
    groups = Progress("kvtc calibrate: fitting layer group", lm.config.num_hidden_layers // args.layers_per_group,
                      enabled=enabled)
    cal = calibrate(kv, layers_per_group=args.layers_per_group, ratio=args.ratio, range_size=args.range_size,
                    sink_tokens=args.sink, recent_tokens=args.recent, model=model,
                    rope_theta=None if args.no_rope_removal else rope_theta_of(lm.config), joint=args.joint,
                    progress=lambda g: groups.step(f"group {g}"))
    ident = cal.save(out)
    print(f"{out}: KVTC calibration {ident[:16]}... ({cal.num_layers} layers in groups of {cal.layers_per_group}, "
          f"{args.windows} x {args.window_len} tokens, {time.perf_counter() - start:.1f} s)")
    return 0


def _check_groups(config, layers_per_group: int) -> None:
    """--layers-per-group must divide the model's layers (KvxError otherwise)."""
    layers = config.num_hidden_layers
    require(layers % layers_per_group == 0, Status.INVALID_ARGUMENT,
            f"--layers-per-group {layers_per_group} does not divide the model's {layers} layers")


def _write_bytes(data: bytes) -> Callable[[str], None]:
    """A `publish` writer of `data`."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
    return write


def _compress(args: argparse.Namespace) -> int:
    cal_path, bundle, out = _paths(args, 3, "CAL BUNDLE OUT")
    check_output(out)
    expect_kind(cal_path, "kvtc-calibration")
    expect_kind(bundle, "bundle")
    from kvx_core.kvtc import load_calibration, read_header
    from kvx_core.transfer.kvtc_bundle import encode_bundle

    cal = load_calibration(cal_path)
    with open_input(bundle) as f:
        buf = encode_bundle(f, cal, deflate=args.deflate)
    publish(out, _write_bytes(buf))
    hdr = read_header(buf)
    raw = 2 * hdr.num_layers * hdr.token_count * hdr.num_kv_heads * hdr.head_dim * 2
    print(f"{out}: {hdr.num_layers} layers x {hdr.token_count} tokens, {len(buf)} bytes "
          f"({raw / len(buf):.2f}x vs BF16)")
    return 0


def _decompress(args: argparse.Namespace) -> int:
    cal_path, path, out = _paths(args, 3, "CAL FILE OUT_BUNDLE")
    check_output(out)
    expect_kind(cal_path, "kvtc-calibration")
    expect_kind(path, "kvtc")
    from kvx_core.kvtc import load_calibration
    from kvx_core.kvtc.codec import read_file
    from kvx_core.transfer.kvtc_bundle import decode_bundle

    cal = load_calibration(cal_path)
    with open_input(path) as f:
        _, buf = read_file(f)

    def write(tmp: str) -> dict:
        with open(tmp, "wb") as f:
            return decode_bundle(buf, cal, f)

    header = publish(out, write)
    n = header["tokens"]["count"]
    print(f"{out}: bf16 bundle of {cal.num_layers} layers x {n} tokens"
          + (" (token ids included)" if header["tokens"].get("ids") else ""))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    (path,) = _paths(args, 1, "FILE")
    expect_kind(path, "kvtc")
    from kvx_core.kvtc.codec import read_file

    with open_input(path) as f:
        hdr, _ = read_file(f, keep=False)
    d = hdr.to_json()
    if args.json:
        print(json.dumps(d, indent=1, sort_keys=True))
    else:
        w = max(len(k) for k in d)
        for k, v in d.items():
            print(f"{k:<{w}}  {v}")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"calibrate": _calibrate, "compress": _compress, "decompress": _decompress,
            "inspect": _inspect}[args.action](args)
