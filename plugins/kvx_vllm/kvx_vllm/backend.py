"""The KVX attention backend for vLLM (0.26-0.33; see `compat`): page geometry, metadata builder,
cache write, attention.

Writes go through `kvx_core.ops.dispatch.write_kv` (quantize into the page's data and scale regions at
the slot mapping) and attention through a `dispatch.AttentionPlan` that the metadata builder makes once per
step (`plan_decode` / `plan_prefill`: backend, splits, work list, workspace, int32 tables) and every layer
runs over its own pages, writing into vLLM's output buffer: on CUDA pages the fused write, CUDA/Triton decode
and Triton prefill kernels (sync-free: vLLM owns its slot mappings and block tables, `max_seq_len` and the host
copy of `query_start_loc` come from its metadata), on CPU the torch reference ops. Uniform steps of 1 + k tokens
per request (speculative decoding's verification, k <= num_speculative_tokens) take the decode plan with
`rows_per_seq = 1 + k` (each token attends its causal prefix of the pages). Other steps with prompt tokens run
the split prefill of `prefill` (new tokens by FlashAttention, cached prefix by KVX, merged) unless the run
asks for `{"kvx": {"prefill": "cache"}}`. Sliding-window layers (Mistral's `sliding_window`, Gemma 2/3 and
gpt-oss `layer_types`): vLLM gives each KV cache group its own builder, so a window group plans its steps with
its window (`window_of`) and frees the blocks that fall out of it (KVX never reads them, `ops.attention`). Attention
sinks (gpt-oss: the impl's `sinks`, one logit per query head and layer) are checked once when the weights are loaded and
given to each layer's run of the step's plan (`AttentionPlan.run`'s `sinks`, `SplitPrefill.run`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from kvx_adapters.vllm import block_table_from_vllm, seq_lens_from_vllm, slot_mapping_from_vllm
from kvx_core.calibration import amax_from_checkpoint, global_scale_for_amax
from kvx_core.descriptors import CacheDesc, KvIoDesc, WriteDesc
from kvx_core.formats import CacheFormat, get_format
from kvx_core.ops import backends
from kvx_core.ops.attention import check_sinks, sink_values
from kvx_core.ops.dispatch import AttentionPlan, BoundLayer, bind, plan_decode, plan_prefill, write_kv
from kvx_core.ops.warmup import warm_up_prefill

from .calibration import layer_values
from .dtypes import KVX_CACHE_DTYPES, is_kvx_dtype
from .options import check_config, options_of
from .pages import PAGE_BLOCK_ALIGN, page_cache_desc, token_bytes
from .prefill import DENSE_MIN_QUERY, DensePrefix, SplitPrefill, dense_rows

_run: dict[str, CacheFormat] = {}
"""The format of this process's run, recorded when its layers are built (inside vLLM's config context)
for `customize_spec`, which vLLM calls outside that context."""


def _run_format() -> CacheFormat:
    """The KVX format of the run being configured (startup checks included), or of the last one built."""
    cfg = get_current_vllm_config_or_none()
    if cfg is not None and is_kvx_dtype(cfg.cache_config.cache_dtype):
        _run["format"] = get_format(check_config(cfg))
    if "format" not in _run:
        raise RuntimeError("KVX backend used outside a vLLM run with a kvx_* --kv-cache-dtype")
    return _run["format"]


def window_of(sliding_window: int | None) -> int | None:
    """KVX's `window` (FlashInfer's `window_left`: a query at position p sees keys p - window .. p) for vLLM's
    `sliding_window` (the window's length in tokens, the query's own included): `sliding_window - 1`, as vLLM's
    FlashAttention backend passes `window_size = (sliding_window - 1, 0)` (vllm/v1/attention/backends/flash_attn.py,
    `FlashAttentionImpl.__init__`) and its SlidingWindowManager keeps the last `sliding_window - 1` computed tokens
    for the next one (`get_num_skipped_tokens`, vllm/v1/core/single_type_kv_cache_manager.py). None: no window."""
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
        raise ValueError(f"KVX attention backend: sliding_window must be a positive int, got {sliding_window!r}")
    return sliding_window - 1


class KvxAttentionBackend(AttentionBackend):
    """Paged attention over KVX-quantized pages (one page = K/V payload + scales of one block)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KVX_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[KvxAttentionImpl]:
        return KvxAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvxMetadataBuilder]:
        return KvxMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Sliding-window layers: every KVX attention path takes the window (`window_of`)."""
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        """Attention sinks (gpt-oss): every KVX attention path joins them (`kvx_core.ops.attention`)."""
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """vLLM 0.28+: no. The builder plans each step from the host copy of the query lengths
        (`query_start_loc_cpu`, `max_query_len`), so adaptive verification, which trims drafts on the device, is
        refused by vLLM's `validate_configuration` instead of running a stale plan."""
        return False

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(PAGE_BLOCK_ALIGN)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        """vLLM 0.29+ (layout page model): one head slot per page, so every layout keeps a page contiguous;
        prefer vLLM CPU's default."""
        from vllm.v1.kv_cache_interface import KVCacheLayout

        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """vLLM 0.26-0.28: each layer's pages as `[num_blocks, 1, block_size, token_bytes]` bytes (the page the
        `KvxFullAttentionSpec` of `spec026` sized; vLLM passes "auto" as the dtype of specs it does not
        know as quantized, so the format is the run's)."""
        return (num_blocks, 1, block_size, token_bytes(_run_format(), num_kv_heads, head_size))

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """vLLM 0.28+: one head slot of `num_kv_heads * bytes_per_token_head` bytes per token, so a block is
        one page."""
        if spec.state_content_bytes is not None:
            return spec
        fmt = _run_format()
        return replace(spec, dtype=torch.uint8, num_head_slots=1,
                       state_content_bytes=token_bytes(fmt, spec.num_kv_heads, spec.head_size))


DENSE_PREFIX_BYTES = 128 << 20
"""The dense prefix route's K + V buffer per KV cache group (`KvxMetadataBuilder._dense_buffer`): 32,768 prefix tokens
a step at 8 KV heads x 128 in BF16, reserved at startup outside vLLM's `gpu_memory_utilization` (as the decode
workspace). Prefixes beyond it in one step stay on the fused kernel."""


@dataclass
class KvxMetadata:
    """Per-step attention metadata: the step's plan holds the tables and lengths (vLLM hands each layer's write
    its slot mapping itself); query rows beyond `num_actual_tokens` are padding."""

    num_actual_tokens: int
    plan: AttentionPlan | SplitPrefill  # this step's attention, run by every layer


class KvxMetadataBuilder(AttentionMetadataBuilder[KvxMetadata]):
    """Slices vLLM's common metadata to the live requests and plans the step's attention once for all layers
    of the group (they must share sm_scale, softcap and sliding window, as FlashInfer's plan requires: vLLM
    groups layers by window); checks the run's config at startup.

    CUDA graphs (uniform decode batches: 1 token per request, or 1 + num_speculative_tokens with speculative
    decoding, whose capture sizes vLLM rounds to multiples of that): a captured step replays the kernels with the
    addresses and split counts of its capture, so everything a plan hands the kernels must outlive the step at a
    fixed address: vLLM's persistent block table / seq_lens / slot mapping buffers (narrowed without copies) and the
    split workspace, one buffer allocated here for the largest batch and context the run can see, which also holds
    the per-row lengths of multi-row steps (computed by the plan, on the device, before the graph replays).

    No `reorder_batch_threshold` (as vLLM's FlashAttention backend): the decode plan serves whole uniform batches
    only (`decode_rows`), never a decode part split off a mixed batch, so reordering would buy nothing."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.format = get_format(check_config(vllm_config))
        prefill = options_of(vllm_config).prefill
        self.split_prefill = prefill in ("split", "split_fused")
        self.dense_prefixes = prefill == "split"
        impls = [layer.impl for layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase,
                                                                     layer_names).values()]
        params = {(impl.scale, impl.softcap, impl.window, impl.num_heads) for impl in impls}
        if len(params) > 1:
            raise ValueError(f"KVX attention backend: the layers of one KV cache group must share sm_scale, "
                             f"logits_soft_cap, sliding window and query heads, got (scale, softcap, window_left, "
                             f"heads) {sorted(params, key=str)}")
        self.sm_scale, self.softcap, self.window, heads = params.pop() if params else (None, None, None, None)
        # query heads of the group's layers (this rank's), not of the target's config: vLLM builds an EAGLE head's
        # builder with the target's vllm_config, for the head's own layers
        self.num_qo_heads = heads or vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.q_dtype = vllm_config.model_config.dtype
        self.max_model_len = vllm_config.model_config.max_model_len
        self.graph_sizes = sorted(vllm_config.compilation_config.cudagraph_capture_sizes or [])
        spec = vllm_config.speculative_config
        self.decode_rows = 1 + (getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 1
        """The most query tokens per request a uniform step runs as a decode (1 + num_speculative_tokens)."""
        self.workspace = None
        if device.type == "cuda":
            from kvx_core.ops.decode import workspace_size

            n = workspace_size(self.format, max_batch=vllm_config.scheduler_config.max_num_seqs,
                               num_qo_heads=self.num_qo_heads, num_kv_heads=kv_cache_spec.num_kv_heads,
                               head_dim=kv_cache_spec.head_size, block_size=kv_cache_spec.block_size,
                               q_dtype=self.q_dtype, device=device,
                               max_seq_len=self.max_model_len, rows_per_seq=self.decode_rows)
            self.workspace = torch.empty(n, dtype=torch.float32, device=device)
        geometry = backends.Geometry(self.num_qo_heads, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size,
                                     kv_cache_spec.block_size, self.q_dtype, vllm_config.scheduler_config.max_num_seqs)
        log = init_logger("vllm.plugins.kvx")
        log.info("KVX attention backend: format %s for %d layers in pid %d on %s: %s", self.format.name,
                 len(layer_names), os.getpid(), device, backends.summary(self.format, device, geometry))
        if device.type == "cuda" and self.split_prefill:
            t = time.perf_counter()
            if self._warm_up(kv_cache_spec, device):
                log.info("KVX: split-prefill kernels compiled for this group in %.1f s", time.perf_counter() - t)
        self.dense_kv = self._dense_buffer(kv_cache_spec, impls, device)
        if self.dense_kv is not None:
            log.info("KVX: dense prefixes for requests with >= %d new tokens, up to %d prefix tokens per step "
                     "(%.0f MiB reserved)", DENSE_MIN_QUERY, self.dense_kv[0].shape[0],
                     2 * self.dense_kv[0].numel() * self.dense_kv[0].element_size() / 2**20)

    def _dense_buffer(self, spec: AttentionSpec, impls: list, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dense prefix route's K / V buffer (`prefill.DensePrefix`), `DENSE_PREFIX_BYTES` for both, reserved
        once like the decode workspace; None where the route does not serve this group: off CUDA, the "cache" and
        "split_fused" prefills, sliding windows, rotated formats and layers whose keys a calibration smooths or
        centers."""
        transformed = any(v is not None and (v[0] is not None or v[1] is not None)
                          for impl in impls for v in (getattr(impl, "_calibration", None) or ()))
        if device.type != "cuda" or not self.dense_prefixes or self.window is not None or self.format.rotate \
                or transformed:
            return None
        tokens = DENSE_PREFIX_BYTES // (2 * spec.num_kv_heads * spec.head_size * self.q_dtype.itemsize)
        shape = (tokens, spec.num_kv_heads, spec.head_size)
        return (torch.empty(shape, dtype=self.q_dtype, device=device),
                torch.empty(shape, dtype=self.q_dtype, device=device))

    def _warm_up(self, spec: AttentionSpec, device: torch.device) -> int:
        """Compile the split prefill's KVX kernels for this group's layers now (`kvx_core.ops.warmup`), over a
        one-block scratch page of the run's page layout: vLLM builds its metadata builders at startup, before its
        CUDA-graph capture, so the first prefix-cache hit no longer waits for Triton's compiler (it did in every run
        on the H200 before this). Returns the kernel launches made (0: no kernel serves this group)."""
        fmt = self.format
        pages = torch.zeros(1, 1, spec.block_size, token_bytes(fmt, spec.num_kv_heads, spec.head_size),
                            dtype=torch.uint8, device=device)
        ones = torch.ones(spec.num_kv_heads, dtype=torch.float32, device=device)
        desc = page_cache_desc(pages, fmt, spec.num_kv_heads, spec.head_size,
                               ones if fmt.k.uses_global_scale else None, ones if fmt.v.uses_global_scale else None)
        return warm_up_prefill(desc, num_qo_heads=self.num_qo_heads, q_dtype=self.q_dtype, sm_scale=self.sm_scale,
                               softcap=self.softcap, window=self.window)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvxMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        spec = self.kv_cache_spec
        lens, table = seq_lens_from_vllm(m.seq_lens, n), block_table_from_vllm(m.block_table_tensor, n)
        geometry = dict(fmt=self.format, num_qo_heads=self.num_qo_heads, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_size, block_size=spec.block_size, q_dtype=self.q_dtype,
                        device=self.device, sm_scale=self.sm_scale, softcap=self.softcap, window=self.window,
                        check=False)
        rows = m.max_query_len
        if 1 <= rows <= self.decode_rows and m.num_actual_tokens == n * rows:
            # every request has `rows` new tokens (speculative decoding: 1 + k; also vLLM's graph padding, whose
            # requests have length 0 and attend nothing); splits sized for the longest context the run allows and
            # for the CUDA-graph bucket (in tokens) vLLM pads this batch to, not for this step's lengths and batch:
            # a graph replays the splits of its capture (whatever lengths vLLM captured with), and eager steps then
            # split alike, so graph and eager decode sum in the same order (each split reads its own row length)
            plan = plan_decode(table, lens, max_seq_len=self.max_model_len, workspace=self.workspace,
                               split_batch=next((b for b in self.graph_sizes if b >= n * rows), n * rows),
                               rows_per_seq=rows, **geometry)
        elif self.split_prefill:
            plan = self._split_prefill(m, table, geometry)
        else:
            plan = plan_prefill(m.query_start_loc_cpu[:n + 1], table, lens, max_seq_len=m.max_seq_len, **geometry)
        return KvxMetadata(m.num_actual_tokens, plan)

    def _split_prefill(self, m: CommonAttentionMetadata, table, geometry: dict) -> SplitPrefill:
        """New tokens over themselves (FlashAttention) + over the cached prefix, merged (`prefill`): the prefixes
        of requests with many new tokens dense (`prefill.DensePrefix`), the others on KVX's prefix plan, which places
        each request's queries right after its prefix, so a window counts from their positions."""
        n = m.num_reqs
        cu = m.query_start_loc[:n + 1]
        starts = m.query_start_loc_cpu[:n + 1].tolist()
        query_lens = cu[1:] - cu[:-1]
        prefix_lens = m.seq_lens[:n] - query_lens  # on the device: no sync
        bounds = self._prefix_bounds(m, starts)
        rows = dense_rows([b - a for a, b in pairwise(starts)], bounds, self.dense_kv[0].shape[0]) \
            if bounds is not None else [False] * n
        dense = self._dense_prefix(m, rows, bounds, starts, query_lens, prefix_lens, table) if any(rows) else None
        prefix = None
        if bounds is None or any(b > 0 and not r for b, r in zip(bounds, rows, strict=True)):
            if dense is not None:
                prefix_lens = torch.where(dense.lens > 0, 0, prefix_lens)
            prefix = plan_prefill(m.query_start_loc_cpu[:n + 1], table, seq_lens_from_vllm(prefix_lens, n),
                                  causal=False, queries_after=True, max_seq_len=m.max_seq_len,
                                  **geometry)  # max_seq_len bounds the prefixes: sizes the key splits
        scale = self.sm_scale if self.sm_scale is not None else self.kv_cache_spec.head_size ** -0.5
        return SplitPrefill(prefix, cu, starts, m.max_query_len, scale, self.softcap, self.window, dense)

    def _prefix_bounds(self, m: CommonAttentionMetadata, starts: list[int]) -> list[int] | None:
        """Host upper bounds of the requests' cached prefixes (vLLM's `seq_lens_cpu_upper_bound`, exact for prefill
        rows, less the new tokens), or None where the dense route does not serve (no buffer, or no bound)."""
        upper = getattr(m, "seq_lens_cpu_upper_bound", None)
        if self.dense_kv is None or upper is None:
            return None
        return [int(u) - (b - a) for u, (a, b) in zip(upper[:m.num_reqs].tolist(), pairwise(starts), strict=True)]

    def _dense_prefix(self, m: CommonAttentionMetadata, rows: list[bool], bounds: list[int], starts: list[int],
                      query_lens: torch.Tensor, prefix_lens: torch.Tensor, table) -> DensePrefix:
        """The step's dense piece over the chosen `rows`: their prefix lengths and row offsets on the device (no
        sync: the host bounds size the buffer and the gather's length cut), the query rows it leaves empty."""
        n, dev = m.num_reqs, m.seq_lens.device
        lens = torch.where(torch.tensor(rows, device=dev), prefix_lens, 0).to(torch.int32)
        cu_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        torch.cumsum(lens, 0, out=cu_k[1:])
        empty = torch.ones(m.num_actual_tokens, dtype=torch.bool, device=dev)  # rows past the requests: padding
        empty[:starts[-1]] = torch.repeat_interleave(lens == 0, query_lens, output_size=starts[-1])
        taken = [b for b, r in zip(bounds, rows, strict=True) if r]
        k, v = self.dense_kv
        return DensePrefix(table.indices, lens, cu_k, max(taken), k[:sum(taken)], v[:sum(taken)], empty)


class KvxAttentionImpl(AttentionImpl[KvxMetadata]):
    """Writes K/V into KVX pages and attends over them (decoder self-attention)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 **extra) -> None:
        unsupported = {
            "attention type " + str(attn_type): attn_type != AttentionType.DECODER,
            "ALiBi": alibi_slopes is not None,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            "extra attention arguments " + str(sorted(k for k, v in extra.items() if v is not None)):
                any(v is not None for v in extra.values()),
        }
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise ValueError(f"KVX cache dtype {kv_cache_dtype}: this model needs {', '.join(refused)}, which the "
                             "KVX vLLM backend does not serve (not verified); use another --kv-cache-dtype")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.softcap = logits_soft_cap or None
        self.sliding_window = sliding_window  # vLLM's, as its impls keep it
        self.window = window_of(sliding_window)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.format = _run_format()
        self.format.check_head_dim(head_size)
        check_sinks(sinks, "KVX attention sinks", num_heads)  # their values are loaded later
        self.sinks = sinks  # vLLM's parameter, as vLLM's own impls keep it
        self._sinks: torch.Tensor | None = None  # FP32 [Hq] on the layer's device: process_weights_after_loading
        self._desc: tuple[tuple, CacheDesc, CacheDesc | BoundLayer] | None = None
        self._quant: tuple[torch.Tensor | None, ...] | None = None
        cfg = get_current_vllm_config_or_none()  # layers are built inside the run's config: startup refusals here
        self._calibration = (None if cfg is None else  # this tensor-parallel rank's KV heads of the file
                             layer_values(cfg, self.format, num_kv_heads, softcap=self.softcap))

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """The layer's sinks, now loaded, as KVX computes with them (FP32 `[Hq]` contiguous on their device) and
        checked once, here (finite: a host sync no step makes)."""
        if self.sinks is not None:
            self._sinks = sink_values(self.sinks, self.num_heads, self.sinks.device, "KVX attention sinks")

    # ------------------------------------------------------------ cache view
    def _layer_quant(self, layer: AttentionLayer, device: torch.device):
        """The layer's FP32 (k_global, v_global, k_smoothing, k_center) on `device`: from the run's KV calibration
        file when it has one (`calibration`; its scales replace a checkpoint's k_scale / v_scale, logged), else the
        checkpoint's k_scale / v_scale when it declares KV cache scales (vLLM loads them into the layer), else
        1.0 (the formats' default) and no smoothing or centering."""
        if self._quant is None:
            fmt = self.format
            ckpt = isinstance(getattr(layer, "quant_method", None), BaseKVCacheMethod)
            s = c = k = v = None
            if self._calibration is not None:
                from vllm.model_executor.models.utils import extract_layer_index

                s, c, k, v = self._calibration[extract_layer_index(layer.layer_name)]
                if ckpt and (k is not None or v is not None):
                    init_logger("vllm.plugins.kvx").info_once(
                        "KVX: the KV calibration file's global scales replace the checkpoint's k_scale / v_scale")
            if k is None and v is None and ckpt:
                sd = {"layers.0.k_scale": layer._k_scale.detach().cpu(),
                      "layers.0.v_scale": layer._v_scale.detach().cpu()}
                amax = amax_from_checkpoint(sd, 1)[0]
                k, v = global_scale_for_amax(fmt.k, amax[0]), global_scale_for_amax(fmt.v, amax[1])
            elif k is None and v is None:
                ones = torch.ones(1, dtype=torch.float32)
                k, v = (ones if fmt.k.uses_global_scale else None), (ones if fmt.v.uses_global_scale else None)
            # bound once: FP32 [H_kv] global scales on the device, so no step copies or expands them
            self._quant = tuple(None if t is None else t.to(device=device, dtype=torch.float32).contiguous()
                                for t in (None if k is None else k.reshape(-1).expand(self.num_kv_heads),
                                          None if v is None else v.reshape(-1).expand(self.num_kv_heads), s, c))
        return self._quant

    def cache_desc(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> CacheDesc:
        """The layer's pages as a KVX descriptor (made when vLLM hands over the cache tensor, then kept)."""
        return self._bound(layer, kv_cache)[0]

    def _bound(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> tuple[CacheDesc, CacheDesc | BoundLayer]:
        """(descriptor, what the hot path runs on): the layer bound once (`dispatch.bind`: pools, scale arguments,
        global scales and key smoothing derived and checked when the cache is registered) where the kernels address
        it, else the descriptor (the reference serves it, e.g. on CPU)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), tuple(kv_cache.stride()))
        if self._desc is None or self._desc[0] != key:
            kg, vg, s, c = self._layer_quant(layer, kv_cache.device)
            desc = page_cache_desc(kv_cache, self.format, self.num_kv_heads, self.head_size, kg, vg,
                                   k_smoothing=s, k_center=c)
            self._desc = (key, desc, bind(desc) or desc)
        return self._desc[1], self._desc[2]

    # ------------------------------------------------------------ data path
    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize new K/V `[T, Hkv, D]` into the pages at `slot_mapping` (-1 = padding, skipped)."""
        n = min(key.shape[0], slot_mapping.numel())
        write = WriteDesc(KvIoDesc(key[:n], value[:n]), slot_mapping_from_vllm(slot_mapping, n))
        write_kv(self._bound(layer, kv_cache)[1], write, check=False)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KvxMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """`output[:num_actual_tokens] [T, Hq, D]` = attention of each request's new queries over its pages."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KVX backend: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        if self.sinks is not None and self._sinks is None:
            raise RuntimeError("KVX backend: attention sinks not prepared (vLLM did not call "
                               "process_weights_after_loading); refusing to attend without them")
        desc, bound = self._bound(layer, kv_cache)
        if isinstance(m.plan, SplitPrefill):
            m.plan.run(query[:n], key[:n], value[:n], desc, out, sinks=self._sinks, bound=bound)
        else:
            m.plan.run(query[:n], bound, out=out, want_lse=False, sinks=self._sinks)
        return output
