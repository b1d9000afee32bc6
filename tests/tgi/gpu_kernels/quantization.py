"""Test-only stand-in for TGI's Hub kernel `quantization` (see README.md): reports no CUTLASS FP8 support (TGI
asks at import), and every other function refuses."""
from kvx_tgi.absent_kernels import refusing_module

_refuse = refusing_module(__name__, "TGI's quantization kernel is not installed on this offline test machine")


def cutlass_scaled_mm_supports_fp8(capability: int) -> bool:
    return False


def __getattr__(name: str):
    return getattr(_refuse, name)
