"""Fuzz target of NIXL lookup tickets: the sender's slot directory forged (`tests.fuzz` runs `directory_entries`
under its memory cap; the NIXL peers and their UCX connection are set up at import, before the cap)."""
from __future__ import annotations

import random

import torch

from kvx_core.errors import KvxError
from kvx_core.transfer.nixl import NixlPeer

from .caches import MODEL, _cache, _descs, _snapshot, _unchanged

SLOTS = 4
IDS = list(range(20))
SENDER, RECEIVER = NixlPeer("kvx-fuzz-send", 1 << 20, slots=SLOTS), NixlPeer("kvx-fuzz-recv", 1 << 20)
SRC, SRC_SLOTS = _cache("int8", 16, 4, tokens=len(IDS))
TICKET = SENDER.lookup_ticket(0)
SENDER.publish(_descs(SRC), SRC_SLOTS, model=MODEL, token_ids=IDS, seq=0)
VALID = SENDER.directory.clone()
RECEIVER.fetch(TICKET)  # connects before the cap
DST = _cache("int8", 16, 4, seed=3)[0]


def directory_entries(rng: random.Random) -> None:
    """A valid directory with 1 to 3 fields forged (seq, address, size: near the valid ones, extremes, random); the
    receive succeeds or raises KvxError with nothing written."""
    SENDER.directory.copy_(VALID)
    _, addr, nbytes = VALID[0].tolist()
    for _ in range(rng.randint(1, 3)):
        value = rng.choice([0, 1, -1, 2**63 - 1, -2**63, rng.getrandbits(63), addr + rng.randint(-4096, 4096),
                            nbytes + rng.randint(-64, 64), 1 << 20, (1 << 20) + 1, addr + (1 << 20) - 8])
        SENDER.directory[0 if rng.random() < 0.75 else rng.randrange(SLOTS), rng.randrange(3)] = value
    before = _snapshot(DST)
    try:
        RECEIVER.receive(TICKET, _descs(DST), torch.arange(len(IDS)), model=MODEL, token_ids=IDS)
    except KvxError:
        assert _unchanged(DST, before), "a refused directory entry changed the cache"
        raise
