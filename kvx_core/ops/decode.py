"""Paged decode on the GPU kernels: the one place that chooses the backend (the CUDA kernel in `ops/cuda` or
the Triton kernel in `ops/triton/decode.py`) and the number of KV splits (`plan_decode`, once per step), then
launches the chosen split-KV kernel and its split merge per layer (`DecodePlan.run`; the CUDA library merges in the
same call, the Triton decode through `ops/triton/merge.py`).
Hadamard formats: the kernels work in the rotated domain. The Triton path rotates q before the kernel and the merged
FP32 output back after it by `ops.rotation.rotate` (the one rotation every KVX path uses); the CUDA library does
both itself, in its one call, with the same math and bits (`paged_decode_mma.cu`'s `rotate_row`).

`ops.dispatch.paged_decode` calls `decode_pools` here for kernel-addressable caches; the benchmarks call it on
raw pools. Pools follow the storage contract of `ops/triton` (HND data `[num_blocks, H_kv, block_size, Dk]`,
uint8 scale pools, FP32 `[H_kv]` global scales, int32 block table `[B, max_blocks]`, int32 seq_lens `[B]`).

Multi-row decode (speculative decoding's verification step, `rows_per_seq = 1 + k`): the plan's `batch` counts
query rows; row r is token `t = r % rows_per_seq` of sequence `r // rows_per_seq`, whose last `rows_per_seq`
cached tokens are the step's new tokens (written before attention), so it attends causally to the first
`len - rows_per_seq + 1 + t` tokens of its sequence: `DecodePlan.row_lens` turns sequence lengths into these
per-row lengths once per step (on the device), and the kernels read block-table row `r // rows_per_seq` and the
row's own length. Every kernel of the one-row decode serves it unchanged otherwise (splits, merge, sinks, window:
the window counts back from the row's own position).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import config
from ..errors import KvxError, Status, require
from ..formats import CacheFormat
from .attention import check_rows_per_seq
from .checks import check_max_seq_len
from .cuda import Choice, choose, decode as cuda_decode
from .kernel_format import FormatCode, kernel_format
from .rotation import rotate
from .smoothing import scale_queries
from .triton import decode as triton_decode
from .triton.launch import (
    as_format,
    check_device,
    check_layer,
    check_plan,
    global_scale_arg,
    interpreting,
    pool_geometry,
    sm_count,
)
from .triton.merge import merge_splits

BACKENDS = ("auto", "cuda", "triton")


def triton_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device) -> int:
    """Splits per (sequence, KV head) of the Triton decode: ~4 programs per SM, but at least 1024 tokens per split
    (several key tiles each: fewer splits of more tiles beat many short ones once the SMs are busy, and short
    contexts gain nothing from splitting; benchmarks/results/decode_triton_splits_blockn_h200.jsonl).
    """
    target = 4 * sm_count(device)
    base = max(1, batch * num_kv_heads)
    by_len = max(1, math.ceil(max_seq_len / 1024))
    return int(max(1, min(math.ceil(target / base), by_len, 256)))


def cuda_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits per (sequence, KV head) of the CUDA decode: >= 9 CTAs per SM for large batches (4 resident per SM),
    ~4 per SM when there are fewer (sequence, KV head) pairs than SMs; at least 2 tiles per warp.

    H200, GQA 32/8, D=128: B=64 at 32k, 3 splits best (2: +1.5%, 1: +4%, 64: +15%;
    benchmarks/results/decode_cuda_cpasync_splits_h200.jsonl); B=1 at 32k, 64 splits (34 us) beat 32 (39 us) and
    16 (57 us) (benchmarks/results/decode_cuda_splits_warps_h200.jsonl).
    """
    base = max(1, batch * num_kv_heads)
    ctas = 4 * sm_count if base < sm_count else 9 * sm_count
    by_len = max(1, math.ceil(max_seq_len / (32 * cuda_decode.WARPS)))
    return int(max(1, min(math.ceil(ctas / base), by_len, 256)))


def choose_splits(backend: str, batch: int, num_kv_heads: int, max_seq_len: int, device) -> int:
    """Splits per (sequence, KV head) for `backend` ("cuda" or "triton")."""
    if backend == "cuda":
        return cuda_num_splits(batch, num_kv_heads, max_seq_len, sm_count(device))
    return triton_num_splits(batch, num_kv_heads, max_seq_len, device)


def requested_backend(backend: str | None) -> str:
    """The backend a call asks for: its `backend` argument, else `$KVX_DECODE_BACKEND` (read once), else "auto"."""
    return backend or config.once("decode_backend")


def choose_backend(backend, fmt: CacheFormat, q_dtype: torch.dtype, device: torch.device, batch: int,
                   num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_warps) -> Choice:
    """Which kernel serves a step of this geometry ("cuda" or "triton", see `decode_pools`' `backend` argument),
    and why not CUDA."""
    backend = requested_backend(backend)
    if backend not in BACKENDS:
        raise KvxError(Status.INVALID_ARGUMENT, f"decode backend must be auto, cuda or triton, got {backend!r}")
    if backend == "triton":
        return Choice("triton", None)
    if backend == "auto" and (interpreting() or device.type != "cuda"):
        return Choice("triton", "interpreting (TRITON_INTERPRET=1)" if interpreting() else "not a CUDA device")
    why = cuda_decode.plan_reason(fmt, q_dtype, device, batch, num_qo_heads, num_kv_heads, head_dim, block_size)
    if why is None and backend == "auto" and kernel_format(fmt.k).code == kernel_format(fmt.v).code == FormatCode.FP8 \
            and batch * num_kv_heads < sm_count(device) // 8:
        # FP8 with very few (sequence, KV head) pairs: Triton measured faster
        # (H200, benchmarks/results/decode_int8_fp8_cuda_vs_triton_h200.jsonl, B=1 32k: 44 us vs 50 us); from B=16
        # (8k) the CUDA kernel is faster (0.106 vs 0.141 ms; B=64: 1.6x).
        why = "tiny-batch FP8 decode runs faster in Triton"
    if why is None and num_warps not in (None, cuda_decode.WARPS):
        why = f"num_warps={num_warps}: the CUDA decode runs {cuda_decode.WARPS} warps per CTA"
    return choose(why, backend, lambda: cuda_decode.kernel_library(device), "decode")


@dataclass(frozen=True)
class DecodePlan:
    """One step's decode decisions (FlashInfer's plan/run split): the backend, the splits, the Triton tile and the
    split workspace for `batch` queries of `num_qo_heads` x `head_dim` over pools of `num_kv_heads` x
    `block_size`. An engine plans once per step and `run`s once per layer: every layer reuses the workspace
    (layers run one after another on one stream) and nothing is decided, allocated or synced per layer
    except the rotated formats' q / output rotations."""

    fmt: CacheFormat
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    q_dtype: torch.dtype
    backend: str  # "cuda" or "triton"
    forced: bool  # the caller asked for this backend (no fallback)
    num_splits: int
    block_n: int
    num_warps: int | None
    num_stages: int | None
    sm_scale: float
    softcap: float | None
    window: int | None
    mid_o: torch.Tensor  # fp32 [B, Hq, S, D] per-split partial outputs
    mid_l: torch.Tensor  # fp32 [B, Hq, S] per-split log2-sum-exps
    rotated_out: torch.Tensor | None  # fp32 [B, Hq, D], rotated formats: the merged output before its rotation back
    # (Triton), or the scratch of the rotated queries (CUDA)
    lse_scratch: torch.Tensor  # fp32 [B, Hq]: where the merge writes the LSE a caller does not want (`want_lse`)
    reason: str | None = None  # why Triton and not the CUDA kernel (None: CUDA, or Triton was asked for)
    sinks: torch.Tensor | None = None  # FP32 [Hq] contiguous attention sinks, joined by the split merge
    rows_per_seq: int = 1  # query rows per block-table row (speculative decoding: 1 + k; see the module docstring)
    row_lens_buf: torch.Tensor | None = None  # int32 [batch] where `row_lens` writes (rows_per_seq > 1)
    cuda_steps: dict = field(default_factory=dict, compare=False)  # (table, lens, sinks) addresses -> CUDA step
    # params (each layer's own sinks, given to `run_bound`, get their own entry: the key has the sinks' address)

    def row_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """The int32 lengths the kernels read per query row, from int32 `seq_lens [batch / rows_per_seq]` (cached
        lengths including the step's new tokens): `seq_lens` itself for one row per sequence, else row r's
        `seq_lens[r // R] - R + 1 + r % R` written into the plan's workspace (a fixed address for CUDA graphs:
        compute it once per step, before the layers run). Device ops only, no host sync. A row whose length would be
        negative (a sequence shorter than its rows, which `dispatch.plan_decode(check=True)` and the reference
        refuse) gets 0: it attends no key, and reads no block."""
        if self.rows_per_seq == 1:
            return seq_lens
        r = self.rows_per_seq
        require(isinstance(seq_lens, torch.Tensor) and seq_lens.dtype == torch.int32
                and tuple(seq_lens.shape) == (self.batch // r,), Status.INVALID_ARGUMENT,
                f"paged_decode: seq_lens must be int32 [{self.batch // r}] (one per sequence of {r} query rows), got "
                f"{getattr(seq_lens, 'dtype', type(seq_lens).__name__)} {tuple(getattr(seq_lens, 'shape', ()))}")
        offsets = torch.arange(1 - r, 1, dtype=torch.int32, device=seq_lens.device)
        out = self.row_lens_buf.view(-1, r)
        torch.add(seq_lens[:, None], offsets, out=out)
        return out.clamp_min_(0).view(-1)

    def run(self, q, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_lens, out=None, lse=None,
            k_smoothing: torch.Tensor | None = None, want_lse: bool = True):
        """Decode one layer: `q [B, Hq, D]` over its pools -> (`out`, `lse`) (written in place when given:
        `out [B, Hq, D]` of any float dtype with a contiguous last dim, `lse [B, Hq]` fp32). `k_smoothing`: FP32
        `[Hkv, D]` the pools' keys were divided by (`ops.smoothing`): the kernels multiply the queries as they load
        them; rotated formats scale them first (torch, before the rotation). `want_lse=False` returns `(out, None)`
        (the merge writes the LSE into the plan's scratch: nothing is allocated per layer). Multi-row plans:
        `block_table [B / rows_per_seq, max_blocks]` and `seq_lens` = `row_lens(...)` `[B]`."""
        fmt = self.fmt
        if not want_lse:
            require(lse is None, Status.INVALID_ARGUMENT, "paged_decode: an lse buffer with want_lse=False")
            lse = self.lse_scratch
        ks, vs, out, lse = check_layer(self, q, self.batch, self.batch // self.rows_per_seq, k_data, k_scales, v_data,
                                       v_scales, block_table, seq_lens, out, lse, num_lens=self.batch)
        kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
        kg = global_scale_arg(k_gs, kk, self.num_kv_heads, q.device)
        vg = global_scale_arg(v_gs, kv, self.num_kv_heads, q.device)
        why = cuda_decode.pool_reason(q, fmt, k_data, ks[0], v_data, vs[0]) if self.backend == "cuda" else None
        return self._launch(q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, out, lse, k_smoothing, why,
                            want_lse, self.sinks)

    def run_bound(self, q: torch.Tensor, layer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  out: torch.Tensor | None = None, want_lse: bool = False, sinks: torch.Tensor | None = None):
        """`run` over a layer bound once (`dispatch.bind`): its pools, scale arguments, global scales, key smoothing
        and the CUDA kernel's layer arguments were checked and derived at bind time, so this compares the query and
        output with the plan (host, attribute reads) and launches: on CUDA one library call (decode + merge; the
        rotations of `_rot` formats inside it), on Triton decode + merge. `sinks`: the layer's FP32 `[Hq]`
        contiguous attention sinks on q's device (prepared once by the engine, not checked here), in place of the
        plan's."""
        if tuple(q.shape) != (self.batch, self.num_qo_heads, self.head_dim) or q.dtype != self.q_dtype \
                or layer.geometry != (self.num_kv_heads, self.block_size, self.head_dim) or layer.fmt is not self.fmt \
                or (out is not None and (out.shape != q.shape or out.dtype not in cuda_decode.OUT_DTYPES
                                         or out.stride(2) != 1 or out.device != q.device)):
            raise KvxError(Status.INVALID_ARGUMENT, f"paged_decode: q {q.dtype} {tuple(q.shape)} over a "
                           f"{layer.fmt.name} layer {layer.geometry} does not match the plan "
                           f"({self.fmt.name}, {self.q_dtype} {(self.batch, self.num_qo_heads, self.head_dim)}, "
                           "(num_kv_heads, block_size, head_dim) "
                           f"{(self.num_kv_heads, self.block_size, self.head_dim)})"
                           + ("" if out is None else f", or out {out.dtype} {tuple(out.shape)} is not an fp32 / "
                              "fp16 / bf16 tensor of q's shape and device with a contiguous last dim"))
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(self.batch, self.num_qo_heads, dtype=torch.float32, device=q.device) if want_lse \
            else self.lse_scratch
        sinks = self.sinks if sinks is None else sinks
        if self.backend == "cuda" and layer.cuda_args is not None and q.stride(2) == 1:
            if self.batch:
                self._cuda_bound(q, layer, block_table, seq_lens, out, lse, sinks)
            return out, lse if want_lse else None
        why = None
        if self.backend == "cuda":
            why = ("query last dim not contiguous" if q.stride(2) != 1 else layer.cuda_pool_reason
                   or "the CUDA kernels are not available for the layer's device")
        return self._launch(q, layer.k_data, layer.k_scale_args, layer.v_data, layer.v_scale_args, layer.k_global,
                            layer.v_global, block_table, seq_lens, out, lse, layer.k_smoothing, why, want_lse, sinks)

    def _cuda_bound(self, q, layer, block_table, seq_lens, out, lse, sinks) -> None:
        """The CUDA decode + merge over a bound layer: the step's parameter group is made once per plan, tables and
        sinks (`cuda_decode.step_params`), the layer's at bind time."""
        key = (block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
               0 if sinks is None else sinks.data_ptr())
        step = self.cuda_steps.get(key)
        if step is None:
            step = self.cuda_steps[key] = cuda_decode.step_params(
                block_table, seq_lens, self.mid_o, self.mid_l, self.sm_scale, self.softcap, self.window,
                self.num_qo_heads // self.num_kv_heads, self.block_size, sinks, rotate_out=self.fmt.rotate,
                rows_per_seq=self.rows_per_seq, q_rot=self.rotated_out)  # `_rot`: the library rotates q and the output
        if self.fmt.rotate and layer.k_smoothing is not None:  # s before the rotation: (H (q s)) . (H (k / s)) = q . k
            q = scale_queries(q, layer.k_smoothing)  # (other formats: the smoothing is in the layer's arguments)
        cuda_decode.launch_args(layer.cuda_args, step, q, out, lse)

    def _launch(self, q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, out, lse, k_smoothing, why,
                want_lse, sinks):
        """Decode + merge (+ the rotations of `_rot` formats) on checked arguments; `why`: why the planned CUDA
        kernel cannot address these pools (None: it can), which sends the step to Triton unless CUDA was forced."""
        fmt = self.fmt
        if self.batch == 0:
            return out, lse if want_lse else None
        qs = None  # the kernels multiply the queries by it as they load them
        if k_smoothing is not None and fmt.rotate:  # s before the rotation: (H (q s)) . (H (k / s)) = q . k
            q = scale_queries(q, k_smoothing)
        elif k_smoothing is not None:
            qs = k_smoothing.contiguous()
        if why is not None and self.forced:
            raise KvxError(Status.UNSUPPORTED, f"CUDA decode cannot address these pools ({why}); plan with "
                           "backend='triton' or 'auto'")
        if self.backend == "cuda" and why is None and out.dtype in cuda_decode.OUT_DTYPES:
            # `_rot`: the library rotates q into the scratch first and the merged output back
            cuda_decode.launch(q, k_data, ks[0], v_data, vs[0], kg, vg, block_table, seq_lens, fmt, self.mid_o,
                               self.mid_l, self.sm_scale, self.softcap, self.window, q_smoothing=qs, out=out,
                               lse=lse, sinks=sinks, rotate_out=fmt.rotate, rows_per_seq=self.rows_per_seq,
                               q_rot=self.rotated_out if fmt.rotate else None)
            return out, lse if want_lse else None
        qq = rotate(q) if fmt.rotate else q  # the fused kernel on CUDA (ops.rotation), as the write rotates
        if self.backend == "cuda" and why is None:  # an output dtype only the Triton merge writes
            cuda_decode.launch(qq, k_data, ks[0], v_data, vs[0], kg, vg, block_table, seq_lens, fmt, self.mid_o,
                               self.mid_l, self.sm_scale, self.softcap, self.window, q_smoothing=qs,
                               rows_per_seq=self.rows_per_seq)
        else:  # Triton, also for pools the planned CUDA kernel cannot address (same splits)
            triton_decode.launch_decode(qq, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, fmt, self.mid_o,
                                        self.mid_l, self.sm_scale, self.softcap, self.window, self.block_n,
                                        self.num_warps, self.num_stages, q_smoothing=qs,
                                        rows_per_seq=self.rows_per_seq)
        merged = out if self.rotated_out is None else self.rotated_out  # rotated: merged in FP32, rotated back
        merge_splits(self.mid_o, self.mid_l, merged, lse, sinks)
        if self.rotated_out is not None:
            rotate(self.rotated_out, out=out)
        return out, lse if want_lse else None


def plan_decode(fmt: CacheFormat | str, *, batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, q_dtype: torch.dtype, device, max_seq_len: int, sm_scale: float | None = None,
                softcap: float | None = None, window: int | None = None, num_splits: int | None = None,
                block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                backend: str | None = None, workspace: torch.Tensor | None = None,
                split_batch: int | None = None, rows_per_seq: int = 1) -> DecodePlan:
    """Plan a decode step (host only, no sync): `max_seq_len` bounds the step's sequence lengths and sizes the
    splits only (each split reads its own sequence length). See `decode_pools` for the options.

    `rows_per_seq` (>= 1, dividing `batch`): `batch` query rows of which each `rows_per_seq` consecutive ones are
    the new tokens of one sequence (speculative decoding, see the module docstring; their lengths: `row_lens`).

    `split_batch` (>= batch): choose the backend and splits as for a batch of this size, e.g. the CUDA-graph
    bucket vLLM pads `batch` to, so eager and replayed steps of one bucket sum in the same order.
    `workspace`: a caller-owned contiguous fp32 buffer the split partials live in (at least `workspace_size`
    elements for the largest step), so plans of every step use one fixed address, as CUDA-graph replays need;
    default: fresh buffers."""
    fmt, kk, kv = check_plan("paged_decode", fmt, q_dtype, (torch.bfloat16, torch.float16, torch.float32),
                             num_qo_heads, num_kv_heads, head_dim)
    check_rows_per_seq(rows_per_seq)
    rows_per_seq = int(rows_per_seq)  # a plain int for the kernels' arguments (numpy integers pass the check)
    require(isinstance(batch, int) and batch >= 0 and batch % rows_per_seq == 0, Status.INVALID_ARGUMENT,
            f"paged_decode: batch {batch!r} query rows must be a multiple of rows_per_seq {rows_per_seq}")
    device = torch.device(device)
    d = head_dim
    if block_n is None:
        block_n = triton_decode.default_block_n(kk, kv, d)
    max_seq_len = check_max_seq_len(max_seq_len)
    if window is not None and window >= 0:
        max_seq_len = min(max_seq_len, window + 1)
    sb = batch if split_batch is None else max(batch, int(split_batch))
    chosen, reason = choose_backend(backend, fmt, q_dtype, device, sb, num_qo_heads, num_kv_heads, d, block_size,
                                    num_warps)
    if num_splits is None:
        num_splits = choose_splits(chosen, sb, num_kv_heads, max_seq_len, device)
    mid_o, mid_l, rotated, lse_scratch, lens = _workspace_views(workspace, fmt, batch, num_qo_heads, num_splits, d,
                                                                device, rows_per_seq)
    forced = requested_backend(backend) != "auto"
    return DecodePlan(fmt, batch, num_qo_heads, num_kv_heads, d, block_size, q_dtype, chosen, forced, num_splits,
                      block_n, num_warps, num_stages, 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale),
                      softcap, window, mid_o, mid_l, rotated, lse_scratch, reason, rows_per_seq=rows_per_seq,
                      row_lens_buf=lens)


def _workspace_sizes(fmt: CacheFormat, batch: int, num_qo_heads: int, num_splits: int, d: int,
                     rows_per_seq: int = 1) -> tuple[int, ...]:
    """Elements of (mid_o, mid_l, rotated output, LSE scratch, int32 row lengths) for one step."""
    rows = batch * num_qo_heads
    return (rows * num_splits * d, rows * num_splits, rows * d if fmt.rotate else 0, rows,
            batch if rows_per_seq > 1 else 0)


def _same_device(a: torch.device, b) -> bool:
    """`a` is `b`, where `b` may name a CUDA device without its index ("cuda": the current one)."""
    b = torch.device(b)
    if b.type == "cuda" and b.index is None:
        b = torch.device("cuda", torch.cuda.current_device())
    return a == b


def _workspace_views(workspace, fmt, batch, num_qo_heads, num_splits, d, device, rows_per_seq=1):
    """(mid_o, mid_l, rotated output or None, LSE scratch, int32 row lengths or None): views of `workspace`, or new
    tensors when it is None."""
    sizes = _workspace_sizes(fmt, batch, num_qo_heads, num_splits, d, rows_per_seq)
    if workspace is None:
        workspace = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    elif not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32 or workspace.dim() != 1 \
            or not workspace.is_contiguous() or not _same_device(workspace.device, device) \
            or workspace.numel() < sum(sizes):
        raise KvxError(Status.INVALID_ARGUMENT, f"workspace must be a contiguous 1-D fp32 tensor on {device} of at "
                       f"least {sum(sizes)} elements for this step (see workspace_size), got "
                       f"{getattr(workspace, 'dtype', type(workspace).__name__)} "
                       f"{tuple(getattr(workspace, 'shape', ()))}")
    a, b, c, e, f = sizes
    mid_o = workspace[:a].view(batch, num_qo_heads, num_splits, d)
    mid_l = workspace[a:a + b].view(batch, num_qo_heads, num_splits)
    rotated = workspace[a + b:a + b + c].view(batch, num_qo_heads, d) if fmt.rotate else None
    lse_scratch = workspace[a + b + c:a + b + c + e].view(batch, num_qo_heads)
    lens = workspace[a + b + c + e:a + b + c + e + f].view(torch.int32) if rows_per_seq > 1 else None  # 4-byte words
    return mid_o, mid_l, rotated, lse_scratch, lens


def workspace_size(fmt: CacheFormat | str, *, max_batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int, q_dtype: torch.dtype, device, max_seq_len: int, rows_per_seq: int = 1) -> int:
    """fp32 elements of a `plan_decode` workspace that serves every step of up to `max_batch` sequences of up to
    `max_seq_len` tokens with the default backend and split choice (splits never shrink as lengths grow), with up
    to `rows_per_seq` query rows per sequence (`plan_decode`: any plan of at most `max_batch * rows_per_seq` rows)."""
    fmt = check_plan("paged_decode", fmt, q_dtype, (torch.bfloat16, torch.float16, torch.float32),
                     num_qo_heads, num_kv_heads, head_dim)[0]
    check_rows_per_seq(rows_per_seq)
    device = torch.device(device)
    best = 0
    for batch in range(1, max_batch * rows_per_seq + 1):
        chosen = choose_backend(None, fmt, q_dtype, device, batch, num_qo_heads, num_kv_heads, head_dim, block_size,
                                None).backend
        splits = choose_splits(chosen, batch, num_kv_heads, max_seq_len, device)
        best = max(best, sum(_workspace_sizes(fmt, batch, num_qo_heads, splits, head_dim, rows_per_seq)))
    return best


def decode_pools(q, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_lens, fmt,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 num_splits: int | None = None, max_seq_len: int | None = None, out=None, lse=None,
                 block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 backend: str | None = None, rows_per_seq: int = 1):
    """Decode attention: `q [B, Hq, D]` over the paged quantized cache -> (`out [B, Hq, D]` q.dtype,
    `lse [B, Hq]` fp32).
    `rows_per_seq`: each `rows_per_seq` consecutive query rows are the new tokens of one sequence (block-table row
    and `seq_lens` entry `r // rows_per_seq`; see the module docstring).

    `plan_decode` then `DecodePlan.run` (engines plan once per step and run per layer). `lse` is the natural-log
    sum-exp of the (scaled, soft-capped) scores; `-inf` and a zero output for an empty sequence. `window` =
    FlashInfer's `window_left`: keys at positions `>= seq_len - 1 - window` are attended. Rotated formats take
    unrotated q and return unrotated out. `backend`: "auto" (default, or `$KVX_DECODE_BACKEND`) runs the CUDA
    kernel (`ops/cuda`: 4-bit, INT8, FP8) where it serves the call and Triton elsewhere; "cuda" requires the CUDA
    kernel; "triton" forces Triton. `block_n`, `num_warps`, `num_stages` tune the Triton kernel (defaults:
    `ops/triton/decode.py`). `max_seq_len` (default: read from `seq_lens`, one host sync) sizes the splits.
    """
    fmt = as_format(fmt)
    check_device(q, k_data, v_data, block_table, seq_lens)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise KvxError(Status.INVALID_ARGUMENT, f"q must be [B, Hq, D], got {tuple(getattr(q, 'shape', ()))}")
    pool_geometry(k_data, v_data)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    bsz, hq, d = q.shape
    plan = plan_decode(fmt, batch=bsz, num_qo_heads=hq, num_kv_heads=k_data.shape[1], head_dim=d,
                       block_size=k_data.shape[2], q_dtype=q.dtype, device=q.device, max_seq_len=max_seq_len,
                       sm_scale=sm_scale, softcap=softcap, window=window, num_splits=num_splits, block_n=block_n,
                       num_warps=num_warps, num_stages=num_stages, backend=backend, rows_per_seq=rows_per_seq)
    return plan.run(q, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, plan.row_lens(seq_lens), out=out,
                    lse=lse)
