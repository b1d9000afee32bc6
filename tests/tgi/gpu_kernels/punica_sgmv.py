"""Test-only refusing stand-in for TGI's Hub kernel `punica_sgmv` (see README.md)."""
import sys

from kvx_tgi.absent_kernels import refusing_module

sys.modules[__name__] = refusing_module(__name__,
                                        "TGI's punica_sgmv kernel is not installed on this offline test machine")
