"""A tiny random Llama with a character tokenizer: a real, loadable Hugging Face checkpoint built offline (tests that
load a model through transformers without the demo's SmolLM2), and the fixtures of the CLI tests that run it over a
text: `tiny = tiny_llama_fixture()`, `text = text_fixture(TEXT)` in a test module."""
from __future__ import annotations

from pathlib import Path

import pytest

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
"""The CLI tests' model: 4 query / 2 KV heads of 16, 256 positions (with `save_tiny_llama`'s 2 layers)."""


def save_tiny_llama(path: Path, *, hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
                    max_position_embeddings: int) -> Path:
    """Write the checkpoint (2 layers, seeded weights, 96-character vocabulary) into `path`; returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["[UNK]"] + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                         max_position_embeddings=max_position_embeddings)
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def tiny_llama_fixture():
    """A module-scoped fixture: the `TINY` checkpoint in a directory of its own (read only: a test that writes next to
    the model copies it first); skipped without transformers."""
    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory) -> Path:
        pytest.importorskip("transformers")
        return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), **TINY)

    return tiny


def text_fixture(content: str):
    """A fixture: a file in the test's `tmp_path` holding `content` (the `--text` a CLI reads)."""
    @pytest.fixture
    def text(tmp_path) -> Path:
        path = tmp_path / "text.txt"
        path.write_text(content)
        return path

    return text
