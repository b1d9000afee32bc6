"""A random-weight EAGLE draft head for a Llama target, written offline: vLLM's `EagleLlamaForCausalLM` (one decoder
layer without its input norm, `fc` joining the token's embedding and the target's hidden state) with the target's
attention geometry, so its attention layer runs through the same KV cache group and backend as the target's."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_eagle_head(target: Path, path: Path, seed: int = 0) -> Path:
    """Write `config.json` and `model.safetensors` of the head into `path` (seeded N(0, 0.02) weights, unit norm
    weights; the embedding and lm_head are shared from the target, as vLLM does when the head has none); returns it."""
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (i, h),
              "layers.0.mlp.up_proj.weight": (i, h), "layers.0.mlp.down_proj.weight": (h, i)}
    gen = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
