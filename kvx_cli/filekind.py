"""Which KVX file a path holds, from its first bytes, so that a command given another kind of KVX file says what it
is and which command reads it (instead of "bad magic"). A hint only: the reader of the kind still checks everything.

Kinds: a KV bundle (magic `KVXBNDL\\0`, `.kvxb`), a KVTC buffer (magic `KVTC`), and two safetensors files told
apart by their metadata key: a KV-cache calibration (`kvx_kv_calibration`, `.kvxcal`) and a KVTC calibration
(`kvx_kvtc`). Reading is capped (`MAX_SNIFF_BYTES`) whatever the file declares."""
from __future__ import annotations

import os
import struct

from kvx_core.errors import KvxError, Status
from kvx_core.kv_calibration import META_KEY
from kvx_core.kvtc.codec import MAGIC as KVTC_MAGIC
from kvx_core.transfer.bundle import MAGIC as BUNDLE_MAGIC

MAX_SNIFF_BYTES = 1 << 20
"""At most this much of a safetensors header is searched for a kind's metadata key (a calibration's header of a
126-layer model with every format is ~0.5 MiB)."""

KINDS = {
    "bundle": ("a KVX KV bundle", "kvx bundle inspect"),
    "kvtc": ("a KVTC buffer", "kvx kvtc inspect"),
    "kv-calibration": ("a KVX KV-cache calibration file", "kvx calibrate-kv inspect"),
    "kvtc-calibration": ("a KVTC calibration file", "kvx kvtc compress / decompress (as CAL)"),
}
_SAFETENSORS_KEYS = {"kv-calibration": f'"{META_KEY}"'.encode(), "kvtc-calibration": b'"kvx_kvtc"'}


def file_kind(path: str) -> str | None:
    """The kind of KVX file at `path` (a key of `KINDS`), None when it is none of them or cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head.startswith(BUNDLE_MAGIC):
                return "bundle"
            if head.startswith(KVTC_MAGIC):
                return "kvtc"
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if not 2 <= n <= os.fstat(f.fileno()).st_size - 8:
                return None
            header = f.read(min(n, MAX_SNIFF_BYTES))
    except OSError:
        return None
    if not header.startswith(b"{"):
        return None
    return next((kind for kind, key in _SAFETENSORS_KEYS.items() if key in header), None)


def expect_kind(path: str, kind: str) -> None:
    """Refuse (INVALID_ARGUMENT) a file that is another kind of KVX file than `kind`, naming what it is and the
    command that reads it; anything else passes on to the reader."""
    found = file_kind(path)
    if found is not None and found != kind:
        what, command = KINDS[found]
        raise KvxError(Status.INVALID_ARGUMENT, f"{path} is {what}, not {KINDS[kind][0]}; read it with `{command}`")
