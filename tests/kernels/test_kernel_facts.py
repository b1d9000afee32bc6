"""The kernel facts each format declares (`TensorFormat.kernel_facts`, read through `ops.kernel_format`): the code
enums equal the `.cu` enums name for name, and every registered format's facts equal a hand-written table (the
facts the kernels were written against), so a format declaring other facts is caught here, not in a kernel."""
import re
from pathlib import Path

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import TensorFormat, get_format, list_formats
from kvx_core.formats.registry import ENGINE_SERVED
from kvx_core.ops.cuda import SOURCE, WRITE_SOURCE
from kvx_core.ops.kernel_format import MIXED, CudaCode, EncoderCode, FormatCode, kernel_format


def _cu_enum(source: Path, prefix: str) -> dict[str, int]:
    """`{NAME: value}` of the first `enum : int { PREFIX_NAME = n, ... }` of a CUDA source."""
    body = re.search(r"enum\s*:\s*int\s*\{([^}]*)\}", source.read_text())
    assert body, f"no enum in {source.name}"
    items = [item.split("=") for item in body.group(1).split(",") if item.strip()]
    assert all(k.strip().startswith(prefix) for k, _ in items), items
    return {k.strip().removeprefix(prefix): int(v) for k, v in items}


@pytest.mark.parametrize("enum, source, prefix", [(CudaCode, SOURCE, "F_"), (EncoderCode, WRITE_SOURCE, "E_")],
                         ids=["decode", "write"])
def test_python_enums_are_the_cu_enums(enum, source, prefix):
    """`CudaCode` is paged_decode_mma.cu's format enum and `EncoderCode` paged_write.cu's encoder enum, name for
    name and value for value."""
    assert _cu_enum(source, prefix) == {c.name: c.value for c in enum}


def test_write_encoders_extend_the_decode_codes():
    """paged_write.cu: "The first six are the CUDA decode's format codes" (same names, same values)."""
    assert {c.name: c.value for c in CudaCode}.items() <= {c.name: c.value for c in EncoderCode}.items()


U8, E4M3, E5M2 = torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2
# name: (Triton code, group, storage, global_scale, has_scales, packed, e5m2, CUDA code, write encoder, rceil),
# written from the format definitions (formats/*.py docstrings) and the kernel enums, not from kernel_facts.
FACTS = {
    "bf16": ("PLAIN", 0, torch.bfloat16, False, False, False, False, None, None, True),
    "fp16": ("PLAIN", 0, torch.float16, False, False, False, False, None, None, True),
    "fp32": ("PLAIN", 0, torch.float32, False, False, False, False, None, None, True),
    "fp8_e4m3": ("FP8", 0, E4M3, True, False, False, False, "E4M3", "E4M3", True),
    "fp8_e5m2": ("FP8", 0, E5M2, True, False, False, True, "E5M2", "E5M2", True),
    "int8": ("INT8", 0, U8, False, True, False, False, "INT8", "INT8", True),
    "int4": ("INT4", 0, U8, False, True, True, False, "INT4", "INT4", True),
    "nvfp4": ("NVFP4", 16, U8, True, True, True, False, "NVFP4", "NVFP4", True),
    "mxfp4_16": ("MXFP4", 16, U8, False, True, True, False, "MXFP4", "MXFP4", True),
    "mxfp4_32": ("MXFP4", 32, U8, False, True, True, False, "MXFP4", "MXFP4_32", True),
    "mxfp4_16_floor": ("MXFP4", 16, U8, False, True, True, False, "MXFP4", "MXFP4_FLOOR", False),
    "mxfp4_32_floor": ("MXFP4", 32, U8, False, True, True, False, "MXFP4", "MXFP4_32_FLOOR", False),
}


def _tensor_formats() -> dict[str, TensorFormat]:
    """Every TensorFormat the registry uses (K and V of every cache format), by TensorFormat name."""
    return {tf.name: tf for name in list_formats() for tf in (get_format(name).k, get_format(name).v)}


def test_the_registry_uses_exactly_the_tabled_tensor_formats():
    assert sorted(_tensor_formats()) == sorted(FACTS)


@pytest.mark.parametrize("name", sorted(FACTS))
def test_declared_facts_equal_the_table(name):
    code, group, storage, gs, has_scales, packed, e5m2, cuda, enc, rceil = FACTS[name]
    kf = kernel_format(_tensor_formats()[name])
    assert (kf.code, kf.group, kf.storage, kf.global_scale, kf.has_scales, kf.packed, kf.e5m2, kf.rceil) == \
        (FormatCode[code], group, storage, gs, has_scales, packed, e5m2, rceil)
    assert kf.cuda_code == (None if cuda is None else CudaCode[cuda])
    assert kf.encoder == (None if enc is None else EncoderCode[enc])
    assert kf.affine == (code in ("INT8", "INT4"))


def test_mixed_pairs_are_k8v4():
    """The only K / V pair of different formats the CUDA kernels are instantiated for is k8v4's (E4M3, NVFP4)."""
    assert MIXED == {(CudaCode.E4M3, CudaCode.NVFP4)}
    for name in ("k8v4", "k8v4_rot"):
        fmt = get_format(name)
        assert (kernel_format(fmt.k).cuda_code, kernel_format(fmt.v).cuda_code) in MIXED


@pytest.mark.parametrize("bad", [None, "nvfp4", get_format("nvfp4"), 3])
def test_kernel_format_refuses_what_is_not_a_tensor_format(bad):
    with pytest.raises(KvxError) as e:
        kernel_format(bad)
    assert e.value.status == Status.UNSUPPORTED


def test_a_format_without_kernel_facts_has_no_kernel():
    """A TensorFormat that declares no kernel facts (the base default) is refused, not given another's facts."""

    class NoKernel(type(get_format("int8").k)):
        def kernel_facts(self):
            return TensorFormat.kernel_facts(self)

    with pytest.raises(KvxError) as e:
        kernel_format(NoKernel(8))
    assert e.value.status == Status.UNSUPPORTED


def test_engine_served_formats_are_registered():
    """The engine plugins' cache dtypes derive from `ENGINE_SERVED`: each is a registry name, listed once."""
    assert len(set(ENGINE_SERVED)) == len(ENGINE_SERVED)
    assert set(ENGINE_SERVED) <= set(list_formats())
