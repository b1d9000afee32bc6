"""KV bundles over NIXL (NVIDIA's inference transfer library; UCX underneath): the network transport.

A `NixlPeer` owns one NIXL agent and one registered host buffer. The sending peer `publish`es a sequence: it
exports the bundle into its buffer (`host.export_to_host`) and returns a `ticket`, a small JSON-safe dict (its
agent's metadata and the buffer's descriptors) that the application passes to the receiver out of band (an HTTP
response, vLLM's `kv_transfer_params`). The receiving peer `fetch`es by a one-sided NIXL READ of the remote buffer
into its own and imports it with every check of `import_bundle`: the bundle's checksums cover the network, a
stale or overwritten remote buffer is refused (other tokens / checksum), and nothing is written unless all passes.
One buffer per peer: a ticket is valid until that peer's next `publish`.

Needs `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` (`scripts/setup_env.sh` installs it; --no-deps because
its declared dependencies pull CUDA builds). Without RDMA hardware UCX runs over
TCP (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo` on one machine; the CPU CI does this).
"""
from __future__ import annotations

import base64
import time
from collections.abc import Sequence

import torch

from ..descriptors import CacheDesc
from ..errors import KvxError, Status, require
from .handoff import ModelFingerprint, import_bundle
from .host import export_to_host

TIMEOUT_S = 60.0


def _agent_class():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        raise KvxError(Status.UNSUPPORTED, "the NIXL transport needs NIXL: pip install --no-deps nixl==1.5.1 "
                                           "nixl-cu12==1.5.1") from None
    return nixl_agent, nixl_agent_config


class NixlPeer:
    """One NIXL agent named `name` with a registered host buffer of `capacity` bytes (pinned when CUDA is
    available, so GPU caches export and import through it at copy speed)."""

    def __init__(self, name: str, capacity: int):
        require(isinstance(capacity, int) and capacity > 0, Status.INVALID_ARGUMENT,
                f"NixlPeer capacity must be a positive byte count, got {capacity!r}")
        agent, config = _agent_class()
        self.name = name
        self.agent = agent(name, config(backends=["UCX"]))
        require("UCX" in self.agent.backends, Status.UNSUPPORTED, "NIXL has no UCX backend on this machine")
        self.buf = torch.zeros(capacity, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.agent.register_memory([self.buf])
        self._remotes: dict[bytes, str] = {}

    def publish(self, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                token_ids: Sequence[int] | None = None, kv_heads: tuple[int, int] | None = None) -> dict:
        """Export a sequence into this peer's buffer; the returned ticket lets another peer fetch it."""
        bundle = export_to_host(caches, slots, model=model, token_ids=token_ids, kv_heads=kv_heads, out=self.buf)
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs([bundle]))
        return {"agent": self.name, "nbytes": bundle.numel(),
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "descs": base64.b64encode(descs).decode()}

    def fetch(self, ticket: dict, timeout_s: float = TIMEOUT_S) -> torch.Tensor:
        """READ the bundle a ticket names into this peer's buffer; returns the bytes (a view of the buffer)."""
        try:
            n, meta = int(ticket["nbytes"]), base64.b64decode(ticket["metadata"])
            remote_descs = base64.b64decode(ticket["descs"])
        except (KeyError, TypeError, ValueError):
            raise KvxError(Status.INVALID_ARGUMENT, "not a KVX NIXL ticket (needs agent, nbytes, metadata, descs)") from None
        require(0 < n <= self.buf.numel(), Status.OUT_OF_RANGE,
                f"the bundle has {n} bytes; this peer's buffer holds {self.buf.numel()}")
        if meta not in self._remotes:
            self._remotes[meta] = self.agent.add_remote_agent(meta)
        local = self.buf[:n]
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs([local]),
                                            self.agent.deserialize_descs(remote_descs), self._remotes[meta])
        try:
            state, deadline = self.agent.transfer(handle), time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            require(state == "DONE", Status.INTERNAL_ERROR,
                    f"NIXL READ of {n} bytes from {ticket.get('agent')!r}: {state if state == 'ERR' else 'timed out'}")
        finally:
            self.agent.release_xfer_handle(handle)
        return local

    def receive(self, ticket: dict, caches: Sequence[CacheDesc], slots: torch.Tensor, *, model: ModelFingerprint,
                token_ids: Sequence[int] | None = None, token_range: tuple[int, int] | None = None) -> dict:
        """`fetch` and import into `caches` at `slots` (all or nothing); returns the bundle header."""
        (header,) = import_bundle(self.fetch(ticket), caches, slots, model=model, token_ids=token_ids,
                                  token_range=token_range)
        return header
