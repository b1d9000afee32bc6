"""A tiny random Llama with a character tokenizer: a real, loadable Hugging Face checkpoint built offline (tests that
load a model through transformers without the demo's SmolLM2)."""
from __future__ import annotations

from pathlib import Path


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
