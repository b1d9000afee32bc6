"""A directory of KVX bundles keyed by model and tokens: KV offload to disk or shared memory (`/dev/shm/...`) and
reload, also across restarts and between processes on one machine.

Each entry is one bundle file named by the sha256 of the model fingerprint and the token ids. `put` writes a
temporary file in the store and renames it into place (readers never see a partial bundle); `get` imports with
every check of `import_bundle` (a damaged file is refused and the cache left untouched). With `kvtc=` (a KVTC
calibration of the model) entries are stored KVTC-coded (`kvx_core.transfer.kvtc_bundle`): written bundles are
compressed, read entries decompressed into BF16 bundles that import into any format; a KVTC entry needs a store opened
with its calibration. An entry is outside bytes like any bundle (another process may have written, or forged, it): every read
checks it as `BundleReader` does, and a damaged, forged or unreadable entry (a directory in its place, an I/O
error) is a KvxError, which the connectors log and treat as a miss. The store owns only its directory: it creates
it with a marker file and refuses a non-empty directory without that marker, and it only ever writes, renames or
deletes its own `*.kvx` / `.tmp-*` files.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

import torch

from ..descriptors import CacheDesc
from ..errors import KvxError, Status, require
from ..kvtc.codec import MAGIC as KVTC_MAGIC
from .bundle import BundleReader
from .kvtc_bundle import decode_bundle, encode_bundle, entry_header
from .handoff import ModelFingerprint, export_bundle, import_bundle
from .schema import token_bytes

MARKER = "kvx_bundle_store.json"


class BundleStore:
    """Bundles under `root` (created when missing; an existing directory must be empty or a store); `kvtc`: a
    `kvx_core.kvtc.Calibration` to store entries KVTC-coded."""

    def __init__(self, root: str | os.PathLike, *, kvtc=None):
        self.root = Path(root)
        self.kvtc = kvtc
        marker = self.root / MARKER
        if self.root.exists():
            require(self.root.is_dir(), Status.INVALID_ARGUMENT, f"bundle store {self.root}: not a directory")
            require(marker.is_file() or not any(self.root.iterdir()), Status.INVALID_ARGUMENT,
                    f"bundle store {self.root}: a non-empty directory KVX did not create (no {MARKER}); "
                    "give a new or empty directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not marker.is_file():
                marker.write_text(json.dumps({"kvx_bundle_store": 1}))
        except OSError as e:
            raise KvxError(Status.INVALID_ARGUMENT, f"bundle store {self.root}: {e.strerror}") from None

    @staticmethod
    def key(model: ModelFingerprint, token_ids: Sequence[int]) -> str:
        """The entry name of a token sequence under a model."""
        h = hashlib.sha256(json.dumps(asdict(model), sort_keys=True).encode())
        h.update(token_bytes(token_ids))
        return h.hexdigest()

    def path(self, model: ModelFingerprint, token_ids: Sequence[int]) -> Path:
        return self.root / f"{self.key(model, token_ids)}.kvx"

    def __contains__(self, entry: tuple[ModelFingerprint, Sequence[int]]) -> bool:
        return self.path(*entry).is_file()

    def put(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
            token_ids: Sequence[int]) -> Path:
        """Offload the sequence `token_ids` (its KV at `slots` of `caches`); replaces an older entry atomically."""
        return self.write_entry(model, token_ids,
                                lambda f: export_bundle(f, caches, slots, model=model, token_ids=token_ids))

    def write_entry(self, model: ModelFingerprint, token_ids: Sequence[int], write: Callable[[BinaryIO], object]) -> Path:
        """Publish the bundle `write(file)` writes as the entry of `token_ids`: into a temporary file, synced, then
        renamed into place (a failure leaves no file and the older entry, if any). A KVTC store compresses it first."""
        final = self.path(model, token_ids)
        if self.kvtc is not None:
            bundle = io.BytesIO()
            write(bundle)
            bundle.seek(0)
            coded = encode_bundle(bundle, self.kvtc)
            write = lambda f: f.write(coded)  # noqa: E731
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".kvx", dir=self.root)
        except OSError as e:
            raise _failed(final, "written", e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as e:
            os.unlink(tmp)
            if isinstance(e, OSError):  # a full disk, a directory in the entry's place
                raise _failed(final, "written", e) from None
            raise
        return final

    def _open(self, model: ModelFingerprint, token_ids: Sequence[int]) -> tuple[BinaryIO | None, bytes | None]:
        """(the entry's file, None) for a bundle entry, (None, its bytes) for a KVTC entry, (None, None) if absent;
        KvxError for an entry that cannot be read (a directory in its place, no permission, an I/O error)."""
        path = self.path(model, token_ids)
        try:
            f = path.open("rb")
        except FileNotFoundError:
            return None, None
        except OSError as e:
            raise _failed(path, "read", e) from None
        try:
            if f.read(len(KVTC_MAGIC)) != KVTC_MAGIC:
                f.seek(0)
                return f, None
            with f:
                return None, KVTC_MAGIC + f.read()
        except OSError as e:
            f.close()
            raise _failed(path, "read", e) from None

    def open_entry(self, model: ModelFingerprint, token_ids: Sequence[int]) -> BinaryIO | None:
        """The entry of `token_ids` as a bundle stream (the caller closes it), None when absent; a KVTC entry is
        decompressed into a BF16 bundle (KvxError without its calibration, or for another model)."""
        f, coded = self._open(model, token_ids)
        if coded is None:
            return f
        entry_header(coded, self.kvtc, model)
        out = io.BytesIO()
        decode_bundle(coded, self.kvtc, out, model=model)
        out.seek(0)
        return out

    def header(self, model: ModelFingerprint, token_ids: Sequence[int]) -> dict | None:
        """The header of the entry of `token_ids` (checked, hash included; chunks not read), None when absent. A KVTC
        entry gives, without decoding, the model, token count, cache geometry (BF16) and codec of the bundle it
        decodes to (`kvtc_bundle.entry_header`)."""
        f, coded = self._open(model, token_ids)
        if coded is not None:
            return entry_header(coded, self.kvtc, model)[1]
        if f is None:
            return None
        with f:
            try:
                return BundleReader(f).header
            except OSError as e:
                raise _failed(self.path(model, token_ids), "read", e) from None

    def get(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
            token_ids: Sequence[int], token_range: tuple[int, int] | None = None) -> bool:
        """Reload the sequence (or its tokens `token_range`, see `import_bundle`) into `caches` at `slots`: True
        when the store had it, False when not."""
        f = self.open_entry(model, token_ids)
        if f is None:
            return False
        with f:
            try:
                import_bundle(f, caches, slots, model=model, token_ids=token_ids, token_range=token_range)
            except OSError as e:
                raise _failed(self.path(model, token_ids), "read", e) from None
        return True

    def remove(self, model: ModelFingerprint, token_ids: Sequence[int]) -> bool:
        """Delete the entry of `token_ids` (True when there was one)."""
        path = self.path(model, token_ids)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _failed(path, "removed", e) from None
        return True


def _failed(path: Path, doing: str, e: OSError) -> KvxError:
    """The KvxError of a store entry the OS refused to read, write or remove."""
    return KvxError(Status.INVALID_ARGUMENT, f"bundle store entry {path} cannot be {doing}: {e.strerror or e}")
