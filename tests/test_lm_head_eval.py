"""kvx_demo.lm_head_eval on a tiny random Llama: its BF16-head perplexity is the model's own loss (HF's oracle),
and a head already on the MXFP4 grid costs nothing (KL 0, full agreement, same perplexity)."""
import math

import pytest
import torch

from kvx_demo.lm_head_eval import lm_head_accuracy

from .core.test_mxfp4_linear import _representable

transformers = pytest.importorskip("transformers")


def _model(vocab=96, hidden=64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_bf16_head_perplexity_is_the_models_loss():
    model = _model()
    head = model.get_output_embeddings().weight
    head.copy_(head.to(torch.bfloat16).float())  # the BF16 head is then the model's own head
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    got = lm_head_accuracy(model, ids)
    loss = sum(float(model(w[None], labels=w[None]).loss) for w in ids) / 2  # equal token counts per window
    assert got["tokens"] == 78
    assert math.isclose(got["ppl_bf16_head"], math.exp(loss), rel_tol=1e-4)
    assert got["kl_mean"] > 0 and got["head_bytes_mxfp4"] == 96 * 32 + 96 * 2


@torch.no_grad()
def test_a_head_on_the_mxfp4_grid_costs_nothing():
    model = _model()
    model.get_output_embeddings().weight.copy_(_representable(96, 64, seed=4) * 2.0 ** -8)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    got = lm_head_accuracy(model, ids)
    assert abs(got["kl_mean"]) < 1e-6 and got["top1_agreement"] == 1.0
    assert math.isclose(got["ppl_mxfp4_head"], got["ppl_bf16_head"], rel_tol=1e-6)
