"""Bundles in host memory at copy speed: export device caches into a (pinned) host buffer, import from one.

The stream writer and reader (`bundle`) move one layer at a time through Python buffers: fine for files and pipes,
far below a PCIe copy for GPU caches. Here the bundle's layout is computed up front (every size follows from the
header), so each layer's chunk is gathered on the device, copied asynchronously to its final place in the buffer,
and checksummed by a thread pool while the next layers copy; import checks every chunk's head and checksum in the
pool while the payloads copy to the device, and nothing is stored until all of them (and the trailer) passed. The
bytes are exactly those of `export_bundle`; the buffer can back a file, shared memory or a NIXL registration.
A bundle may also be imported from a CUDA device's memory (where a NIXL READ into GPU memory lands it): its payloads
are checksummed on the GPU and only the header, chunk heads, checksums, tail segments and trailer go to the host.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..descriptors import CacheDesc
from ..errors import Status, require
from .bundle import (
    SEGMENT_BYTES,
    BundleReader,
    bundle_bytes,
    bundle_prefix,
    check_chunk_head,
    check_chunk_sum,
    check_trailer,
    chunk_at,
    chunk_head,
    combine_segments,
    parse_specs,
    segment_digest,
    segments,
    split_chunks,
    trailer,
)
from .header import bundle_header
from .kernels import use_kernels
from .layer_set import layer_set
from .rows import checked_once, read_chunk, read_chunks
from .schema import ModelFingerprint, check_layers
from .views import StorageViews

GPU_SEGMENT_BYTES = 1 << 16
"""Checksum segments of bundles exported from CUDA caches: 64 KiB, one GPU program each (thousands per bundle)."""
GPU_HASH_MAX_SEGMENT = 1 << 20
"""Import verifies segments up to this size on the GPU; larger ones (few and long) in the host thread pool."""
EXPORT_STAGE_BYTES = 256 << 20
"""A kernel export gathers every layer into one device staging buffer (one allocation and view per bundle, not per
layer) only up to this size: a larger bundle (bf16 at 16k tokens x 32 layers is ~2 GiB) gathers each layer into its
own chunk, freed once copied, so the export never needs the whole bundle's size free on an engine's GPU; at that
size the per-layer host work is small beside the bytes moved."""
THREADS = min(16, os.cpu_count() or 1)
"""Checksum threads: xxhash releases the GIL, so checksum segments hash in parallel (~6-10 GB/s per thread)."""
_pool: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """One checksum pool per process, started on first use (no thread start-up per bundle)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvx-bundle-hash")
    return _pool


def gpu_segment_digests(buf: torch.Tensor, segment: int, seed: int) -> torch.Tensor:
    """`gpu_hash.segment_digests` (imported on first use: Triton is needed only for CUDA caches)."""
    from .gpu_hash import segment_digests

    return segment_digests(buf, segment, seed)


def gpu_chunk_digests(buf: torch.Tensor, count: int, stride: int, size: int, segment: int, seed: int
                      ) -> torch.Tensor:
    """`gpu_hash.chunk_digests`: every staged layer's whole segments in one launch (imported on first use)."""
    from .gpu_hash import chunk_digests

    return chunk_digests(buf, count, stride, size, segment, seed)


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for bundle copies (created on first use)."""
    device = torch.device(device)
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def bundle_size(header: dict) -> tuple[int, int, int]:
    """(offset of the first chunk, payload bytes per chunk, total bytes) of the bundle of `header`."""
    layers, tokens, specs, _ = parse_specs(header)
    first = len(bundle_prefix(header)[0])
    payload = sum(s.nbytes(tokens) for s in specs)
    return first, payload, bundle_bytes(first, payload, layers)


def staged_stride(payload: int) -> int:
    """Bytes per layer in a GPU staging buffer of chunk payloads of `payload` bytes: rounded up to 256, so each
    layer's payload starts aligned (the GPU hash reads 8-byte words)."""
    return -(-payload // 256) * 256


def _host_bytes(buf: torch.Tensor, what: str, cuda_ok: bool = False) -> None:
    """A contiguous 1-D uint8 tensor in host memory (or, when `cuda_ok`, a CUDA device's)."""
    where = ("cpu", "cuda") if cuda_ok else ("cpu",)
    require(isinstance(buf, torch.Tensor) and buf.device.type in where and buf.dtype == torch.uint8
            and buf.dim() == 1 and buf.is_contiguous(), Status.INVALID_ARGUMENT,
            f"{what} must be a contiguous 1-D uint8 {' or '.join(w.upper() for w in where)} tensor"
            f"{'' if cuda_ok else ' (pinned for GPU speed)'}")


class _Export:
    """What one export writes, fixed before a byte is: the header (every layer's cache and the slots checked), the
    bundle's layout and each layer's slots, blocks and format."""

    def __init__(self, caches: Sequence[CacheDesc], slots: torch.Tensor, model: ModelFingerprint,
                 token_ids: Sequence[int] | None, kv_heads: tuple[int, int] | None, segment_bytes: int):
        self.caches = caches
        self.header = bundle_header(caches, slots, model=model, token_ids=token_ids, kv_heads=kv_heads,
                                    segment_bytes=segment_bytes)
        self.layers, tokens, self.specs, self.segment = parse_specs(self.header)
        self.prefix, self.seed = bundle_prefix(self.header)
        self.first, self.size = len(self.prefix), sum(s.nbytes(tokens) for s in self.specs)
        self.total = bundle_bytes(self.first, self.size, self.layers)
        self.whole = self.size // self.segment * self.segment  # the bytes of whole checksum segments
        self.stride = staged_stride(self.size)
        # the layers bound once (`layer_set`); each layer's blocks / offsets (block sizes may differ)
        self.set = layer_set(caches)
        self.slots, self.wheres, self.formats = self.set.check_slots(slots)

    def at(self, i: int) -> int:
        """The offset of layer `i`'s payload in the bundle."""
        return chunk_at(self.first, self.size, i) + 16

    def staging(self, device: torch.device) -> StorageViews | None:
        """One device buffer every layer's chunk is gathered into (`EXPORT_STAGE_BYTES`), or None: a chunk each."""
        if use_kernels(device) and self.layers * self.stride <= EXPORT_STAGE_BYTES:
            return StorageViews(torch.empty(self.layers * self.stride, dtype=torch.uint8, device=device))
        return None

    def chunks(self, stage: StorageViews | None) -> Iterator[tuple[int, torch.Tensor]]:
        """(layer, its chunk payload on the caches' device), gathered in layer order; into `stage` when given, every
        layer's gather queued first: the layers bound once (`layer_set.LayerSet.plan_rows`), else one launch per
        geometry planned for this request (`rows.read_chunks`)."""
        if stage is not None:
            gather = self.set.plan_rows(self.slots, self.specs, stage, self.stride, scatter=False)
            if gather is not None:
                gather()
                yield from enumerate(stage.views([i * self.stride for i in range(self.layers)], torch.uint8,
                                                 (self.size,)))
                return
        scales = self.set.scales()
        if stage is not None:
            yield from enumerate(read_chunks(self.caches, self.slots, self.specs, stage, self.stride, scales,
                                             self.formats))
            return
        for i, (cache, where, gs, fmt) in enumerate(zip(self.caches, self.wheres, scales, self.formats, strict=True)):
            yield i, read_chunk(cache, self.slots, self.specs, where=where, scales=gs, fmt=fmt)

    def sums(self, gpu: list[list[int]], host: list[list[int]]) -> list[int]:
        """Each chunk's checksum from its segments' digests: those hashed on the device, then the host's."""
        return [combine_segments(i, g + h, self.seed) for i, (g, h) in enumerate(zip(gpu, host, strict=True))]

    def small_bytes(self, sums: list[int]) -> list[tuple[int, bytes]]:
        """(offset, bytes) of everything but the payloads: the prefix, chunk heads and checksums, the trailer."""
        out = [(0, self.prefix)]
        for i, c in enumerate(sums):
            out += [(self.at(i) - 16, chunk_head(i, self.size)), (self.at(i) + self.size, c.to_bytes(8, "little"))]
        return out + [(self.total - 24, trailer(sums, self.total - 24, self.seed))]


def _digest_lists(digests: torch.Tensor | list[torch.Tensor], layers: int) -> list[list[int]]:
    """Per layer, the device digests of its whole segments as Python ints (one host sync)."""
    if isinstance(digests, list):
        if not digests:
            return [[] for _ in range(layers)]
        digests = torch.stack(digests)
    return digests.cpu().numpy().view(np.uint64).tolist()  # Python ints already


def _side_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, keep: torch.Tensor
                 ) -> torch.cuda.Event:
    """Each `dst.copy_(src)` of `pairs` (between the host and `device`) on the device's side stream, back to back,
    after the work queued so far on the current stream (the gathers; whatever last used a freshly allocated block),
    so the copies overlap what is queued next. `keep`, the device memory they use, stays allocated until they ran
    even if its owner drops it first (a refused import). Returns the event of their end."""
    side, ready, done = _copy_stream(device), torch.cuda.Event(), torch.cuda.Event()
    ready.record()
    with torch.cuda.stream(side):
        side.wait_event(ready)
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        done.record(side)
    if pairs:
        keep.record_stream(side)
    return done


@checked_once
def export_to_host(caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                   token_ids: Sequence[int] | None = None, kv_heads: tuple[int, int] | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The bundle of one sequence (as `export_bundle` writes it) in host memory: `out[:n]` when `out` (a uint8 CPU
    tensor, pinned for speed, reused across calls) is given and large enough, else a new pinned (on CUDA) tensor.
    From CUDA caches the checksum segments are 64 KiB and hashed on the GPU before each chunk is copied out.
    Every check (caches, every layer's slots, `out`) passes before the first byte of `out` is written."""
    cuda = caches[0].k.tensor.device.type == "cuda" if caches else False
    e = _Export(caches, slots, model, token_ids, kv_heads, GPU_SEGMENT_BYTES if cuda else SEGMENT_BYTES)
    if out is None:
        out = torch.empty(e.total, dtype=torch.uint8, pin_memory=cuda)
    _host_bytes(out, "export_to_host: out")
    require(out.numel() >= e.total, Status.OUT_OF_RANGE, f"export_to_host: the bundle needs {e.total} bytes, out "
                                                         f"has {out.numel()}")
    buf = out[:e.total]
    mem = buf.numpy()
    size, segment, seed = e.size, e.segment, e.seed
    pool, landed, futures, on_gpu = _hash_pool(), [], [], []

    def hash_landed(block: bool) -> None:
        """Submit the host-side checksum segments of every layer whose copy has landed (all when `block`)."""
        while len(futures) < len(landed):
            i, done = len(futures), landed[len(futures)]
            if done is not None and not done.query():
                if not block:
                    return
                done.synchronize()
            at = e.at(i)
            host = segments(size, segment, e.whole if cuda else 0)
            futures.append([pool.submit(segment_digest, mem[at + a:at + b], seed) for a, b in host])

    dev = caches[0].k.tensor.device
    stage = e.staging(dev)
    host = StorageViews(buf)
    if cuda and stage is not None:  # every layer gathered by one launch, hashed by one while the copies run
        chunks = list(e.chunks(stage))
        dsts = host.views([e.at(i) for i, _ in chunks], torch.uint8, (size,))
        pairs = [(d, c) for d, (_, c) in zip(dsts, chunks, strict=True)] if size else []
        landed = [_side_copies(pairs, dev, stage.buf)] * e.layers
        if size:  # queued after the copies' start event: the copies wait for the gather only
            on_gpu = gpu_chunk_digests(stage.buf, e.layers, e.stride, size, segment, seed)
    else:
        for i, chunk in e.chunks(stage):
            if cuda:  # a chunk per layer: gathered, hashed and copied in turn
                if size:
                    on_gpu.append(gpu_segment_digests(chunk, segment, seed))
                landed.append(_side_copies([(host.view(e.at(i), torch.uint8, (size,)), chunk)] if size else [],
                                           dev, chunk))
            else:
                if size:
                    host.view(e.at(i), torch.uint8, (size,)).copy_(chunk)
                landed.append(None)
            hash_landed(block=False)
    hash_landed(block=True)
    sums = e.sums(_digest_lists(on_gpu, e.layers), [[f.result() for f in fs] for fs in futures])
    for at, b in e.small_bytes(sums):
        mem[at:at + len(b)] = memoryview(b)
    return buf


@checked_once
def export_to_device(caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                     token_ids: Sequence[int] | None = None, kv_heads: tuple[int, int] | None = None,
                     out: torch.Tensor) -> torch.Tensor:
    """The bundle of one sequence written into `out[:n]`, a uint8 buffer on the caches' own device (a NIXL VRAM
    slot), without a round trip through host memory: each layer's chunk is gathered by the transfer kernel, its 64
    KiB checksum segments hashed there and the payload copied device to device into place; only the digests and
    the payloads' tail segments come to the host (one sync), and the prefix, chunk heads, checksums and trailer go
    back in one scatter. The bytes are `export_to_host`'s from the same caches. Returns once they are all in `out`.
    Every check passes before the first byte of `out` is written."""
    dev = caches[0].k.tensor.device if caches else None
    require(isinstance(out, torch.Tensor) and out.device == dev and out.dtype == torch.uint8 and out.dim() == 1
            and out.is_contiguous(), Status.INVALID_ARGUMENT,
            f"export_to_device: out must be a contiguous 1-D uint8 tensor on the caches' device {dev}")
    require(use_kernels(dev), Status.UNSUPPORTED,
            f"export_to_device: the caches on {dev} are not served by the transfer kernels (CUDA): export_to_host")
    e = _Export(caches, slots, model, token_ids, kv_heads, GPU_SEGMENT_BYTES)
    require(out.numel() >= e.total, Status.OUT_OF_RANGE, f"export_to_device: the bundle needs {e.total} bytes, out "
                                                         f"has {out.numel()}")
    buf, size = out[:e.total], e.size
    stage, on_gpu, tails = e.staging(dev), [], []
    for i, chunk in e.chunks(stage):
        if size and stage is None:
            buf[e.at(i):e.at(i) + size].copy_(chunk)
            if e.whole < size:  # a chunk of its own is freed after its layer: keep a copy of its tail only
                tails.append(chunk[e.whole:].clone())
            on_gpu.append(gpu_segment_digests(chunk, e.segment, e.seed))
    if size and stage is not None:  # the staged payloads land in one strided copy, their tails come in one too
        staged = stage.buf.view(e.layers, e.stride)[:, :size]
        buf.as_strided((e.layers, size), (e.at(1) - e.at(0), 1), buf.storage_offset() + e.at(0)).copy_(staged)
        on_gpu = gpu_chunk_digests(stage.buf, e.layers, e.stride, size, e.segment, e.seed)
        tails = list(staged[:, e.whole:])
    host_tails = torch.stack(tails).cpu().numpy() if e.whole < size else None
    sums = e.sums(_digest_lists(on_gpu, e.layers),
                  [[] if host_tails is None else [segment_digest(host_tails[i], e.seed)] for i in range(e.layers)])
    small = e.small_bytes(sums)
    where = torch.from_numpy(np.concatenate([np.arange(at, at + len(b), dtype=np.int64) for at, b in small]))
    data = torch.frombuffer(bytearray(b"".join(b for _, b in small)), dtype=torch.uint8)
    buf.index_copy_(0, where.to(dev), data.to(dev))
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    return buf


class _View:
    """A read-only stream over a uint8 tensor (for `BundleReader`'s header checks); of a CUDA tensor, only the bytes
    read are copied to the host."""

    def __init__(self, buf: torch.Tensor):
        self.buf, self.pos = buf, 0
        self.mem = buf.numpy() if buf.device.type == "cpu" else None

    def _bytes(self, a: int, b: int) -> np.ndarray:
        return self.mem[a:b] if self.mem is not None else self.buf[a:b].cpu().numpy()

    def readinto(self, b) -> int:
        n = min(len(b), self.buf.numel() - self.pos)
        b[:n] = self._bytes(self.pos, self.pos + n)
        self.pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = self.buf.numel() if n < 0 else min(self.buf.numel(), self.pos + n)
        out = bytes(self._bytes(self.pos, end))
        self.pos = end
        return out


class HostBundle:
    """A bundle in host memory (or a CUDA device's), read like a `BundleReader` (`header`, `tokens`, `specs`,
    `read_all`): the header is checked at once, `read_all(device)` verifies every chunk and the trailer and returns
    the layers on `device`."""

    def __init__(self, buf: torch.Tensor):
        _host_bytes(buf, "a bundle buffer", cuda_ok=True)
        view = _View(buf)
        self.buf, self.mem = buf, view.mem
        reader = BundleReader(view, size=buf.numel())  # the buffer's length checked there
        self.header, self.version, self.seed = reader.header, reader.version, reader.seed
        self.num_layers, self.tokens, self.specs = reader.num_layers, reader.tokens, reader.specs
        self.segment, self.format = reader.segment, reader.format
        self.first, self.size, self.total = reader.offset, reader.payload, reader.total
        self._staged: tuple[torch.device, torch.Tensor, torch.cuda.Event] | None = None
        self.verified: torch.Tensor | None = None  # the staging buffer the last `read_all` onto a GPU verified

    @property
    def _stride(self) -> int:
        return staged_stride(self.size)

    def prefetch(self, device: torch.device | str) -> None:
        """Start copying every payload of a bundle in host memory to `device` (CUDA; elsewhere nothing to do), back to
        back on the device's side stream, into a staging buffer of this reader (nothing else is written), so that
        what the host does next (an import's destination checks) overlaps the copies. `read_all(device)` waits for
        them and verifies every byte."""
        device = torch.device(device)
        if self.mem is None or device.type != "cuda" or (self._staged is not None and self._staged[0] == device):
            return
        n, stride = self.size, self._stride
        staged = torch.empty(self.num_layers * stride, dtype=torch.uint8, device=device)
        at = [chunk_at(self.first, n, i) + 16 for i in range(self.num_layers if n else 0)]
        done = _side_copies([(staged[i * stride:i * stride + n], self.buf[a:a + n]) for i, a in enumerate(at)], device,
                            staged)
        self._staged = (device, staged, done)

    def staging(self, device: torch.device | str) -> tuple[StorageViews, int] | None:
        """(Views of the staging buffer `prefetch(device)` fills, its bytes per layer), or None without one: bytes
        still copying and not yet verified, for planning what will read them once they are (an import's store: the
        plan reads no values); work queued on the current stream from here on waits for the copies. `read_all(device)`
        then verifies exactly this buffer (`verified`)."""
        device = torch.device(device)
        if self._staged is None or self._staged[0] != device:
            return None
        _, staged, done = self._staged
        torch.cuda.current_stream(device).wait_event(done)
        return StorageViews(staged), self._stride

    def read_all(self, device: torch.device | str | None = None) -> list[dict[str, torch.Tensor]]:
        """Every layer's tensors on `device` (default: views of the host buffer), after every check passed. Onto a
        GPU, small checksum segments are verified there after the copy; otherwise in the host thread pool."""
        device = torch.device("cpu" if device is None else device)
        cuda = device.type == "cuda"
        if self.mem is None:
            require(cuda, Status.INVALID_ARGUMENT, "a bundle in CUDA memory imports into CUDA caches only (copy it to "
                                                   "the host first)")
            return self._read_all_cuda(device)
        m, n = self.mem, self.size
        on_gpu = cuda and n and self.segment <= GPU_HASH_MAX_SEGMENT
        stride, staged = self._stride, None
        if cuda:  # the payloads copied (or copying since `prefetch`); what runs next on the device waits for them
            self.prefetch(device)
            _, staged, done = self._staged
            self._staged = None  # a later read_all copies again
            torch.cuda.current_stream(device).wait_event(done)
        whole = n // self.segment * self.segment if on_gpu else 0
        pool, futures = _hash_pool(), []
        for i in range(self.num_layers):
            at = chunk_at(self.first, n, i)
            check_chunk_head(bytes(m[at:at + 16]), i, n)
            futures.append([pool.submit(segment_digest, m[at + 16 + a:at + 16 + b], self.seed)
                            for a, b in segments(n, self.segment, whole)])  # those the GPU does not hash
        # every layer's whole segments in one launch, after all the copies it waited for
        gpu_sums = gpu_chunk_digests(staged, self.num_layers, stride, n, self.segment, self.seed).cpu().numpy().view(
            np.uint64).tolist() if on_gpu else [[] for _ in futures]
        sums = [check_chunk_sum(i, combine_segments(i, gpu_sums[i] + [f.result() for f in fs],
                                                    self.seed),
                                bytes(m[chunk_at(self.first, n, i) + 16 + n:][:8])) for i, fs in enumerate(futures)]
        check_trailer(bytes(m[self.total - 24:]), self.num_layers, self.total - 24, sums, self.seed)
        at, step = (0, stride) if cuda else (chunk_at(self.first, n, 0) + 16, chunk_at(0, n, 1))
        layers = split_chunks(staged if cuda else self.buf, at, step, self.num_layers, self.specs, self.tokens)
        check_layers(layers, self.format)  # one host sync for the bundle
        self.verified = staged
        return layers

    def _read_all_cuda(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """`read_all` of a bundle in CUDA memory: each payload is copied (device to device) to an aligned staging
        chunk on `device` and its whole segments hashed there; the chunk heads, checksums, tail segments and trailer
        come to the host in one copy and are checked there."""
        n, layers, buf = self.size, self.num_layers, self.buf
        whole = n // self.segment * self.segment
        step, at0 = chunk_at(0, n, 1), buf.storage_offset() + chunk_at(self.first, n, 0)

        def every_layer(start: int, size: int) -> torch.Tensor:
            """Bytes [start, start + size) of every chunk (from its head), as one strided `[layers, size]` view."""
            return buf.as_strided((layers, size), (step, 1), at0 + start)

        # the chunk heads, checksums, tail segments and trailer, in that order, in one copy to the host
        tail_bytes = [every_layer(16 + whole, n - whole)] if whole < n else []
        parts = [every_layer(0, 16), every_layer(16 + n, 8), *tail_bytes, buf[self.total - 24:]]
        small = torch.cat([p.reshape(-1) for p in parts]).cpu().numpy()
        sizes = [16] * layers + [8] * layers + [n - whole] * (layers if tail_bytes else 0) + [24]
        ends = np.cumsum([0] + sizes).tolist()

        def piece(k: int) -> bytes:
            return bytes(small[ends[k]:ends[k + 1]])

        for i in range(layers):
            check_chunk_head(piece(i), i, n)
        stride = self._stride
        staged = torch.empty(layers * stride, dtype=torch.uint8, device=device)
        if n:  # every payload in one strided copy
            staged.view(layers, stride)[:, :n].copy_(every_layer(16, n))
        digests = gpu_chunk_digests(staged, layers, stride, n, self.segment, self.seed).cpu().numpy().view(
            np.uint64).tolist() if n else [[] for _ in range(layers)]
        tails = [[segment_digest(piece(2 * layers + i), self.seed)] if whole < n else [] for i in range(layers)]
        sums = [check_chunk_sum(i, combine_segments(i, digests[i] + tails[i], self.seed),
                                piece(layers + i)) for i in range(layers)]
        check_trailer(piece(len(sizes) - 1), layers, self.total - 24, sums, self.seed)
        out = split_chunks(staged, 0, stride, layers, self.specs, self.tokens)
        check_layers(out, self.format)  # one host sync for the bundle
        return out
