"""KV bundles over NIXL (NVIDIA's inference transfer library; UCX underneath): the network transport.

A `NixlPeer` owns one NIXL agent and one registered buffer, cut into `slots` equal slots, in host memory
(`memory="host"`: NIXL "DRAM", pinned when CUDA is available) or in a GPU's (`memory="device"`: NIXL "VRAM" on
`device`; UCX moves it GPU to GPU over NVLink / PCIe by cuda_ipc, or cuda_copy). The sending peer `publish`es a
sequence: it exports the bundle into a free slot (`host.export_to_host`; into device memory from caches on that GPU
by `host.export_to_device`, device to device; from caches elsewhere through a pinned staging buffer of one slot)
and returns a `ticket`, a small JSON-safe dict that the application passes to the receiver out of band (an HTTP
response, vLLM's `kv_transfer_params`):

    {"agent": name, "nbytes": bundle bytes, "addr": the bundle's address in the sender's buffer,
     "seq": the publish's number, "metadata": base64 of the sender agent's NIXL metadata,
     "memory": "host" | "device", "device": the sender's CUDA device index (device memory only)}

A receiver READs into its own buffer, host or device memory as it was built, whatever the sender's; a bundle in
device memory is checked and imported on the GPU (`host.HostBundle`).

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
TCP (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo` on one machine; the CPU CI does this). On a host with GPUs NIXL refuses a
UCX_TLS without a CUDA transport: `tcp,cuda_copy` there.
"""
from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from ..descriptors import CacheDesc
from ..errors import KvxError, Status, require
from ..formats.base import is_int
from ..jsonsafe import loads_object
from .handoff import ModelFingerprint, import_bundle
from .host import export_to_device, export_to_host
from .kernels import use_kernels
from .schema import short

TIMEOUT_S = 60.0
MAX_METADATA_CHARS = 1 << 20
"""A ticket's base64 agent metadata longer than this is refused before decoding (UCX metadata takes ~400 chars)."""
MAX_AGENT_NAME = 256
"""A ticket's agent name longer than this is refused."""


MAX_SLOTS = 4096
"""A peer's slot count, and a directory ticket's, above this is refused (the directory READ is 24 bytes a slot)."""
MEMORY = ("host", "device")
"""Where a peer's buffer is: host memory (NIXL "DRAM") or a CUDA device's (NIXL "VRAM")."""
MAX_DEVICE = 1 << 10
"""A ticket's CUDA device index at or above this is refused."""
_ENTRY = 3  # a directory entry: seq + 1 (0: empty), the bundle's address, its size (int64 each)


@dataclass(frozen=True)
class Ticket:
    """A checked ticket: the sender agent's name and NIXL metadata, the bundle's seq, and either its address and size
    (`nbytes`, `addr`) or where the sender's slot directory is (`directory`, `slots`: the bundle is looked up by
    seq)."""

    agent: str
    seq: int
    metadata: bytes
    nbytes: int | None = None
    addr: int | None = None
    directory: int | None = None
    slots: int | None = None
    memory: str = "host"
    device: int = 0


def _bad_ticket(what: str) -> KvxError:
    return KvxError(Status.INVALID_ARGUMENT, f"not a KVX NIXL ticket: {what} (a ticket is {{agent, seq, metadata}} "
                                             "with {nbytes, addr} or {directory, slots}, and memory, as "
                                             "NixlPeer.publish or NixlPeer.lookup_ticket returns it)")


def _int_field(ticket: dict, key: str, low: int, high: int) -> int:
    v = ticket.get(key)
    if not is_int(v) or not low <= v < high:
        raise _bad_ticket(f"{key} must be an integer in [{low}, {high}), got {short(v)}")
    return v


def parse_ticket(ticket: dict | str | bytes) -> Ticket:
    """The `Ticket` of a ticket dict (or its JSON text, parsed strictly); KvxError INVALID_ARGUMENT naming the field
    that is missing, of another type or out of range: `agent` a name of 1 to `MAX_AGENT_NAME` characters, `seq` an
    integer in [0, 2**63), `metadata` base64 of at most `MAX_METADATA_CHARS`; then `nbytes` in [1, 2**63) and `addr`
    in [0, 2**64), or (a ticket without `nbytes`) `directory` in [0, 2**64) and `slots` in [1, `MAX_SLOTS`];
    `memory` (where the sender's bundle is) "host" (also when absent: tickets of older senders) or "device" with
    `device` an integer in [0, `MAX_DEVICE`) (a host ticket has no `device`)."""
    if isinstance(ticket, (str, bytes, bytearray)):
        ticket = loads_object(ticket, "KVX NIXL ticket")
    if not isinstance(ticket, dict):
        raise _bad_ticket(f"a {type(ticket).__name__}, not an object")
    agent, meta = ticket.get("agent"), ticket.get("metadata")
    if not isinstance(agent, str) or not 0 < len(agent) <= MAX_AGENT_NAME:
        raise _bad_ticket(f"agent must be a name of 1 to {MAX_AGENT_NAME} characters, got {short(agent)}")
    seq = _int_field(ticket, "seq", 0, 2**63)
    if not isinstance(meta, str) or not 0 < len(meta) <= MAX_METADATA_CHARS:
        raise _bad_ticket(f"metadata must be base64 text of 1 to {MAX_METADATA_CHARS} characters, got {short(meta)}")
    try:
        raw = base64.b64decode(meta, validate=True)
    except (binascii.Error, ValueError):
        raise _bad_ticket("metadata is not base64") from None
    memory = ticket.get("memory", "host")
    if memory not in MEMORY:  # `in` a tuple of str: an unhashable or non-str value is simply not in it
        raise _bad_ticket(f"memory must be one of {', '.join(MEMORY)}, got {short(memory)}")
    if memory == "host" and "device" in ticket:
        raise _bad_ticket("a host-memory ticket has no device")
    where = {"memory": memory, "device": _int_field(ticket, "device", 0, MAX_DEVICE) if memory == "device" else 0}
    if "nbytes" not in ticket and "directory" in ticket:
        return Ticket(agent, seq, raw, directory=_int_field(ticket, "directory", 0, 2**64),
                      slots=_int_field(ticket, "slots", 1, MAX_SLOTS + 1), **where)
    return Ticket(agent, seq, raw, nbytes=_int_field(ticket, "nbytes", 1, 2**63),
                  addr=_int_field(ticket, "addr", 0, 2**64), **where)


def parse_ticket_set(ticket: dict | str | bytes) -> list[tuple[Ticket, tuple[int, int] | None]]:
    """The shards a ticket names, as (`Ticket`, the model's KV heads `[start, stop)` that shard holds): a plain
    ticket is one shard of every KV head (None), a tensor-parallel producer's ticket set `{"shards": [ticket +
    "kv_heads": [start, stop], ...]}` one per distinct head range, 1 to `MAX_SHARDS` of them, the ranges disjoint.
    KvxError INVALID_ARGUMENT for anything else (each shard's fields as `parse_ticket` checks them)."""
    if isinstance(ticket, (str, bytes, bytearray)):
        ticket = loads_object(ticket, "KVX NIXL ticket")
    if not isinstance(ticket, dict) or "shards" not in ticket:
        return [(parse_ticket(ticket), None)]
    shards = ticket["shards"]
    if set(ticket) != {"shards"} or not isinstance(shards, list) or not 0 < len(shards) <= MAX_SHARDS:
        raise _bad_ticket(f"a ticket set is {{shards: [1 to {MAX_SHARDS} tickets]}}, got keys {short(sorted(ticket))}")
    out = []
    for shard in shards:
        heads = shard.get("kv_heads") if isinstance(shard, dict) else None
        if not (isinstance(heads, list) and len(heads) == 2 and all(is_int(h) for h in heads)
                and 0 <= heads[0] < heads[1] <= MAX_KV_HEADS):
            raise _bad_ticket(f"a shard's kv_heads must be [start, stop) within [0, {MAX_KV_HEADS}], got "
                              f"{short(heads)}")
        out.append((parse_ticket({k: v for k, v in shard.items() if k != "kv_heads"}), (heads[0], heads[1])))
    ranges = sorted(r for _, r in out)
    if any(a[1] > b[0] for a, b in pairwise(ranges)):
        raise _bad_ticket(f"the shards' kv_heads overlap: {ranges}")
    return out


def _agent_class():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        raise KvxError(Status.UNSUPPORTED, "the NIXL transport needs NIXL: pip install --no-deps nixl==1.5.1 "
                                           "nixl-cu12==1.5.1") from None
    return nixl_agent, nixl_agent_config


def _buffer_device(memory: str, device: int | None) -> torch.device:
    """The torch device of a peer's buffer, checked before anything is allocated or registered."""
    require(isinstance(memory, str) and memory in MEMORY, Status.INVALID_ARGUMENT,
            f"NixlPeer memory must be one of {', '.join(MEMORY)}, got {memory!r}")
    if memory == "host":
        require(device is None, Status.INVALID_ARGUMENT, "NixlPeer: a device is given for memory 'device' only")
        return torch.device("cpu")
    require(torch.cuda.is_available(), Status.UNSUPPORTED,
            "NixlPeer memory 'device' registers GPU memory, and this platform has no CUDA device "
            "(torch.cuda.is_available() is False): use memory 'host'")
    count = torch.cuda.device_count()
    require(device is None or (is_int(device) and 0 <= device < count), Status.INVALID_ARGUMENT,
            f"NixlPeer device must be a CUDA device index in [0, {count}), got {device!r}")
    return torch.device("cuda", torch.cuda.current_device() if device is None else device)


_READ_NOTIF = re.compile(rb"kvx-read ([0-9]{1,19})(?: ([0-9]{1,4}))?")
"""The notification a reader's READ sends its sender when it completes: the `seq` of the bundle read, and how many
readers that bundle has (absent: one; the READs of a tensor-parallel consumer's ranks, each reading it)."""
MAX_READERS = 1024
"""A notification's reader count above this is refused (ignored)."""
MAX_SHARDS = 64
"""A ticket set (a tensor-parallel producer's) of more shards than this is refused."""
MAX_KV_HEADS = 1 << 16
"""A shard's KV-head range must lie in [0, MAX_KV_HEADS)."""


class NixlPeer:
    """One NIXL agent named `name` with a registered buffer of `capacity` bytes in `slots` equal slots, each holding
    a published bundle until its reader has read it or `hold_s` seconds have passed, and a registered slot directory
    in host memory (per slot: seq + 1, address, size) through which a `lookup_ticket` finds its bundle. `memory`
    "host": the buffer is host memory (pinned when CUDA is available, so GPU caches export and import through it at
    copy speed); "device": GPU memory of CUDA device `device` (default: the current one), UNSUPPORTED without CUDA."""

    def __init__(self, name: str, capacity: int, *, slots: int = 1, hold_s: float = 0.0, memory: str = "host",
                 device: int | None = None):
        require(is_int(capacity) and capacity > 0, Status.INVALID_ARGUMENT,
                f"NixlPeer capacity must be a positive byte count, got {capacity!r}")
        require(is_int(slots) and 0 < slots <= min(capacity, MAX_SLOTS), Status.INVALID_ARGUMENT,
                f"NixlPeer slots must be an integer in [1, {MAX_SLOTS}] and at most capacity, got {slots!r}")
        require(isinstance(hold_s, (int, float)) and 0 <= hold_s < float("inf"), Status.INVALID_ARGUMENT,
                f"NixlPeer hold_s must be a finite number of seconds >= 0, got {hold_s!r}")
        where = _buffer_device(memory, device)
        agent, config = _agent_class()
        self.name, self.memory = name, memory
        self.agent = agent(name, config(backends=["UCX"]))
        require("UCX" in self.agent.backends, Status.UNSUPPORTED, "NIXL has no UCX backend on this machine")
        pin = torch.cuda.is_available()
        self.buf = torch.zeros(capacity, dtype=torch.uint8, device=where, pin_memory=pin and where.type == "cpu")
        self.directory = torch.zeros(slots, _ENTRY, dtype=torch.int64, pin_memory=pin)
        self.agent.register_memory(self.buf)  # one call per memory kind (NIXL takes a list of one kind)
        self.agent.register_memory(self.directory)
        self._stage: torch.Tensor | None = None  # device memory: the pinned host slot bundles are exported into
        self.slot_bytes, self.hold_s = capacity // slots, float(hold_s)
        self._seq = [-1] * slots  # the seq of the bundle each slot holds (-1: none yet)
        self._until = [0.0] * slots  # time.monotonic() until which each slot is held for its readers
        self._reads = [0] * slots  # READs of each slot's bundle completed so far
        self._published = 0
        self._remotes: dict[bytes, str] = {}

    def publish(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                token_ids: Sequence[int] | None = None, kv_heads: tuple[int, int] | None = None,
                seq: int | None = None) -> dict:
        """Export a sequence into a free slot under `seq` (default: this peer's next number; a caller handing out
        `lookup_ticket`s before publishing gives its own); the returned ticket lets another peer fetch it.
        OUT_OF_RANGE, with every slot unchanged, while all slots are held or when the bundle does not fit a slot."""
        require(seq is None or (is_int(seq) and 0 <= seq < 2**63 - 1), Status.INVALID_ARGUMENT,
                f"NixlPeer.publish: seq must be an integer in [0, 2**63 - 1), got {seq!r}")
        i = self._free_slot()
        out = self.buf[i * self.slot_bytes:(i + 1) * self.slot_bytes]
        if self.memory == "host":
            bundle = export_to_host(caches, slots, model=model, token_ids=token_ids, kv_heads=kv_heads, out=out)
        elif caches and caches[0].k.tensor.device == self.buf.device and use_kernels(self.buf.device):  # on the GPU
            bundle = export_to_device(caches, slots, model=model, token_ids=token_ids, kv_heads=kv_heads, out=out)
        else:  # caches elsewhere: exported into a pinned host stage, then one copy to the slot, landed on return
            if self._stage is None:
                self._stage = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            staged = export_to_host(caches, slots, model=model, token_ids=token_ids, kv_heads=kv_heads,
                                    out=self._stage)
            bundle = out[:staged.numel()]
            bundle.copy_(staged)
        if seq is None:
            seq = self._published
        self._published = max(self._published, seq + 1)
        self._seq[i], self._until[i], self._reads[i] = seq, time.monotonic() + self.hold_s, 0
        self.directory[i] = torch.tensor([seq + 1, bundle.data_ptr(), bundle.numel()])
        return {"agent": self.name, "nbytes": bundle.numel(), "addr": bundle.data_ptr(), "seq": seq,
                "metadata": self._metadata(), **self._where()}

    def lookup_ticket(self, seq: int) -> dict:
        """A ticket of the bundle this peer publishes (or will) under `seq`: the reader finds it in the directory."""
        return {"agent": self.name, "seq": seq, "directory": self.directory.data_ptr(),
                "slots": self.directory.shape[0], "metadata": self._metadata(), **self._where()}

    def _where(self) -> dict:
        """The ticket fields saying where this peer's bundles are."""
        if self.memory == "host":
            return {"memory": "host"}
        return {"memory": "device", "device": self.buf.device.index}

    def _metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

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
        """Release the slots whose bundles' READs completed, all of its readers' ("kvx-read <seq> [<readers>]"
        notifications; others ignored)."""
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                m = _READ_NOTIF.fullmatch(message) if isinstance(message, bytes) else None
                readers = int(m.group(2) or 1) if m else 0
                if m and int(m.group(1)) in self._seq and 0 < readers <= MAX_READERS:
                    i = self._seq.index(int(m.group(1)))
                    self._reads[i] += 1
                    if self._reads[i] >= readers:
                        self._until[i] = 0.0

    def fetch(self, ticket: dict | str | bytes | Ticket, timeout_s: float = TIMEOUT_S, *, at: int = 0,
              readers: int = 1) -> torch.Tensor:
        """READ the bundle a ticket names (a lookup ticket: first the sender's directory, then the slot holding its
        seq) into this peer's buffer from byte `at` (the shards of a ticket set side by side); returns the bytes (a
        view of the buffer). `readers`: how many peers READ this bundle (a tensor-parallel consumer's ranks): its
        sender releases the slot once that many READs completed."""
        require(is_int(at) and 0 <= at and is_int(readers) and 0 < readers <= MAX_READERS, Status.INVALID_ARGUMENT,
                f"NixlPeer.fetch: at must be >= 0 and readers in [1, {MAX_READERS}], got {at!r}, {readers!r}")
        t = ticket if isinstance(ticket, Ticket) else parse_ticket(ticket)
        if t.directory is not None:
            entries = self._read(t, t.directory, t.slots * _ENTRY * 8, ("DRAM", 0), b"", timeout_s,
                                 at).view(torch.int64).view(-1, 3)
            found = [e for e in entries.tolist() if e[0] == t.seq + 1]
            require(bool(found), Status.INVALID_ARGUMENT,
                    f"the bundle of NIXL ticket seq {t.seq} is not published by {short(t.agent)} (not yet, failed, "
                    "or its slot was reused): compute the prompt")
            _, addr, n = found[0]  # the sender's memory says so: checked like a ticket's fields
            if not (0 <= addr and 0 < n):
                raise _bad_ticket(f"the directory of {short(t.agent)} gives address {addr}, size {n}")
            t = Ticket(t.agent, t.seq, t.metadata, nbytes=n, addr=addr, memory=t.memory, device=t.device)
        where = ("VRAM", t.device) if t.memory == "device" else ("DRAM", 0)
        notif = b"kvx-read %d" % t.seq if readers == 1 else b"kvx-read %d %d" % (t.seq, readers)
        return self._read(t, t.addr, t.nbytes, where, notif, timeout_s, at)

    def _read(self, t: Ticket, addr: int, n: int, where: tuple[str, int], notif: bytes,
              timeout_s: float, at: int = 0) -> torch.Tensor:
        """One NIXL READ of `n` bytes at the sender's `addr` in its memory `where` (NIXL memory type, device) into
        this peer's buffer at byte `at` (`notif`: the notification the sender gets when it completes)."""
        require(at + n <= self.buf.numel(), Status.OUT_OF_RANGE,
                f"the bundle has {n} bytes; this peer's buffer holds {self.buf.numel() - at} from byte {at}")
        local = self.buf[at:at + n]
        try:  # NIXL parses the metadata and checks the remote range against what the sender registered
            if t.metadata not in self._remotes:
                name = self.agent.add_remote_agent(t.metadata)
                self._remotes[t.metadata] = name.decode() if isinstance(name, bytes) else name
            name = self._remotes[t.metadata]
            require(name == t.agent, Status.INVALID_ARGUMENT,
                    f"not a KVX NIXL ticket: agent {short(t.agent)}, its metadata names {short(name)}")
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs([local]),
                                                self.agent.get_xfer_descs([(addr, n, where[1])], where[0]), name,
                                                notif_msg=notif)
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
