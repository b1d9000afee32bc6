"""`kvx kvtc calibrate OUT`, `kvx kvtc compress CAL BUNDLE OUT`, `kvx kvtc inspect FILE`: KVTC transform coding
of KV caches (kvx_core.kvtc) from the command line. Every output is a new file (an existing one is refused)."""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

from kvx_core.errors import KvxError, Status

from .args import open_input


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kvtc", help="KVTC: calibrate, compress KV bundles, inspect compressed buffers",
                       description="calibrate: run the demo model (or --model) over calibration text and write the "
                                   "KVTC calibration OUT (safetensors); compress: a KVX bundle's KV -> a KVTC buffer "
                                   "OUT with calibration CAL; decompress: a KVTC buffer -> a BF16 KVX bundle any "
                                   "engine imports; inspect: print a KVTC buffer's header (checksum checked). Exit 2 "
                                   "with one line when an input is refused.")
    p.add_argument("action", choices=("calibrate", "compress", "decompress", "inspect"))
    p.add_argument("paths", nargs="+",
                   help="calibrate: OUT; compress: CAL BUNDLE OUT; decompress: CAL FILE OUT_BUNDLE; inspect: FILE")
    p.add_argument("--model", default=None, help="calibrate: a checkpoint directory (default: the demo's SmolLM2)")
    p.add_argument("--windows", type=int, default=4, help="calibrate: windows of calibration text (default 4)")
    p.add_argument("--window-len", type=int, default=1024, help="calibrate: tokens per window (default 1024)")
    p.add_argument("--ratio", type=float, default=16.0, help="calibrate: target ratio vs BF16 of coded tokens")
    p.add_argument("--layers-per-group", type=int, default=6)
    p.add_argument("--range-size", type=int, default=16)
    p.add_argument("--sink", type=int, default=4, help="calibrate: first tokens kept raw (attention sinks)")
    p.add_argument("--recent", type=int, default=64, help="calibrate: last tokens of a buffer kept raw")
    p.add_argument("--no-rope-removal", action="store_true",
                   help="calibrate: code keys with their RoPE (default: removed when the model's RoPE is the default form)")
    p.add_argument("--joint", action="store_true", help="calibrate: K and V of a group share one byte budget")
    p.add_argument("--deflate", action="store_true", help="compress: DEFLATE the coded body (lossless)")
    p.add_argument("--json", action="store_true", help="inspect: print JSON")
    p.set_defaults(run=run)


def _paths(args: argparse.Namespace, n: int, usage: str) -> list[str]:
    if len(args.paths) != n:
        raise KvxError(Status.INVALID_ARGUMENT, f"kvtc {args.action} takes {usage}")
    return args.paths


def _new_file(path: str) -> None:
    if os.path.exists(path):
        raise KvxError(Status.INVALID_ARGUMENT, f"{path} exists; kvx kvtc writes new files only")


def _calibrate(args: argparse.Namespace) -> int:
    (out,) = _paths(args, 1, "OUT")
    _new_file(out)
    from kvx_core.kvtc import calibrate
    from kvx_core.kvtc.rope import rope_theta_of
    from kvx_core.transfer import checkpoint_fingerprint
    from kvx_demo.kvtc_eval import collect_kv
    from kvx_demo.model import load_model
    from kvx_demo.text import load_windows

    lm = load_model(args.model)
    fp = checkpoint_fingerprint(str(lm.source)) if lm.source.is_dir() else None
    model = {} if fp is None else asdict(fp)
    start = time.perf_counter()
    kv = collect_kv(lm.model, load_windows(lm.tokenizer, args.windows, args.window_len))
    cal = calibrate(kv, layers_per_group=args.layers_per_group, ratio=args.ratio, range_size=args.range_size,
                    sink_tokens=args.sink, recent_tokens=args.recent, model=model,
                    rope_theta=None if args.no_rope_removal else rope_theta_of(lm.config), joint=args.joint)
    ident = cal.save(out)
    print(f"{out}: KVTC calibration {ident[:16]}... ({cal.num_layers} layers in groups of {cal.layers_per_group}, "
          f"{args.windows} x {args.window_len} tokens, {time.perf_counter() - start:.1f} s)")
    return 0


def _compress(args: argparse.Namespace) -> int:
    cal_path, bundle, out = _paths(args, 3, "CAL BUNDLE OUT")
    _new_file(out)
    from kvx_core.kvtc import load_calibration, read_header
    from kvx_core.kvtc.bundle import encode_bundle

    cal = load_calibration(cal_path)
    with open_input(bundle) as f:
        buf = encode_bundle(f, cal, deflate=args.deflate)
    with open(out, "xb") as f:
        f.write(buf)
    hdr = read_header(buf)
    raw = 2 * hdr.num_layers * hdr.token_count * hdr.num_kv_heads * hdr.head_dim * 2
    print(f"{out}: {hdr.num_layers} layers x {hdr.token_count} tokens, {len(buf)} bytes "
          f"({raw / len(buf):.2f}x vs BF16)")
    return 0


def _decompress(args: argparse.Namespace) -> int:
    cal_path, path, out = _paths(args, 3, "CAL FILE OUT_BUNDLE")
    _new_file(out)
    from kvx_core.kvtc import load_calibration
    from kvx_core.kvtc.bundle import decode_bundle

    cal = load_calibration(cal_path)
    with open_input(path) as f:
        buf = f.read()
    with open(out, "xb") as f:
        header = decode_bundle(buf, cal, f)
    n = header["tokens"]["count"]
    print(f"{out}: bf16 bundle of {cal.num_layers} layers x {n} tokens"
          + (" (token ids included)" if header["tokens"].get("ids") else ""))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    (path,) = _paths(args, 1, "FILE")
    from kvx_core.kvtc import read_header

    with open_input(path) as f:
        hdr = read_header(f.read())
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
