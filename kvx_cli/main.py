"""`kvx` entry point: dispatches to the subcommands.

A refused command line (argparse) and any KvxError both end as one line on stderr and exit code 2,
also when `main` is called in process (it returns 2 instead of raising SystemExit).
"""
from __future__ import annotations

import importlib.metadata
import sys

from kvx_core.abi.version import ABI_VERSION
from kvx_core.errors import KvxError

from . import bundle_cmd, calibrate_kv_cmd, config_cmd, demo_cmd, doctor_cmd, inspect_cmd, kvtc_cmd
from .args import Parser, UsageError


def _fail(message: str) -> int:
    """Print `message` as a single line (newlines folded) on stderr; the exit code of a refused call."""
    print(" ".join(message.splitlines()), file=sys.stderr)
    return 2


def version() -> str:
    """What `kvx --version` prints: the installed distribution's version and the C ABI version this code speaks."""
    try:
        dist = importlib.metadata.version("kvx")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        dist = "(not installed)"
    return f"kvx {dist}, KVX ABI {'.'.join(map(str, ABI_VERSION))}"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="kvx", description="KVX: paged, quantized KV caches across engines",
                    epilog="exit status: 0 on success; 2 when an argument or input is refused, "
                           "with one line on stderr")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    inspect_cmd.add_parser(sub)
    demo_cmd.add_parser(sub)
    bundle_cmd.add_parser(sub)
    kvtc_cmd.add_parser(sub)
    calibrate_kv_cmd.add_parser(sub)
    doctor_cmd.add_parser(sub)
    config_cmd.add_parser(sub)
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return _fail(str(e))
    try:
        return args.run(args)
    except KvxError as e:
        return _fail(f"kvx {args.command}: error: {e}")


if __name__ == "__main__":
    sys.exit(main())
