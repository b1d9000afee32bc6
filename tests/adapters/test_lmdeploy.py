"""LMDeploy/TurboMind quant_policy -> KvCacheMode -> KVX format (kvx_adapters.lmdeploy)."""
import pytest
import torch

from kvx_adapters.lmdeploy import KvCacheMode, kv_cache_format_name, select_kv_cache_mode
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format

POLICY_CASES = [
    (0, 90, KvCacheMode.NONE), (0, 75, KvCacheMode.NONE), (4, 80, KvCacheMode.INT4), (8, 80, KvCacheMode.INT8),
    (12, 90, KvCacheMode.INT8),  # both int bits: int8 wins (seed priority)
    (16, 89, KvCacheMode.MXFP4), (16, 90, KvCacheMode.MXFP4), (16, 100, KvCacheMode.NVFP4),
    (16, 103, KvCacheMode.NVFP4), (16, 120, KvCacheMode.NVFP4), (16, 121, KvCacheMode.NVFP4),
    (20, 90, KvCacheMode.MXFP4), (28, 100, KvCacheMode.NVFP4),  # FP4 bit wins over int bits
]


@pytest.mark.parametrize("policy,sm,mode", POLICY_CASES)
def test_select_kv_cache_mode(policy, sm, mode):
    assert select_kv_cache_mode(policy, sm) is mode


def test_policy_format_names():
    assert kv_cache_format_name(16, 90) == "mxfp4" and kv_cache_format_name(16, 100) == "nvfp4"
    assert kv_cache_format_name(8, 90) == "int8" and kv_cache_format_name(4, 90) == "int4"
    assert kv_cache_format_name(0, 90) == "bf16" and kv_cache_format_name(0, 90, torch.float16) == "fp16"
    for mode in KvCacheMode:
        if mode.format_name is not None:
            get_format(mode.format_name)
    with pytest.raises(KvxError):
        kv_cache_format_name(0, 90, torch.int8)


@pytest.mark.parametrize("policy", [1, 2, 3, 32, 64, 5, 17, 0x100, -4])
def test_invalid_policy_bits(policy):
    with pytest.raises(KvxError) as e:
        select_kv_cache_mode(policy, 90)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_invalid_policy_types_and_sm():
    for policy, sm in ((True, 90), (4.0, 90), ("8", 90), (8, 0), (8, -90), (8, 9.0)):
        with pytest.raises(KvxError) as e:
            select_kv_cache_mode(policy, sm)
        assert e.value.status == Status.INVALID_ARGUMENT
    for sm in (70, 80, 86, 88):
        with pytest.raises(KvxError) as e:
            select_kv_cache_mode(16, sm)
        assert e.value.status == Status.UNSUPPORTED
        assert select_kv_cache_mode(8, sm) is KvCacheMode.INT8
