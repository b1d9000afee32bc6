"""Prefill/decode disaggregation, two vLLM instances at once: per request, the time from the prefill instance's end
to the decode instance's first token, with KVX's connector and with vLLM's own NixlConnector as the peer.

    python benchmarks/bench_pd.py MODEL --connector kvx-nixl --consumer kvx_nvfp4 [--gpus 0,1] [--len 4096]
    python benchmarks/bench_pd.py MODEL --connector vllm-nixl --consumer auto        # vLLM's NixlConnector (peer)
    python benchmarks/bench_pd.py MODEL --connector kvx-store --store /dev/shm/kvx   # KVX's store directory
    python benchmarks/bench_pd.py --geometry llama3-8b-8l --connector kvx-nixl       # a geometry, random weights

MODEL is a checkpoint directory with its tokenizer (KvxConnector fingerprints the tokenizer), e.g. the demo's
SmolLM2-135M (`kvx demo` builds it under ~/.cache/kvx), or `--geometry NAME` (`model_geometries.MODELS`): that
geometry with vLLM's dummy weights (uniform in +-1e-3 from vLLM's fixed seed 1234: both instances draw the same) and
a word-level tokenizer written beside its config, so a GPU machine needs no checkpoint and the bundles have a real
model's width (the Llama 3 8B geometry cut to 8 layers: 32 KiB of BF16 K/V per token; SmolLM2: 22.5 KiB), while the
first-token gap means little (near-uniform logits). The producer (`--producer`, default `auto`) runs on the first
of `--gpus`, the consumer on the second (on a CPU machine: vLLM CPU, both on the CPU). The parent process plays P/D's
proxy: per request it asks the producer to prefill the prompt (one output token, `do_remote_decode`), passes the
returned `kv_transfer_params` to the consumer, which generates the prompt's first token with them; then the consumer
computes the same prompt itself (`skip_reading_prefix_cache`). One JSON line per request (after one warm-up request
excluded from the record): `prefill_s` (the producer's generate), `handoff_s` (the producer's return to the consumer's
first token: the transfer plus the consumer's step, as a proxy sees it; both clocks are this host's), `consumer_s`
(the consumer's generate alone), `local_s` (the consumer computing the prompt itself), `cached` (vLLM's
`num_cached_tokens` of the consumer's request: prompt length - 1 when KvxConnector's load worked; vLLM 0.32's
NixlConnector loads asynchronously and its tokens do not show there (0 on vLLM CPU, where the consumer's step then
took 0.14 s against 0.9-1.0 s computing a 256-token prompt): compare `consumer_s` with `local_s`), and
`first_token_gap` (max |logprob difference| over the top-5 tokens of both first tokens, handed over vs computed: the
cache format's error, reported, not judged). `--breakdown` (KvxConnector over NIXL, TP=1): each instance's engine core
runs in its process, where `PHASES` are timed (each up to a device sync): per request `producer_phases` (export source,
publish) and `consumer_phases` (the NIXL READ, the import), in seconds; with `--profile-phases` also each phase's
`--top` functions by own time under cProfile (`producer_profile` / `consumer_profile`: `[function, own us, calls]`,
cProfile's overhead included: where the host time goes, not how long it takes).

Transports: `kvx-nixl`, KvxConnector's NIXL transport (`nixl_memory`: `--nixl-memory host|device`); `kvx-store`,
its store directory (`--store`, the same for both; /dev/shm for memory speed); `vllm-nixl`, vLLM's NixlConnector
(both instances the same cache dtype: it refuses others at its handshake; side channels on 127.0.0.1, ports 5600 /
5601). Prompts are random token ids, a different prompt per request, so no prefix cache serves one.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from common import emit, env_info, time_calls, top_functions
from model_geometries import MODELS, write_config, write_tokenizer

CONNECTORS = ("kvx-nixl", "kvx-store", "vllm-nixl")


def _transfer_config(connector: str, role: str, args) -> tuple[dict, dict]:
    """(kv_transfer_config, additional_config) of one instance."""
    if connector == "vllm-nixl":
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if args.device == "cpu":
            cfg["kv_buffer_device"] = "cpu"
        return cfg, {}
    kvx = ({"transport": "nixl", "nixl_memory": args.nixl_memory, "nixl_buffer": args.nixl_buffer,
            "nixl_slots": 4, "nixl_hold_s": 600} if connector == "kvx-nixl" else {"store": args.store})
    return {"kv_connector": "KvxConnector", "kv_role": role}, {"kvx": kvx}


PHASES = {"read_s": ("kvx_core.transfer.nixl", "NixlPeer", "fetch"),
          "import_s": ("kvx_vllm.layer_kv", "LayerCaches", "load"),
          "export_s": ("kvx_vllm.layer_kv", "LayerCaches", "export_source"),
          "publish_s": ("kvx_core.transfer.nixl", "NixlPeer", "publish")}
"""`--breakdown`: KvxConnector's phases timed inside an instance (its engine core in this process): the consumer's
NIXL READ of the bundle and its import (every check, the conversion, the stores), the producer's export source and
its publish (the bundle packed into its NIXL buffer)."""


def _profile_phases(profiles: dict[str, cProfile.Profile]) -> None:
    """Wrap each phase's method so that it runs under its phase's profiler in `profiles` (made on first use)."""
    for name, (module, cls, method) in PHASES.items():
        owner = getattr(importlib.import_module(module), cls)
        fn = getattr(owner, method)

        def profiled(*args, _fn=fn, _name=name, **kwargs):
            return profiles.setdefault(_name, cProfile.Profile()).runcall(_fn, *args, **kwargs)
        setattr(owner, method, profiled)


def _time_phases(spent: dict[str, float]) -> None:
    """Wrap each phase's method so that its wall time, from the device's completion of the work queued before it to
    that of its own, adds to `spent` (the syncs slow the instance: phase times, not the handoff's latency)."""
    for name, (module, cls, method) in PHASES.items():
        time_calls(getattr(importlib.import_module(module), cls), method,
                   lambda s, name=name: spent.__setitem__(name, spent.get(name, 0.0) + s), sync=True)


def _child(role: str, args) -> None:
    """One instance: build it, print BENCH_READY, then serve the parent's commands (one JSON object per line)."""
    from vllm import LLM, SamplingParams

    spent: dict[str, float] = {}
    profiles: dict[str, cProfile.Profile] = {}
    if args.profile_phases:
        _profile_phases(profiles)  # inside the timer: the syncs are not profiled
    if args.breakdown:
        _time_phases(spent)

    dtype = args.producer if role == "kv_producer" else args.consumer
    blocks = [int(b) for b in args.block_size.split(",")]
    block = blocks[0] if role == "kv_producer" else blocks[-1]
    transfer, extra = _transfer_config(args.connector, role, args)
    dummy = {"load_format": "dummy", "skip_tokenizer_init": True} if args.geometry else {}
    llm = LLM(model=args.model, dtype="bfloat16", kv_cache_dtype=dtype, block_size=block, **dummy,
              max_model_len=args.len + 16, max_num_seqs=4, enable_prefix_caching=True, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.device == "cpu",
              kv_transfer_config=transfer, additional_config=extra)
    print("BENCH_READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        prompt = {"prompt_token_ids": cmd["ids"]}
        if cmd["op"] == "prefill":
            sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params":
                                                                            {"do_remote_decode": True}})
            t0 = time.time()
            r = llm.generate([prompt], sp, use_tqdm=False)[0]
            reply = {"prefill_s": time.time() - t0, "end": time.time(), "params": r.kv_transfer_params}
        else:  # "decode": with the producer's params; "local": computing the prompt itself
            extra_args = {"kv_transfer_params": cmd["params"]} if cmd["op"] == "decode" else {}
            sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, extra_args=extra_args,
                                skip_reading_prefix_cache=cmd["op"] == "local")
            t0 = time.time()
            r = llm.generate([prompt], sp, use_tqdm=False)[0]
            t1 = time.time()
            o = r.outputs[0]
            reply = {"seconds": t1 - t0, "end": t1, "cached": r.num_cached_tokens, "finish": o.finish_reason,
                     "top": {str(k): v.logprob for k, v in o.logprobs[0].items()} if o.logprobs else {}}
        reply["phases"] = {k: round(v, 5) for k, v in spent.items()}
        reply["profile"] = {k: top_functions(p, args.top) for k, p in profiles.items()}
        spent.clear()
        profiles.clear()
        print("BENCH_REPLY " + json.dumps(reply), flush=True)


class _Instance:
    """A child process speaking one JSON line per command and per reply."""

    def __init__(self, role: str, gpu: str | None, port: int, argv: list[str]):
        # spawn: the child's main has initialized CUDA (env_info) before vLLM starts its engine core, which a fork
        # cannot inherit ("Cannot re-initialize CUDA in forked subprocess", the first run on 2x H200)
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
               "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        if "--breakdown" in argv:  # the engine core (the connector's worker side) in this process, to time it
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.role = role
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--one", role],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)

    def _line(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            sys.stderr.write(f"[{self.role}] {line}")
        raise SystemExit(f"bench_pd: the {self.role} instance exited ({self.proc.wait()}) before '{prefix.strip()}'")

    def ready(self) -> None:
        self._line("BENCH_READY")

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line("BENCH_REPLY "))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _gap(a: dict, b: dict) -> float | None:
    shared = a.keys() & b.keys()
    return round(max(abs(a[t] - b[t]) for t in shared), 4) if shared else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="checkpoint directory with its tokenizer")
    ap.add_argument("--geometry", choices=list(MODELS), help="instead of MODEL: this geometry, dummy weights")
    ap.add_argument("--connector", choices=CONNECTORS, default="kvx-nixl")
    ap.add_argument("--producer", default="auto", help="the prefill instance's --kv-cache-dtype")
    ap.add_argument("--consumer", default="kvx_nvfp4", help="the decode instance's --kv-cache-dtype")
    ap.add_argument("--gpus", default="0,1", help="producer,consumer CUDA devices (ignored on a CPU machine)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--len", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--block-size", default="16", help="PRODUCER[,CONSUMER] page size (vLLM CPU: auto 32, kvx 128)")
    ap.add_argument("--store", default="/dev/shm/kvx-bench-pd", help="kvx-store: the store directory")
    ap.add_argument("--nixl-memory", choices=("host", "device"), default="host")
    ap.add_argument("--nixl-buffer", default="1GiB")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--breakdown", action="store_true",
                    help="KvxConnector's phases per request (`PHASES`; engine cores in-process, a sync per phase)")
    ap.add_argument("--profile-phases", action="store_true",
                    help="with --breakdown: each phase's --top functions by own time under cProfile, per request")
    ap.add_argument("--top", type=int, default=25, help="--profile-phases: functions per phase")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this role here
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)  # a child: the model directory the parent made
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one:
        args.model = args.model_dir
        return _child(args.one, args)
    if (args.model is None) == (args.geometry is None):
        raise SystemExit("bench_pd: give either a checkpoint directory or --geometry")
    if args.profile_phases and not args.breakdown:
        raise SystemExit("bench_pd: --profile-phases profiles the --breakdown phases: give --breakdown too")
    if args.connector == "vllm-nixl" and args.producer != args.consumer:
        raise SystemExit("bench_pd: vLLM's NixlConnector hands KV between instances of one cache dtype only")
    with tempfile.TemporaryDirectory() as d:
        if args.geometry:
            args.model = _geometry_dir(args.geometry, d)
        _run(args, [*sys.argv[1:], "--model-dir", args.model])


def _geometry_dir(name: str, d: str) -> str:
    """`name`'s config.json and a word-level tokenizer.json of its vocabulary (what KvxConnector fingerprints) in
    `d`."""
    write_tokenizer(d, write_config(name, d)["vocab_size"])
    return d


def _run(args, argv: list[str]) -> None:
    """Both instances, the requests, one JSON line per request."""
    gpus = args.gpus.split(",") if args.device == "cuda" else [None, None]
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.len,), generator=g).tolist() for _ in range(args.requests + 1)]
    prod = _Instance("kv_producer", gpus[0], 5600, argv)
    cons = _Instance("kv_consumer", gpus[1], 5601, argv)
    base = {**env_info(), "bench": "pd", "connector": args.connector, "producer": args.producer,
            "consumer": args.consumer, "len": args.len,
            "model": args.geometry or os.path.basename(os.path.normpath(args.model)),
            "device": args.device}
    try:
        prod.ready()
        cons.ready()
        for i, ids in enumerate(prompts):
            p = prod.ask({"op": "prefill", "ids": ids})
            d = cons.ask({"op": "decode", "ids": ids, "params": p["params"] or {}})
            loc = cons.ask({"op": "local", "ids": ids})
            if i == 0:
                continue  # warm-up: kernels compiled, NIXL handshakes made
            emit(args.out, {**base, "request": i, "prefill_s": round(p["prefill_s"], 4),
                            "handoff_s": round(d["end"] - p["end"], 4), "consumer_s": round(d["seconds"], 4),
                            "local_s": round(loc["seconds"], 4), "cached": d["cached"], "local_cached": loc["cached"],
                            "finish": d["finish"], "first_token_gap": _gap(d["top"], loc["top"]),
                            **({"producer_phases": p["phases"], "consumer_phases": d["phases"]}
                               if args.breakdown else {}),
                            **({"producer_profile": p["profile"], "consumer_profile": d["profile"]}
                               if args.profile_phases else {})})
    finally:
        prod.close()
        cons.close()


if __name__ == "__main__":
    main()
