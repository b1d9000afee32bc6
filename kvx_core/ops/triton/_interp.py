"""CPU interpreter (TRITON_INTERPRET=1) compatibility shim.

Triton 3.6's interpreter holds scalars as 1-element numpy arrays and converts them with
`int(array)`, which numpy >= 2.4 rejects for arrays with ndim > 0 ("only 0-dimensional arrays can be
converted to Python scalars"); that breaks every `range(lo, hi)` with runtime bounds. We wrap its
tensor patcher so `__index__` reads the single element explicitly. Its `tl.dot` also multiplies
bfloat16 operands as their raw uint16 bit patterns; we widen them to float32 first (exact). Its E4M3
upcast reads the NaN bytes 0x7F / 0xFF as 480; we make them NaN, as the GPU's cvt does.
No effect on GPU compilation.
"""
from __future__ import annotations


def install() -> None:
    try:
        from triton.runtime import interpreter as _it
    except Exception:  # pragma: no cover - triton missing
        return
    if getattr(_it, "_kvx_index_shim", False):
        return
    orig = _it._patch_lang_tensor

    def _patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _it._patch_lang_tensor = _patched

    import numpy as np
    import triton.language as tl

    builder = _it.InterpreterBuilder
    orig_dot = builder.create_dot

    def _bf16_to_f32(h):
        if h.dtype.scalar == tl.bfloat16 if hasattr(h.dtype, "scalar") else h.dtype == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return _it.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _bf16_to_f32(a), _bf16_to_f32(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    orig_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = orig_fp_to_fp(self, src, dst_type, rounding_mode)
        if src.dtype.scalar == tl.float8e4nv and dst_type.scalar.primitive_bitwidth > 8:
            nan = (src.data.view(np.uint8) & 0x7F) == 0x7F
            data = out.data.copy()
            data[nan] = np.nan
            out = _it.TensorHandle(data, out.dtype)
        return out

    builder.create_fp_to_fp = create_fp_to_fp
    _it._kvx_index_shim = True
