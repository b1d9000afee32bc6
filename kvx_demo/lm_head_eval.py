"""What an MXFP4 lm_head costs in accuracy: the demo model's logits with its head in BF16 vs MXFP4.

The model runs once per window (float32); its final hidden states go through both heads: the BF16 weight (what
vLLM serves) and `kvx_core.mxfp4_linear` of the same weight. Reported per window set: mean KL(BF16 || MXFP4) of
the next-token distributions, top-1 agreement, and the perplexity of the text under each head.
"""
from __future__ import annotations

from typing import Any

import torch

from kvx_core.mxfp4_linear import mxfp4_linear, quantize_mxfp4


@torch.no_grad()
def lm_head_accuracy(model: Any, windows: torch.Tensor) -> dict[str, float]:
    """Compare the BF16 and MXFP4 heads of `model` (a transformers causal LM) over token `windows [N, T]`."""
    head = model.get_output_embeddings().weight
    w_bf16 = head.detach().to(torch.bfloat16).float()
    w_mx = quantize_mxfp4(head.detach().to(torch.bfloat16))
    kl = nll_ref = nll_mx = agree = 0.0
    count = 0
    for ids in windows:
        hidden = model.model(ids.unsqueeze(0)).last_hidden_state[0, :-1]  # predicts tokens 1..T-1
        target = ids[1:]
        ref = torch.log_softmax(hidden @ w_bf16.T, dim=-1)
        got = torch.log_softmax(mxfp4_linear(hidden, w_mx), dim=-1)
        kl += float((ref.exp() * (ref - got)).sum())
        nll_ref -= float(ref.gather(1, target[:, None]).sum())
        nll_mx -= float(got.gather(1, target[:, None]).sum())
        agree += float((ref.argmax(-1) == got.argmax(-1)).sum())
        count += int(target.numel())
    ppl_ref, ppl_mx = torch.tensor(nll_ref / count).exp().item(), torch.tensor(nll_mx / count).exp().item()
    return {"tokens": count, "kl_mean": kl / count, "top1_agreement": agree / count, "ppl_bf16_head": ppl_ref,
            "ppl_mxfp4_head": ppl_mx, "ppl_delta_pct": 100 * (ppl_mx / ppl_ref - 1),
            "head_bytes_bf16": head.numel() * 2, "head_bytes_mxfp4": w_mx.nbytes}
