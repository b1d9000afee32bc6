"""Tensor parallelism on GPUs (vLLM 0.26, two GPUs of one host): the KVX backend at TP=2 against TP=1 on a Llama 3 8B
and a Llama 3 70B geometry, random weights, CUDA graphs on.

The same runner as the CPU test (`vllm_tp_run.py`, `mp` executor: one worker process per rank, prompts as token ids)
with `KVX_TP_RUN_GRAPHS=1` (decode in full CUDA graphs, as bench_vllm.py serves). The models: the geometries of
`benchmarks/model_geometries.py` cut to 2 layers with a 32000-token vocabulary (what TP splits, the query / KV heads,
hidden and MLP widths, are the models'; the vocabulary only sizes the embedding and the head, and a 128k one would
add 4 GB of random weights to write and load per run), HF-initialized with `realistic_weights` (N(0, 0.02)
matrices, identity norms) and saved as a checkpoint, so both TP sizes load the same weights (vLLM's dummy loader
would draw each rank's shard on its own).

Runs (dtype, TP): 8B: kvx_nvfp4 and kvx_int4 at TP=1 and TP=2 (a global-scale and a plain 4-bit page: TP changes
each rank's heads and page count, not the page codec; test_vllm_tp.py runs kvx_int8 too, on CPU); 70B: kvx_nvfp4 at
TP=1 and 2, kvx_int4 at TP=1 (its control). TP=1 runs go two at a time, one per GPU.

Asserted: every rank serves KV_HEADS / 2 heads; TP=2 holds at least 1.9x the blocks of TP=1 (each rank stores half the
heads in a GPU of its own, and holds half the weights; the 0.1 leaves room for the all-reduce buffers TP adds); the
prompt (chunked prefill over the pages) and decode log-probabilities of TP=2 within TP_BOUND of TP=1 and much closer
to it than to the TP=1 run of another 4-bit dtype (the control; test_vllm_tp.py's `_gaps` / `_summary`).

The connector across TP sizes and dtypes (test_vllm_connector_tp_engine.py's handoff and checks, on GPUs): the 8B
model served `auto` at TP=2 (GPUs 0 and 1) hands each prompt's KV to a `kvx_nvfp4` instance at TP=1 (GPU 0).

Skipped with the reason on fewer than two GPUs. `KVX_VLLM_TP_GPU_RESULTS=FILE` records the runs (FILE's name with
`.<geometry>.json` per geometry, `.handoff.json` for the handoff: the results files in benchmarks/results/);
`-k llama3-8b` runs one geometry; run alone, not under xdist (docs/guide/testing.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ..procs import communicate
from .runs import ROOT, parse, root_on_path
from .test_vllm_connector_tp_engine import check_handoff, handoff
from .test_vllm_tp import CONTROL_RATIO, TP_BOUND, _gaps, _summary

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.slow]

RUNNER = Path(__file__).with_name("vllm_tp_run.py")
LAYERS, VOCAB, KV_HEADS = 2, 32000, 8
GEOMETRIES = {"llama3-8b": "llama3-8b-8l", "llama3-70b": "llama3-70b-4l"}
RUNS = {"llama3-8b": [(d, tp) for d in ("kvx_nvfp4", "kvx_int4") for tp in (1, 2)],
        "llama3-70b": [("kvx_nvfp4", 1), ("kvx_int4", 1), ("kvx_nvfp4", 2)]}
CONTROL = {"kvx_nvfp4": "kvx_int4", "kvx_int4": "kvx_nvfp4"}
"""The TP=1 run a TP=2 run must lie much farther from: the other 4-bit dtype."""
BLOCK_RATIO = 1.9
GPU_ENV = {**os.environ, "KVX_TP_RUN_GRAPHS": "1",
           "PYTHONPATH": root_on_path(os.environ)}
"""The runs' environment: CUDA graphs, and the repository root on the path (the runner hands its per-rank probe to
vLLM's workers by module name)."""


def _prompts() -> list[list[int]]:
    ids = torch.randint(0, VOCAB, (160,), generator=torch.Generator().manual_seed(1)).tolist()
    return [ids, ids[20:120], ids[40:100], ids[5:150]]


def _checkpoint(geometry: str, d: Path) -> Path:
    """The geometry's checkpoint (2 layers, VOCAB tokens, `realistic_weights`), made on the CPU: this process never
    touches CUDA, so vLLM's memory profiling sees free GPUs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from model_geometries import realistic_weights, write_config, write_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    write_config(GEOMETRIES[geometry], str(d), num_hidden_layers=LAYERS, vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), torch_dtype=torch.bfloat16)
    realistic_weights(model, seed=0)
    model.save_pretrained(d, safe_serialization=True)
    write_tokenizer(str(d), VOCAB)  # hashed by the connector's model fingerprint
    return d


def _start(model: Path, dtype: str, tp: int, gpus: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUNNER), str(model), dtype, str(tp), json.dumps(_prompts())],
                            env={**GPU_ENV, "CUDA_VISIBLE_DEVICES": gpus}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _result(proc: subprocess.Popen, what: str) -> dict:
    start = time.monotonic()
    out, _ = communicate(proc, what)
    # printed as each run ends, so a run cut by its time limit still records the runs before the cut
    print(f"{what}: exit {proc.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    r = parse(what, proc.returncode, out)
    heads = [[layer["num_kv_heads"] for layer in rank["layers"]] for rank in r["ranks"]]
    print(f"  blocks {r['num_blocks']}, cuda graphs {r['cuda_graphs']}, KV heads per rank, layer {heads}", flush=True)
    return r


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """geometry -> its checkpoint, made on first use (a test run alone makes only what it serves)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallelism needs two GPUs of one host; this machine has {torch.cuda.device_count()}")
    made: dict[str, Path] = {}

    def get(geometry: str) -> Path:
        if geometry not in made:
            made[geometry] = _checkpoint(geometry, tmp_path_factory.mktemp(geometry))
        return made[geometry]
    return get


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def runs(request, model) -> tuple[str, dict[tuple, dict]]:
    """One geometry (a parameter, so `-k llama3-8b` runs one) and its runs: (dtype, TP size) -> the run's result."""
    geometry, out = request.param, {}
    path = model(geometry)
    single = [r for r in RUNS[geometry] if r[1] == 1]
    for i in range(0, len(single), 2):  # TP=1 runs two at a time, one per GPU
        procs = [(r, _start(path, r[0], 1, str(g))) for g, r in enumerate(single[i:i + 2])]
        for (dtype, tp), proc in procs:
            out[dtype, tp] = _result(proc, f"{geometry} {dtype} TP={tp}")
    for dtype, tp in RUNS[geometry]:
        if tp == 2:
            out[dtype, tp] = _result(_start(path, dtype, 2, "0,1"), f"{geometry} {dtype} TP=2")
    if os.environ.get("KVX_VLLM_TP_GPU_RESULTS"):
        summary = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "geometry": geometry,
                   "layers": LAYERS, "vocab": VOCAB, "runs": {"/".join(map(str, k)): v for k, v in out.items()}}
        base = Path(os.environ["KVX_VLLM_TP_GPU_RESULTS"])
        base.with_suffix(f".{geometry}.json").write_text(json.dumps(summary))
    return geometry, out


def test_each_rank_serves_half_the_heads_in_cuda_graphs(runs):
    geometry, out = runs
    for (dtype, tp), r in out.items():
        assert r["cuda_graphs"], (geometry, dtype, tp)
        assert [rank["rank"] for rank in r["ranks"]] == list(range(tp))
        for rank in r["ranks"]:
            assert [layer["num_kv_heads"] for layer in rank["layers"]] == [KV_HEADS // tp] * LAYERS, \
                (geometry, dtype, tp, rank)


def test_tp2_holds_about_twice_the_blocks(runs):
    geometry, out = runs
    for (dtype, tp), r in out.items():
        if tp == 2:
            one, two = out[dtype, 1]["num_blocks"], r["num_blocks"]
            print(geometry, dtype, "blocks TP=1", one, "TP=2", two, f"{two / one:.3f}x")
            assert two >= BLOCK_RATIO * one, (geometry, dtype, one, two)


def test_tp2_logprobs_match_tp1(runs):
    """TP=2 within TP_BOUND of TP=1 (prompt and decode), and much closer to it than to the control."""
    geometry, out = runs
    for (dtype, tp), r in out.items():
        if tp != 2:
            continue
        near = _gaps(r, out[dtype, 1])
        far = _gaps(r, out[CONTROL[dtype], 1])
        print(geometry, dtype, {k: _summary(v) for k, v in near.items()}, "control",
              {k: _summary(v) for k, v in far.items()})
        assert len(near["decode"]) >= 10, (geometry, dtype)
        for what, (mean_bound, max_bound) in TP_BOUND.items():
            n, mean, worst = _summary(near[what])
            assert mean <= mean_bound and worst <= max_bound, (geometry, dtype, what, mean, worst)
        assert _summary(near["prompt"])[1] <= CONTROL_RATIO * _summary(far["prompt"])[1], (geometry, dtype)


def test_tp2_auto_hands_off_to_tp1_nvfp4_on_another_gpu_set(model, tmp_path):
    store = tmp_path / "store"
    r = handoff(model("llama3-8b"), store, ("auto", 2), ("kvx_nvfp4", 1), VOCAB, GPU_ENV, gpus=("0,1", "0"))
    rows = check_handoff(r, store, VOCAB)
    print("handoff TP=2 auto -> TP=1 kvx_nvfp4", rows)
    if os.environ.get("KVX_VLLM_TP_GPU_RESULTS"):
        path = Path(os.environ["KVX_VLLM_TP_GPU_RESULTS"]).with_suffix(".handoff.json")
        path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "rows": rows, "runs": r}))
