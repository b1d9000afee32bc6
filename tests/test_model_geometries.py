"""`benchmarks/model_geometries.realistic_weights(tie_head=True)`: the weights the speculative-decoding runs on the
GPU use (tests/vllm/vllm_models_run.py). A random model must then repeat the token it reads, or vLLM's n-gram
speculator never drafts and the multi-token decode path goes untested (as happened for gpt-oss and Qwen3)."""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from model_geometries import realistic_weights  # noqa: E402

VOCAB, HIDDEN = 512, 256


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
