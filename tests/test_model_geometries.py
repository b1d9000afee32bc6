"""`benchmarks/model_geometries.py`: the geometries (each a consistent HF config whose attention is the published
model's, cut in layers only) and `realistic_weights(tie_head=True)`, the weights the speculative-decoding runs on the
GPU use (tests/vllm/vllm_models_run.py). A random model must then repeat the token it reads, or vLLM's n-gram
speculator never drafts and the multi-token decode path goes untested (as happened for gpt-oss and Qwen3)."""
import json
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from model_geometries import MODELS, realistic_weights, write_config  # noqa: E402

VOCAB, HIDDEN = 512, 256

PUBLISHED = {
    # name: (hidden, query heads, KV heads, head_dim, layers of the full model, window, sliding layers per period,
    #        experts, softmax scale), typed from the published configs (the sources cited in model_geometries.py)
    "llama3-8b-8l": (4096, 32, 8, 128, 32, None, None, None, 128 ** -0.5),
    "llama3-70b-4l": (8192, 64, 8, 128, 80, None, None, None, 128 ** -0.5),
    "gpt-oss-20b-4l": (2880, 64, 8, 64, 24, 128, (1, 2), 32, 64 ** -0.5),
    "gpt-oss-120b-4l": (2880, 64, 8, 64, 36, 128, (1, 2), 128, 64 ** -0.5),
    "gemma3-27b-6l": (5376, 32, 16, 128, 62, 1024, (5, 6), None, 168 ** -0.5),
    "gemma3-12b-6l": (3840, 16, 8, 256, 48, 1024, (5, 6), None, 256 ** -0.5),
    "qwen3-8b-8l": (4096, 32, 8, 128, 36, None, None, None, 128 ** -0.5),
}


def test_every_geometry_has_its_published_numbers():
    assert set(MODELS) == set(PUBLISHED)


@pytest.mark.parametrize("name", PUBLISHED)
def test_geometry_matches_the_published_config(name):
    hidden, hq, hkv, d, full_layers, window, pattern, experts, scale = PUBLISHED[name]
    cfg = MODELS[name]
    layers = cfg["num_hidden_layers"]
    assert name.endswith(f"-{layers}l") and layers < full_layers
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (hidden, hq, hkv, d)
    assert hq % hkv == 0
    assert cfg.get("sliding_window") == window
    kinds = cfg.get("layer_types", ["full_attention"] * layers)
    assert len(kinds) == layers and set(kinds) <= {"sliding_attention", "full_attention"}
    if pattern is None:
        assert "sliding_attention" not in kinds
    else:  # a whole number of periods, each `sliding` window layers then full ones, as the full model's first layers
        local, period = pattern
        assert layers % period == 0
        assert kinds == (["sliding_attention"] * local + ["full_attention"] * (period - local)) * (layers // period)
    assert cfg.get("num_local_experts") == experts
    assert cfg.get("query_pre_attn_scalar", d) ** -0.5 == pytest.approx(scale)
    assert not cfg.get("attn_logit_softcapping")


def test_gpt_oss_120b_attention_is_the_20b_one():
    """The 120b differs from the 20b in layers and experts only: what the KV cache sees is the same."""
    a, b = MODELS["gpt-oss-20b-4l"], MODELS["gpt-oss-120b-4l"]
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"num_local_experts"}


@pytest.mark.parametrize("name", PUBLISHED)
def test_transformers_reads_the_geometry(name):
    """The config a run writes is one transformers builds the model's config from, with the same attention."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(MODELS[name])
    hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == PUBLISHED[name][1:4]
    assert getattr(hf, "sliding_window", None) == PUBLISHED[name][5]


def test_write_config_writes_the_geometry_with_overrides(tmp_path):
    cfg = write_config("gemma3-12b-6l", str(tmp_path), num_hidden_layers=2)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk == cfg and cfg["num_hidden_layers"] == 2 and cfg["head_dim"] == 256
    assert MODELS["gemma3-12b-6l"]["num_hidden_layers"] == 6


def test_write_config_refuses_an_unknown_geometry(tmp_path):
    with pytest.raises(KeyError, match="gpt-oss-120b-4l"):
        write_config("gpt-oss-120b", str(tmp_path))
    assert not list(tmp_path.iterdir())


class Block(nn.Module):
    """A residual block whose output is as large as a random layer's (std-0.02 weights on a normalized input)."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.proj(self.input_layernorm(x))


class Toy(nn.Module):
    """gpt-oss's parameter names (`model.embedding`, `lm_head`), an untied head, no embedding normalizer."""

    def __init__(self, layers: int = 4, emb_name: str = "embedding"):
        super().__init__()
        self.model = nn.Module()
        setattr(self.model, emb_name, nn.Embedding(VOCAB, HIDDEN))
        self.model.layers = nn.ModuleList(Block() for _ in range(layers))
        self.model.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.emb_name = emb_name

    def forward(self, ids):
        x = getattr(self.model, self.emb_name)(ids)
        for b in self.model.layers:
            x = b(x)
        return self.lm_head(self.model.norm(x))


@pytest.mark.parametrize("emb_name", ["embedding", "embed_tokens"])
def test_tied_head_makes_a_random_model_repeat_its_input(emb_name):
    m = Toy(emb_name=emb_name)
    realistic_weights(m, tie_head=True)
    emb = getattr(m.model, emb_name).weight
    assert torch.equal(m.lm_head.weight, emb)
    assert emb.std().item() == pytest.approx(0.02 * HIDDEN ** 0.5, rel=0.05)
    ids = torch.arange(VOCAB)
    with torch.no_grad():
        repeats = (m(ids).argmax(-1) == ids).float().mean().item()
    assert repeats > 0.99, repeats


def test_untied_random_model_does_not_repeat():
    """The oracle's other side: the same model without the tie almost never predicts the token it read."""
    m = Toy()
    realistic_weights(m)
    ids = torch.arange(VOCAB)
    with torch.no_grad():
        repeats = (m(ids).argmax(-1) == ids).float().mean().item()
    assert repeats < 0.05, repeats


def test_tie_head_without_a_pair_is_refused():
    m = Toy()
    m.lm_head = nn.Linear(HIDDEN, VOCAB + 1, bias=False)
    with pytest.raises(ValueError, match="tie_head"):
        realistic_weights(m, tie_head=True)
