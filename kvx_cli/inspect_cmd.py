"""`kvx inspect`: allocate a cache the way an engine does, view it as KVX descriptors, validate, print."""
from __future__ import annotations

import argparse
import json
import os

import torch

from kvx_adapters import flashinfer, tgi, trtllm, vllm
from kvx_core.cache import PagedKVCache, page_bytes
from kvx_core.descriptors import CacheDesc, TensorDesc
from kvx_core.errors import KvxError, Status, require
from kvx_core.formats import get_format, list_formats

from .args import UINT32_MAX, bounded_int

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_BACKENDS = {"vllm": ("flash_attn", "flashinfer", "paged"), "tgi": tgi.ATTENTION,
             "trtllm": ("kv_block_array",), "flashinfer": ("paged",), "kvx": ("paged_kv_cache",)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print and validate the KVX descriptors of an engine's KV cache",
                       description="Allocate one layer's KV cache exactly as ENGINE does, adapt it to KVX "
                                   "descriptors (zero copy), validate them, and print shapes, strides "
                                   "(elements) and bytes per block / token.")
    p.add_argument("--engine", required=True, choices=sorted(_BACKENDS))
    p.add_argument("--backend", help="engine attention backend: vllm " + "|".join(_BACKENDS["vllm"])
                   + "; tgi " + "|".join(_BACKENDS["tgi"]) + " (default: the engine's first)")
    p.add_argument("--layout", choices=("NHD", "HND"), default="NHD", help="physical block layout (default NHD)")
    size = bounded_int(1, UINT32_MAX)
    limits = f"1..{UINT32_MAX} (a uint32 of the C ABI); the cache must fit this machine's memory"
    p.add_argument("--num-blocks", type=size, required=True, help=f"physical blocks, {limits}")
    p.add_argument("--block-size", type=size, required=True, help=f"tokens per block (page), {limits}")
    p.add_argument("--kv-heads", type=size, required=True, help=f"KV heads, {limits}")
    p.add_argument("--head-dim", type=size, required=True, help=f"dimension per KV head, {limits}")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="cache element dtype (engines)")
    p.add_argument("--format", choices=list_formats(), help="KVX cache format (engine kvx only; default = --dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def _vllm_tensor(backend: str, layout: str, n: int, b: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The per-layer tensor vLLM binds: allocated in stride order, permuted back to the logical shape."""
    storage = torch.uint8 if dtype.itemsize == 1 else dtype  # vLLM keeps fp8 caches as uint8
    logical = (2, n, b, h, d) if backend == "flash_attn" else (n, 2, b, h, d)
    order = (0, 1, 2, 3, 4) if layout == "NHD" else (0, 1, 3, 2, 4)
    phys = torch.empty([logical[i] for i in order], dtype=storage)
    inverse = [order.index(i) for i in range(5)]
    return phys.permute(*inverse)


def _engine_cache(a: argparse.Namespace) -> tuple[CacheDesc, dict[str, torch.Tensor], PagedKVCache | None]:
    n, b, h, d, dt = a.num_blocks, a.block_size, a.kv_heads, a.head_dim, _DTYPES[a.dtype]
    backend = a.backend or _BACKENDS[a.engine][0]
    if backend not in _BACKENDS[a.engine]:
        raise KvxError(Status.INVALID_ARGUMENT, f"--backend {backend!r} is not one of {a.engine}'s "
                                                f"{', '.join(_BACKENDS[a.engine])}")
    if a.format and a.engine != "kvx":
        raise KvxError(Status.INVALID_ARGUMENT, "--format selects a KVX cache format: use it with --engine kvx")
    fp8 = dt if dt.itemsize == 1 else None
    if a.engine == "vllm" and backend == "paged":
        x = 16 // dt.itemsize
        storage = torch.uint8 if fp8 else dt
        k, v = torch.empty(n, h, d // x, b, x, dtype=storage), torch.empty(n, h, d, b, dtype=storage)
        return vllm.from_vllm_paged(k, v, cache_dtype=fp8), {"key_cache": k, "value_cache": v}, None
    if a.engine == "vllm":
        t = _vllm_tensor(backend, a.layout, n, b, h, d, dt)
        return vllm.from_vllm_kv_cache(t, backend=backend, cache_dtype=fp8), {"kv_cache": t}, None
    if a.engine == "tgi":
        shape = (n, h, b, d) if backend == "ipex-cpu" else (n, b, h, d)
        if backend == "paged":
            x = b // dt.itemsize if b >= dt.itemsize else 1
            k, v = torch.empty(n, h, d // x, b, x, dtype=dt), torch.empty(n, h, d, b, dtype=dt)
        else:
            k, v = torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt)
        return tgi.from_tgi_kv_cache((k, v), attention=backend), {"key_cache": k, "value_cache": v}, None
    if a.engine == "trtllm":
        pool = torch.empty(n, 1, 2, h * b * d, dtype=dt)
        desc = trtllm.from_trtllm_layer(pool, 0, tokens_per_block=b, num_kv_heads=h, head_dim=d)
        return desc, {"primary_pool [blocks, layers, 2, H*T*D]": pool}, None
    if a.engine == "flashinfer":
        t = torch.empty((n, 2, b, h, d) if a.layout == "NHD" else (n, 2, h, b, d), dtype=dt)
        return flashinfer.from_flashinfer_paged_kv_cache(t, a.layout), {"paged_kv_cache": t}, None
    fmt = get_format(a.format or a.dtype)
    cache = PagedKVCache(fmt, num_layers=1, num_blocks=n, block_size=b, num_kv_heads=h, head_dim=d,
                         page_buffer=True)
    return cache.descriptor(0), {"page_buffer": cache.layers[0].k_data}, cache


def _tensor_info(t: TensorDesc | torch.Tensor) -> dict:
    if isinstance(t, torch.Tensor):
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride())}
    return {"dtype": t.dtype.name, "layout": t.layout.name, "memory": t.memory.name,
            "shape": list(t.shape), "stride": list(t.stride)}


def describe(desc: CacheDesc, engine_tensors: dict[str, torch.Tensor], cache: PagedKVCache | None) -> dict:
    """A JSON-able summary of a validated cache descriptor."""
    desc.validate()
    out: dict = {"geometry": {"num_blocks": desc.num_blocks, "block_size": desc.block_size,
                              "num_kv_heads": desc.num_kv_heads, "head_dim": desc.head_dim},
                 "engine_tensors": {k: _tensor_info(t) for k, t in engine_tensors.items()},
                 "k": _tensor_info(desc.k), "v": _tensor_info(desc.v)}
    per_block = 2 * desc.block_size * desc.num_kv_heads * desc.head_dim * desc.k.tensor.element_size()
    if cache is not None:
        f = cache.format
        per_block = page_bytes(f, desc.block_size, desc.num_kv_heads, desc.head_dim)
        q = desc.quant
        out["format"] = {"name": f.name, "capacity_vs_bf16": round(
            get_format("bf16").bytes_per_token_head(desc.head_dim) / f.bytes_per_token_head(desc.head_dim), 4)}
        if q is not None:
            out["quant"] = {"format": q.format.name, "group_size": q.group_size, "flags": q.flags,
                            "global_scale_count": q.global_scale_count,
                            "k_scales": _tensor_info(q.k_scales) if q.k_scales else None,
                            "v_scales": _tensor_info(q.v_scales) if q.v_scales else None}
    if desc.pool is not None:
        out["pool"] = {"memory": desc.pool.memory.name, "bytes_per_block": desc.pool.bytes_per_block}
    out["bytes_per_block"] = per_block
    out["bytes_per_token"] = per_block / desc.block_size
    out["valid"] = True
    return out


def _print_text(info: dict, engine: str) -> None:
    g = info["geometry"]
    print(f"engine {engine}: {g['num_blocks']} blocks x {g['block_size']} tokens, "
          f"{g['num_kv_heads']} KV heads x head_dim {g['head_dim']}")
    for name, t in info["engine_tensors"].items():
        print(f"  engine {name}: {t['dtype']} shape {tuple(t['shape'])} stride {tuple(t['stride'])}")
    for which in ("k", "v"):
        t = info[which]
        print(f"  KVX {which.upper()}: {t['layout']:<10} {t['dtype']:<10} {t['memory']:<6} "
              f"shape {tuple(t['shape'])} stride {tuple(t['stride'])}")
    if "format" in info:
        print(f"  format {info['format']['name']}: {info['format']['capacity_vs_bf16']}x the tokens of BF16")
    if info.get("quant"):
        q = info["quant"]
        print(f"  quant {q['format']} group {q['group_size']} flags {q['flags']:#x} "
              f"global scales {q['global_scale_count']}")
        for which in ("k_scales", "v_scales"):
            if q[which]:
                t = q[which]
                print(f"    {which}: {t['dtype']} shape {tuple(t['shape'])} stride {tuple(t['stride'])}")
    if "pool" in info:
        print(f"  pool: {info['pool']['memory']} bytes_per_block {info['pool']['bytes_per_block']}")
    print(f"  bytes per block (K+V, one layer): {info['bytes_per_block']}")
    print(f"  bytes per token (K+V, one layer): {info['bytes_per_token']:g}")
    print("  validation: OK (KVX v1 spec §7.1)")


def _cache_bytes(a: argparse.Namespace) -> int:
    """Bytes `_engine_cache` will allocate for K and V (with scales for a KVX format)."""
    if a.engine == "kvx":
        return a.num_blocks * page_bytes(get_format(a.format or a.dtype), a.block_size, a.kv_heads, a.head_dim)
    return 2 * a.num_blocks * a.block_size * a.kv_heads * a.head_dim * _DTYPES[a.dtype].itemsize


def _physical_memory() -> int | None:
    """This machine's RAM in bytes, None where the OS does not say (no sysconf)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _require_fits_memory(a: argparse.Namespace) -> None:
    """Refuse a cache larger than this machine's memory before allocating (torch would raise or swap)."""
    need, have = _cache_bytes(a), _physical_memory()
    require(have is None or need <= have, Status.OUT_OF_RANGE,
            f"this cache needs {need:,} bytes, more than this machine's {have or 0:,} bytes of memory: "
            f"use fewer or smaller blocks")


def run(a: argparse.Namespace) -> int:
    _require_fits_memory(a)
    desc, tensors, cache = _engine_cache(a)
    info = describe(desc, tensors, cache)
    if a.json:
        print(json.dumps(info))
    else:
        _print_text(info, a.engine if a.engine != "kvx" else "kvx")
    return 0
