"""KVX's safetensors files (KVTC calibration, KV-cache calibration): the content hash that names a file's contents,
a checked read and an atomic write that never replaces a file unless asked. No pickle anywhere: safetensors holds
raw tensors and string metadata only."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch

from .errors import KvxError, Status, require


def content_hash(params: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the JSON parameters (sorted keys) and every tensor's name and bytes, in name order: a file's
    identity, recomputed on load to detect damaged or edited contents."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_tensor_file(path: str, max_bytes: int | None = None) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file on the CPU; KvxError INVALID_ARGUMENT when it is missing, not a
    regular file, larger than `max_bytes` (the caller's stated cap, checked before a byte is read, so what is
    allocated is bounded by it), foreign or damaged. safetensors itself refuses a tensor whose declared dtype and
    shape do not match the bytes present."""
    from safetensors import safe_open

    require(os.path.isfile(path), Status.INVALID_ARGUMENT, f"{path}: no such file")
    size = os.path.getsize(path)
    require(max_bytes is None or size <= max_bytes, Status.INVALID_ARGUMENT,
            f"{path}: {size} bytes, more than the {max_bytes} this file type may hold")
    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for foreign or damaged files
        raise KvxError(Status.INVALID_ARGUMENT, f"{path}: not a readable safetensors file ({e})") from None


def write_tensor_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                      overwrite: bool = False) -> None:
    """Write a safetensors file through a temporary file in the same directory, then link (new files) or rename
    (`overwrite`) it into place: readers never see a partial file, and an existing file is refused (KvxError)
    unless `overwrite`, also when another writer creates it meanwhile; `overwrite` replaces regular files only (not
    a directory, device or FIFO); a folder it cannot create the temporary file in is refused (KvxError) too."""
    from safetensors.torch import save_file

    exists = f"{path} exists; KVX never overwrites a file without an explicit overwrite"
    require(overwrite or not os.path.lexists(path), Status.INVALID_ARGUMENT, exists)
    require(not os.path.lexists(path) or os.path.isfile(path), Status.INVALID_ARGUMENT,
            f"{path} exists and is not a regular file (a directory, device or FIFO): KVX replaces only files")
    folder = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(folder), Status.INVALID_ARGUMENT, f"{folder}: no such directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvx-", suffix=".tmp", dir=folder)
    except OSError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{folder}: cannot write there ({e.strerror})") from None
    os.close(fd)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic, and fails if the name exists
            except FileExistsError:
                raise KvxError(Status.INVALID_ARGUMENT, exists) from None
            except OSError:  # a file system without hard links: check, then rename (a concurrent writer could race)
                require(not os.path.exists(path), Status.INVALID_ARGUMENT, exists)
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
