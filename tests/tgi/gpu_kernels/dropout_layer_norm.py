"""Test-only torch stand-in for flash-attn's `dropout_layer_norm.dropout_add_ln_fwd` as TGI calls it: no
dropout, no row/col scales, residual added first (see README.md)."""
import torch

from kvx_tgi.cpu_layers import rms_normalized


def dropout_add_ln_fwd(x0, residual, gamma, beta, rowscale, colscale, x0_subset, z_subset, dropout_p, epsilon,
                       rowscale_const, z_numrows, gen, residual_in_fp32, is_rms_norm):
    if dropout_p != 0.0 or rowscale is not None or colscale is not None or x0_subset is not None:
        raise NotImplementedError("stand-in dropout_add_ln_fwd: dropout and row/column scales are not implemented")
    x = x0 if residual is None else x0 + residual
    if is_rms_norm:
        y = rms_normalized(x, epsilon)
    else:
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=epsilon)
    y = y * gamma.float() + (0.0 if beta is None else beta.float())
    return y.to(x0.dtype), (x if residual is not None else None), None
