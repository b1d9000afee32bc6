"""Strict JSON for bytes from outside (bundle headers, calibration metadata, tickets, environment variables).

`json.loads` accepts `NaN` / `Infinity` (not JSON), raises `ValueError` / `UnicodeDecodeError` on bad text and
`RecursionError` on deep nesting: a forged file would crash the reader instead of being refused. Every reader of
outside JSON calls `loads`, which raises only `KvxError` (INVALID_ARGUMENT), naming `what` it was reading.
"""
from __future__ import annotations

import json
import math

from .errors import KvxError, Status

MAX_DEPTH = 64
"""Nesting deeper than this is refused before parsing: no KVX document nests more than a few levels."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth(text: str) -> int:
    """The deepest nesting of `[` / `{` outside strings (a linear scan: the parser recurses, this does not)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads(data: bytes | bytearray | memoryview | str, what: str) -> object:
    """The JSON value in `data` (UTF-8); KvxError(INVALID_ARGUMENT) naming `what` for anything that is not strict
    JSON nested at most `MAX_DEPTH` deep (NaN, Infinity, bad UTF-8, syntax errors, deep nesting)."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    # nesting is at most the count of opening brackets (counted in C): the scan in Python only when that is not
    # already within the bound (a bundle header with 4096 token ids spent 1.4 ms in the scan)
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} is not valid JSON: {e}") from None


def loads_object(data: bytes | bytearray | memoryview | str, what: str) -> dict:
    """`loads` for a document that must be a JSON object."""
    value = loads(data, what)
    if not isinstance(value, dict):
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def finite_number(value: object) -> float | None:
    """A JSON number (an int or float, not a bool) as a finite float; None for anything else, an int beyond the
    float range included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None
