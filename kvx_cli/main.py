"""`kvx` entry point: dispatches to the subcommands; KvxErrors become one-line messages and exit code 2."""
from __future__ import annotations

import argparse
import sys

from kvx_core.errors import KvxError

from . import demo_cmd, inspect_cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvx", description="KVX: paged, quantized KV caches across engines")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect_cmd.add_parser(sub)
    demo_cmd.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KvxError as e:
        print(f"kvx {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
