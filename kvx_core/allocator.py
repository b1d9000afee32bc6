"""Block allocator for dual-pool paged caches: one id space for the data and scale pools.

A block id is free, in use (ref count >= 1, shared by every sequence whose prefix covers it), or
cached (ref count 0, content kept under a prefix key for reuse until evicted, least recently
released first). Because the data pool and the scale pool are indexed by the same ids, allocating
here allocates both: they cannot drift apart.

Block ids and counts are ints: Python ints and numpy/torch integer scalars are accepted (and stored
as Python ints); bools, floats, strings and None are refused, never rounded. Every operation checks
all of its arguments before it changes anything, so a rejected call leaves the allocator as it was.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import torch

from .errors import KvxError, Status, require


def as_int(value: object, what: str, minimum: int | None = None) -> int:
    """`value` as a Python int (KvxError INVALID_ARGUMENT otherwise, or when below `minimum`).

    Accepts ints and 0-d numpy/torch integer scalars (e.g. an id read out of a block table); refuses
    bools, floats, strings, None and arrays, since each of those is a caller bug that a cast would hide.
    """
    is_bool = isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    n = None
    if not is_bool and getattr(value, "ndim", 0) == 0:
        try:
            n = operator.index(value)
        except TypeError:
            pass
    if n is None:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be an int, got {value!r} ({type(value).__name__})")
    require(minimum is None or n >= minimum, Status.INVALID_ARGUMENT, f"{what} must be >= {minimum}, got {n}")
    return n


class BlockAllocator:
    """Allocate / share / free / evict block ids in `[0, num_blocks)`."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = as_int(num_blocks, "num_blocks", 1)
        self._next = 0  # ids >= _next were never handed out (kept implicit: num_blocks may be huge)
        self._free: list[int] = []  # released ids, reused most recently released first
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[int, Hashable] = OrderedDict()  # ref 0, kept for reuse, LRU first
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free plus evictable cached blocks)."""
        return len(self._free) + (self.num_blocks - self._next) + len(self._cached)

    def ref_count(self, block: int) -> int:
        """References held on `block` (0 for free and cached blocks)."""
        return self._refs.get(self._block_id(block), 0)

    def lookup(self, key: Hashable) -> int | None:
        """The block holding the content registered under `key` (in use or cached), if any."""
        return self._block_of.get(_checked_key(key))

    # ------------------------------------------------------------ operations
    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (ref count 1), evicting least recently released cached blocks if needed.
        Released ids are reused first, then never-used ids in increasing order."""
        n = as_int(n, "number of blocks to allocate", 0)
        if n > self.num_free:
            raise KvxError(Status.OUT_OF_RANGE,
                           f"KV cache full: {n} blocks requested, {self.num_free} free or evictable of "
                           f"{self.num_blocks}; free finished sequences or raise the cache budget")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            elif self._next < self.num_blocks:
                block, self._next = self._next, self._next + 1
            else:
                block, _ = self._cached.popitem(last=False)
                self._forget(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block (prefix sharing); cached blocks come back into use.
        All ids are checked before any is applied."""
        blocks = self._block_ids(blocks)
        for block in blocks:
            require(block in self._cached or self._refs.get(block, 0) > 0, Status.INVALID_ARGUMENT,
                    f"block {block} is free: only allocated or cached blocks can be shared")
        for block in blocks:
            if block in self._cached:
                del self._cached[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; at zero it becomes cached (if keyed) or free.
        All ids are checked before any is applied (a list may name a block once per reference)."""
        blocks = self._block_ids(blocks)
        for block in set(blocks):
            require(self._refs.get(block, 0) >= blocks.count(block), Status.INVALID_ARGUMENT,
                    f"double free of block {block}")
        for block in blocks:
            refs = self._refs[block]
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            if block in self._key_of:
                self._cached[block] = self._key_of[block]
            else:
                self._free.append(block)

    def register(self, block: int, key: Hashable) -> None:
        """Record that in-use `block` holds the full-block content identified by `key` (prefix cache)."""
        block, key = self._block_id(block), _checked_key(key)
        require(self._refs.get(block, 0) > 0, Status.INVALID_ARGUMENT, f"block {block} is not in use")
        require(key not in self._block_of or self._block_of[key] == block, Status.INVALID_ARGUMENT,
                f"prefix key already maps to block {self._block_of.get(key)}")
        self._forget(block)
        self._key_of[block] = key
        self._block_of[key] = block

    def evict(self, n: int | None = None) -> list[int]:
        """Evict up to `n` (default all) cached blocks, least recently released first; returns them."""
        n = len(self._cached) if n is None else as_int(n, "number of blocks to evict", 0)
        out = []
        while self._cached and len(out) < n:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self._free.append(block)
            out.append(block)
        return out

    # ------------------------------------------------------------ internals
    def _forget(self, block: int) -> None:
        if block in self._key_of:  # any hashable is a key, None included
            del self._block_of[self._key_of.pop(block)]

    def _block_id(self, block: object) -> int:
        """`block` as an int id in range (KvxError INVALID_ARGUMENT for a non-int, OUT_OF_RANGE outside)."""
        b = as_int(block, "block id")
        require(0 <= b < self.num_blocks, Status.OUT_OF_RANGE, f"block id {b} out of range [0, {self.num_blocks})")
        return b

    def _block_ids(self, blocks: Iterable[int]) -> list[int]:
        """Every id of `blocks`, all checked before the caller changes anything."""
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
            raise KvxError(Status.INVALID_ARGUMENT, f"expected an iterable of block ids, got {blocks!r}")
        return [self._block_id(b) for b in blocks]

    def check_invariants(self) -> None:
        """Every id is exactly one of free / in use / cached (used by tests and debug builds)."""
        free, used, cached = set(self._free), set(self._refs), set(self._cached)
        require(len(free) == len(self._free), Status.INTERNAL_ERROR, "a block is free twice")
        require(not (free & used or free & cached or used & cached), Status.INTERNAL_ERROR,
                "a block is in two states")
        require(all(b < self._next for b in free | used | cached), Status.INTERNAL_ERROR,
                "a never-allocated block is in use, cached or free")
        require(len(free) + len(used) + len(cached) == self._next, Status.INTERNAL_ERROR, "a block leaked")
        require(all(r > 0 for r in self._refs.values()), Status.INTERNAL_ERROR, "in-use block with ref 0")


def _checked_key(key: object) -> Hashable:
    """A prefix key must be hashable (KvxError instead of dict's TypeError)."""
    try:
        hash(key)
    except TypeError:
        raise KvxError(Status.INVALID_ARGUMENT, f"prefix key must be hashable, got {type(key).__name__}") from None
    return key
