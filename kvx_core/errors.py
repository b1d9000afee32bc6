"""KVX status codes (spec §8) and the one exception type every KVX entry point raises."""
from __future__ import annotations

import enum
import operator


class Status(enum.IntEnum):
    """`kvx_status_t`: values are part of the C ABI (kvx_abi.h)."""

    OK = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    OUT_OF_RANGE = 3
    INCOMPATIBLE = 4
    INTERNAL_ERROR = 5


class KvxError(Exception):
    """A KVX failure carrying the spec status code and a message the user can act on."""

    def __init__(self, status: Status, message: str) -> None:
        self.status = Status(status)
        self.message = message
        super().__init__(f"[KVX_STATUS_{self.status.name}] {message}")


def int_value(value: object) -> int | None:
    """The int `value` stands for: a Python int or an integer scalar of NumPy / torch (anything with
    `__index__`); None for anything else, bools included (True is no count, size or enum)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def require(cond: bool, status: Status, message: str) -> None:
    """Raise `KvxError(status, message)` unless `cond` holds."""
    if not cond:
        raise KvxError(status, message)
