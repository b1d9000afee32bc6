"""Block allocator for dual-pool paged caches: one id space for the data and scale pools.

A block id is free, in use (ref count >= 1, shared by every sequence whose prefix covers it), or
cached (ref count 0, content kept under a prefix key for reuse until evicted, least recently
released first). Because the data pool and the scale pool are indexed by the same ids, allocating
here allocates both: they cannot drift apart.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from .errors import KvxError, Status, require


class BlockAllocator:
    """Allocate / share / free / evict block ids in `[0, num_blocks)`."""

    def __init__(self, num_blocks: int) -> None:
        require(num_blocks > 0, Status.INVALID_ARGUMENT, f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[int, Hashable] = OrderedDict()  # ref 0, kept for reuse, LRU first
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free plus evictable cached blocks)."""
        return len(self._free) + len(self._cached)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._refs.get(block, 0)

    def lookup(self, key: Hashable) -> int | None:
        """The block holding the content registered under `key` (in use or cached), if any."""
        return self._block_of.get(key)

    # ------------------------------------------------------------ operations
    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (ref count 1), evicting least recently released cached blocks if needed."""
        require(n >= 0, Status.INVALID_ARGUMENT, f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise KvxError(Status.OUT_OF_RANGE,
                           f"KV cache full: {n} blocks requested, {self.num_free} free or evictable of "
                           f"{self.num_blocks}; free finished sequences or raise the cache budget")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                self._forget(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block (prefix sharing); cached blocks come back into use.
        All ids are checked before any is applied."""
        blocks = list(blocks)
        for block in blocks:
            self._check_id(block)
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
        blocks = list(blocks)
        for block in blocks:
            self._check_id(block)
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
        self._check_id(block)
        require(self._refs.get(block, 0) > 0, Status.INVALID_ARGUMENT, f"block {block} is not in use")
        require(key not in self._block_of or self._block_of[key] == block, Status.INVALID_ARGUMENT,
                f"prefix key already maps to block {self._block_of.get(key)}")
        self._forget(block)
        self._key_of[block] = key
        self._block_of[key] = block

    def evict(self, n: int | None = None) -> list[int]:
        """Evict up to `n` (default all) cached blocks, least recently released first; returns them."""
        out = []
        while self._cached and (n is None or len(out) < n):
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self._free.append(block)
            out.append(block)
        return out

    # ------------------------------------------------------------ internals
    def _forget(self, block: int) -> None:
        if block in self._key_of:  # any hashable is a key, None included
            del self._block_of[self._key_of.pop(block)]

    def _check_id(self, block: int) -> None:
        require(0 <= block < self.num_blocks, Status.OUT_OF_RANGE,
                f"block id {block} out of range [0, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Every id is exactly one of free / in use / cached (used by tests and debug builds)."""
        free, used, cached = set(self._free), set(self._refs), set(self._cached)
        require(len(free) == len(self._free), Status.INTERNAL_ERROR, "a block is free twice")
        require(not (free & used or free & cached or used & cached), Status.INTERNAL_ERROR,
                "a block is in two states")
        require(len(free) + len(used) + len(cached) == self.num_blocks, Status.INTERNAL_ERROR, "a block leaked")
        require(all(r > 0 for r in self._refs.values()), Status.INTERNAL_ERROR, "in-use block with ref 0")
