"""KV bundles through NIXL between two processes (GPU to GPU, or through host memory) against the same-run copy.

    python benchmarks/bench_nixl.py [--format nvfp4,bf16] [--tokens 16384] [--layers 8] [--runs 3]
                                    [--memory device,host] [--devices 0,1] [--ucx-tls TLS] [--ucx-proto-info]
                                    [--out FILE.jsonl]

This process is the consumer; per `--memory` it starts a producer process. The producer builds a cache of
`--layers` x `--tokens` tokens (8 KV heads x 128, `bench_transfer`'s caches) per format on `cuda:<first of
--devices>` and publishes its bundle in a `NixlPeer` of that memory ("device": the producer GPU's memory, NIXL VRAM;
"host": pinned host memory, DRAM), printing the ticket, the cache's global scales and a digest of its rows. The
consumer (caches on `cuda:<second of --devices>`, its own peer in the same memory kind) times, best of `--runs`:
the NIXL READ alone (`read_gbps`, `read_ms`) and READ + every bundle check + import (`import_gbps`, `request_ms`:
the per-request latency), then checks that the imported rows equal the producer's bit for bit (`imported_xxh64`,
exit 1 otherwise). GB/s count the bundle's bytes. The baseline, in the same run: a copy of as many bytes from the
producer GPU to the consumer GPU (`copy_` into a tensor there, both GPUs synchronized, best of runs: `d2d_gbps`);
`read_x_d2d` and `import_x_d2d` are the ratios (the issue's target: `read_x_d2d` >= 0.7 for device memory).

UCX picks its transports (cuda_ipc between GPUs, cuda_copy, shared memory, TCP) unless `--ucx-tls` sets UCX_TLS for
both processes; NIXL's Python API does not say which ones a transfer used, `--ucx-proto-info` sets UCX_PROTO_INFO=y
so UCX prints its protocol choices (transports included) to the output. Without CUDA (the CPU test) everything is
in host memory on the CPU with tiny sizes: `--memory host`, no `d2d_gbps`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import torch
import xxhash

from kvx_core.transfer import ModelFingerprint
from kvx_core.transfer.host import export_to_host
from kvx_core.transfer.nixl import NixlPeer
from kvx_core.transfer.rows import read_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_transfer import _best, _cache, _filled  # noqa: E402
from common import emit, env_info  # noqa: E402

LINE = "KVX_BENCH "
"""The prefix of the producer's output lines the consumer reads (NIXL and UCX log to the same stdout)."""


def _model(layers: int) -> ModelFingerprint:
    return ModelFingerprint("bench", layers, 8, 128, {}, "0" * 64, "0" * 64)


def rows_digest(cache, tokens: int) -> str:
    """xxh64 of every layer's stored rows of tokens 0 .. tokens - 1 (payload, scales, global scales), host bytes."""
    h, slots = xxhash.xxh64(), torch.arange(tokens, device=cache.device)
    for layer in range(cache.num_layers):
        rows = read_rows(cache.descriptor(layer), slots)
        for name in sorted(rows):
            h.update(rows[name].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _scales(cache) -> list:
    """Each layer's global (k, v) scales as lists of floats (None for a format without them)."""
    return [None if p.k_global is None else [p.k_global.tolist(), p.v_global.tolist()] for p in cache.layers]


def _device(a, i: int) -> str:
    return f"cuda:{a.devices[i]}" if torch.cuda.is_available() else "cpu"


def producer(a) -> None:
    """Publish one bundle per format and print its line; keep the buffers until the consumer says done."""
    dev = _device(a, 0)
    if dev != "cpu":
        torch.cuda.set_device(dev)
    model, slots = _model(a.layers), torch.arange(a.tokens)
    peers = []
    for fmt in a.format:
        src = _filled(fmt, SimpleNamespace(tokens=a.tokens, layers=a.layers, device=dev),
                      torch.Generator().manual_seed(0))
        descs = [src.descriptor(i) for i in range(a.layers)]
        n = export_to_host(descs, slots, model=model).numel()
        peer = NixlPeer(f"kvx-bench-send-{fmt}-{os.getpid()}", n, memory=a.memory,
                        device=a.devices[0] if a.memory == "device" else None)
        ticket = peer.publish(descs, slots, model=model)
        peers.append(peer)
        print(LINE + json.dumps({"format": fmt, "ticket": ticket, "scales": _scales(src),
                                 "xxh64": rows_digest(src, a.tokens)}), flush=True)
    print(LINE + "{}", flush=True)
    sys.stdin.readline()


def _start_producer(a) -> tuple[subprocess.Popen, list[dict]]:
    """The producer process and its lines (one per format)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "producer", "--memory", a.memory,
           "--format", ",".join(a.format), "--tokens", str(a.tokens), "--layers", str(a.layers),
           "--devices", ",".join(map(str, a.devices))]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in p.stdout:
        if line.startswith(LINE):
            rec = json.loads(line[len(LINE):])
            if not rec:
                return p, lines
            lines.append(rec)
        elif line.strip():
            print(line, end="", file=sys.stderr)  # UCX / NIXL logs (UCX_PROTO_INFO among them)
    raise SystemExit(f"bench_nixl: the producer ({a.memory} memory) exited with {p.wait()} before publishing")


def d2d_seconds(a, n: int) -> float | None:
    """Best time of a copy of `n` bytes from the producer GPU to the consumer GPU (None without two GPUs)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    x = torch.empty(n, dtype=torch.uint8, device=_device(a, 0)).random_(0, 255)
    y = torch.empty(n, dtype=torch.uint8, device=_device(a, 1))
    return _best(partial(y.copy_, x), "cuda", a.runs)


def consumer(a, env: dict) -> None:
    dev = _device(a, 1)
    if dev != "cpu":
        torch.cuda.set_device(dev)
    p, lines = _start_producer(a)
    model, slots = _model(a.layers), torch.arange(a.tokens)
    try:
        for rec in lines:
            fmt, ticket = rec["format"], rec["ticket"]
            dst = _cache(fmt, SimpleNamespace(tokens=a.tokens, layers=a.layers, device=dev))
            for layer, pair in enumerate(rec["scales"]):  # the producer's global scales: rows move as stored
                if pair is not None:
                    dst.set_global_scales(layer, torch.tensor(pair[0]), torch.tensor(pair[1]))
            dsts = [dst.descriptor(i) for i in range(a.layers)]
            n = ticket["nbytes"]
            peer = NixlPeer(f"kvx-bench-recv-{fmt}-{os.getpid()}", n, memory=a.memory,
                            device=a.devices[1] if a.memory == "device" else None)
            peer.fetch(ticket)  # connects to the producer's agent: not timed
            t_read = _best(partial(peer.fetch, ticket), dev, a.runs)
            t_all = _best(partial(peer.receive, ticket, dsts, slots, model=model), dev, a.runs)
            got = rows_digest(dst, a.tokens)
            t_d2d, gb = d2d_seconds(a, n), n / 1e9
            emit(a.out, {**env, "memory": a.memory, "format": fmt, "bundle_bytes": n,
                         "read_gbps": round(gb / t_read, 3), "read_ms": round(t_read * 1e3, 3),
                         "import_gbps": round(gb / t_all, 3), "request_ms": round(t_all * 1e3, 3),
                         "d2d_gbps": None if t_d2d is None else round(gb / t_d2d, 3),
                         "read_x_d2d": None if t_d2d is None else round(t_d2d / t_read, 3),
                         "import_x_d2d": None if t_d2d is None else round(t_d2d / t_all, 3),
                         "imported_xxh64": got, "bit_exact": got == rec["xxh64"]})
            if got != rec["xxh64"]:
                raise SystemExit(f"bench_nixl: {fmt} ({a.memory} memory): the imported rows differ from the "
                                 "producer's")
    finally:
        p.communicate("done\n", timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="nvfp4,bf16", type=lambda s: s.split(","))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory", default="device,host", type=lambda s: s.split(","))
    ap.add_argument("--devices", type=lambda s: [int(d) for d in s.split(",")],
                    help="CUDA device indices of the producer and the consumer (default: 0,1 where two GPUs are "
                         "visible, else 0,0: a worker of scripts/gpu_suite.sh sees one)")
    ap.add_argument("--ucx-tls", help="UCX_TLS for both processes (default: UCX's choice)")
    ap.add_argument("--ucx-proto-info", action="store_true", help="UCX prints its protocol / transport choices")
    ap.add_argument("--role", default="consumer", choices=("consumer", "producer"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.devices is None:
        a.devices = [0, 1 if torch.cuda.device_count() > 1 else 0]
    if a.ucx_tls:
        os.environ["UCX_TLS"] = a.ucx_tls
    if a.ucx_proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    if a.role == "producer":
        a.memory = a.memory[0]
        return producer(a)
    if not torch.cuda.is_available() and "device" in a.memory:
        print("bench_nixl: no CUDA device: timing host memory only", file=sys.stderr)
        a.memory = ["host"]
    env = {**env_info(), "bench": "nixl", "layers": a.layers, "tokens": a.tokens, "runs": a.runs,
           "producer": _device(a, 0), "consumer": _device(a, 1), "ucx_tls": os.environ.get("UCX_TLS")}
    for memory in a.memory:
        consumer(SimpleNamespace(**{**vars(a), "memory": memory}), env)


if __name__ == "__main__":
    main()
