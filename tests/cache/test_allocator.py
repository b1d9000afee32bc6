"""Block allocator: random allocate / free / share / register / evict sequences against an explicit model
(ref counts, LRU prefix cache, keys), with the data and scale pools of a real `PagedKVCache` checked
after every step: each live block still holds, in BOTH pools, exactly what was written when it was
allocated (so ids never double-allocate and data/scales never drift apart)."""
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvx_core.allocator import BlockAllocator
from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 6, 2, 1, 32
KEYS = st.sampled_from([None, 0, 1, 2, "prefix-a", ("t", 3)])
ANY_BLOCK = st.integers(0, NUM_BLOCKS - 1)


def _raises(status: Status, fn, *args) -> None:
    with pytest.raises(KvxError) as e:
        fn(*args)
    assert e.value.status == status


class AllocatorMachine(RuleBasedStateMachine):
    PAGE_BUFFER = False

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache("nvfp4", num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                  num_kv_heads=HEADS, head_dim=HEAD_DIM, page_buffer=self.PAGE_BUFFER)
        self.alloc = self.cache.allocator
        self.refs: dict[int, int] = {}  # in use
        self.cached: OrderedDict[int, object] = OrderedDict()  # ref 0, keyed, least recently released first
        self.key_of: dict[int, object] = {}  # in-use or cached blocks registered under a key
        self.expected = {name: torch.zeros_like(t) for name, t in self._pools().items()}
        self.tag = 0

    def _pools(self) -> dict[str, torch.Tensor]:
        p = self.cache.layers[0]
        return {"k_data": p.k_data, "v_data": p.v_data, "k_scales": p.k_scales, "v_scales": p.v_scales}

    def _fill(self, block: int) -> None:
        """Write a block-unique pattern (payload AND group scales differ per tag) and record its encoding."""
        self.tag += 1
        base = torch.linspace(-1.0, 1.0, BLOCK_SIZE * HEADS * HEAD_DIM).reshape(BLOCK_SIZE, HEADS, HEAD_DIM)
        k, v = base * (0.5 + self.tag), -base * (1.5 + 2 * self.tag)
        slots = torch.arange(BLOCK_SIZE) + block * BLOCK_SIZE
        self.cache.write(0, k, v, slots)
        fmt = self.cache.format
        for which, x in (("k", k), ("v", v)):
            payload, scales = getattr(fmt, f"encode_{which}")(x)  # [T, H, X] -> pool rows [H, T, X]
            self.expected[f"{which}_data"][block] = payload.transpose(0, 1)
            self.expected[f"{which}_scales"][block] = scales.transpose(0, 1)

    def _pick(self, data) -> int:
        """Mostly a block the model holds (in use or cached), sometimes any id (free ones hit the error paths)."""
        held = sorted(set(self.refs) | set(self.cached))
        return data.draw(st.one_of(st.sampled_from(held), ANY_BLOCK) if held else ANY_BLOCK)

    # ------------------------------------------------------------ rules
    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        free = [b for b in range(NUM_BLOCKS) if b not in self.refs and b not in self.cached]
        if n > len(free) + len(self.cached):
            _raises(Status.OUT_OF_RANGE, self.alloc.allocate, n)
            return
        got = self.alloc.allocate(n)
        assert len(set(got)) == n and not set(got) & set(self.refs)  # never double-allocated
        k = min(n, len(free))
        assert set(got[:k]) <= set(free)  # free blocks first, then evict least recently released
        assert got[k:] == list(self.cached)[:n - k]
        for b in got:
            if b in self.cached:
                del self.cached[b]
                del self.key_of[b]
            self.refs[b] = 1
            self._fill(b)

    @rule(data=st.data())
    def share(self, data):
        block = self._pick(data)
        if block in self.refs:
            self.refs[block] += 1
        elif block in self.cached:
            del self.cached[block]
            self.refs[block] = 1
        else:
            _raises(Status.INVALID_ARGUMENT, self.alloc.share, [block])
            return
        self.alloc.share([block])

    @rule(data=st.data())
    def free(self, data):
        block = self._pick(data)
        if block not in self.refs:
            _raises(Status.INVALID_ARGUMENT, self.alloc.free, [block])  # double free / never allocated
            return
        self.alloc.free([block])
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            if block in self.key_of:
                self.cached[block] = self.key_of[block]

    @rule(data=st.data(), key=KEYS)
    def register(self, data, key):
        block = self._pick(data)
        owner = next((b for b, k in self.key_of.items() if k == key), None)
        if block not in self.refs or owner not in (None, block):
            _raises(Status.INVALID_ARGUMENT, self.alloc.register, block, key)
            return
        self.alloc.register(block, key)
        self.key_of[block] = key

    @rule(n=st.one_of(st.none(), st.integers(0, 3)))
    def evict(self, n):
        want = list(self.cached)[:n] if n is not None else list(self.cached)
        assert self.alloc.evict(n) == want
        for b in want:
            del self.cached[b]
            del self.key_of[b]

    # ------------------------------------------------------------ invariants
    @invariant()
    def allocator_matches_model(self):
        self.alloc.check_invariants()
        assert self.alloc.num_free == NUM_BLOCKS - len(self.refs)
        for b in range(NUM_BLOCKS):
            assert self.alloc.ref_count(b) == self.refs.get(b, 0)
        for key in (None, 0, 1, 2, "prefix-a", ("t", 3)):
            assert self.alloc.lookup(key) == next((b for b, k in self.key_of.items() if k == key), None)

    @invariant()
    def pools_hold_each_live_blocks_own_write(self):
        live = sorted(set(self.refs) | set(self.cached))
        for name, t in self._pools().items():
            assert torch.equal(t[live].view(torch.uint8), self.expected[name][live].view(torch.uint8)), name


class PageBufferMachine(AllocatorMachine):
    PAGE_BUFFER = True


_SETTINGS = settings(max_examples=80, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestAllocatorSeparatePools = AllocatorMachine.TestCase
TestAllocatorSeparatePools.settings = _SETTINGS
TestAllocatorPageBuffer = PageBufferMachine.TestCase
TestAllocatorPageBuffer.settings = _SETTINGS


def test_cache_full_is_out_of_range_and_changes_nothing():
    cache = PagedKVCache("int4", num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64)
    _raises(Status.OUT_OF_RANGE, cache.allocator.allocate, 5)
    first = cache.allocator.allocate(3)
    with pytest.raises(KvxError) as e:
        cache.allocator.allocate(2)
    assert e.value.status == Status.OUT_OF_RANGE and "KV cache full" in e.value.message
    assert cache.allocator.num_free == 1 and sorted(first + cache.allocator.allocate(1)) == [0, 1, 2, 3]
    _raises(Status.OUT_OF_RANGE, cache.allocator.allocate, 1)
    cache.allocator.check_invariants()


def test_allocator_argument_errors():
    _raises(Status.INVALID_ARGUMENT, BlockAllocator, 0)
    a = BlockAllocator(3)
    _raises(Status.INVALID_ARGUMENT, a.allocate, -1)
    _raises(Status.OUT_OF_RANGE, a.free, [3])
    _raises(Status.OUT_OF_RANGE, a.share, [-1])
    _raises(Status.OUT_OF_RANGE, a.ref_count, 7)
    assert a.allocate(0) == [] and a.num_free == 3
