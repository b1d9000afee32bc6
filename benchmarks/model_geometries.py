"""HF configs of the model geometries the vLLM benchmarks and GPU runs serve with random weights
(`load_format="dummy"`, no tokenizer), cut to a few layers so the GPU's memory goes to the KV cache.

Each keeps what decides the KV cache and attention: query / KV heads, head_dim, window layers and their pattern,
attention sinks, the softmax scale (Gemma's `query_pre_attn_scalar`), vocab. Values from the models' published
`config.json` files; `num_hidden_layers` is cut (and says so in the name).
"""
from __future__ import annotations

import json
import os

_COMMON = {"torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}

# gpt-oss-20b, 4 of 24 layers: learned sinks, 128-token windows on even layers, MoE (BF16 experts here:
# no MXFP4 weights are loaded with dummy weights), head_dim 64, 64 query / 8 KV heads
_GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                "intermediate_size": 2880, "num_hidden_layers": 4, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
                "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
                "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2,
                "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096},
                "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
                "initial_context_length": 4096, "router_aux_loss_coef": 0.9, "output_router_logits": False}

# Gemma 3 27B, 6 of 62 layers (one period of its 5 local : 1 global pattern), 1024-token windows,
# query_pre_attn_scalar 168 (sm_scale 168^-0.5, not head_dim^-0.5), head_dim 128, 32 query / 16 KV heads
_GEMMA3_27B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
               "intermediate_size": 21504, "num_hidden_layers": 6, "num_attention_heads": 32,
               "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208,
               "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
               "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True}

MODELS: dict[str, dict] = {
    # Llama 3 8B, 8 of 32 layers: bench_vllm.py's model since its first results (kept for comparability)
    "llama3-8b-8l": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
                     "max_position_embeddings": 65536, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "hidden_act": "silu", "tie_word_embeddings": False},
    # Llama 3 70B, 4 of 80 layers: GQA 64/8, hidden 8192 (the tensor-parallel runs: 8 KV heads over 2-8 ranks)
    "llama3-70b-4l": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 4, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                      "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                      "hidden_act": "silu", "tie_word_embeddings": False},
    "gpt-oss-20b-4l": _GPT_OSS_20B,
    # gpt-oss-120b, 4 of 36 layers: the 20b's attention (sinks, 128-token windows on even layers, 64/8 heads,
    # head_dim 64) and 128 experts (top-4) instead of 32. Numbers: openai/gpt-oss-120b's config.json, as the defaults
    # of huggingface/transformers src/transformers/models/gpt_oss/configuration_gpt_oss.py (commit 02b8f42b: 36
    # layers, 128 experts, the 20b's other values)
    "gpt-oss-120b-4l": {**_GPT_OSS_20B, "num_local_experts": 128},
    "gemma3-27b-6l": _GEMMA3_27B,
    # Gemma 3 12B, 6 of 48 layers (one 5 local : 1 global period), 1024-token windows, head_dim 256 (as 1B and 4B),
    # 16 query / 8 KV heads, scale head_dim^-0.5 (query_pre_attn_scalar 256). Numbers: google-deepmind/gemma
    # gemma/gm/nn/_gemma.py (commit 9fec24ca, Gemma3_12B) and the Gemma3TextConfig defaults of huggingface/transformers
    # src/transformers/models/gemma3/configuration_gemma3.py (vocab 262208, rope_local_base_freq, eps):
    # the 27B's values but the sizes below
    "gemma3-12b-6l": {**_GEMMA3_27B, "hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16,
                      "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256},
    # Qwen3-8B, 8 of 36 layers: q/k norms, head_dim 128, 32 query / 8 KV heads
    "qwen3-8b-8l": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                    "intermediate_size": 12288, "num_hidden_layers": 8, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0,
                    "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 40960,
                    "attention_bias": False, "tie_word_embeddings": False},
}
DEFAULT = "llama3-8b-8l"


def write_config(name: str, model_dir: str, **overrides) -> dict:
    """`model_dir/config.json` of geometry `name` (KeyError naming the choices for an unknown one)."""
    if name not in MODELS:
        raise KeyError(f"unknown model geometry {name!r}; choose from {', '.join(MODELS)}")
    cfg = {**MODELS[name], **_COMMON, **overrides}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


def write_tokenizer(model_dir: str, vocab: int) -> None:
    """`model_dir/tokenizer.json`: a word-level tokenizer of `vocab` tokens, for checkpoints of random weights served
    from token ids; KvxConnector's model fingerprint hashes this file with config.json."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(
        os.path.join(model_dir, "tokenizer.json"))


EMBEDDINGS = ("embed_tokens.weight", "embedding.weight")
"""Input-embedding parameter names: most models' and gpt-oss's (`model.embedding`)."""


def realistic_weights(model, seed: int = 0, std: float = 0.02, tie_head: bool = False) -> None:
    """Random weights that make attention matter, in place (vLLM's dummy loader draws U(-1e-3, 1e-3), which makes
    every norm ~0 and the logits ~uniform, whatever the KV cache holds): N(0, std) matrices (HF's init), norms at
    their identity (1, or 0 for Gemma's `1 + w` norms), biases 0, attention sinks N(0, 1). Deterministic for a
    given seed and model, so runs with different KV cache dtypes share their weights.

    `tie_head`: the LM head set to the input embedding (as tied models have it, e.g. Gemma), both scaled by
    sqrt(hidden) where the model does not scale its embedding itself (Gemma's `normalizer`). The residual stream is
    then dominated by the token just read, which the tied head scores highest, so greedy continuations repeat and the
    n-gram speculator finds drafts. Without the scale the random layers' outputs dominate the residual and the
    continuations never repeat (measured: gpt-oss and Qwen3 geometries drafted nothing), as with an independent head."""
    import torch

    norms = {}
    for mname, mod in model.named_modules():
        if "Norm" in type(mod).__name__:
            for pname, _ in mod.named_parameters(recurse=False):
                norms[f"{mname}.{pname}" if mname else pname] = 0.0 if "Gemma" in type(mod).__name__ else 1.0
    gen = None
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if not p.is_floating_point():
                continue
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            if name in norms:
                p.fill_(norms[name])
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        if tie_head:
            emb = next((p for n, p in model.named_parameters() if n.endswith(EMBEDDINGS)), None)
            head = next((p for n, p in model.named_parameters() if n.endswith("lm_head.weight")), None)
            if emb is None or head is None or head.shape != emb.shape:
                raise ValueError(f"tie_head: no embedding / LM head pair of one shape in {type(model).__name__}")
            if not any(n.endswith("normalizer") for n, _ in model.named_buffers()):
                emb.mul_(emb.shape[1] ** 0.5)  # as Gemma's forward scales it: the token read dominates the residual
            if head is not emb:
                head.copy_(emb)
