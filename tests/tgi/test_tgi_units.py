"""The KVX TGI backend's parts that need no server: settings, warmup sizing arithmetic, refusals, CPU layers."""
from __future__ import annotations

import math

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_tgi import config, memory
from kvx_tgi.absent_kernels import refusing_module


@pytest.mark.parametrize("text, n", [("1", 1), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("64k", 64 << 10),
                                     (" 7 b ", 7)])
def test_parse_bytes(text, n):
    assert config.parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "0", "-1", "1.5GiB", "2TB", "lots", "GiB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(KvxError) as e:
        config.parse_bytes(text)
    assert e.value.status == Status.INVALID_ARGUMENT


def _run(fmt: str, block: int = 256, cap: int | None = None) -> config.RunConfig:
    return config.RunConfig(get_format(fmt), "flashdecoding", block, cap)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nvfp4", "mxfp4_32", "k8v4"])
def test_warmup_sizing_counts_kvx_bytes(fmt):
    """TGI computes `free // tgi_block + warmup_blocks`; the reported free memory must make that the number of
    KVX blocks that fit, at the format's bytes per (token, head) (independent formula)."""
    g = memory.Geometry(num_layers=30, num_blocks=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    run = _run(fmt)
    per_block = 30 * 256 * 3 * get_format(fmt).bytes_per_token_head(64)
    assert memory.kvx_block_bytes(run, g) == per_block
    assert memory.tgi_block_bytes(run, g) == 30 * 256 * 3 * 64 * 2 * 2
    free = 10 << 30
    reported = memory.blocks_to_add(run, g, free) * memory.tgi_block_bytes(run, g)
    assert reported // memory.tgi_block_bytes(run, g) + g.num_blocks == free // per_block + g.num_blocks
    capped = _run(fmt, cap=1 << 30)  # the cap counts the warmup blocks too
    assert memory.blocks_to_add(capped, g, free) + g.num_blocks == (1 << 30) // per_block
    assert memory.blocks_to_add(capped, g, 0) == 0  # never more than is free
    tiny = _run(fmt, cap=1)
    assert memory.blocks_to_add(tiny, g, free) == 0


def test_capacity_ratio_of_4bit_formats():
    g = memory.Geometry(30, 0, 3, 64, torch.bfloat16)
    bf16 = memory.kvx_block_bytes(_run("bf16"), g)
    assert bf16 / memory.kvx_block_bytes(_run("nvfp4"), g) == pytest.approx(256 / 72)
    assert bf16 / memory.kvx_block_bytes(_run("mxfp4_32"), g) == pytest.approx(256 / 68)


def test_fp8_cache_dtype_is_refused():
    with pytest.raises(KvxError) as e:
        _run("int8").check_cache_dtype(torch.float8_e4m3fn)
    assert e.value.status == Status.UNSUPPORTED and "KVX_FORMAT" in e.value.message


def test_refused_attention_arguments():
    from kvx_tgi import attention

    with pytest.raises(KvxError, match="sliding-window"):
        attention._refuse(4096)
    with pytest.raises(KvxError, match="non-causal"):
        attention._refuse(-1, causal=False)
    attention._refuse(-1)


def test_refusing_module_says_why():
    mod = refusing_module("some_kernels", "not built here")
    f = mod.fused_thing
    with pytest.raises(KvxError) as e:
        f(1, 2)
    assert e.value.status == Status.UNSUPPORTED and "some_kernels.fused_thing: not built here" in e.value.message
    assert not hasattr(mod, "__wrapped__")


def test_reinstall_with_another_attention_is_refused(monkeypatch):
    import kvx_tgi

    kvx_tgi.install("int8")  # TGI is imported by now in this process (flashdecoding)
    monkeypatch.setenv("ATTENTION", "paged")
    monkeypatch.setenv("PREFIX_CACHING", "0")
    with pytest.raises(KvxError, match="one process serves one ATTENTION"):
        kvx_tgi.install("int8")


def test_cpu_rotary_matches_the_rotation_formula():
    from kvx_tgi.cpu_layers import rotary_forward

    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 64, dtype=torch.bfloat16), torch.randn(5, 2, 64, dtype=torch.bfloat16)
    pos = torch.arange(5, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    ang = pos[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :].to(torch.bfloat16), ang.sin()[:, None, :].to(torch.bfloat16)
    want_q = q.float().clone()
    a, b = want_q[..., :32].clone(), want_q[..., 32:].clone()
    c, s = cos.float(), sin.float()
    want_q[..., :32], want_q[..., 32:] = a * c - b * s, b * c + a * s
    q2 = q.clone()
    rotary_forward(None, q2, k.clone(), cos, sin)
    assert torch.equal(q2, want_q.to(torch.bfloat16))


def test_cpu_rms_norm_adds_the_residual_first():
    from kvx_tgi.cpu_layers import rms_norm_forward

    class Norm:
        weight = torch.full((8,), 2.0, dtype=torch.bfloat16)
        variance_epsilon = 1e-6

    x, r = torch.ones(3, 8, dtype=torch.bfloat16), torch.full((3, 8), 2.0, dtype=torch.bfloat16)
    y, res = rms_norm_forward(Norm(), x, r)
    assert torch.equal(res, x + r)
    assert torch.allclose(y.float(), torch.full((3, 8), 2.0), atol=1e-2)
    y0, res0 = rms_norm_forward(Norm(), x)
    assert res0 is x and math.isclose(float(y0[0, 0]), 2.0, rel_tol=1e-2)


@pytest.mark.parametrize("k, v", [(0.0, 1.0), (-0.5, 1.0), (float("nan"), 1.0), (1.0, float("inf"))])
def test_bad_checkpoint_kv_scales_are_refused(k, v):
    from kvx_tgi.kv_cache import KVScales

    with pytest.raises(KvxError) as e:
        KVScales(torch.tensor(k), torch.tensor(v))
    assert e.value.status == Status.INVALID_ARGUMENT and "finite and > 0" in e.value.message


def test_per_head_checkpoint_kv_scales_are_refused():
    from kvx_tgi.kv_cache import KVScales

    with pytest.raises(KvxError) as e:
        KVScales(torch.ones(2), torch.ones(2))
    assert e.value.status == Status.UNSUPPORTED


@pytest.mark.parametrize("env, words", [({"KVX_KV_CACHE_MEMORY": "1.5GiB"}, "KVX_KV_CACHE_MEMORY"),
                                        ({"KVX_FORMAT": "nvfp5"}, "KVX_FORMAT"),
                                        ({"KVX_FORMAT": "fp32"}, "KVX_FORMAT")])
def test_tgi_settings_are_read_through_the_table(monkeypatch, env, words):
    """kvx_tgi's run settings go through the configuration table (kvx_core.config): its parsing and messages."""
    monkeypatch.setenv("ATTENTION", "flashdecoding")
    monkeypatch.setenv("PREFIX_CACHING", "1")
    monkeypatch.setenv("KVX_FORMAT", "int8")
    monkeypatch.setenv("KVX_KV_CACHE_MEMORY", "2GiB")
    run = config.resolve(None)
    assert (run.format.name, run.cache_memory) == ("int8", 2 << 30)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KvxError) as e:
        config.resolve(None)
    assert e.value.status == Status.INVALID_ARGUMENT and words in e.value.message
