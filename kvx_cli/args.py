"""argparse pieces shared by the `kvx` subcommands: bounded integers, one-line usage errors, input files.

Every numeric option is checked by its `type=` while the command line is parsed, so a bad value
is refused before any work (no allocation, no model load) with one line and exit code 2.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import BinaryIO, NoReturn

from kvx_core.errors import KvxError, Status

UINT32_MAX = 2**32 - 1  # the C ABI's sizes (num_blocks, block_size, num_kv_heads, head_dim) are uint32


class UsageError(Exception):
    """A command line that argparse refused; `kvx_cli.main.main` prints it as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line instead of a usage block plus SystemExit.

    Subparsers inherit the class, so `kvx inspect --num-blocks -1` fails the same way.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse `type=` accepting a decimal integer in [lo, hi] and refusing anything else."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi}]")
        return value

    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def bounded_float(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse `type=` accepting a finite number in [lo, hi] and refusing anything else (nan, inf, words)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number in [{lo:g}, {hi:g}]")
        return value

    parse.__name__ = f"number in [{lo:g}, {hi:g}]"
    return parse


def open_input(path: str) -> BinaryIO:
    """An input file opened for binary reading; KvxError (exit 2, one line) when there is no such file."""
    if not os.path.isfile(path):
        raise KvxError(Status.INVALID_ARGUMENT, f"{path}: no such file")
    return open(path, "rb")
