"""KVX's safetensors files (KVTC calibration, KV-cache calibration): the content hash that names a file's contents,
a checked read and an atomic write that never replaces a file unless asked. No pickle anywhere: safetensors holds
raw tensors and string metadata only."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import torch

from .errors import KvxError, Status, require
from .files import publish


def content_hash(params: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the JSON parameters (sorted keys) and every tensor's name and bytes, in name order: a file's
    identity, recomputed on load to detect damaged or edited contents."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (safetensors dtype name such as "F32", shape): what a reader expects a file to hold."""


def read_tensor_file(path: str, *, max_bytes: int | None = None,
                     expect: Callable[[dict[str, str]], TensorSpecs] | None = None,
                     ) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file on the CPU; KvxError INVALID_ARGUMENT when it is missing, foreign
    or damaged. `max_bytes`: a larger file is refused before it is opened. `expect(metadata)` (which raises KvxError
    for metadata it refuses) names the exact tensors, dtypes and shapes the file must hold: the declared ones are
    compared with it before any tensor is read, so a forged shape allocates nothing."""
    from safetensors import safe_open

    require(os.path.isfile(path), Status.INVALID_ARGUMENT, f"{path}: no such file")
    size = os.path.getsize(path)
    require(max_bytes is None or size <= max_bytes, Status.INVALID_ARGUMENT,
            f"{path}: {size} bytes, more than the {max_bytes} this file type may hold")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            if expect is not None:
                want = expect(meta)
                got = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
                if got != want:
                    bad = sorted(set(got) ^ set(want)) or sorted(k for k in got if got[k] != want[k])
                    name = bad[0]
                    raise KvxError(Status.INVALID_ARGUMENT, f"{path}: tensor {name} is {got.get(name, 'missing')}, "
                                   f"its metadata implies {want.get(name, 'none')}")
            return meta, {k: f.get_tensor(k) for k in f.keys()}
    except KvxError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for foreign or damaged files
        raise KvxError(Status.INVALID_ARGUMENT, f"{path}: not a readable safetensors file ({e})") from None


def write_tensor_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                      overwrite: bool = False) -> None:
    """Write a safetensors file through a temporary file in the same directory (`files.publish`): readers never see
    a partial file, and an existing file is refused (KvxError) unless `overwrite`, also when another writer creates
    it meanwhile."""
    from safetensors.torch import save_file

    publish(path, lambda tmp: save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp,
                                        metadata=metadata), overwrite=overwrite)
