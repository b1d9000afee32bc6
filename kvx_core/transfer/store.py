"""A directory of KVX bundles keyed by model and tokens: KV offload to disk or shared memory (`/dev/shm/...`) and
reload, also across restarts and between processes on one machine.

Each entry is one bundle file named by the sha256 of the model fingerprint and the token ids. `put` writes a
temporary file in the store and renames it into place (readers never see a partial bundle); `get` imports with
every check of `import_bundle` (a damaged file is refused and the cache left untouched). With `kvtc=` (a KVTC
calibration of the model) entries are stored KVTC-coded (`kvx_core.transfer.kvtc_bundle`): written bundles are
compressed, read entries decompressed into BF16 bundles that import into any format; a KVTC entry needs a store opened
with its calibration. An entry is outside bytes like any bundle (another process may have written, or forged, it): every
read checks it as `BundleReader` does, and a damaged, forged or unreadable entry (a directory in its place, an I/O
error) is a KvxError, which the connectors log and treat as a miss. The store owns only its directory: it creates
it with a marker file and refuses a non-empty directory without that marker, and it only ever writes, renames or
deletes its own `*.kvx` / `*.kvxset` / `*.kvxp` / `.tmp-*` files.

Tensor parallelism: a producer of tensor-parallel size M > 1 stores an entry as a shard set: one bundle per distinct
KV-head range of its ranks (`tp.shard_ranges`; replicas of a head write nothing), `<key>.tp<M>-<i>.kvx`, then a
manifest `<key>.kvxset` naming M and each shard's head range and size, published (renamed into place) by whichever
writer finds every shard present, so a reader never sees a half-written set. A reader requires the manifest and
every shard it names at its declared size and with its declared head range, and imports from all of them (every
shard's checksums verified, whatever head range the importer holds): any missing or damaged shard refuses the whole
entry. The manifest is outside bytes: at most `MAX_MANIFEST_BYTES`, strict JSON (`jsonsafe`), exactly its three
keys, `tp_size` an integer up to `MAX_TP_SIZE`, shard ranges exactly vLLM's split of the model's KV heads over
`tp_size` ranks (so they tile them, no overlap, no gap).

Prefix reuse: `longest_prefix(model, token_ids)` finds the stored entry sharing the longest prefix with a prompt, at
the granularity of the store's `prefix_block` tokens (recorded in the marker; `PREFIX_BLOCK` for a new store). Each
entry publishes, after itself, one link file per full block of its tokens: `<chain>.kvxp`, where chain_k = sha256(
chain_{k-1} || block k's token ids as u32) starting from the model fingerprint and the block size, holding the
entry's key (64 hex characters, nothing else). A prompt's chain names the links to probe, longest first. A link is
outside bytes and only a hint: a missing link, or one naming an absent entry (evicted: stale), is a miss at that
length; a link naming an entry whose header's token ids do not start with the prompt's prefix (a forged link, a hash
collision) is a miss too, never a hit (the ids are compared, and the worker's import checks the bundle holds those
ids); a link file that is not 64 hex characters is a KvxError. Entries sharing a prefix overwrite each other's links
of it (renames: any of them serves it); the last writer's removal takes those links along, the other entries are
then found by their own longer blocks only. A KVTC-coded entry's header holds no token ids
without decoding it, so a KVTC store matches whole prompts only (it writes no links).

Eviction: `BundleStore(root, max_bytes=N)` keeps the store's entry files (bundles, shards, manifests; not the
links, 64 bytes per block of an entry, nor other writers' in-flight `.tmp-*` files) within N bytes: a write that
would pass the cap first removes whole entries, least recently used first (an entry's use time is its newest file's
mtime: written, or touched by a hit of `longest_prefix`, `open_shards` or `get`), never the entry being written, then
the links left naming no entry. An entry larger than the cap by itself is refused (OUT_OF_RANGE) with nothing
removed. The cap holds per writer: concurrent writers each make room for their own entry, so the store may pass it by
what they write at the same time. A reader holding an evicted entry's file open reads it whole (POSIX unlink); one
opening it after the eviction gets None (a miss) or, for a shard set whose shards go after its manifest, a KvxError
naming the missing shard: never a mix of entries.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
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
from .handoff import ModelFingerprint, export_bundle, import_bundle
from .kvtc_bundle import decode_bundle, encode_bundle, entry_header
from .schema import token_bytes, token_list
from .tp import shard_ranges, tp_head_range, writes_shard

MARKER = "kvx_bundle_store.json"
_MARKER_TEMP = re.compile(r"\.tmp-[a-z0-9_]{8}\.json")
"""The name `tempfile.mkstemp(prefix=".tmp-", suffix=".json")` gives the marker while another process creates the
store: the ranks and the scheduler of one vLLM instance open the same new store at once, so a directory holding
only that file is a store being created, not a foreign directory."""
MAX_MARKER_BYTES = 1 << 12
"""The marker is ~50 bytes of JSON; a larger one is refused after reading one byte past this."""
PREFIX_BLOCK = 256
"""Tokens per prefix-lookup block of a new store (as LMCache's chunks): one link file per block of each entry."""
MAX_PREFIX_BLOCK = 1 << 20
"""The largest prefix block a marker may declare."""
LINK_BYTES = 64
"""A prefix link file's size: the entry key in hex."""
_MANIFEST_SHARD_BYTES = 64
"""A bound on a shard set manifest's bytes per shard (and for its frame): room a shard's writer makes for it."""
_HEX = frozenset(b"0123456789abcdef")
MAX_MANIFEST_BYTES = 1 << 16
"""A shard set's manifest is ~50 bytes per shard; a larger file is refused after reading one byte past this."""
MAX_TP_SIZE = 1 << 12
"""The largest tensor-parallel size a manifest may declare (shard files are named by it)."""


class BundleStore:
    """Bundles under `root` (created when missing; an existing directory must be empty or a store); `kvtc`: a
    `kvx_core.kvtc.Calibration` to store entries KVTC-coded; `prefix_block`: tokens per prefix-lookup block (None:
    the store's recorded one, else `PREFIX_BLOCK`; another one than recorded is INCOMPATIBLE); `max_bytes`: the
    size cap eviction keeps (None: no cap)."""

    def __init__(self, root: str | os.PathLike, *, kvtc=None, prefix_block: int | None = None,
                 max_bytes: int | None = None):
        self.root = Path(root)
        self.kvtc = kvtc
        require(prefix_block is None or _is_int(prefix_block, 1, MAX_PREFIX_BLOCK), Status.INVALID_ARGUMENT,
                f"bundle store: prefix_block must be an integer in 1..{MAX_PREFIX_BLOCK}, got {prefix_block!r}")
        require(max_bytes is None or _is_int(max_bytes, 1, 2**63), Status.INVALID_ARGUMENT,
                f"bundle store: max_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        marker = self.root / MARKER
        if self.root.exists():
            require(self.root.is_dir(), Status.INVALID_ARGUMENT, f"bundle store {self.root}: not a directory")
            require(marker.is_file() or all(_MARKER_TEMP.fullmatch(p.name) for p in self.root.iterdir()),
                    Status.INVALID_ARGUMENT,
                    f"bundle store {self.root}: a non-empty directory KVX did not create (no {MARKER}); "
                    "give a new or empty directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvxError(Status.INVALID_ARGUMENT, f"bundle store {self.root}: {e.strerror}") from None
        recorded = self._recorded_block(marker)
        require(prefix_block is None or recorded is None or prefix_block == recorded, Status.INCOMPATIBLE,
                f"bundle store {self.root}: its prefix block is {recorded} tokens, {prefix_block} given (open it "
                "without prefix_block, or use another directory)")
        self.prefix_block = recorded or prefix_block or PREFIX_BLOCK
        if recorded is None:  # a new store, or one written before prefix links (it has none)
            doc = json.dumps({"kvx_bundle_store": 1, "prefix_block": self.prefix_block}).encode()
            self._publish(marker, lambda f: f.write(doc))

    def _recorded_block(self, marker: Path) -> int | None:
        """The marker's prefix block; None when there is no marker or it predates prefix links. The marker is
        outside bytes: at most `MAX_MARKER_BYTES` of strict JSON, `prefix_block` an integer up to `MAX_PREFIX_BLOCK`."""
        what = f"bundle store marker {marker}"
        raw = _read_capped(marker, MAX_MARKER_BYTES, what)
        if raw is None:
            return None
        doc = loads_object(raw, what)
        block = doc.get("prefix_block")
        require(_is_int(doc.get("kvx_bundle_store"), 1, 1) and set(doc) <= {"kvx_bundle_store", "prefix_block"}
                and (block is None or _is_int(block, 1, MAX_PREFIX_BLOCK)), Status.INVALID_ARGUMENT,
                f'{what}: must be {{"kvx_bundle_store": 1, "prefix_block": 1..{MAX_PREFIX_BLOCK}}}')
        return block

    @staticmethod
    def key(model: ModelFingerprint, token_ids: Sequence[int]) -> str:
        """The entry name of a token sequence under a model."""
        h = hashlib.sha256(json.dumps(asdict(model), sort_keys=True).encode())
        h.update(token_bytes(token_ids))
        return h.hexdigest()

    def path(self, model: ModelFingerprint, token_ids: Sequence[int]) -> Path:
        return self._plain(self.key(model, token_ids))

    def _plain(self, key: str) -> Path:
        return self.root / f"{key}.kvx"

    def __contains__(self, entry: tuple[ModelFingerprint, Sequence[int]]) -> bool:
        """Whether the entry is there: its plain bundle or a shard set's manifest (published last)."""
        key = self.key(*entry)
        return self._plain(key).is_file() or self._set_path(key).is_file()

    def put(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
            token_ids: Sequence[int]) -> Path:
        """Offload the sequence `token_ids` (its KV at `slots` of `caches`); replaces an older entry atomically."""
        return self.write_entry(model, token_ids,
                                lambda f: export_bundle(f, caches, slots, model=model, token_ids=token_ids))

    def write_entry(self, model: ModelFingerprint, token_ids: Sequence[int],
                    write: Callable[[BinaryIO], object]) -> Path:
        """Publish the bundle `write(file)` writes as the entry of `token_ids`: into a temporary file, synced, then
        renamed into place (a failure leaves no file and the older entry, if any). A KVTC store compresses it first."""
        key = self.key(model, token_ids)
        final = self._plain(key)
        self._publish(final, self._coded(write), room_for=key)
        self._link(model, token_ids, key)
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
        key = self.key(model, token_ids)
        final = self._shard_path(key, tp_size, ranges.index(tp_head_range(model.num_kv_heads, tp_size, tp_rank)))
        self._publish(final, self._coded(write), room_for=key, extra=_MANIFEST_SHARD_BYTES * (len(ranges) + 1))
        sizes = []
        for i in range(len(ranges)):  # after our own rename: of two last writers, the later one sees both shards
            try:
                sizes.append(self._shard_path(key, tp_size, i).stat().st_size)
            except FileNotFoundError:
                return final
            except OSError as e:
                raise _failed(final, "written", e) from None
        shards = [{"kv_heads": list(r), "bytes": n} for r, n in zip(ranges, sizes, strict=True)]
        manifest = json.dumps({"kvx_shard_set": 1, "tp_size": tp_size, "shards": shards})
        self._publish(self._set_path(key), lambda f: f.write(manifest.encode()))
        self._link(model, token_ids, key)
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

    def _publish(self, final: Path, write: Callable[[BinaryIO], object], *, room_for: str | None = None,
                 extra: int = 0, sync: bool = True) -> None:
        """Write `final` atomically: into a temporary file, synced, then renamed into place (a failure leaves no
        file and the older one, if any). `room_for`: the key of the entry it belongs to, whose size plus `extra`
        bytes (its links, a manifest) the store makes room for under `max_bytes` before the rename (`_make_room`)."""
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=final.suffix, dir=self.root)
        except OSError as e:
            raise _failed(final, "written", e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(fd, new_file_mode())  # mkstemp makes 0600: engines of other users share a store
                write(f)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
                size = f.tell()
            if room_for is not None:
                self._make_room(size + extra, room_for)
            os.replace(tmp, final)
        except BaseException as e:
            os.unlink(tmp)
            if isinstance(e, OSError):  # a full disk, a directory in the entry's place
                raise _failed(final, "written", e) from None
            raise

    def _shard_path(self, key: str, tp_size: int, index: int) -> Path:
        return self.root / f"{key}.tp{tp_size}-{index}.kvx"

    def _set_path(self, key: str) -> Path:
        return self.root / f"{key}.kvxset"

    def _files(self, key: str, model: ModelFingerprint) -> list[tuple[Path, tuple[int, int]]] | None:
        """The bundle files of the entry `key` and the KV heads each holds: the plain bundle (all heads) when there
        is one, else the shards its manifest names (checked, each present at its declared size), None when absent."""
        plain = self._plain(key)
        if os.path.lexists(plain):
            return [(plain, (0, model.num_kv_heads))]
        path = self._set_path(key)
        what = f"bundle store manifest {path}"
        raw = _read_capped(path, MAX_MANIFEST_BYTES, what)
        if raw is None:
            return None
        doc = loads_object(raw, what)
        tp, shards = doc.get("tp_size"), doc.get("shards")
        require(set(doc) == {"kvx_shard_set", "tp_size", "shards"} and _is_int(doc["kvx_shard_set"], 1, 1)
                and _is_int(tp, 1, MAX_TP_SIZE) and isinstance(shards, list), Status.INVALID_ARGUMENT,
                f"{what}: must be {{\"kvx_shard_set\": 1, \"tp_size\": 1..{MAX_TP_SIZE}, \"shards\": [...]}}")
        want = shard_ranges(model.num_kv_heads, tp)
        got = [s.get("kv_heads") if isinstance(s, dict) else None for s in shards]
        require(len(got) == len(want)
                and all(isinstance(g, list) and all(type(x) is int for x in g) and tuple(g) == r
                        for g, r in zip(got, want, strict=True)), Status.INVALID_ARGUMENT,
                f"{what}: its shards must hold KV heads {want} (the model's {model.num_kv_heads} split over {tp} "
                f"ranks: a tiling, no overlap, no gap), not {str(got)[:200]}")
        files = []
        for i, (s, r) in enumerate(zip(shards, want, strict=True)):
            shard = self._shard_path(key, tp, i)
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
        files = self._files(self.key(model, token_ids), model)
        if files is None:
            return None
        require(len(files) == 1, Status.UNSUPPORTED, f"bundle store entry {files[0][0].name}: a tensor-parallel "
                "shard set; import it with open_shards / get")
        return self._open_bundle(files[0][0], model)

    def open_shards(self, model: ModelFingerprint, token_ids: Sequence[int]) -> list[BinaryIO] | None:
        """Every bundle of the entry of `token_ids` as streams (one for a plain entry; the caller closes them),
        None when absent; KvxError when a shard named by the manifest is missing, of another size, or its header
        declares other KV heads or tokens than the set's (a swapped or foreign shard): nothing is returned open.
        Counts as a use of the entry (eviction is least recently used first)."""
        key = self.key(model, token_ids)
        files = self._files(key, model)
        if files is None:
            return None
        self._touch(key)
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
        return self._header_of(self.key(model, token_ids), model)

    def _header_of(self, key: str, model: ModelFingerprint) -> dict | None:
        """`header` of the entry `key`."""
        files = self._files(key, model)
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
        """Delete the entry of `token_ids`, plain or shard set (manifest first: readers then see no entry), and
        its prefix links that still name it; True when there was an entry."""
        key = self.key(model, token_ids)
        removed = self._remove_key(key)
        for link in self._chain(model, token_ids):
            with contextlib.suppress(KvxError):  # a damaged link is no link of ours to keep or remove
                if self._read_link(link) == key:
                    self._unlink(self._link_path(link))
        return removed

    def _remove_key(self, key: str) -> bool:
        """Delete the files of the entry `key` (manifest first), True when there was one."""
        removed = False
        for path in [self._set_path(key), self._plain(key), *sorted(self.root.glob(f"{key}.tp*-*.kvx"))]:
            removed = self._unlink(path) or removed
        return removed

    def _unlink(self, path: Path) -> bool:
        """Delete a store file, False when it was already gone."""
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _failed(path, "removed", e) from None

    # ------------------------------------------------------------------ prefix links
    def longest_prefix(self, model: ModelFingerprint, token_ids: Sequence[int]) -> tuple[int, list[int] | None]:
        """(n, the stored entry's token ids) for the entry sharing the longest prefix with `token_ids`: the entry of
        exactly `token_ids` (n = all of them), else the entry reached by the longest block-aligned prefix link whose
        header's token ids start with that prefix (n = the prefix, or the whole entry when `token_ids` extends it);
        (0, None) when none. Missing or stale links are misses; KvxError for a damaged link or entry. Import the
        hit with `get(..., token_ids=<entry's ids>, token_range=(start, n))`. Counts as a use of the entry."""
        ids = token_list(token_ids)
        key = self.key(model, ids)
        if self._header_of(key, model) is not None:
            self._touch(key)
            return len(ids), ids
        for k, link in reversed(list(enumerate(self._chain(model, ids), 1))):
            key = self._read_link(link)
            header = None if key is None else self._header_of(key, model)
            if header is None or header["model"] != asdict(model):
                continue
            stored, n = header["tokens"].get("ids"), k * self.prefix_block
            if stored is None or stored[:n] != ids[:n] or self.key(model, stored) != key:
                continue  # a forged link, or a hash collision: never a hit
            self._touch(key)
            return (len(stored) if stored == ids[:len(stored)] else n), stored
        return 0, None

    def _chain(self, model: ModelFingerprint, token_ids: Sequence[int]) -> list[str]:
        """The chained hashes (hex) of each full `prefix_block` of `token_ids` under `model`: link names."""
        h = hashlib.sha256(b"kvx-prefix\0" + json.dumps(asdict(model), sort_keys=True).encode()
                           + self.prefix_block.to_bytes(4, "little")).digest()
        raw, step = token_bytes(token_ids), 4 * self.prefix_block
        out = []
        for start in range(0, len(raw) - step + 1, step):
            h = hashlib.sha256(h + raw[start:start + step]).digest()
            out.append(h.hex())
        return out

    def _link_path(self, link: str) -> Path:
        return self.root / f"{link}.kvxp"

    def _link(self, model: ModelFingerprint, token_ids: Sequence[int], key: str) -> None:
        """Publish the prefix links of the entry `key` (after the entry: a link never precedes its entry). Not
        synced (a link lost in a crash is a miss). None in a KVTC store (its headers hold no token ids)."""
        if self.kvtc is not None:
            return
        for link in self._chain(model, token_ids):
            self._publish(self._link_path(link), lambda f: f.write(key.encode()), sync=False)

    def _read_link(self, link: str) -> str | None:
        """The entry key a prefix link names, None when there is no link; KvxError for a file that is not a key."""
        path = self._link_path(link)
        raw = _read_head(path, LINK_BYTES)
        if raw is None:
            return None
        require(_is_key(raw), Status.INVALID_ARGUMENT,
                f"bundle store link {path}: must hold an entry key ({LINK_BYTES} lowercase hex characters)")
        return raw.decode()

    # ------------------------------------------------------------------ eviction
    def _touch(self, key: str) -> None:
        """Mark the entry `key` used now (its plain bundle's or manifest's mtime), for least-recently-used eviction;
        best effort (an entry of another user that we may not touch ages from its write)."""
        for path in (self._plain(key), self._set_path(key)):
            with contextlib.suppress(OSError):
                os.utime(path)
                return

    def _entries(self) -> dict[str, tuple[int, float]]:
        """Each entry's (bytes, last use) from its regular files: bundle, shards, manifest (last use: the newest
        mtime). Files that vanish meanwhile (another process evicting) are skipped."""
        out: dict[str, tuple[int, float]] = {}
        with os.scandir(self.root) as it:
            for e in it:
                name = e.name
                if not (len(name) > 65 and name[64] == "." and _is_key(name[:64])
                        and name.endswith((".kvx", ".kvxset"))):
                    continue
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                size, used = out.get(name[:64], (0, 0.0))
                out[name[:64]] = (size + st.st_size, max(used, st.st_mtime))
        return out

    def _make_room(self, incoming: int, keep: str) -> None:
        """Evict entries, least recently used first (never `keep`, the entry being written), until `incoming` more
        bytes fit under `max_bytes`, then the links left naming no entry; OUT_OF_RANGE, nothing removed, when they
        cannot fit even so."""
        if self.max_bytes is None:
            return
        entries = self._entries()
        total = sum(size for size, _ in entries.values())
        if total + incoming <= self.max_bytes:
            return
        kept = entries.get(keep, (0, 0.0))[0]
        require(kept + incoming <= self.max_bytes, Status.OUT_OF_RANGE,
                f"bundle store {self.root}: an entry of {kept + incoming} bytes does not fit under its max_bytes "
                f"{self.max_bytes}; raise the cap")
        for key, (size, _) in sorted(entries.items(), key=lambda kv: kv[1][1]):
            if total + incoming <= self.max_bytes:
                break
            if key != keep:
                self._remove_key(key)
                total -= size
        self._sweep_links()

    def _sweep_links(self) -> None:
        """Delete the prefix links naming no entry (left by eviction) or no key at all (damaged)."""
        for path in self.root.glob("*.kvxp"):
            if not _is_key(path.stem):
                continue  # not a name the store gives: not ours
            try:
                key = self._read_link(path.stem)
            except KvxError:
                key = None
            if key is None or not (self._plain(key).exists() or self._set_path(key).exists()):
                self._unlink(path)


def _read_head(path: Path, cap: int) -> bytes | None:
    """At most `cap + 1` bytes of a small store file (one more than it may hold, so a caller sees it is larger),
    None when absent."""
    try:
        with path.open("rb") as f:
            return f.read(cap + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _failed(path, "read", e) from None


def _read_capped(path: Path, cap: int, what: str) -> bytes | None:
    """A small store file's bytes (None when absent), refused past `cap`."""
    raw = _read_head(path, cap)
    require(raw is None or len(raw) <= cap, Status.INVALID_ARGUMENT, f"{what}: larger than {cap} bytes")
    return raw


def _failed(path: Path, doing: str, e: OSError) -> KvxError:
    """The KvxError of a store entry the OS refused to read, write or remove."""
    return KvxError(Status.INVALID_ARGUMENT, f"bundle store entry {path} cannot be {doing}: {e.strerror or e}")


def _is_int(v: object, lo: int, hi: int) -> bool:
    """Whether a JSON value is an integer (not a bool or a float) in [lo, hi]."""
    return type(v) is int and lo <= v <= hi


def _is_key(name: str | bytes) -> bool:
    """Whether `name` is an entry key: 64 lowercase hex characters."""
    raw = name.encode() if isinstance(name, str) else name
    return len(raw) == LINK_BYTES and set(raw) <= _HEX


def _check_shard(path: Path, header: dict, heads: tuple[int, int], first: dict) -> None:
    """A shard's header declares the head range its manifest names and the same tokens as the set's first shard."""
    require(header["cache"]["kv_heads"] == list(heads), Status.INVALID_ARGUMENT,
            f"bundle store shard {path.name}: holds KV heads {header['cache']['kv_heads']}, its manifest names "
            f"{list(heads)} (a swapped or foreign shard)")
    require(header["tokens"] == first["tokens"], Status.INVALID_ARGUMENT,
            f"bundle store shard {path.name}: holds other tokens than the set's first shard")
