"""`kvx bundle inspect | verify FILE`, `kvx bundle convert FILE OUT --format F`: what a KVX bundle holds, whether
every checksum in it holds, and the same KV re-encoded in another format."""
from __future__ import annotations

import argparse
import json
import os

from kvx_core.errors import KvxError, Status
from kvx_core.formats import list_formats
from kvx_core.transfer.bundle import BundleReader
from kvx_core.transfer.handoff import convert_bundle

from .args import open_input


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="inspect or verify a KVX KV bundle (cross-engine handoff file)",
                       description="inspect: print the header (model, tokens, format, tensors) as a table or "
                                   "JSON; verify: also read every chunk and check every checksum, the layer order, "
                                   "the trailer and the end of file; convert: write OUT (a new file, never an "
                                   "existing one) with the same KV in --format. Exit 2 with one line when a file "
                                   "is refused.")
    p.add_argument("action", choices=("inspect", "verify", "convert"))
    p.add_argument("file", help="bundle file")
    p.add_argument("out", nargs="?", help="convert: the new bundle file (must not exist)")
    p.add_argument("--json", action="store_true", help="print the header as JSON (inspect)")
    p.add_argument("--format", choices=list_formats(), help="convert: the KVX format of OUT")
    p.set_defaults(run=run)


def _convert(args: argparse.Namespace) -> int:
    if not args.out or not args.format:
        raise KvxError(Status.INVALID_ARGUMENT, "convert needs FILE OUT --format FORMAT")
    with open_input(args.file) as f:
        try:
            out = open(args.out, "xb")  # noqa: SIM115  (exclusive: an existing file is never overwritten)
        except FileExistsError:
            raise KvxError(Status.INVALID_ARGUMENT, f"{args.out} exists; convert writes a new file only") from None
        except OSError as e:
            raise KvxError(Status.INVALID_ARGUMENT, f"{args.out}: {e.strerror}") from None
        try:
            with out:
                header = convert_bundle(f, out, args.format)
        except BaseException:
            os.remove(args.out)  # the partial file this call created
            raise
    print(f"{args.out}: {header['cache']['num_layers']} layers x {header['tokens']['count']} tokens in {args.format}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "convert":
        return _convert(args)
    with open_input(args.file) as f:
        reader = BundleReader(f)
        h = reader.header
        if args.action == "verify":
            n = sum(1 for _ in reader.layers())
            print(f"{args.file}: OK, KVX bundle {reader.version[0]}.{reader.version[1]}, {n} layers x "
                  f"{reader.tokens} tokens, every checksum verified")
            return 0
    if args.json:
        print(json.dumps(h, indent=1, sort_keys=True))
        return 0
    m, c = h.get("model", {}), h["cache"]
    rows = [("bundle version", f"{reader.version[0]}.{reader.version[1]}"),
            ("model", f"{m.get('architecture')} ({m.get('num_layers')} layers, {m.get('num_kv_heads')} KV heads x "
                      f"{m.get('head_dim')})"),
            ("config / tokenizer sha256", f"{str(m.get('config_sha256'))[:16]}... / {str(m.get('tokenizer_sha256'))[:16]}..."),
            ("tokens", f"{reader.tokens}" + ("" if h["tokens"].get("ids") is None else " (ids included)")),
            ("format", c.get("format")), ("KV heads in bundle", str(c.get("kv_heads")))]
    rows += [(f"tensor {s.name}", f"{str(s.dtype).removeprefix('torch.')} {'[tokens, ' if s.per_token else '['}"
              f"{', '.join(map(str, s.shape))}] {s.nbytes(reader.tokens)} bytes/layer") for s in reader.specs]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0
