"""Independent torch re-statements of how each engine allocates, writes and reads its KV cache.

These are the oracles of the adapter tests: written from the engines' source (cited per function),
never from kvx_adapters or kvx_core. Each `*_write` stores K/V of tokens at slots the way the engine's
kernel does; each `*_read` fetches one token the way the engine's attention kernel addresses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------- workload
@dataclass
class Workload:
    """Sequences with random physical blocks, a padded int32 block table and shuffled tokens with padding."""

    lens: list[int]
    block_size: int
    num_blocks: int
    table: torch.Tensor  # int32 [S, M], padding entries hold stale (but valid) ids like vLLM's
    seq_ids: torch.Tensor  # int64 [T], -1 for padding tokens
    positions: torch.Tensor  # int64 [T], -1 for padding tokens
    slots: torch.Tensor  # int64 [T], -1 for padding tokens
    key: torch.Tensor  # [T, H, D]
    value: torch.Tensor

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of every valid token ordered by (sequence, position): what a KVX gather returns."""
        valid = self.seq_ids >= 0
        order = torch.argsort(self.seq_ids[valid] * (1 << 32) + self.positions[valid])
        return self.key[valid][order], self.value[valid][order]


def make_workload(gen: torch.Generator, lens: list[int], block_size: int, heads: int, head_dim: int,
                  dtype: torch.dtype, spare_blocks: int = 2, padding: int = 3) -> Workload:
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    m = max(need + [1]) + 1
    table = torch.randint(0, num_blocks, (len(lens), m), generator=gen).to(torch.int32)
    at = 0
    for s, k in enumerate(need):
        table[s, :k] = perm[at:at + k].to(torch.int32)
        at += k
    seq_ids = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, n in enumerate(lens)] +
                        [torch.full((padding,), -1, dtype=torch.int64)])
    positions = torch.cat([torch.arange(n) for n in lens] + [torch.full((padding,), -1, dtype=torch.int64)])
    shuffle = torch.randperm(seq_ids.numel(), generator=gen)
    seq_ids, positions = seq_ids[shuffle], positions[shuffle]
    ok = seq_ids >= 0
    blk = table.to(torch.int64)[seq_ids.clamp(min=0), positions.clamp(min=0) // block_size]
    slots = torch.where(ok, blk * block_size + positions % block_size, -1)
    key = rand(gen, (seq_ids.numel(), heads, head_dim), dtype)
    value = rand(gen, (seq_ids.numel(), heads, head_dim), dtype)
    return Workload(lens, block_size, num_blocks, table, seq_ids, positions, slots, key, value)


def rand(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- vLLM
def vllm_allocate(kind: str, layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int,
                  dtype: torch.dtype, num_layers: int = 0, layer: int = 0) -> torch.Tensor:
    """The per-layer tensor vLLM binds: raw bytes viewed in stride order, then `.permute(*inv_order)`.

    `vllm/v1/worker/gpu_model_runner.py` `_reshape_kv_cache_tensors`; shapes and stride orders from
    `flash_attn.py` / `flashinfer.py` `get_kv_cache_shape` / `get_kv_cache_stride_order` (with
    `num_layers`, flash_attn's cross-layer order `include_num_layers_dimension=True`).
    """
    n, b, h, d = num_blocks, block_size, heads, head_dim
    if num_layers:
        assert kind == "flash_attn"
        shape = (num_layers, 2, n, b, h, d)
        order = (2, 0, 1, 3, 4, 5) if layout == "NHD" else (2, 4, 0, 1, 3, 5)
    else:
        shape = (2, n, b, h, d) if kind == "flash_attn" else (n, 2, b, h, d)
        order = (0, 1, 2, 3, 4) if layout == "NHD" else (0, 1, 3, 2, 4)
    phys = tuple(shape[i] for i in order)
    inv = [order.index(i) for i in range(len(order))]
    numel = 1
    for x in phys:
        numel *= x
    es = torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(numel * es, dtype=torch.int8).view(dtype).view(phys).permute(*inv)
    return raw[layer] if num_layers else raw


def vllm_kv(kv_cache: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (kv_cache[0], kv_cache[1]) if kind == "flash_attn" else (kv_cache[:, 0], kv_cache[:, 1])


def vllm_reshape_and_cache_flash(key, value, key_cache, value_cache, slots):
    """`csrc/cache_kernels.cu` `reshape_and_cache_flash`: `cache[slot // B, slot % B, head, :] = x`
    through the tensor's strides; negative slots are skipped."""
    b = key_cache.shape[1]
    ok = slots >= 0
    blk, off = slots[ok] // b, slots[ok] % b
    key_cache[blk, off] = key[ok].to(key_cache.dtype)
    value_cache[blk, off] = value[ok].to(value_cache.dtype)


def vllm_flash_read(key_cache, value_cache, slots):
    b = key_cache.shape[1]
    return key_cache[slots // b, slots % b], value_cache[slots // b, slots % b]


def _packed_index(slots, h, d, b, x):
    """Flat element offsets of `reshape_and_cache`'s `tgt_key_idx` / `tgt_value_idx`, [T, H, D]."""
    blk, off = (slots // b).view(-1, 1, 1), (slots % b).view(-1, 1, 1)
    hh = torch.arange(h).view(1, -1, 1)
    dd = torch.arange(d).view(1, 1, -1)
    k_idx = blk * h * (d // x) * b * x + hh * (d // x) * b * x + (dd // x) * b * x + off * x + dd % x
    v_idx = blk * h * d * b + hh * d * b + dd * b + off
    return k_idx, v_idx


def vllm_reshape_and_cache(key, value, key_cache, value_cache, slots):
    """`csrc/cache_kernels.cu` `reshape_and_cache_kernel`: contiguous packed K `[N, H, D/x, B, x]`,
    V `[N, H, D, B]`, negative slots skipped. Also TGI's `paged` store (same kernel)."""
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    _, h, dx, b, x = key_cache.shape
    ok = slots >= 0
    k_idx, v_idx = _packed_index(slots[ok], h, dx * x, b, x)
    key_cache.view(-1)[k_idx.reshape(-1)] = key[ok].to(key_cache.dtype).reshape(-1)
    value_cache.view(-1)[v_idx.reshape(-1)] = value[ok].to(value_cache.dtype).reshape(-1)


def vllm_paged_read(key_cache, value_cache, slots):
    _, h, dx, b, x = key_cache.shape
    k_idx, v_idx = _packed_index(slots, h, dx * x, b, x)
    return key_cache.reshape(-1)[k_idx], value_cache.reshape(-1)[v_idx]


# ---------------------------------------------------------------- TGI
def tgi_store_nhd(key, value, key_cache, value_cache, slots):
    """`layers/attention/kv_cache.py` `KVCache.store` (flashinfer / flashdecoding):
    `key_cache.view(-1, H, D)[slots] = key` (TGI has no -1 padding)."""
    shape = key_cache.shape
    key_cache.view(-1, shape[-2], shape[-1])[slots] = key.to(key_cache.dtype)
    value_cache.view(-1, shape[-2], shape[-1])[slots] = value.to(value_cache.dtype)


def tgi_store_hnd(key, value, key_cache, value_cache, slots):
    """IPEX CPU `reshape_and_cache` on TGI's `(num_blocks, num_heads, BLOCK_SIZE, head_size)` caches."""
    b = key_cache.shape[2]
    ok = slots >= 0
    blk, off = slots[ok] // b, slots[ok] % b
    key_cache.permute(0, 2, 1, 3)[blk, off] = key[ok].to(key_cache.dtype)
    value_cache.permute(0, 2, 1, 3)[blk, off] = value[ok].to(value_cache.dtype)


# ---------------------------------------------------------------- FlashInfer
def flashinfer_append(key, value, k_cache, v_cache, kv_layout, batch_indices, positions, indptr, indices):
    """`flashinfer/page.py` `append_paged_kv_cache`: entry `(b, p)` lands in page
    `indices[indptr[b] + p // page_size]`, row `p % page_size` (NHD `[page, row, h]`, HND `[page, h, row]`)."""
    ps = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    page = indices.to(torch.int64)[indptr.to(torch.int64)[batch_indices] + positions // ps]
    row = positions % ps
    if kv_layout == "NHD":
        k_cache[page, row] = key.to(k_cache.dtype)
        v_cache[page, row] = value.to(v_cache.dtype)
    else:
        k_cache.permute(0, 2, 1, 3)[page, row] = key.to(k_cache.dtype)
        v_cache.permute(0, 2, 1, 3)[page, row] = value.to(v_cache.dtype)


def flashinfer_read(k_cache, v_cache, kv_layout, batch_indices, positions, indptr, indices):
    ps = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    page = indices.to(torch.int64)[indptr.to(torch.int64)[batch_indices] + positions // ps]
    row = positions % ps
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
    return k_cache[page, row], v_cache[page, row]


# ---------------------------------------------------------------- TensorRT-LLM
def trtllm_offset(mem_idx, num_layers: int, kv: int, secondary=False) -> torch.Tensor:
    """`kvCacheManager.cpp` `setOffsets`: `flat_index3(mem_idx, layerIdx=0, kv, numLayers, kvFactor=2)`,
    bit 31 for the secondary pool (`kvCacheIndex.h`), -1 (all bits) for null / negative ids."""
    m = torch.as_tensor(mem_idx, dtype=torch.int64)
    v = (m * num_layers) * 2 + kv
    v = torch.where(torch.as_tensor(secondary, dtype=torch.bool), v | (1 << 31), v)
    v = torch.where(m < 0, (1 << 32) - 1, v)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def _decode(offset: torch.Tensor):
    u = offset.to(torch.int64) & 0xFFFFFFFF
    return u & 0x7FFFFFFF, (u >> 31) == 1


def _trtllm_addresses(offsets, layer, num_layers, t, h, d, es, seq, beam, pos, kv):
    """Byte address of every `(token, head, dim, byte)` and its pool: `KVBlockArray::getBlockPtr` with the
    layer pool pointer `base + layer * kv_factor * bytes_per_block` (`attentionOp.cpp`), interior
    `getKVLocalIdx` = `(head * T + pos % T) * D + dim`."""
    bpb = t * h * d * es
    o = offsets[seq, beam, kv, pos // t]
    idx, secondary = _decode(o)
    hh = torch.arange(h).view(1, -1, 1, 1)
    dd = torch.arange(d).view(1, 1, -1, 1)
    bb = torch.arange(es).view(1, 1, 1, -1)
    local = ((hh * t + (pos % t).view(-1, 1, 1, 1)) * d + dd) * es + bb
    addr = layer * 2 * bpb + idx.view(-1, 1, 1, 1) * bpb + local
    return addr, secondary


def trtllm_write(prim_bytes, sec_bytes, offsets, layer, num_layers, t, key, value, seq, beam, pos):
    """Store K/V of tokens `(seq, beam, pos)` by raw byte arithmetic on flat uint8 pools."""
    _, h, d = key.shape
    es = key.element_size()
    for kv, x in ((0, key), (1, value)):
        addr, secondary = _trtllm_addresses(offsets, layer, num_layers, t, h, d, es, seq, beam, pos, kv)
        data = x.contiguous().view(torch.uint8).view(-1, h, d, es)
        for pool, sel in ((prim_bytes, ~secondary), (sec_bytes, secondary)):
            if bool(sel.any()):
                pool[addr[sel].reshape(-1)] = data[sel].reshape(-1)


def trtllm_read(prim_bytes, sec_bytes, offsets, layer, num_layers, t, h, d, dtype, seq, beam, pos):
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for kv in (0, 1):
        addr, secondary = _trtllm_addresses(offsets, layer, num_layers, t, h, d, es, seq, beam, pos, kv)
        data = torch.empty(addr.shape, dtype=torch.uint8)
        for pool, sel in ((prim_bytes, ~secondary), (sec_bytes, secondary)):
            if bool(sel.any()):
                data[sel] = pool[addr[sel]]
        out.append(data.reshape(-1, h, d * es).view(dtype).reshape(-1, h, d))
    return out[0], out[1]


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same memory seen the same way: shape, start and the strides of every dim longer than 1."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape, strict=True) if n > 1))


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind `t` as a flat uint8 tensor (the raw memory a C++ kernel sees)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
