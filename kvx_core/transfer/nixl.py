"""KV bundles over NIXL (NVIDIA's inference transfer library; UCX underneath): the network transport.

A `NixlPeer` owns one NIXL agent and one registered host buffer, cut into `slots` equal slots. The sending peer
`publish`es a sequence: it exports the bundle into a free slot (`host.export_to_host`) and returns a `ticket`, a
small JSON-safe dict that the application passes to the receiver out of band (an HTTP response, vLLM's
`kv_transfer_params`):

    {"agent": name, "nbytes": bundle bytes, "addr": the bundle's address in the sender's buffer,
     "seq": the publish's number, "metadata": base64 of the sender agent's NIXL metadata}

The receiving peer `fetch`es by a one-sided NIXL READ of the remote slot into its own buffer (which notifies the
sender "kvx-read <seq>" when it completes) and imports it with every check of `import_bundle`: the bundle's
checksums cover the network, a stale or overwritten remote slot is refused (other tokens / checksum), and nothing
is written unless all passes.

Slot lifetime: a published bundle holds its slot until its reader's READ completes (the notification) or `hold_s`
seconds pass, whichever is first; a publish takes the free slot published longest ago, and is refused
(OUT_OF_RANGE) while every slot is held. A ticket is thus valid until its slot is reused: a reader coming later
gets another bundle, which the import refuses. The defaults (one slot, `hold_s` 0) reuse the one slot at the next
publish. A ticket is outside input: `parse_ticket` checks every field's type and range (a JSON ticket strictly: no
NaN / Infinity) before anything is allocated or sent, and the remote buffer travels as plain numbers (NIXL's own
serialized descriptor lists are pickles: never loaded from a ticket). A notification is outside input too: only
"kvx-read <seq>" of a bundle a slot holds releases it.

Needs `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` (`scripts/setup_env.sh` installs it; --no-deps because
its declared dependencies pull CUDA builds). Without RDMA hardware UCX runs over
TCP (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo` on one machine; the CPU CI does this).
"""
from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..descriptors import CacheDesc
from ..errors import KvxError, Status, require
from ..formats.base import is_int
from ..jsonsafe import loads_object
from .handoff import ModelFingerprint, import_bundle
from .host import export_to_host
from .schema import short

TIMEOUT_S = 60.0
MAX_METADATA_CHARS = 1 << 20
"""A ticket's base64 agent metadata longer than this is refused before decoding (UCX metadata takes ~400 chars)."""
MAX_AGENT_NAME = 256
"""A ticket's agent name longer than this is refused."""


@dataclass(frozen=True)
class Ticket:
    """A checked ticket: the sender agent's name and NIXL metadata, and its bundle's address and size."""

    agent: str
    nbytes: int
    addr: int
    seq: int
    metadata: bytes


def _bad_ticket(what: str) -> KvxError:
    return KvxError(Status.INVALID_ARGUMENT, f"not a KVX NIXL ticket: {what} (a ticket is {{agent, nbytes, addr, "
                                             f"seq, metadata}} as NixlPeer.publish returns it)")


def parse_ticket(ticket: dict | str | bytes) -> Ticket:
    """The `Ticket` of a ticket dict (or its JSON text, parsed strictly); KvxError INVALID_ARGUMENT naming the field
    that is missing, of another type or out of range: `agent` a name of 1 to `MAX_AGENT_NAME` characters, `nbytes`
    an integer in [1, 2**63), `addr` an integer in [0, 2**64), `seq` an integer in [0, 2**63), `metadata` base64 of at
    most `MAX_METADATA_CHARS`."""
    if isinstance(ticket, (str, bytes, bytearray)):
        ticket = loads_object(ticket, "KVX NIXL ticket")
    if not isinstance(ticket, dict):
        raise _bad_ticket(f"a {type(ticket).__name__}, not an object")
    agent, nbytes, addr, seq, meta = (ticket.get(k) for k in ("agent", "nbytes", "addr", "seq", "metadata"))
    if not isinstance(agent, str) or not 0 < len(agent) <= MAX_AGENT_NAME:
        raise _bad_ticket(f"agent must be a name of 1 to {MAX_AGENT_NAME} characters, got {short(agent)}")
    if not is_int(nbytes) or not 0 < nbytes < 2**63:
        raise _bad_ticket(f"nbytes must be an integer in [1, 2**63), got {short(nbytes)}")
    if not is_int(addr) or not 0 <= addr < 2**64:
        raise _bad_ticket(f"addr must be an integer in [0, 2**64), got {short(addr)}")
    if not is_int(seq) or not 0 <= seq < 2**63:
        raise _bad_ticket(f"seq must be an integer in [0, 2**63), got {short(seq)}")
    if not isinstance(meta, str) or not 0 < len(meta) <= MAX_METADATA_CHARS:
        raise _bad_ticket(f"metadata must be base64 text of 1 to {MAX_METADATA_CHARS} characters, got {short(meta)}")
    try:
        raw = base64.b64decode(meta, validate=True)
    except (binascii.Error, ValueError):
        raise _bad_ticket("metadata is not base64") from None
    return Ticket(agent, nbytes, addr, seq, raw)


def _agent_class():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        raise KvxError(Status.UNSUPPORTED, "the NIXL transport needs NIXL: pip install --no-deps nixl==1.5.1 "
                                           "nixl-cu12==1.5.1") from None
    return nixl_agent, nixl_agent_config


_READ_NOTIF = re.compile(rb"kvx-read ([0-9]{1,19})")
"""The notification a reader's READ sends its sender when it completes: the `seq` of the bundle read."""


class NixlPeer:
    """One NIXL agent named `name` with a registered host buffer of `capacity` bytes (pinned when CUDA is
    available, so GPU caches export and import through it at copy speed) in `slots` equal slots, each holding a
    published bundle until its reader has read it or `hold_s` seconds have passed."""

    def __init__(self, name: str, capacity: int, *, slots: int = 1, hold_s: float = 0.0):
        require(isinstance(capacity, int) and capacity > 0, Status.INVALID_ARGUMENT,
                f"NixlPeer capacity must be a positive byte count, got {capacity!r}")
        require(is_int(slots) and 0 < slots <= capacity, Status.INVALID_ARGUMENT,
                f"NixlPeer slots must be an integer in [1, capacity], got {slots!r}")
        require(isinstance(hold_s, (int, float)) and 0 <= hold_s < float("inf"), Status.INVALID_ARGUMENT,
                f"NixlPeer hold_s must be a finite number of seconds >= 0, got {hold_s!r}")
        agent, config = _agent_class()
        self.name = name
        self.agent = agent(name, config(backends=["UCX"]))
        require("UCX" in self.agent.backends, Status.UNSUPPORTED, "NIXL has no UCX backend on this machine")
        self.buf = torch.zeros(capacity, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.agent.register_memory([self.buf])
        self.slot_bytes, self.hold_s = capacity // slots, float(hold_s)
        self._seq = [-1] * slots  # the seq of the bundle each slot holds (-1: none yet)
        self._until = [0.0] * slots  # time.monotonic() until which each slot is held for its reader
        self._published = 0
        self._remotes: dict[bytes, str] = {}

    def publish(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                token_ids: Sequence[int] | None = None, kv_heads: tuple[int, int] | None = None) -> dict:
        """Export a sequence into a free slot; the returned ticket lets another peer fetch it. OUT_OF_RANGE, with
        every slot unchanged, while all slots are held or when the bundle does not fit a slot."""
        i = self._free_slot()
        out = self.buf[i * self.slot_bytes:(i + 1) * self.slot_bytes]
        bundle = export_to_host(caches, slots, model=model, token_ids=token_ids, kv_heads=kv_heads, out=out)
        seq, self._published = self._published, self._published + 1
        self._seq[i], self._until[i] = seq, time.monotonic() + self.hold_s
        return {"agent": self.name, "nbytes": bundle.numel(), "addr": bundle.data_ptr(), "seq": seq,
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def held_slots(self) -> int:
        """How many slots hold a bundle not yet read whose hold time has not passed."""
        self._collect_reads()
        now = time.monotonic()
        return sum(until > now for until in self._until)

    def _free_slot(self) -> int:
        """The free slot published longest ago (a stale ticket's bundle is kept as long as possible)."""
        self._collect_reads()
        now = time.monotonic()
        free = [i for i, until in enumerate(self._until) if until <= now]
        require(bool(free), Status.OUT_OF_RANGE,
                f"all {len(self._until)} slots of NIXL peer {self.name!r} hold bundles not read yet (the first is "
                f"released in {min(self._until) - now:.1f} s, or when a reader's READ completes): raise its slots "
                "or buffer, or lower its hold time")
        return min(free, key=lambda i: self._seq[i])

    def _collect_reads(self) -> None:
        """Release the slots whose bundles' READs completed ("kvx-read <seq>" notifications; others ignored)."""
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                m = _READ_NOTIF.fullmatch(message) if isinstance(message, bytes) else None
                if m and int(m.group(1)) in self._seq:
                    self._until[self._seq.index(int(m.group(1)))] = 0.0

    def fetch(self, ticket: dict | str | bytes, timeout_s: float = TIMEOUT_S) -> torch.Tensor:
        """READ the bundle a ticket names into this peer's buffer; returns the bytes (a view of the buffer)."""
        t = parse_ticket(ticket)
        n = t.nbytes
        require(n <= self.buf.numel(), Status.OUT_OF_RANGE,
                f"the bundle has {n} bytes; this peer's buffer holds {self.buf.numel()}")
        local = self.buf[:n]
        try:  # NIXL parses the metadata and checks the remote range against what the sender registered
            if t.metadata not in self._remotes:
                name = self.agent.add_remote_agent(t.metadata)
                self._remotes[t.metadata] = name.decode() if isinstance(name, bytes) else name
            name = self._remotes[t.metadata]
            require(name == t.agent, Status.INVALID_ARGUMENT,
                    f"not a KVX NIXL ticket: agent {short(t.agent)}, its metadata names {short(name)}")
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs([local]),
                                                self.agent.get_xfer_descs([(t.addr, n, 0)], "DRAM"),
                                                self._remotes[t.metadata], notif_msg=b"kvx-read %d" % t.seq)
        except KvxError:
            raise
        except Exception as e:  # noqa: BLE001 - NIXL's own errors (nixlMismatchError, ...) for a forged ticket
            raise KvxError(Status.INVALID_ARGUMENT, f"NIXL refused the ticket of {short(t.agent)}: "
                                                    f"{type(e).__name__} {e}") from None
        try:
            state, deadline = self.agent.transfer(handle), time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            require(state == "DONE", Status.INTERNAL_ERROR,
                    f"NIXL READ of {n} bytes from {t.agent!r}: {state if state == 'ERR' else 'timed out'}")
        finally:
            self.agent.release_xfer_handle(handle)
        return local

    def receive(self, ticket: dict | str | bytes, caches: Sequence[CacheDesc], slots: torch.Tensor, *,
                model: ModelFingerprint,
                token_ids: Sequence[int] | None = None, token_range: tuple[int, int] | None = None) -> dict:
        """`fetch` and import into `caches` at `slots` (all or nothing); returns the bundle header."""
        (header,) = import_bundle(self.fetch(ticket), caches, slots, model=model, token_ids=token_ids,
                                  token_range=token_range)
        return header
