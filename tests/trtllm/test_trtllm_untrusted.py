"""What describes a TRT-LLM cache comes from outside KVX: `describe_trtllm_cache`'s arguments (refused with KvxError,
never a crash or a float truncated to an int) and the `KVX_KV_SCALES` file the connector reads (refused with the
connector's documented ValueError naming the variable, also for 100k-deep nesting, NaN, huge numbers, a device or
FIFO), each with a capped fuzz test starting from valid inputs."""
from __future__ import annotations

import functools
import json
import math
import os
import random
import tempfile

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_trtllm import connector
from kvx_trtllm.cache import describe_trtllm_cache
from tests.fuzz import DEEP, EXTREME_JSON, dumps_json, mutate_json, run_capped

from .test_trtllm_cache import TwoPools
from .test_trtllm_nvfp4 import Nvfp4Cache


@functools.cache
def _caches() -> dict[str, object]:
    return {"bf16": TwoPools(secondary=False), "fp8": TwoPools(dtype=torch.float8_e4m3fn, secondary=False),
            "nvfp4": Nvfp4Cache()}


def _kwargs(which: str) -> tuple[object, object, dict]:
    """(pools, offsets, keyword arguments) that `describe_trtllm_cache` accepts for one of `_caches()`."""
    c = _caches()[which]
    if which == "nvfp4":
        return c.data, c.offsets, dict(tokens_per_block=c.t, num_kv_heads=2, head_dim=32, scale_pools=c.scales,
                                       kv_scale_quant_orig=c.quant_orig)
    kw = dict(tokens_per_block=4, num_kv_heads=list(c.heads), head_dim=8, pool_mapping=c.mapping, beam_width=c.w)
    if which == "fp8":
        kw.update(kv_scale_quant_orig=torch.tensor([0.5, 2.0, 0.125]),
                  kv_scale_orig_quant=1 / torch.tensor([0.5, 2.0, 0.125]))
    return c.pools, c.offsets, kw


@pytest.mark.parametrize("which", ["bf16", "fp8", "nvfp4"])
def test_valid_arguments_are_described(which):
    pools, offsets, kw = _kwargs(which)
    assert len(describe_trtllm_cache(pools, offsets, **kw)) in (2, 3)


@pytest.mark.parametrize("which, edit, words", [
    ("nvfp4", {"head_dim": 0}, "head_dim must be >= 1"),  # was ZeroDivisionError
    ("nvfp4", {"num_kv_heads": 2.0}, "num_kv_heads must be an int"),  # was TypeError
    ("nvfp4", {"num_kv_heads": "2"}, "num_kv_heads must be an int"),  # was accepted
    ("bf16", {"num_kv_heads": [4.5, 2]}, "num_kv_heads[0] must be an int"),  # was truncated to 4
    ("bf16", {"head_dim": 8.5}, "head_dim must be an int"),  # was truncated to 8
    ("bf16", {"tokens_per_block": 4.0}, "tokens_per_block must be an int"),
    ("bf16", {"tokens_per_block": None}, "tokens_per_block must be an int"),
    ("bf16", {"kv_factor": 2.0}, "kv_factor must be an int"),
    ("bf16", {"beam_width": 2.0}, "beam_width must be an int"),
    ("bf16", {"beam_width": True}, "beam_width must be an int"),
    ("bf16", {"pool_mapping": "0,1"}, "kv_cache_pool_mapping must be a tensor"),
    ("bf16", {"pool_mapping": [[True, False]] * 3}, "kv_cache_pool_mapping must hold real numbers"),
    ("bf16", {"pool_pointers": [[0.5, 0.0]] * 2}, "integer addresses"),
    ("bf16", {"secondary_pools": 7}, "secondary_pools must be a tensor"),
    ("bf16", {"secondary_pools": ["x", None]}, "secondary_pools must be tensors"),
    ("fp8", {"kv_scale_quant_orig": "0.5"}, "kv_scale_quant_orig must be a tensor"),  # was TypeError
    ("fp8", {"kv_scale_quant_orig": [0.5, "a", 1.0]}, "kv_scale_quant_orig must be a tensor"),
    ("fp8", {"kv_scale_quant_orig": [True] * 3, "kv_scale_orig_quant": None}, "must hold real numbers"),
    ("fp8", {"kv_scale_orig_quant": "2"}, "kv_scale_orig_quant must be a tensor"),
    ("nvfp4", {"kv_scale_quant_orig": [[1, 2, 3], [1, 2]]}, "kv_scale_quant_orig must be a tensor"),
    ("nvfp4", {"v_scale_layout": ["linear"]}, "v_scale_layout must be one of"),
])
def test_bad_arguments_are_refused(which, edit, words):
    pools, offsets, kw = _kwargs(which)
    before = [p.clone() for p in (pools if isinstance(pools, list) else [pools])] + [offsets.clone()]
    with pytest.raises(KvxError) as e:
        describe_trtllm_cache(pools, offsets, **{**kw, **edit})
    assert e.value.status == Status.INVALID_ARGUMENT and words in e.value.message, e.value.message
    after = (pools if isinstance(pools, list) else [pools]) + [offsets]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing written


def test_offsets_that_are_no_tensor_are_refused():
    pools, _, kw = _kwargs("bf16")
    for bad in ("offsets", [[["a"]]], None):
        with pytest.raises(KvxError) as e:
            describe_trtllm_cache(pools, bad, **kw)
        assert e.value.status == Status.INVALID_ARGUMENT


# ------------------------------------------------------------------ KVX_KV_SCALES
def _scales_file(tmp_path, data: bytes) -> str:
    p = tmp_path / "scales.json"
    p.write_bytes(data)
    return str(p)


def test_kv_scales_file_reads_a_list_of_positive_numbers(tmp_path):
    assert connector._kv_scales(_scales_file(tmp_path, b"[0.5, 2, 1e-3]")) == (0.5, 2.0, 1e-3)
    assert connector._kv_scales(None) is None and connector._kv_scales("") is None


@pytest.mark.parametrize("data, words", [
    (dumps_json(DEEP), "nests deeper"),  # was RecursionError
    (b"[0.5, NaN]", "not valid JSON"),
    (b"[0.5, Infinity]", "not valid JSON"),
    (b"[0.5, " + b"9" * 400 + b"]", "finite positive"),  # was OverflowError in math.isfinite
    (b"[0.5, 1e999]", "finite positive"),
    (b"[true, 1.0]", "finite positive"),
    (b"[]", "finite positive"),
    (b'{"0": 1.0}', "finite positive"),
    (b"\xff\xfe[1.0]", "not UTF-8"),
    (b"[1.0] x", "not valid JSON"),
])
def test_bad_kv_scales_files_are_the_documented_value_error(tmp_path, data, words):
    path = _scales_file(tmp_path, data)
    with pytest.raises(ValueError, match=f"^KVX connector: KVX_KV_SCALES={path}") as e:
        connector._kv_scales(path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_kv_scales_must_be_a_regular_file_under_the_cap(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "fifo")  # open() would block forever
    for path in ("/dev/zero", str(tmp_path / "fifo"), str(tmp_path), str(tmp_path / "absent.json")):
        with pytest.raises(ValueError, match="is not a regular file"):
            connector._kv_scales(path)
    path = _scales_file(tmp_path, json.dumps([1.0] * 40).encode())
    monkeypatch.setattr(connector, "MAX_KV_SCALES_BYTES", os.path.getsize(path) - 1)
    with pytest.raises(ValueError, match="larger than"):
        connector._kv_scales(path)


# ------------------------------------------------------------------ fuzz
def _extreme(rng: random.Random) -> object:
    """A forged argument: an extreme JSON value, or a tensor of a random shape and dtype."""
    if rng.random() < 0.6:
        return rng.choice(EXTREME_JSON)
    shape = rng.choice([(), (0,), (3,), (3, 2), (2, 3, 2, 5), (1, 6, 2, 4)])
    dtype = rng.choice([torch.int32, torch.int64, torch.float32, torch.uint8, torch.bool])
    return torch.zeros(shape, dtype=dtype) if dtype == torch.bool else (torch.rand(shape) * 40 - 8).to(dtype)


def fuzz_describe(rng: random.Random) -> None:
    """`describe_trtllm_cache` of valid arguments with one to three replaced by forged ones, or one element of the
    offsets / mapping / scales set to an extreme value."""
    pools, offsets, kw = _kwargs(rng.choice(["bf16", "fp8", "nvfp4"]))
    args = {"pools": pools, "offsets": offsets.clone(), **kw}
    names = [*args, "pool_pointers", "secondary_pools", "kv_factor", "v_scale_layout"]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(names)
        t = args.get(name)
        if isinstance(t, torch.Tensor) and t.numel() and name not in ("pools", "scale_pools") and rng.random() < 0.5:
            t = args[name] = t.clone()
            value = rng.choice([-1, 2**31 - 1, -(2**31), 7, 0, math.nan, math.inf, 1e30])
            try:
                t.view(-1)[rng.randrange(t.numel())] = value
            except (RuntimeError, OverflowError):  # a value the tensor's dtype cannot hold: a forger cannot either
                pass
        else:
            args[name] = _extreme(rng)
    describe_trtllm_cache(args.pop("pools"), args.pop("offsets"), **args)


def fuzz_kv_scales(rng: random.Random) -> None:
    """The connector's KVX_KV_SCALES reader on a mutated valid list: a tuple of scales or its documented
    ValueError."""
    data = dumps_json(mutate_json([0.5, 2.0, 0.125], rng))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(data)
        f.flush()
        try:
            scales = connector._kv_scales(f.name)
        except ValueError as e:
            if not str(e).startswith(f"KVX connector: KVX_KV_SCALES={f.name}"):
                raise
            return
    assert scales and all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in scales), scales


def test_fuzz_describe_trtllm_cache():
    run_capped("tests.trtllm.test_trtllm_untrusted:fuzz_describe", cases=300)


def test_fuzz_kv_scales_file():
    run_capped("tests.trtllm.test_trtllm_untrusted:fuzz_kv_scales", cases=300)
