"""Bundles between engines' real cache layouts (CPU, the adapters' zero-copy descriptors over tensors allocated as
each engine allocates them): vLLM (flash_attn NHD, flashinfer HND, the legacy x-packed paged cache, FP8 as
uint8, and the KVX plugin's `kvx_*` pages), TGI (flashinfer, paged), TensorRT-LLM (the [blocks, layers, 2, H*T*D]
primary pool), FlashInfer (HND) and KVX pages (NVFP4, INT4 rotated). Every ordered pair: the destination's gathered K/V
equal what writing the source's gathered K/V into it gives (bit for bit), and the same format with the same scales moves
bytes as they are."""
from __future__ import annotations

import importlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest
import torch

from kvx_adapters import flashinfer, tgi, trtllm, vllm
from kvx_core.cache import PagedKVCache
from kvx_core.codec import format_of
from kvx_core.descriptors import BlockTable, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from kvx_core.formats import get_format
from kvx_core.ops import reference
from kvx_core.transfer import ModelFingerprint, export_bundle, import_bundle
from kvx_core.transfer.rows import read_rows

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "kvx_vllm"
if importlib.util.find_spec("kvx_vllm") is None:  # the main venv does not install the plugin; pages needs no vLLM
    sys.path.insert(0, str(PLUGIN))
pages = importlib.import_module("kvx_vllm.pages")

LAYERS, H, D, N = 2, 2, 64, 6
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {"rope_theta": 1e4}, "c" * 64, "t" * 64)
TOKENS = 37


def _vllm_flash(bs, layout="NHD", dtype=torch.bfloat16):
    storage = torch.uint8 if dtype.itemsize == 1 else dtype
    if layout == "NHD":
        t = torch.zeros(2, N, bs, H, D, dtype=storage)
    else:
        t = torch.zeros(2, N, H, bs, D, dtype=storage).permute(0, 1, 3, 2, 4)
    return vllm.from_vllm_kv_cache(t, backend="flash_attn", cache_dtype=dtype if dtype.itemsize == 1 else None)


def _vllm_flashinfer_hnd(bs):
    t = torch.zeros(N, 2, H, bs, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    return vllm.from_vllm_kv_cache(t, backend="flashinfer")


def _vllm_026_packed_nhd(bs):
    """vLLM 0.26 FlashAttention: (blocks, heads, block_size, 2 * head_size), NHD stride order, K|V in each row."""
    return vllm.from_vllm_packed_kv_cache(torch.zeros(N, bs, H, 2 * D, dtype=torch.bfloat16).permute(0, 2, 1, 3))


def _vllm_paged(bs):
    x = 16 // 2
    return vllm.from_vllm_paged(torch.zeros(N, H, D // x, bs, x, dtype=torch.float16), torch.zeros(N, H, D, bs,
                                                                                                 dtype=torch.float16))


def _tgi(bs, attention):
    return tgi.from_tgi_kv_cache((torch.zeros(N, bs, H, D, dtype=torch.bfloat16),
                                  torch.zeros(N, bs, H, D, dtype=torch.bfloat16)), attention=attention)


def _trtllm(bs):
    """Both layers over one unique primary pool, as TRT-LLM allocates it."""
    pool = torch.zeros(N, LAYERS, 2, H * bs * D, dtype=torch.float16)
    return [trtllm.from_trtllm_layer(pool, layer, tokens_per_block=bs, num_kv_heads=H, head_dim=D)
            for layer in range(LAYERS)]


def _flashinfer_hnd(bs):
    return flashinfer.from_flashinfer_paged_kv_cache(torch.zeros(N, 2, H, bs, D, dtype=torch.bfloat16), "HND")


def _kvx(bs, fmt):
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=N, block_size=bs, num_kv_heads=H, head_dim=D,
                     page_buffer=True)
    return [c.descriptor(i) for i in range(LAYERS)]


def _vllm_kvx_pages(bs, name):
    """The vLLM plugin's pages for `--kv-cache-dtype kvx_*`: one uint8 [blocks, 1, block_size, C] tensor per layer,
    the global scales a 1-element 1.0 as the plugin passes them without checkpoint scales."""
    fmt = get_format(name)
    t = torch.zeros(N, 1, bs, pages.token_bytes(fmt, H, D), dtype=torch.uint8)
    one = torch.ones(1)
    return pages.page_cache_desc(t, fmt, H, D, one if fmt.k.uses_global_scale else None,
                                 one if fmt.v.uses_global_scale else None)


def _per_layer(make):
    return lambda bs: [make(bs) for _ in range(LAYERS)]


ENGINES = {
    "vllm_flash_attn_bf16": (8, _per_layer(_vllm_flash)),
    "vllm_flash_attn_fp8": (16, _per_layer(lambda bs: _vllm_flash(bs, dtype=torch.float8_e4m3fn))),
    "vllm_flashinfer_hnd": (16, _per_layer(_vllm_flashinfer_hnd)),
    "vllm_paged_fp16": (16, _per_layer(_vllm_paged)),
    "vllm_026_flash_packed": (32, _per_layer(_vllm_026_packed_nhd)),
    "tgi_flashinfer": (8, _per_layer(lambda bs: _tgi(bs, "flashinfer"))),
    "trtllm_pool_fp16": (8, _trtllm),
    "flashinfer_hnd": (16, _per_layer(_flashinfer_hnd)),
    "kvx_nvfp4": (16, lambda bs: _kvx(bs, "nvfp4")),
    "vllm_kvx_nvfp4_pages": (16, _per_layer(lambda bs: _vllm_kvx_pages(bs, "nvfp4"))),
    "vllm_kvx_k8v4_pages": (16, _per_layer(lambda bs: _vllm_kvx_pages(bs, "k8v4"))),
    "kvx_int4_rot": (8, lambda bs: _kvx(bs, "int4_rot")),
}


def _make(name):
    bs, make = ENGINES[name]
    return bs, make(bs)


def _table(bs, seed):
    blocks = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:(TOKENS + bs - 1) // bs]
    pos = torch.arange(TOKENS)
    return blocks.to(torch.int32).view(1, -1), blocks[pos // bs] * bs + pos % bs


def _gather(desc, table):
    io_ = reference.gather_kv(desc, GatherDesc(BlockTable.packed(table), SeqLens(torch.tensor([TOKENS])), TOKENS),
                              out_dtype=torch.float32)
    return io_.key, io_.value


def _fill(descs, slots, seed):
    g = torch.Generator().manual_seed(seed)
    for d in descs:
        k, v = torch.randn(TOKENS, H, D, generator=g) * 0.5, torch.randn(TOKENS, H, D, generator=g) * 0.5
        reference.write_kv(d, WriteDesc(KvIoDesc(k, v), SlotMapping(slots)))


@pytest.mark.parametrize("dst_name", sorted(ENGINES))
@pytest.mark.parametrize("src_name", sorted(ENGINES))
def test_handoff_between_engine_layouts(src_name, dst_name):
    sbs, src = _make(src_name)
    stable, sslots = _table(sbs, 1)
    _fill(src, sslots, 2)
    buf = io.BytesIO()
    export_bundle(buf, src, sslots, model=MODEL)
    dbs, dst = _make(dst_name)
    dtable, dslots = _table(dbs, 3)
    import_bundle(io.BytesIO(buf.getvalue()), dst, dslots, model=MODEL)
    _, oracle = _make(dst_name)
    for layer in range(LAYERS):
        k, v = _gather(src[layer], stable)
        reference.write_kv(oracle[layer], WriteDesc(KvIoDesc(k, v), SlotMapping(dslots)))
        got, want = _gather(dst[layer], dtable), _gather(oracle[layer], dtable)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (src_name, dst_name, layer)
        if format_of(src[layer]) == format_of(dst[layer]):  # same format, default scales: the stored bytes move
            a, b = read_rows(src[layer], sslots), read_rows(dst[layer], dslots)
            assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
