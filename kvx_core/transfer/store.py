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
deletes its own `*.kvx` / `*.kvxset` / `.tmp-*` files.

Tensor parallelism: a producer of tensor-parallel size M > 1 stores an entry as a shard set: one bundle per distinct
KV-head range of its ranks (`tp.shard_ranges`; replicas of a head write nothing), `<key>.tp<M>-<i>.kvx`, then a
manifest `<key>.kvxset` naming M and each shard's head range and size, published (renamed into place) by whichever
writer finds every shard present, so a reader never sees a half-written set. A reader requires the manifest and
every shard it names at its declared size and with its declared head range, and imports from all of them (every
shard's checksums verified, whatever head range the importer holds): any missing or damaged shard refuses the whole
entry. The manifest is outside bytes: at most `MAX_MANIFEST_BYTES`, strict JSON (`jsonsafe`), exactly its three
keys, `tp_size` an integer up to `MAX_TP_SIZE`, shard ranges exactly vLLM's split of the model's KV heads over
`tp_size` ranks (so they tile them, no overlap, no gap).
"""
from __future__ import annotations

import contextlib
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
from ..files import new_file_mode
from ..jsonsafe import loads_object
from ..kvtc.codec import MAGIC as KVTC_MAGIC
from .bundle import BundleReader
from .kvtc_bundle import decode_bundle, encode_bundle, entry_header
from .handoff import ModelFingerprint, export_bundle, import_bundle
from .schema import token_bytes
from .tp import shard_ranges, tp_head_range, writes_shard

MARKER = "kvx_bundle_store.json"
MAX_MANIFEST_BYTES = 1 << 16
"""A shard set's manifest is ~50 bytes per shard; a larger file is refused after reading one byte past this."""
MAX_TP_SIZE = 1 << 12
"""The largest tensor-parallel size a manifest may declare (shard files are named by it)."""


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
        """Whether the entry is there: its plain bundle or a shard set's manifest (published last)."""
        return self.path(*entry).is_file() or self._set_path(*entry).is_file()

    def put(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
            token_ids: Sequence[int]) -> Path:
        """Offload the sequence `token_ids` (its KV at `slots` of `caches`); replaces an older entry atomically."""
        return self.write_entry(model, token_ids,
                                lambda f: export_bundle(f, caches, slots, model=model, token_ids=token_ids))

    def write_entry(self, model: ModelFingerprint, token_ids: Sequence[int], write: Callable[[BinaryIO], object]) -> Path:
        """Publish the bundle `write(file)` writes as the entry of `token_ids`: into a temporary file, synced, then
        renamed into place (a failure leaves no file and the older entry, if any). A KVTC store compresses it first."""
        final = self.path(model, token_ids)
        self._publish(final, self._coded(write))
        return final

    def write_shard(self, model: ModelFingerprint, token_ids: Sequence[int], tp_size: int, tp_rank: int,
                    write: Callable[[BinaryIO], object]) -> Path | None:
        """Publish rank `tp_rank`'s bundle (`write(file)` exports its KV heads, `tp.tp_head_range`) as its shard of
        the entry of a tensor-parallel size `tp_size` producer, then the set's manifest if every shard is present
        now. None (nothing written) for a rank replicating a head an earlier rank exports; with one range in all
        (`tp_size` 1, or every rank holding all heads) the entry is a plain bundle (`write_entry`)."""
        ranges = shard_ranges(model.num_kv_heads, tp_size)
        if not writes_shard(model.num_kv_heads, tp_size, tp_rank):
            return None
        if len(ranges) == 1:
            return self.write_entry(model, token_ids, write)
        final = self._shard_path(model, token_ids, tp_size, ranges.index(tp_head_range(model.num_kv_heads, tp_size,
                                                                                          tp_rank)))
        self._publish(final, self._coded(write))
        sizes = []
        for i in range(len(ranges)):  # after our own rename: of two last writers, the later one sees both shards
            try:
                sizes.append(self._shard_path(model, token_ids, tp_size, i).stat().st_size)
            except FileNotFoundError:
                return final
            except OSError as e:
                raise _failed(final, "written", e) from None
        manifest = json.dumps({"kvx_shard_set": 1, "tp_size": tp_size,
                               "shards": [{"kv_heads": list(r), "bytes": n} for r, n in zip(ranges, sizes)]})
        self._publish(self._set_path(model, token_ids), lambda f: f.write(manifest.encode()))
        return final

    def _coded(self, write: Callable[[BinaryIO], object]) -> Callable[[BinaryIO], object]:
        """`write`, or in a KVTC store a writer of its bundle KVTC-compressed."""
        if self.kvtc is None:
            return write
        bundle = io.BytesIO()
        write(bundle)
        bundle.seek(0)
        coded = encode_bundle(bundle, self.kvtc)
        return lambda f: f.write(coded)

    def _publish(self, final: Path, write: Callable[[BinaryIO], object]) -> None:
        """Write `final` atomically: into a temporary file, synced, then renamed into place (a failure leaves no
        file and the older one, if any)."""
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=final.suffix, dir=self.root)
        except OSError as e:
            raise _failed(final, "written", e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(fd, new_file_mode())  # mkstemp makes 0600: engines of other users share a store
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as e:
            os.unlink(tmp)
            if isinstance(e, OSError):  # a full disk, a directory in the entry's place
                raise _failed(final, "written", e) from None
            raise

    def _shard_path(self, model: ModelFingerprint, token_ids: Sequence[int], tp_size: int, index: int) -> Path:
        return self.root / f"{self.key(model, token_ids)}.tp{tp_size}-{index}.kvx"

    def _set_path(self, model: ModelFingerprint, token_ids: Sequence[int]) -> Path:
        return self.root / f"{self.key(model, token_ids)}.kvxset"

    def _files(self, model: ModelFingerprint, token_ids: Sequence[int]) -> list[tuple[Path, tuple[int, int]]] | None:
        """The entry's bundle files and the KV heads each holds: the plain bundle (all heads) when there is one,
        else the shards its manifest names (checked, each present at its declared size), None when absent."""
        plain = self.path(model, token_ids)
        if os.path.lexists(plain):
            return [(plain, (0, model.num_kv_heads))]
        path = self._set_path(model, token_ids)
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _failed(path, "read", e) from None
        what = f"bundle store manifest {path}"
        require(len(raw) <= MAX_MANIFEST_BYTES, Status.INVALID_ARGUMENT,
                f"{what}: larger than {MAX_MANIFEST_BYTES} bytes")
        doc = loads_object(raw, what)
        tp, shards = doc.get("tp_size"), doc.get("shards")
        require(set(doc) == {"kvx_shard_set", "tp_size", "shards"} and _is_int(doc["kvx_shard_set"], 1, 1)
                and _is_int(tp, 1, MAX_TP_SIZE) and isinstance(shards, list), Status.INVALID_ARGUMENT,
                f"{what}: must be {{\"kvx_shard_set\": 1, \"tp_size\": 1..{MAX_TP_SIZE}, \"shards\": [...]}}")
        want = shard_ranges(model.num_kv_heads, tp)
        got = [s.get("kv_heads") if isinstance(s, dict) else None for s in shards]
        require(len(got) == len(want) and all(isinstance(g, list) and all(type(x) is int for x in g)
                                              and tuple(g) == r for g, r in zip(got, want)), Status.INVALID_ARGUMENT,
                f"{what}: its shards must hold KV heads {want} (the model's {model.num_kv_heads} split over {tp} "
                f"ranks: a tiling, no overlap, no gap), not {str(got)[:200]}")
        files = []
        for i, (s, r) in enumerate(zip(shards, want)):
            shard = self._shard_path(model, token_ids, tp, i)
            require(set(s) == {"kv_heads", "bytes"} and _is_int(s["bytes"], 1, 2**63), Status.INVALID_ARGUMENT,
                    f"{what}: shard {i} must be {{\"kv_heads\": [start, stop], \"bytes\": size}}")
            try:
                size = shard.stat().st_size if shard.is_file() else None
            except OSError as e:
                raise _failed(shard, "read", e) from None
            require(size == s["bytes"], Status.INVALID_ARGUMENT,
                    f"{what}: shard {i} ({shard.name}) is {'missing' if size is None else f'{size} bytes'}, the "
                    f"manifest says {s['bytes']} bytes")
            files.append((shard, r))
        return files

    def _open(self, path: Path) -> tuple[BinaryIO | None, bytes | None]:
        """(the file's stream, None) for a bundle, (None, its bytes) for a KVTC buffer, (None, None) if absent;
        KvxError for a file that cannot be read (a directory in its place, no permission, an I/O error)."""
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

    def _open_bundle(self, path: Path, model: ModelFingerprint) -> BinaryIO | None:
        """A bundle file as a stream (a KVTC one decompressed into a BF16 bundle), None when absent."""
        f, coded = self._open(path)
        if coded is None:
            return f
        entry_header(coded, self.kvtc, model)
        out = io.BytesIO()
        decode_bundle(coded, self.kvtc, out, model=model)
        out.seek(0)
        return out

    def _header(self, path: Path, model: ModelFingerprint) -> dict | None:
        """A bundle file's checked header (chunks not read; a KVTC buffer's without decoding), None when absent."""
        f, coded = self._open(path)
        if coded is not None:
            return entry_header(coded, self.kvtc, model)[1]
        if f is None:
            return None
        with f:
            try:
                return BundleReader(f).header
            except OSError as e:
                raise _failed(path, "read", e) from None

    def open_entry(self, model: ModelFingerprint, token_ids: Sequence[int]) -> BinaryIO | None:
        """The entry of `token_ids` as a bundle stream (the caller closes it), None when absent; a KVTC entry is
        decompressed into a BF16 bundle (KvxError without its calibration, or for another model). A shard set
        (tensor-parallel producer) is UNSUPPORTED here: `open_shards` reads it."""
        files = self._files(model, token_ids)
        if files is None:
            return None
        require(len(files) == 1, Status.UNSUPPORTED, f"bundle store entry {files[0][0].name}: a tensor-parallel "
                "shard set; import it with open_shards / get")
        return self._open_bundle(files[0][0], model)

    def open_shards(self, model: ModelFingerprint, token_ids: Sequence[int]) -> list[BinaryIO] | None:
        """Every bundle of the entry of `token_ids` as streams (one for a plain entry; the caller closes them),
        None when absent; KvxError when a shard named by the manifest is missing, of another size, or its header
        declares other KV heads or tokens than the set's (a swapped or foreign shard): nothing is returned open."""
        files = self._files(model, token_ids)
        if files is None:
            return None
        streams: list[BinaryIO] = []
        headers: list[dict] = []
        try:
            for path, heads in files:
                f = self._open_bundle(path, model)
                require(f is not None, Status.INVALID_ARGUMENT, f"bundle store entry {path}: gone while read")
                streams.append(f)
                if len(files) > 1:
                    try:
                        headers.append(BundleReader(f).header)
                        f.seek(0)
                    except OSError as e:
                        raise _failed(path, "read", e) from None
                    _check_shard(path, headers[-1], heads, headers[0])
        except BaseException:
            for f in streams:
                f.close()
            raise
        return streams

    def header(self, model: ModelFingerprint, token_ids: Sequence[int]) -> dict | None:
        """The header of the entry of `token_ids` (checked, hash included; chunks not read), None when absent; of a
        shard set, its first shard's, after checking every shard's header against the manifest. A KVTC entry gives,
        without decoding, the model, token count, cache geometry (BF16) and codec of the bundle it decodes to
        (`kvtc_bundle.entry_header`)."""
        files = self._files(model, token_ids)
        if files is None:
            return None
        headers = []
        for path, heads in files:
            h = self._header(path, model)
            require(h is not None, Status.INVALID_ARGUMENT, f"bundle store entry {path}: gone while read")
            headers.append(h)
            if len(files) > 1:
                _check_shard(path, h, heads, headers[0])
        return headers[0]

    def get(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
            token_ids: Sequence[int], token_range: tuple[int, int] | None = None,
            kv_heads: tuple[int, int] | None = None) -> bool:
        """Reload the sequence (or its tokens `token_range`, see `import_bundle`) into `caches` (holding the KV
        heads `kv_heads`, default all) at `slots`, from a plain entry or every shard of a shard set: True when the
        store had it, False when not; all or nothing."""
        streams = self.open_shards(model, token_ids)
        if streams is None:
            return False
        with contextlib.ExitStack() as stack:
            for f in streams:
                stack.enter_context(f)
            try:
                import_bundle(streams, caches, slots, model=model, token_ids=token_ids, token_range=token_range,
                              kv_heads=kv_heads)
            except OSError as e:
                raise _failed(self.path(model, token_ids), "read", e) from None
        return True

    def remove(self, model: ModelFingerprint, token_ids: Sequence[int]) -> bool:
        """Delete the entry of `token_ids`, plain or shard set (manifest first: readers then see no entry), True
        when there was one."""
        key = self.key(model, token_ids)
        removed = False
        for path in [self.path(model, token_ids), self._set_path(model, token_ids),
                     *sorted(self.root.glob(f"{key}.tp*-*.kvx"))]:
            try:
                path.unlink()
                removed = True
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _failed(path, "removed", e) from None
        return removed


def _failed(path: Path, doing: str, e: OSError) -> KvxError:
    """The KvxError of a store entry the OS refused to read, write or remove."""
    return KvxError(Status.INVALID_ARGUMENT, f"bundle store entry {path} cannot be {doing}: {e.strerror or e}")


def _is_int(v: object, lo: int, hi: int) -> bool:
    """Whether a JSON value is an integer (not a bool or a float) in [lo, hi]."""
    return type(v) is int and lo <= v <= hi


def _check_shard(path: Path, header: dict, heads: tuple[int, int], first: dict) -> None:
    """A shard's header declares the head range its manifest names and the same tokens as the set's first shard."""
    require(header["cache"]["kv_heads"] == list(heads), Status.INVALID_ARGUMENT,
            f"bundle store shard {path.name}: holds KV heads {header['cache']['kv_heads']}, its manifest names "
            f"{list(heads)} (a swapped or foreign shard)")
    require(header["tokens"] == first["tokens"], Status.INVALID_ARGUMENT,
            f"bundle store shard {path.name}: holds other tokens than the set's first shard")
