"""`kvx-tgi-server` as users run it: refusals exit 2 with one line; `ATTENTION=paged` (BLOCK_SIZE 16, whole-prompt
prefill, no prefix caching) serves TGI's gRPC service from a subprocess."""
from __future__ import annotations

import os

import pytest

from kvx_core.formats import get_format
from kvx_tgi.config import parse_bytes

from ..procs import run, wait
from .checks import PPL_BOUND, expected_blocks, perplexity
from .harness import Router, launch, launcher, wait_for_socket

PAGED = {"ATTENTION": "paged", "PREFIX_CACHING": "0", "REQUEST_LOGPROBS": "1", "KVX_KV_CACHE_MEMORY": "64MiB"}


@pytest.mark.parametrize("env, args, says", [
    ({"ATTENTION": "flashinfer", "PREFIX_CACHING": "1", "KVX_FORMAT": "nvfp4"}, [], "ATTENTION=flashinfer"),
    ({"ATTENTION": "flashdecoding-ipex", "PREFIX_CACHING": "1", "KVX_FORMAT": "nvfp4"}, [], "flashdecoding-ipex"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": ""}, [], "KVX_FORMAT"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": "nvfp5"}, [], "nvfp5"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": "fp32"}, [], "fp32"),
    ({"ATTENTION": "paged", "KVX_FORMAT": "int8"}, [], "PREFIX_CACHING"),
    ({"PREFIX_CACHING": "0", "KVX_FORMAT": "int8"}, [], "ATTENTION is not set"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": "int8", "KVX_KV_CACHE_MEMORY": "lots"}, [],
     "KVX_KV_CACHE_MEMORY"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": "int8"}, ["--kv-cache-dtype", "fp8_e4m3fn"],
     "--kv-cache-dtype"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": "int8"}, ["--speculate", "2"], "--speculate"),
    ({"ATTENTION": "paged", "PREFIX_CACHING": "0", "KVX_FORMAT": "int8"}, ["--sharded"], "--sharded"),
])
def test_launcher_refuses_with_one_line(env, args, says, tmp_path):
    full = {k: v for k, v in os.environ.items() if k not in ("ATTENTION", "PREFIX_CACHING", "KVX_FORMAT",
                                                              "KVX_KV_CACHE_MEMORY")}
    full.update({k: v for k, v in env.items() if v})
    p = run([*launcher(), "serve", str(tmp_path / "no-model"), *args], env=full)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvx-tgi-server: error: ") and says in lines[0], p.stderr
    assert not (tmp_path / "no-model").exists()


def _serve(model_dir: str, fmt: str, tmp_path, tok, ids):
    """One launcher run in ATTENTION=paged: warmup, a 256-token scored prompt, a batched greedy decode."""
    uds = str(tmp_path / f"paged-{fmt}")
    proc = launch(model_dir, uds, {**PAGED, "KVX_FORMAT": fmt}, tmp_path / f"{fmt}.log", "--dtype", "bfloat16")
    try:
        router = Router(wait_for_socket(f"unix://{uds}-0", proc), 16)
        assert router.info.attention_impl == "paged" and router.info.block_size == 16
        assert not router.info.support_chunking and not router.info.use_prefix_caching
        router.warmup([router.warmup_request("KVX warmup", 4)], max_total_tokens=1024, max_prefill_tokens=512)
        scored, s = router.request(tok.decode(ids), max_new_tokens=4, prompt_len=len(ids), prefill_logprobs=True)
        other, o = router.request("The capital of France is", max_new_tokens=8, prompt_len=8)
        router.run_to_end(router.prefill([scored, other]))
        assert s.prompt_ids == ids and len(s.tokens) == 4 and len(o.tokens) == 8
        router.clear()
        return router.num_blocks, perplexity(s.prompt_logprobs)
    finally:
        proc.terminate()
        wait(proc, f"kvx-tgi-server {fmt} (stopping after SIGTERM)", tmp_path / f"{fmt}.log")


def test_launcher_serves_paged_attention(smol_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from kvx_demo.text import default_text

    tok = AutoTokenizer.from_pretrained(smol_dir)
    ids = tok(default_text(), add_special_tokens=False).input_ids[:256]
    assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids
    cfg = AutoConfig.from_pretrained(smol_dir)
    cap = parse_bytes(PAGED["KVX_KV_CACHE_MEMORY"])
    results = {fmt: _serve(smol_dir, fmt, tmp_path, tok, ids) for fmt in ("bf16", "int4")}
    for fmt, (blocks, _) in results.items():
        assert blocks == expected_blocks(get_format(fmt), cap, cfg.num_hidden_layers, 16, cfg.num_key_value_heads,
                                         cfg.hidden_size // cfg.num_attention_heads), fmt
    assert results["int4"][0] / results["bf16"][0] > 3.5  # 72 vs 256 bytes per token-head at head_dim 64
    assert results["int4"][1] <= results["bf16"][1] * (1 + PPL_BOUND["int4"])
