"""The NIXL transport (`kvx_core.transfer.nixl`): real NIXL agents, UCX over TCP loopback, in one process and
across two; the bundle checks cover what crosses the wire."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

try:
    import nixl  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # scripts/setup_env.sh installs it: missing in CI is a failure, not a skip
        raise
    pytest.skip("NIXL not installed: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1", allow_module_level=True)

from kvx_core.errors import KvxError, Status  # noqa: E402
from kvx_core.transfer import import_bundle  # noqa: E402
from kvx_core.transfer.host import export_to_host  # noqa: E402
from kvx_core.transfer.nixl import MAX_SHARDS, NixlPeer, parse_ticket_set  # noqa: E402
from kvx_core.transfer.rows import read_rows  # noqa: E402

from ..fuzz import run_capped  # noqa: E402
from ..procs import communicate  # noqa: E402
from . import caches  # noqa: E402
from .caches import LAYERS, MODEL, _cache, _descs, _snapshot, _unchanged  # noqa: E402

LOOPBACK_TLS = "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"
"""UCX over TCP loopback; NIXL's UCX backend refuses a transport list without a CUDA one on a host with GPUs
("Add cuda_copy for basic GPU support"), so a GPU host adds cuda_copy."""
UCX = {"UCX_TLS": LOOPBACK_TLS, "UCX_NET_DEVICES": "lo"}


@pytest.fixture(autouse=True)
def _ucx_loopback(monkeypatch):
    for k, v in UCX.items():
        monkeypatch.setenv(k, v)


def _rows_equal(a, sa, b, sb) -> bool:
    return all(all(torch.equal(x[n].view(torch.uint8), y[n].view(torch.uint8)) for n in x)
               for x, y in ((read_rows(a.descriptor(i), sa), read_rows(b.descriptor(i), sb)) for i in range(LAYERS)))


def _same_scales(dst, src):
    """The destination takes the source's global scales, so same-format rows are stored as they are."""
    for layer in range(LAYERS):
        if src.layers[layer].k_global is not None:
            dst.set_global_scales(layer, src.layers[layer].k_global, src.layers[layer].v_global)
    return dst


def test_in_process_handoff_is_bit_identical_and_converts():
    src, slots = _cache("nvfp4", 16, 4, tokens=40)
    sender, receiver = NixlPeer("kvx-send", 1 << 20), NixlPeer("kvx-recv", 1 << 20)
    ids = list(range(40))
    ticket = sender.publish(_descs(src), slots, model=MODEL, token_ids=ids)
    assert json.loads(json.dumps(ticket)) == ticket  # travels as JSON
    dst = _same_scales(_cache("nvfp4", 8, 8)[0], src)
    back = torch.arange(63, 23, -1)
    header = receiver.receive(ticket, _descs(dst), back, model=MODEL, token_ids=ids)
    assert header["cache"]["format"] == "nvfp4" and _rows_equal(src, slots, dst, back)
    into_bf16, oracle = _cache("bf16", 8, 8)[0], _cache("bf16", 8, 8)[0]
    receiver.receive(ticket, _descs(into_bf16), back, model=MODEL)
    import_bundle(receiver.fetch(ticket).clone(), _descs(oracle), back, model=MODEL)
    assert _rows_equal(into_bf16, back, oracle, back)


def test_ticket_sets_and_reads_side_by_side():
    """A tensor-parallel producer's ticket set: each shard parsed with its KV-head range, READ at its own offset of
    the receiver's buffer; a set that is empty, too long, has other keys, or heads missing, reversed or overlapping
    is refused; so are a negative offset, a reader count out of range and a READ past the buffer's end."""
    src, slots = _cache("int8", 16, 4, tokens=20)
    sender, receiver = NixlPeer("kvx-send-set", 1 << 20, slots=2), NixlPeer("kvx-recv-set", 1 << 16)
    a = sender.publish(_descs(src), slots, model=MODEL, seq=1)
    b = sender.publish(_descs(src), slots[:10], model=MODEL, seq=2)
    plain = parse_ticket_set(json.dumps(a))
    assert len(plain) == 1 and plain[0][1] is None and plain[0][0].seq == 1
    shards = parse_ticket_set({"shards": [{**b, "kv_heads": [1, 2]}, {**a, "kv_heads": [0, 1]}]})
    assert [(t.seq, h) for t, h in shards] == [(2, (1, 2)), (1, (0, 1))]
    first = receiver.fetch(shards[1][0])
    second = receiver.fetch(shards[0][0], at=-(-first.numel() // 256) * 256)
    assert torch.equal(first, sender.buf[:a["nbytes"]]) and second.data_ptr() > first.data_ptr()
    assert torch.equal(second, sender.buf[b["addr"] - sender.buf.data_ptr():][:b["nbytes"]])
    for forged in ({"shards": []}, {"shards": [{**a, "kv_heads": [0, 1]}] * (MAX_SHARDS + 1)},
                   {"shards": [{**a, "kv_heads": [0, 1]}], "seq": 1}, {"shards": [a]},
                   {"shards": [{**a, "kv_heads": [1, 1]}]}, {"shards": [{**a, "kv_heads": [0, 1.0]}]},
                   {"shards": [{**a, "kv_heads": [0, 2]}, {**b, "kv_heads": [1, 3]}]},
                   {"shards": [{**a, "kv_heads": [0, 1]}, {**b, "kv_heads": [0, 1]}]},
                   {"shards": [{**a, "agent": 7, "kv_heads": [0, 1]}]}):
        with pytest.raises(KvxError, match="ticket") as e:
            parse_ticket_set(forged)
        assert e.value.status == Status.INVALID_ARGUMENT
    for kw in ({"at": -1}, {"readers": 0}, {"readers": 1025}, {"at": 1.0}):
        with pytest.raises(KvxError) as e:
            receiver.fetch(a, **kw)
        assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError) as e:
        receiver.fetch(a, at=(1 << 16) - 10)
    assert e.value.status == Status.OUT_OF_RANGE


def test_stale_ticket_bad_ticket_and_small_buffer_are_refused_untouched():
    a, slots = _cache("int8", 16, 4, tokens=20)
    sender, receiver = NixlPeer("kvx-send2", 1 << 20), NixlPeer("kvx-recv2", 4096)
    ticket = sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    dst, _ = _cache("int8", 16, 4, seed=3, tokens=12)
    before = _snapshot(dst)
    with pytest.raises(KvxError) as e:  # 4 KiB cannot hold the bundle
        receiver.fetch(ticket)
    assert e.value.status == Status.OUT_OF_RANGE
    big = NixlPeer("kvx-recv3", 1 << 20)
    b, _ = _cache("int8", 16, 4, seed=5, tokens=20)
    sender.publish(_descs(b), slots, model=MODEL, token_ids=list(range(1, 21)))  # overwrites the sender's buffer
    with pytest.raises(KvxError, match="truncated"):  # the new bundle is one byte longer than the ticket says
        big.receive(ticket, _descs(dst), torch.arange(20), model=MODEL, token_ids=list(range(20)))
    sender.publish(_descs(b), slots, model=MODEL, token_ids=list(range(19, -1, -1)))  # same size, other tokens
    with pytest.raises(KvxError, match="other tokens"):
        big.receive(ticket, _descs(dst), torch.arange(20), model=MODEL, token_ids=list(range(20)))
    for bad in ({}, {"nbytes": "x", "metadata": "", "descs": ""}):
        with pytest.raises(KvxError, match="ticket"):
            big.fetch(bad)
    assert _unchanged(dst, before)


def test_a_refused_publish_keeps_the_published_bundle_and_forged_tickets_are_refused():
    """A publish whose layer 1 cannot hold the slots is refused before the peer's buffer (the bundle its last ticket
    names) changes; a ticket whose agent its metadata does not name, whose metadata NIXL cannot read or whose size
    is not an integer is refused before any transfer."""
    from kvx_core.cache import PagedKVCache  # noqa: PLC0415

    a, slots = _cache("int8", 16, 4, tokens=20)
    sender, receiver = NixlPeer("kvx-send4", 1 << 20), NixlPeer("kvx-recv4", 1 << 20)
    ticket = sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    published = sender.buf.clone()
    small = PagedKVCache("int8", num_layers=LAYERS, num_blocks=1, block_size=16, num_kv_heads=a.num_kv_heads,
                         head_dim=a.head_dim)
    with pytest.raises(KvxError) as e:
        sender.publish([a.descriptor(0), small.descriptor(1)], torch.arange(20, 40), model=MODEL)
    assert e.value.status == Status.OUT_OF_RANGE and torch.equal(sender.buf, published)
    assert torch.equal(receiver.fetch(ticket), published[:ticket["nbytes"]])
    garbage = base64.b64encode(b"not nixl metadata").decode()
    for forged in ({**ticket, "agent": "kvx-someone-else"}, {**ticket, "metadata": garbage},
                   {**ticket, "nbytes": float("inf")}, json.dumps({**ticket, "nbytes": 1.5})):
        with pytest.raises(KvxError, match="ticket") as e:
            receiver.fetch(forged)
        assert e.value.status == Status.INVALID_ARGUMENT


SENDER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from tests.transfer.caches import MODEL, _cache, _descs
    from kvx_core.transfer.nixl import NixlPeer
    src, slots = _cache("k8v4", 16, 4, tokens=50)
    peer = NixlPeer("kvx-remote-sender", 1 << 20)
    ticket = peer.publish(_descs(src), slots, model=MODEL, token_ids=list(range(50)))
    print("KVX_TICKET " + json.dumps(ticket), flush=True)
    sys.stdin.readline()  # keep the buffer alive until the receiver is done
""")


def test_handoff_between_two_processes_over_tcp_loopback():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-c", SENDER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, **UCX})
    try:
        line = ""
        while not line.startswith("KVX_TICKET ") and (line or p.poll() is None):
            line = p.stdout.readline()  # NIXL logs to stdout too
        assert line.startswith("KVX_TICKET "), p.stderr.read()[-3000:]
        ticket = json.loads(line.split(" ", 1)[1])
        src, slots = _cache("k8v4", 16, 4, tokens=50)  # the sender's cache, rebuilt from the same seed
        dst = _same_scales(_cache("k8v4", 32, 4)[0], src)
        back = torch.arange(100, 50, -1)
        NixlPeer("kvx-remote-receiver", 1 << 20).receive(ticket, _descs(dst), back, model=MODEL,
                                                         token_ids=list(range(50)))
        assert _rows_equal(src, slots, dst, back)
    finally:
        communicate(p, "the NIXL sender process", "done\n")
    assert p.returncode == 0


def _wait_released(peer: NixlPeer, held: int) -> None:
    """Poll until the peer has taken its readers' notifications (they arrive asynchronously over UCX; the deadline
    only bounds a hang)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if peer.held_slots() == held:
            return
    raise AssertionError(f"{peer.held_slots()} slots held, expected {held}")


def test_slots_are_held_until_read_and_a_recycled_slot_is_refused():
    """Two slots held for an hour: a third publish is refused with both bundles unchanged; the receiver's READ of the
    first releases its slot (its notification), the next publish reuses it, and the first ticket then names another
    bundle of as many bytes in that slot: refused (other tokens), nothing written; the second ticket stays valid."""
    sender, receiver = NixlPeer("kvx-send5", 1 << 20, slots=2, hold_s=3600), NixlPeer("kvx-recv5", 1 << 20)
    a, slots = _cache("int8", 16, 4, tokens=20)
    first = sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(100, 120)))
    second = sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(300, 320)))
    assert first["addr"] != second["addr"] and sender.held_slots() == 2
    published = sender.buf.clone()
    with pytest.raises(KvxError, match="slots") as e:
        sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(200, 220)))
    assert e.value.status == Status.OUT_OF_RANGE and torch.equal(sender.buf, published)
    dst, _ = _cache("int8", 16, 4, seed=3, tokens=12)
    before = _snapshot(dst)
    assert torch.equal(receiver.fetch(first), published[:first["nbytes"]])
    _wait_released(sender, 1)
    third = sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(200, 220)))
    assert third["addr"] == first["addr"] and third["seq"] > second["seq"]
    with pytest.raises(KvxError, match="other tokens"):
        receiver.receive(first, _descs(dst), torch.arange(20), model=MODEL, token_ids=list(range(100, 120)))
    assert _unchanged(dst, before)
    receiver.receive(second, _descs(dst), torch.arange(20), model=MODEL, token_ids=list(range(300, 320)))
    assert _rows_equal(a, slots, dst, torch.arange(20))


def test_a_held_slot_is_released_by_its_hold_time_and_forged_notifications_release_nothing():
    """hold_s 0 releases at once (one slot, reused by each publish); a notification that is not "kvx-read <seq>" of
    a held bundle releases nothing (sent before the real one of the other slot, which UCX delivers after them)."""
    a, slots = _cache("int8", 16, 4, tokens=20)
    quick = NixlPeer("kvx-send6", 1 << 20, slots=1)
    t1 = quick.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    t2 = quick.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    assert t1["addr"] == t2["addr"] and quick.held_slots() == 0
    held = NixlPeer("kvx-send7", 1 << 20, slots=2, hold_s=3600)
    first = held.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    held.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    other = NixlPeer("kvx-notifier", 4096)
    other.agent.add_remote_agent(held.agent.get_agent_metadata())
    for message in (b"kvx-read 7", b"kvx-read 0 ", b"kvx-read -0", b"hello", b"kvx-read 99999999999999999999"):
        other.agent.send_notif("kvx-send7", message)
    other.agent.send_notif("kvx-send7", b"kvx-read 1")
    _wait_released(held, 1)
    assert held.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))["addr"] != first["addr"]
    with pytest.raises(KvxError, match="slots"):  # seq 0's slot is still held
        held.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))
    assert torch.equal(NixlPeer("kvx-recv7", 1 << 20).fetch(first), held.buf[:first["nbytes"]])


@pytest.mark.parametrize("slots, hold_s", [(0, 0.0), (2.0, 0.0), (1, -1.0), (1, float("nan")), (1, float("inf"))])
def test_bad_slot_settings_are_refused(slots, hold_s):
    with pytest.raises(KvxError) as e:
        NixlPeer("kvx-bad", 1 << 20, slots=slots, hold_s=hold_s)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_a_ticket_without_an_integer_seq_is_refused():
    a, slots = _cache("int8", 16, 4, tokens=20)
    sender, receiver = NixlPeer("kvx-send8", 1 << 20), NixlPeer("kvx-recv8", 1 << 20)
    ticket = sender.publish(_descs(a), slots, model=MODEL)
    for seq in (None, -1, 2**63, 1.0, "0", True):
        with pytest.raises(KvxError, match="seq") as e:
            receiver.fetch({**ticket, "seq": seq})
        assert e.value.status == Status.INVALID_ARGUMENT


def test_a_lookup_ticket_finds_its_bundle_through_the_directory_until_its_slot_is_reused():
    """A lookup ticket handed out before the publish (as vLLM's scheduler does): refused while nothing is published
    under its seq, read bit for bit once it is, refused again after its slot took another bundle; a directory entry
    that the sender's memory forges (size 0, a negative address, more than the receiving buffer) is refused before
    the bundle READ, with nothing written."""
    sender, receiver = NixlPeer("kvx-send9", 1 << 20, slots=1), NixlPeer("kvx-recv9", 1 << 20)
    ticket = sender.lookup_ticket(5)
    assert json.loads(json.dumps(ticket)) == ticket
    dst, _ = _cache("int8", 16, 4, seed=3, tokens=12)
    before = _snapshot(dst)
    with pytest.raises(KvxError, match="not published") as e:
        receiver.fetch(ticket)
    assert e.value.status == Status.INVALID_ARGUMENT
    a, slots = _cache("int8", 16, 4, tokens=20)
    direct = sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)), seq=5)
    assert torch.equal(receiver.fetch(ticket), sender.buf[:direct["nbytes"]])
    good = sender.directory.clone()
    for entry, status in (([6, direct["addr"], 0], Status.INVALID_ARGUMENT),
                          ([6, -1, direct["nbytes"]], Status.INVALID_ARGUMENT),
                          ([6, direct["addr"], 2 << 20], Status.OUT_OF_RANGE)):
        sender.directory[0] = torch.tensor(entry)
        with pytest.raises(KvxError) as e:
            receiver.receive(ticket, _descs(dst), torch.arange(20), model=MODEL, token_ids=list(range(20)))
        assert e.value.status == status
    sender.directory.copy_(good)
    sender.publish(_descs(a), slots, model=MODEL, token_ids=list(range(20)))  # seq 6 takes the only slot
    with pytest.raises(KvxError, match="not published"):
        receiver.receive(ticket, _descs(dst), torch.arange(20), model=MODEL, token_ids=list(range(20)))
    assert _unchanged(dst, before)
    for forged in ({**ticket, "slots": 0}, {**ticket, "slots": 4097}, {**ticket, "directory": -1},
                   {**ticket, "directory": 1.0}, {k: v for k, v in ticket.items() if k != "slots"}):
        with pytest.raises(KvxError, match="ticket") as e:
            receiver.fetch(forged)
        assert e.value.status == Status.INVALID_ARGUMENT


def test_fuzz_lookup_ticket_directory():
    """The slot directory a lookup ticket reads is the sender's memory: forged entries are refused with KvxError
    (nothing written) under the memory cap, never a crash or a read outside what the sender registered."""
    run_capped("tests.transfer.nixl_fuzz:directory_entries", cases=300, env=UCX)


def test_device_memory_is_refused_without_cuda_and_bad_memory_settings_are_refused():
    """A peer in GPU memory on a CPU-only platform is UNSUPPORTED with a message naming the fix; an unknown memory
    kind, or a device for host memory, is INVALID_ARGUMENT; nothing is created."""
    if torch.cuda.is_available():
        pytest.skip("this platform has CUDA: device memory is served (the gpu tests)")
    with pytest.raises(KvxError, match="no CUDA device.*memory 'host'") as e:
        NixlPeer("kvx-dev", 1 << 20, memory="device")
    assert e.value.status == Status.UNSUPPORTED
    for kwargs in ({"memory": "gpu"}, {"memory": None}, {"memory": "HOST"}, {"memory": "host", "device": 0}):
        with pytest.raises(KvxError, match="NixlPeer") as e:
            NixlPeer("kvx-dev", 1 << 20, **kwargs)
        assert e.value.status == Status.INVALID_ARGUMENT


def test_a_tickets_memory_and_device_are_parsed_strictly():
    """Tickets say where the sender's bundle is: host tickets (and those of older senders, without `memory`) read
    the bundle; an unknown memory kind, a device ticket without an integer device index in range, or a host
    ticket with a device is refused before any transfer."""
    from kvx_core.transfer.nixl import MAX_DEVICE, parse_ticket  # noqa: PLC0415

    a, slots = _cache("int8", 16, 4, tokens=20)
    sender, receiver = NixlPeer("kvx-send10", 1 << 20), NixlPeer("kvx-recv10", 1 << 20)
    ticket = sender.publish(_descs(a), slots, model=MODEL)
    assert ticket["memory"] == "host" and sender.lookup_ticket(3)["memory"] == "host"
    older = {k: v for k, v in ticket.items() if k != "memory"}
    assert torch.equal(receiver.fetch(older), sender.buf[:ticket["nbytes"]])
    t = parse_ticket({**ticket, "memory": "device", "device": 3})
    assert (t.memory, t.device) == ("device", 3)
    for forged in ({**ticket, "memory": "gpu"}, {**ticket, "memory": ["host"]}, {**ticket, "memory": None},
                   {**ticket, "memory": "device"}, {**ticket, "memory": "device", "device": -1},
                   {**ticket, "memory": "device", "device": MAX_DEVICE}, {**ticket, "memory": "device", "device": 1.0},
                   {**ticket, "memory": "device", "device": True}, {**ticket, "memory": "device", "device": "0"},
                   {**ticket, "device": 0}):
        with pytest.raises(KvxError, match="ticket") as e:
            receiver.fetch(forged)
        assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.gpu
def test_device_memory_peers_hand_a_bundle_over_bit_for_bit(monkeypatch):
    """Both peers in GPU memory (the last GPU receives): a direct and a lookup ticket are read into VRAM and
    imported with every check into a CUDA cache, the rows equal the source's; a damaged bundle is refused there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for k in UCX:  # UCX's own transport choice: TCP alone does not move GPU memory
        monkeypatch.delenv(k)
    from kvx_core.cache import PagedKVCache  # noqa: PLC0415

    last = torch.cuda.device_count() - 1
    src, slots = _cache("nvfp4", 16, 4, tokens=40)
    sender = NixlPeer("kvx-send-gpu", 1 << 20, slots=2, memory="device")
    receiver = NixlPeer("kvx-recv-gpu", 1 << 20, memory="device", device=last)
    ids = list(range(40))
    ticket = sender.publish(_descs(src), slots, model=MODEL, token_ids=ids, seq=7)
    assert (ticket["memory"], ticket["device"]) == ("device", torch.cuda.current_device())
    assert torch.equal(receiver.fetch(sender.lookup_ticket(7)).cpu(), receiver.fetch(ticket).cpu())
    dst = PagedKVCache("nvfp4", num_layers=LAYERS, num_blocks=8, block_size=8, num_kv_heads=src.num_kv_heads,
                       head_dim=src.head_dim, per_head_global_scale=True, device=f"cuda:{last}")
    _same_scales(dst, src)
    back = torch.arange(63, 23, -1)
    receiver.receive(ticket, _descs(dst), back.to(dst.device), model=MODEL, token_ids=ids)
    for i in range(LAYERS):
        x, y = read_rows(src.descriptor(i), slots), read_rows(dst.descriptor(i), back.to(dst.device))
        assert all(torch.equal(x[n].view(torch.uint8), y[n].cpu().view(torch.uint8)) for n in x)
    before = _snapshot(dst)
    sender.buf[ticket["addr"] - sender.buf.data_ptr() + ticket["nbytes"] // 2] ^= 1
    with pytest.raises(KvxError, match="checksum"):
        receiver.receive(ticket, _descs(dst), back.to(dst.device), model=MODEL, token_ids=ids)
    assert _unchanged(dst, before)
    # caches on the sender's GPU: exported straight into its VRAM slot (host.export_to_device), the bytes of the
    # host export of the same caches, and read and imported like the staged bundle above
    monkeypatch.setattr(caches, "DEVICE", "cuda")
    on_gpu, _ = _cache("nvfp4", 16, 4, tokens=40)  # the same rows (seeded on the host), on the current GPU
    direct = sender.publish(_descs(on_gpu), slots.cuda(), model=MODEL, token_ids=ids, seq=8)
    at = direct["addr"] - sender.buf.data_ptr()
    want = export_to_host(_descs(on_gpu), slots.cuda(), model=MODEL, token_ids=ids)
    assert torch.equal(sender.buf[at:at + direct["nbytes"]].cpu(), want)
    receiver.receive(direct, _descs(dst), back.to(dst.device), model=MODEL, token_ids=ids)
    assert _unchanged(dst, before)  # the same rows stored again
