"""A whole TensorRT-LLM KV cache as KVX descriptors: every layer over its pool, addressed by TRT-LLM's own tables.

TRT-LLM facts this follows (`cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`, `thop/attentionOp.cpp`,
`kernels/kvCacheUtils.h`; details and commits in `kvx_adapters/trtllm.py`):
- pools `[num_blocks, layers_in_pool, kv_factor, H*T*D]` (`get_unique_primary_pool()` for one pool), a pinned
  host secondary pool of the same layout; `kv_cache_pool_pointers [num_pools, 2]` = (primary, secondary) bases;
  `kv_cache_pool_mapping [num_layers, 2]` = (pool index, layer within the pool);
- offsets `[num_pools, seqs * beams, 2 (K, V), max_blocks]` int32 `KVCacheIndex` (bit 31 = secondary pool, -1 =
  null) holding `mem_idx * layers_in_pool * kv_factor + kv`; a layer's kernels read from the pool base plus
  `layer_in_pool * kv_factor * bytes_per_block`, so the table is shared by every layer of a pool;
- FP8 caches: one fp32 `kv_scale_quant_orig` per layer (x = fp8 * s, for K and V), `kv_scale_orig_quant = 1/s`.
- NVFP4 caches (`thop/attentionOp.cpp`, `unfusedAttentionKernels_2_template.h` `quantizeAndWriteFP4KVCache`,
  `_torch/pyexecutor/resource_manager.py`; commits in docs/engine_layouts.md §17.6): data pools hold `H*T*D/2` bytes
  per block (E2M1 pairs, element 2i in the low nibble), block-scale pools `[num_blocks, layers_in_pool, kv_factor,
  H*T*D/16]` E4M3 bytes addressed by the same offsets (scale-pool layer pointer `layer_in_pool * kv_factor *
  bytes_per_block / 16`); `kv_cache_pool_pointers [num_pools, 2, 2 (data, scale)]`; per layer `kv_scale_quant_orig
  [3]` (Q, K, V): x = e2m1 * e4m3 * kv_scale_quant_orig[1 (K) / 2 (V)]. K scales are linear `[H, T, D/16]`; V scales
  are interleaved by 4 tokens (`KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4`, `kvx_core/scale_layout.py`) for the trtllm-gen
  kernels; releases before that interleave wrote V scales linearly (`v_scale_layout="linear"`).

`describe_trtllm_cache` turns those into one `TrtllmLayer` per model layer: a KVX `CacheDesc` whose K and V are the
layer's `[n, H, T, D]` block array from its pool pointer (zero copy) and the pool's KV_OFFSETS `BlockTable`, the
raw TRT-LLM offsets unchanged. `gather_kv` / `paged_decode` / `paged_prefill` of `kvx_core.ops.dispatch` take them
as they are. Each layer also comes bound for its KV_OFFSETS table (`TrtllmLayer.bound`, `dispatch.bind(cache,
table_format=KV_OFFSETS)`: pools with V one block after K, scale arguments, global scales, checked once), or None
where the kernels cannot address it (CPU pools, a pool with a host (secondary) pool, NVFP4 with V scales interleaved
by 4 tokens); an engine plans each step once (`dispatch.plan_decode(layer.table, ..., check=False)`) and runs every
layer with `plan.run(q, layer.bound or layer.cache, out=..., want_lse=False)`, which launches decode + merge alone
for a bound layer. A bound layer takes no writes (its K and V are one block array): `layer_views` gives the same
memory as per-layer strided K/V views with PACKED block ids (memory-pool block indices), where slot-mapped writes
and bundle export / import apply.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvx_adapters.trtllm import from_trtllm_layer, from_trtllm_offsets, from_trtllm_pool
from kvx_core.allocator import as_int
from kvx_core.codec import format_of, quant_desc
from kvx_core.descriptors import BlockTable, CacheDesc, PoolDesc, memory_of
from kvx_core.enums import QUANT_FLAG_V_SCALE_INTERLEAVE4, BlockTableFormat, Layout
from kvx_core.errors import KvxError, Status, require
from kvx_core.formats import get_format
from kvx_core.ops.dispatch import BoundLayer, bind

_FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)
_NVFP4 = torch.uint8  # TRT-LLM's FP4 pools are bytes: two E2M1 codes each
_V_SCALE_FLAGS = {"interleaved": QUANT_FLAG_V_SCALE_INTERLEAVE4, "linear": 0}


@dataclass(frozen=True)
class TrtllmLayer:
    """One model layer of a TRT-LLM cache: its KVX cache over the layer's pool pointer, its pool's table, and the
    cache bound for that table (what plans run on: `bound or cache`)."""

    cache: CacheDesc
    table: BlockTable  # the pool's KV_OFFSETS table (raw TRT-LLM offsets)
    pool: int
    layer_in_pool: int
    bound: BoundLayer | None  # `cache` bound for KV_OFFSETS tables; None where the kernels cannot address it


def _layer(cache: CacheDesc, table: BlockTable, pool: int, layer_in_pool: int) -> TrtllmLayer:
    """The layer with `cache` bound once for its pool's KV_OFFSETS table (checked here, not at every step)."""
    return TrtllmLayer(cache, table, pool, layer_in_pool, bind(cache, table_format=BlockTableFormat.KV_OFFSETS))


def _as_list(x, what: str) -> list:
    """A tensor or a list / tuple of them (None: none) as a list; KvxError for anything else."""
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    require(isinstance(x, (list, tuple)), Status.INVALID_ARGUMENT,
            f"{what} must be a tensor or a list of tensors, got {type(x).__name__}")
    return list(x)


def _as_tensor(x: object, what: str) -> torch.Tensor:
    """`x` (a tensor, or nested lists of numbers) as a tensor; KvxError naming `what` for anything else (a string,
    ragged lists, a bool or complex tensor) instead of torch's TypeError / ValueError."""
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{what} must be a tensor or (nested) list of numbers ({e})") from None
    require(t.dtype != torch.bool and not t.is_complex(), Status.INVALID_ARGUMENT,
            f"{what} must hold real numbers, got {t.dtype}")
    return t


def _per_pool(value: int | Sequence[int], num_pools: int, what: str) -> list[int]:
    """One int >= 1 for every pool, or a list of one per pool (never a float or bool truncated)."""
    if isinstance(value, (list, tuple)):
        vals = [as_int(v, f"{what}[{i}]", 1) for i, v in enumerate(value)]
    else:
        vals = [as_int(value, what, 1)] * num_pools
    require(len(vals) == num_pools, Status.INVALID_ARGUMENT, f"{what}: {len(vals)} values for {num_pools} pools")
    return vals


def _mapping(pool_mapping: torch.Tensor | None, pools: list[torch.Tensor]) -> list[tuple[int, int]]:
    """`kv_cache_pool_mapping [num_layers, 2]` as (pool, layer_in_pool) pairs (one pool: layers in order)."""
    if pool_mapping is None:
        require(len(pools) == 1, Status.INVALID_ARGUMENT, "several pools need kv_cache_pool_mapping [num_layers, 2]")
        return [(0, i) for i in range(pools[0].shape[1])]
    m = _as_tensor(pool_mapping, "kv_cache_pool_mapping")
    require(m.dim() == 2 and m.shape[1] == 2 and not m.is_floating_point(), Status.INVALID_ARGUMENT,
            f"kv_cache_pool_mapping must be an integer [num_layers, 2] tensor, got {tuple(m.shape)} {m.dtype}")
    pairs = [(int(p), int(li)) for p, li in m.tolist()]
    for layer, (p, li) in enumerate(pairs):
        require(0 <= p < len(pools) and 0 <= li < pools[p].shape[1], Status.INVALID_ARGUMENT,
                f"kv_cache_pool_mapping[{layer}] = ({p}, {li}) names no layer of the {len(pools)} pools")
    require(len(set(pairs)) == len(pairs), Status.INVALID_ARGUMENT,
            "kv_cache_pool_mapping maps two layers to one (pool, layer_in_pool)")
    return pairs


def _layer_scales(kv_scale_quant_orig, kv_scale_orig_quant, num_layers: int, width: int,
                  used: slice) -> torch.Tensor:
    """`[num_layers, width]` dequantization scales `s` (x = q * s) from TRT-LLM's pair of KV scales (FP8: one per
    layer; NVFP4: Q, K, V per layer); KvxError when missing or inconsistent in the columns the cache uses."""
    shape = f"[{num_layers}]" if width == 1 else f"[num_layers={num_layers}, {width}]"
    require(kv_scale_quant_orig is not None, Status.INVALID_ARGUMENT,
            f"a quantized TRT-LLM cache needs kv_scale_quant_orig {shape} fp32 (1.0 for unit scales)")
    s = _as_tensor(kv_scale_quant_orig, "kv_scale_quant_orig").to(torch.float32).cpu()
    require(s.numel() == num_layers * width, Status.INVALID_ARGUMENT,
            f"kv_scale_quant_orig has {s.numel()} values, this cache needs {shape}")
    s = s.reshape(num_layers, width)
    require(bool(torch.isfinite(s[:, used]).all() and (s[:, used] > 0).all()), Status.INVALID_ARGUMENT,
            f"kv_scale_quant_orig must be finite and positive, got {s.tolist()}")
    if kv_scale_orig_quant is not None:
        inv = _as_tensor(kv_scale_orig_quant, "kv_scale_orig_quant").to(torch.float32).cpu()
        require(inv.numel() == s.numel() and torch.allclose(inv.reshape(s.shape)[:, used] * s[:, used],
                                                            torch.ones_like(s[:, used]), rtol=1e-6, atol=0),
                Status.INVALID_ARGUMENT, "kv_scale_orig_quant must be 1 / kv_scale_quant_orig per layer")
    return s


def _check_pointers(pool_pointers, pools: list[torch.Tensor], secondary: list[torch.Tensor | None],
                    scale_pools: list[torch.Tensor] | None) -> None:
    """`kv_cache_pool_pointers` must be the given pools' base addresses (0: no secondary pool): `[num_pools, 2]`
    (primary, secondary), or NVFP4's `[num_pools, 2, 2]` with the block-scale pools' bases at `[..., 1]`."""
    if pool_pointers is None:
        return
    ptr = _as_tensor(pool_pointers, "kv_cache_pool_pointers").cpu()
    require(not ptr.is_floating_point(), Status.INVALID_ARGUMENT,
            f"kv_cache_pool_pointers must hold integer addresses, got {ptr.dtype}")
    want_shape = (len(pools), 2) if scale_pools is None else (len(pools), 2, 2)
    require(tuple(ptr.shape) == want_shape, Status.INVALID_ARGUMENT,
            f"kv_cache_pool_pointers must be {list(want_shape)} for these pools, got {tuple(ptr.shape)}"
            + (" (NVFP4 caches stack the block-scale pools' pointers: [num_pools, 2, 2])" if scale_pools is None
               else ""))
    for p, (prim, sec) in enumerate(zip(pools, secondary, strict=True)):
        want = [prim.data_ptr(), 0 if sec is None else sec.data_ptr()]
        got = ptr[p].reshape(2, -1)[:, 0].tolist()
        if scale_pools is not None:
            want, got = want + [scale_pools[p].data_ptr(), 0], got + ptr[p, :, 1].tolist()
        require(got == want, Status.INVALID_ARGUMENT,
                f"kv_cache_pool_pointers[{p}] = {got} are not the given pools' base addresses {want}")


def _with_fp8_scale(c: CacheDesc, fmt_name: str, s: torch.Tensor) -> CacheDesc:
    """`c` (FP8 K/V views) with TRT-LLM's per-layer `kv_scale_quant_orig` `s` as the KVX per-head global scale of K
    and V (x = fp8 * s for both)."""
    g = s.expand(c.num_kv_heads).to(c.k.tensor.device).contiguous()
    q = quant_desc(get_format(fmt_name), c.head_dim, None, None, g, g.clone())
    return CacheDesc.from_torch(c.k.tensor, c.v.tensor, block_size=c.block_size, num_kv_heads=c.num_kv_heads,
                                head_dim=c.head_dim, k_layout=c.k.layout, v_layout=c.v.layout, pool=c.pool, quant=q)


def _byte_blocks(pool: torch.Tensor, layer_in_pool: int, tokens_per_block: int, heads: int,
                 row_bytes: int) -> torch.Tensor:
    """The `[n, H, T, row_bytes]` uint8 blocks at a byte pool's layer pointer (`from_trtllm_pool` addresses
    elements, so the bytes go through it as a 1-byte element type and come back as bytes; zero copy)."""
    c = from_trtllm_pool(pool.view(torch.float8_e4m3fn), tokens_per_block=tokens_per_block, num_kv_heads=heads,
                         head_dim=row_bytes, layer=layer_in_pool)
    return c.k.tensor.view(torch.uint8)


def _nvfp4_layer(data: torch.Tensor, scales: torch.Tensor, li: int, t: int, h: int, d: int, g: torch.Tensor,
                 flags: int) -> CacheDesc:
    """One layer of an NVFP4 pool: E2M1 data `[n, H, T, D/2]` and E4M3 scales `[n, H, T, D/16]` at the layer's
    pointers, K and V both addressed by the raw offsets; `g` = this layer's (Q, K, V) `kv_scale_quant_orig`."""
    kd = _byte_blocks(data, li, t, h, d // 2)
    ks = _byte_blocks(scales, li, t, h, d // 16)
    require(ks.shape[0] == kd.shape[0], Status.INVALID_ARGUMENT,
            f"the block-scale pool holds {ks.shape[0]} blocks after the layer pointer, the data pool {kd.shape[0]}")
    gk, gv = (g[i].expand(h).to(data.device).contiguous() for i in (1, 2))
    q = quant_desc(get_format("nvfp4"), d, ks, ks, gk, gv, flags=flags)
    pool = PoolDesc(memory_of(kd), h * t * d // 2, primary=kd)
    c = CacheDesc.from_torch(kd, kd, block_size=t, num_kv_heads=h, head_dim=d, k_layout=Layout.HND,
                             v_layout=Layout.HND, pool=pool, quant=q)
    format_of(c)  # the format's rules now, not at the first read (e.g. the interleave's block_size % 4)
    return c


def describe_trtllm_cache(pools: torch.Tensor | Sequence[torch.Tensor], offsets: torch.Tensor, *,
                          tokens_per_block: int, num_kv_heads: int | Sequence[int], head_dim: int,
                          pool_mapping: torch.Tensor | None = None,
                          secondary_pools: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
                          pool_pointers: torch.Tensor | None = None, kv_factor: int = 2, beam_width: int = 1,
                          kv_scale_quant_orig: torch.Tensor | Sequence[float] | None = None,
                          kv_scale_orig_quant: torch.Tensor | Sequence[float] | None = None,
                          scale_pools: torch.Tensor | Sequence[torch.Tensor] | None = None,
                          v_scale_layout: str = "interleaved") -> list[TrtllmLayer]:
    """Every layer of a TRT-LLM KV cache as a KVX cache + KV_OFFSETS table (zero copy), in model layer order.

    `pools[p]`: pool p `[num_blocks, layers_in_pool, kv_factor, H*T*D]` in the cache dtype (bf16 / fp16 / fp32 /
    fp8; NVFP4: uint8 `H*T*D/2` bytes); `offsets`: `kv_cache_block_offsets [num_pools, seqs * beam_width, 2,
    max_blocks]` int32 (one pool: `[seqs * beam_width, 2, max_blocks]` too); `pool_mapping`: `kv_cache_pool_mapping
    [num_layers, 2]` (default: one pool, its layers in order); `num_kv_heads`: one value or one per pool. FP8 pools
    need `kv_scale_quant_orig` (per layer; `kv_scale_orig_quant`, when given, is checked to be its inverse), which
    becomes the KVX FP8 per-head global scale of K and V. NVFP4 pools need `scale_pools` (the block-scale pools,
    `[num_blocks, layers_in_pool, kv_factor, H*T*D/16]` E4M3 bytes) and `kv_scale_quant_orig [num_layers, 3]`
    (Q, K, V); `v_scale_layout` says how the V scales were written: "interleaved" (by 4 tokens, TRT-LLM's
    trtllm-gen layout, recorded as `KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4`) or "linear" (releases before it). K-only
    / MLA pools (`kv_factor` 1) and NVFP4 host (secondary) pools are refused (UNSUPPORTED) with the reason.
    """
    tokens_per_block, head_dim = as_int(tokens_per_block, "tokens_per_block", 1), as_int(head_dim, "head_dim", 1)
    kv_factor, beam_width = as_int(kv_factor, "kv_factor", 1), as_int(beam_width, "beam_width", 1)
    prim = _as_list(pools, "pools")
    require(len(prim) > 0, Status.INVALID_ARGUMENT, "describe_trtllm_cache: no pool given")
    require(kv_factor == 2, Status.UNSUPPORTED,
            f"kv_factor {kv_factor}: K-only / MLA TRT-LLM caches hold one latent tensor per token, not K and V; "
            "KVX describes K/V caches")
    sec = _as_list(secondary_pools, "secondary_pools") or [None] * len(prim)
    require(len(sec) == len(prim), Status.INVALID_ARGUMENT, f"{len(sec)} secondary pools for {len(prim)} pools")
    require(all(t is None or isinstance(t, torch.Tensor) for t in sec), Status.INVALID_ARGUMENT,
            "secondary_pools must be tensors (None: no host pool)")
    for p, t in enumerate(prim):
        require(isinstance(t, torch.Tensor) and t.dim() == 4, Status.INVALID_ARGUMENT,
                f"pool {p} must be [num_blocks, layers_in_pool, kv_factor, H*T*D], got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        require(t.dtype in _PLAIN or t.dtype in _FP8 or t.dtype == _NVFP4, Status.UNSUPPORTED,
                f"pool {p} dtype {t.dtype}: served are bf16, fp16, fp32, fp8 and NVFP4 (uint8) TRT-LLM caches")
    require(len({t.dtype for t in prim}) == 1, Status.INVALID_ARGUMENT, "the pools hold different dtypes")
    nvfp4 = prim[0].dtype == _NVFP4
    sp = _nvfp4_scale_pools(scale_pools, prim, sec, head_dim, v_scale_layout) if nvfp4 else None
    require(nvfp4 or scale_pools is None, Status.INVALID_ARGUMENT,
            f"scale_pools are NVFP4's block scales; these pools hold {prim[0].dtype}")
    heads = _per_pool(num_kv_heads, len(prim), "num_kv_heads")
    _check_pointers(pool_pointers, prim, sec, sp)
    mapping = _mapping(pool_mapping, prim)
    o = _as_tensor(offsets, "offsets")
    if o.dim() == 3:
        require(len(prim) == 1, Status.INVALID_ARGUMENT, "offsets of several pools must be [num_pools, rows, 2, M]")
        o = o.unsqueeze(0)
    require(o.dim() == 4 and o.shape[0] == len(prim), Status.INVALID_ARGUMENT,
            f"offsets must be [num_pools={len(prim)}, seqs * beams, 2, max_blocks], got {tuple(o.shape)}")
    tables = [from_trtllm_offsets(o[p], beam_width=beam_width) for p in range(len(prim))]
    fp8 = _FP8.get(prim[0].dtype)
    scales = None
    if fp8 or nvfp4:
        scales = _layer_scales(kv_scale_quant_orig, kv_scale_orig_quant, len(mapping), 3 if nvfp4 else 1,
                               slice(1, 3) if nvfp4 else slice(0, 1))
    layers = []
    for layer, (p, li) in enumerate(mapping):
        if nvfp4:
            c = _nvfp4_layer(prim[p], sp[p], li, tokens_per_block, heads[p], head_dim, scales[layer],
                             _V_SCALE_FLAGS[v_scale_layout])
            layers.append(_layer(c, tables[p], p, li))
            continue
        c = from_trtllm_pool(prim[p], tokens_per_block=tokens_per_block, num_kv_heads=heads[p], head_dim=head_dim,
                             layer=li, kv_factor=kv_factor, secondary_pool=sec[p])
        layers.append(_layer(_with_fp8_scale(c, fp8, scales[layer, 0]) if fp8 else c, tables[p], p, li))
    return layers


def _nvfp4_scale_pools(scale_pools, prim: list[torch.Tensor], sec: list[torch.Tensor | None], head_dim: int,
                       v_scale_layout: str) -> list[torch.Tensor]:
    """The block-scale pools of NVFP4 pools as uint8, one per pool and shaped like its data pool with `H*T*D/16`
    bytes per block; KvxError for what KVX cannot describe exactly."""
    require(isinstance(v_scale_layout, str) and v_scale_layout in _V_SCALE_FLAGS, Status.INVALID_ARGUMENT,
            f"v_scale_layout must be one of {sorted(_V_SCALE_FLAGS)}, got {v_scale_layout!r}")
    require(head_dim % 16 == 0, Status.INVALID_ARGUMENT,
            f"NVFP4 head_dim must be a multiple of 16 (one E4M3 scale per 16 elements), got {head_dim}")
    require(all(s is None for s in sec), Status.UNSUPPORTED,
            "NVFP4 host (secondary) pools: their block scales live in a secondary block-scale pool, which a KVX v1.1 "
            "cache descriptor cannot name; describe caches whose blocks are on the GPU")
    sp = _as_list(scale_pools, "scale_pools")
    require(len(sp) == len(prim), Status.INVALID_ARGUMENT,
            f"NVFP4 (uint8) pools need scale_pools, the block-scale pools: {len(sp)} given for {len(prim)} pools")
    out = []
    for p, (data, s) in enumerate(zip(prim, sp, strict=True)):
        require(isinstance(s, torch.Tensor) and s.dtype in (torch.uint8, torch.float8_e4m3fn), Status.INVALID_ARGUMENT,
                f"scale pool {p} must be a uint8 / float8_e4m3fn tensor")
        want = (*data.shape[:3], data.shape[3] // (head_dim // 2) * (head_dim // 16))
        require(tuple(s.shape) == want and s.is_contiguous() and s.device == data.device, Status.INVALID_ARGUMENT,
                f"scale pool {p} must be a contiguous {list(want)} tensor on {data.device} (data pool "
                f"{list(data.shape)}: one E4M3 byte per 16 elements), got {list(s.shape)} on {s.device}")
        out.append(s.view(torch.uint8))
    return out


def layer_views(pool: torch.Tensor, *, tokens_per_block: int, num_kv_heads: int, head_dim: int,
                kv_scale_quant_orig: torch.Tensor | Sequence[float] | None = None) -> list[CacheDesc]:
    """Each layer of one primary pool `[num_blocks, num_layers, 2, H*T*D]` as strided HND K/V views (zero copy):
    block ids are memory-pool block indices and slot = block * tokens_per_block + position, as vLLM's (what the
    bundle handoff reads and writes). bf16 / fp16 / fp32 pools, and FP8 pools with their per-layer
    `kv_scale_quant_orig` (the layers' KVX global scales). NVFP4 pools are refused: their block scales live in
    another pool."""
    require(isinstance(pool, torch.Tensor) and pool.dim() == 4, Status.INVALID_ARGUMENT,
            f"a TRT-LLM primary pool is [num_blocks, num_layers, kv_factor, H*T*D], got "
            f"{tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__}")
    fp8 = _FP8.get(pool.dtype)
    if pool.dtype not in _PLAIN and not fp8:
        raise KvxError(Status.UNSUPPORTED, f"pool dtype {pool.dtype}: per-layer views serve bf16 / fp16 / fp32 / fp8 "
                       "pools (an NVFP4 pool's block scales are in a block-scale pool: use describe_trtllm_cache)")
    require(pool.shape[2] == 2, Status.UNSUPPORTED,
            f"kv_factor {pool.shape[2]}: K-only / MLA TRT-LLM caches hold no separate V")
    require(fp8 is not None or kv_scale_quant_orig is None, Status.INVALID_ARGUMENT,
            f"kv_scale_quant_orig is for FP8 pools; this pool holds {pool.dtype}")
    views = [from_trtllm_layer(pool, i, tokens_per_block=tokens_per_block, num_kv_heads=num_kv_heads,
                               head_dim=head_dim) for i in range(pool.shape[1])]
    if not fp8:
        return views
    scales = _layer_scales(kv_scale_quant_orig, None, len(views), 1, slice(0, 1))
    return [_with_fp8_scale(c, fp8, scales[i, 0]) for i, c in enumerate(views)]
