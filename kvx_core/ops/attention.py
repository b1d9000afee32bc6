"""Reference paged attention over a KVX cache (any format): the oracle for the GPU kernels, and the CPU path.

K/V are read through `gather_kv` (which dequantizes and undoes any Hadamard rotation), so the
result is exactly softmax attention over the cache's stored values, computed in FP64 and returned in FP32
(so it does not depend on how queries are chunked or batched).
LSE is the natural-log log-sum-exp of the (scaled, soft-capped) scores per query head.
Options follow FlashInfer, as the Triton kernels do: `window` is `window_left` (a query at position p
sees keys p - window .. p; None or negative: no window), `softcap` None or 0 means no soft cap.

Attention sinks (gpt-oss; vLLM's `sinks`, FlashAttention's `s_aux`): `sinks [Hq]`, one learned logit per query
head in natural-log units, neither scaled by `sm_scale` nor soft-capped, joins every row's softmax denominator
and carries no value: `p_i = exp(s_i) / (exp(sink) + sum_j exp(s_j))`, `out = sum_i p_i v_i`. KVX takes vLLM's
tensor as it stores it (any float dtype) and computes with its FP32 values (`sink_values`: finite, checked).
LSE semantics with sinks: the LSE returned is the log of the whole denominator, `log(exp(sink) + sum_j
exp(s_j))`; a row with no allowed key gives output 0 and LSE = sink (without sinks: 0 and -inf). Attention
computed in pieces and merged by LSE (vLLM's split prefill: new tokens over themselves + over the cached
prefix) must count the sink once: the pieces are computed without sinks and `apply_sinks` joins them after
the merge. `apply_sinks` is the one torch implementation of that join (this reference, a centered cache's
kernel output in `ops.dispatch`, the vLLM split prefill); the Triton kernels join the sink in their split merge
(decode) or final normalisation (prefill) with the same formula (`ops/triton/dequant.py` `join_sink`).
"""
from __future__ import annotations

import math
import numbers
from itertools import pairwise

import torch

from ..descriptors import BlockTable, CacheDesc, GatherDesc, SeqLens
from ..enums import BlockTableFormat
from ..errors import Status, require
from .checks import UINT32_MAX, check_table_types, require_type
from .reference import gather_kv


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, sm_scale: float,
           softcap: float | None, window: int | None, causal: bool,
           sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP64 attention core: q [Tq, Hq, D] at positions `q_pos`, k/v [L, Hkv, D] at positions 0..L-1 ->
    (out [Tq, Hq, D], lse [Tq, Hq]) in FP64. Rows with no allowed key give 0 and -inf (with `sinks [Hq]`,
    checked by the caller: 0 and the sink); NaN scores give NaN.

    The paged functions below round it to FP32; the kernel tests' oracle (tests/kernels/oracle.py) runs it on
    K/V decoded by the formats themselves. It is tested against hand-made cases in tests/cache."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # FP64 products: the rounded FP32 result then no longer depends on how an engine chunks or batches the
    # queries (BLAS picks its summation order by shape; FP32 sums would differ in the last bits)
    qg = q.double().view(tq, hkv, g, d)
    s = torch.einsum("thgd,lhd->thgl", qg, k.double()) * sm_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0], device=q.device)
    allowed = torch.ones(tq, k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= kpos[None, :] <= q_pos[:, None]
    if window is not None and window >= 0:
        allowed &= kpos[None, :] >= q_pos[:, None] - window
    s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)[..., None]  # rows with no allowed key: output 0, lse -inf
    p = torch.where(empty, 0.0, torch.exp(s - torch.where(empty, 0.0, lse[..., None])))  # NaN K/V stays NaN
    out = torch.einsum("thgl,lhd->thgd", p, v.double())
    out, lse = out.reshape(tq, hq, d), lse.reshape(tq, hq)
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join attention sinks into finished attention (see the module docstring): `out [T, Hq, D]` and natural-log
    `lse [T, Hq]` of a softmax without them -> `(out * exp(lse - lse'), lse')` with `lse' = log(exp(lse) +
    exp(sinks[h]))`, in lse's dtype (FP32 at least). A row with no key (lse -inf) gives 0 and the sink; NaN stays
    NaN. Pieces merged by LSE are joined once, after their merge."""
    dt = torch.promote_types(lse.dtype, torch.float32)
    lse = lse.to(dt)
    total = torch.logaddexp(lse, sinks.to(lse.device, dt))  # log-domain: a sink up to FP32's max stays finite
    return out.to(dt) * torch.exp(lse - total)[..., None], total


def softmax_scale(sm_scale: float | None, head_dim: int) -> float:
    """The logits' scale: `sm_scale`, or 1 / sqrt(head_dim) when None (FlashInfer's default)."""
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale


def check_sinks(sinks, what: str, num_qo_heads: int | None = None) -> None:
    """`sinks`: None or a 1-D float tensor of one logit per query head (`num_qo_heads` when known); host metadata
    only (sync-free). Their values: `sink_values`."""
    if sinks is None:
        return
    require(isinstance(sinks, torch.Tensor) and sinks.is_floating_point() and sinks.dim() == 1,
            Status.INVALID_ARGUMENT, f"{what}: sinks must be None or a 1-D float tensor [num_q_heads], got "
            f"{(sinks.dtype, tuple(sinks.shape)) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    require(num_qo_heads is None or sinks.shape[0] == num_qo_heads, Status.INVALID_ARGUMENT,
            f"{what}: sinks has {sinks.shape[0]} values for {num_qo_heads} query heads (one per query head)")


def sink_values(sinks, num_qo_heads: int, device, what: str, *, check_values: bool = True) -> torch.Tensor | None:
    """`sinks` (`check_sinks`) as every path computes with them: FP32, contiguous, on `device`; None for None.
    With `check_values` (one host sync) finite in FP32: a NaN or infinite sink (or an FP64 one beyond FP32's
    range) would turn its head's every output into NaN or 0. Large finite sinks are allowed."""
    check_sinks(sinks, what, num_qo_heads)
    if sinks is None:
        return None
    s = sinks.to(device=device, dtype=torch.float32).contiguous()
    if check_values:
        bad = ~torch.isfinite(s)
        require(not bool(bad.any()), Status.INVALID_ARGUMENT,
                f"{what}: sinks must be finite in FP32, got {s[bad].tolist()[:4]} at query heads "
                f"{bad.nonzero().flatten().tolist()[:4]}")
    return s


def check_options(what: str, *, sm_scale=None, softcap=None, window=None, causal=True, sinks=None,
                  queries_after=False) -> None:
    """The attention options: finite numbers, softcap >= 0, an int window, sinks' type, `queries_after` only
    without `causal` (host only)."""
    require(isinstance(causal, bool), Status.INVALID_ARGUMENT, f"{what}: causal must be a bool, got {causal!r}")
    require(isinstance(queries_after, bool) and not (queries_after and causal), Status.INVALID_ARGUMENT,
            f"{what}: queries_after must be a bool and needs causal=False (the queries follow every cached key), "
            f"got queries_after={queries_after!r}, causal={causal!r}")
    for name, x in (("sm_scale", sm_scale), ("softcap", softcap)):
        require(x is None or (isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)),
                Status.INVALID_ARGUMENT, f"{what}: {name} must be None or a finite number, got {x!r}")
    require(softcap is None or softcap >= 0, Status.INVALID_ARGUMENT, f"{what}: softcap must be >= 0, got {softcap}")
    # an int: the reference would compare a float window, the kernels truncate it
    require(window is None or (isinstance(window, numbers.Integral) and not isinstance(window, bool)),
            Status.INVALID_ARGUMENT, f"{what}: window must be None or an int, got {window!r}")
    check_sinks(sinks, what)


def check_args(query: torch.Tensor, cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, what: str, *,
               sm_scale=None, softcap=None, window=None, causal=True, sinks=None, queries_after=False) -> None:
    """Argument types, the query's shape and the options (the gather checks the rest); sync-free, so the
    kernel path of `ops.dispatch` runs it too."""
    check_options(what, sm_scale=sm_scale, softcap=softcap, window=window, causal=causal, sinks=sinks,
                  queries_after=queries_after)
    require_type(cache, CacheDesc, f"{what}: cache")
    require(not softcap or cache.quant is None or cache.quant.k_center is None, Status.UNSUPPORTED,
            f"{what}: a soft cap over a cache with key centering (tanh is not shift invariant: the kernels' logits "
            "are q . (k - c)); use a calibration without centering for soft-capped models")
    check_table_types(table, seq_lens)
    require_type(query, torch.Tensor, f"{what}: query")
    require(query.dim() == 3 and query.shape[-1] == cache.head_dim, Status.INVALID_ARGUMENT,
            f"{what}: query must be [tokens, num_q_heads, head_dim={cache.head_dim}], got {tuple(query.shape)}")
    require(query.shape[1] % cache.num_kv_heads == 0, Status.INVALID_ARGUMENT,
            f"{what}: num_q_heads {query.shape[1]} must be a multiple of num_kv_heads {cache.num_kv_heads} (GQA)")
    check_sinks(sinks, what, query.shape[1])


def check_rows_per_seq(rows_per_seq) -> None:
    """`rows_per_seq`: an int >= 1 (query rows per sequence of a decode step: 1, or 1 + k with k speculative
    tokens)."""
    require(isinstance(rows_per_seq, numbers.Integral) and not isinstance(rows_per_seq, bool) and rows_per_seq >= 1,
            Status.INVALID_ARGUMENT, f"paged_decode: rows_per_seq must be an int >= 1, got {rows_per_seq!r}")


def check_rows_fit(rows_per_seq: int, lens: list[int]) -> None:
    """Each sequence's cached length holds its `rows_per_seq` new tokens (the rows' queries are its last cached
    tokens) or is 0 (an empty sequence, e.g. an engine's padding: its rows give 0 and -inf or the sink)."""
    for b, n in enumerate(lens):
        require(n == 0 or n >= rows_per_seq, Status.INVALID_ARGUMENT,
                f"paged_decode: sequence {b} has {n} cached tokens, fewer than its {rows_per_seq} query rows (the "
                "new tokens must be written before attention)")


def check_qo_indptr(qo_indptr: torch.Tensor, lens: list[int], num_tokens: int | None,
                    queries_cached: bool = True) -> list[int]:
    """`qo_indptr` as a host list, after checking it is an int32/int64 tensor of `len(lens) + 1` non-decreasing
    entries from 0 to `num_tokens` that (when `queries_cached`: the queries are the last cached tokens) gives no
    sequence more new tokens than its cached length (INVALID_ARGUMENT). Read on its own dtype: callers narrow it
    only after this. `num_tokens` None: a plan made before the queries are known (the run checks the query rows
    against the last entry)."""
    is_tensor = isinstance(qo_indptr, torch.Tensor)
    got = (qo_indptr.dtype, tuple(qo_indptr.shape)) if is_tensor else qo_indptr
    require(is_tensor and qo_indptr.dtype in (torch.int32, torch.int64) and qo_indptr.dim() == 1,
            Status.INVALID_ARGUMENT, f"paged_prefill: qo_indptr must be a 1-D int32/int64 tensor, got {got!r}")
    ip = qo_indptr.tolist()
    require(len(ip) == len(lens) + 1 and ip[0] == 0 and ip[-1] == (ip[-1] if num_tokens is None else num_tokens)
            and all(a <= b for a, b in pairwise(ip)), Status.INVALID_ARGUMENT,
            "paged_prefill: qo_indptr must have seq_count + 1 non-decreasing entries from 0 to num query tokens")
    for b, n in enumerate(lens):
        require(not queries_cached or ip[b + 1] - ip[b] <= n, Status.INVALID_ARGUMENT,
                f"paged_prefill: sequence {b} has {ip[b + 1] - ip[b]} new tokens but only {n} cached tokens")
    return ip


def queries_cached(causal: bool, window: int | None, queries_after: bool = False) -> bool:
    """Whether a prefill's queries must be the last cached tokens: their positions matter for a causal or
    windowed mask; without either each query attends to all of its sequence's cached tokens (e.g. a new chunk
    attending its cached prefix, its own K/V attended elsewhere and merged by LSE). `queries_after`: the queries
    are the tokens right after the cached ones (positions `seq_len ..`), so none need be cached."""
    return not queries_after and (causal or (window is not None and window >= 0))


def _window_table(cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, first_key: list[int] | None):
    """(table, seq_lens) without each PACKED row's blocks that lie wholly before `first_key[b]`, the first key
    position a window lets sequence b's queries see, so those blocks are never read (vLLM's sliding-window manager
    frees them and leaves stale or null ids in the row). Positions stay right relative to the shortened lengths
    (queries sit at the end of a sequence or right after it). Other table formats and no window: unchanged."""
    rows = table.indices
    if first_key is None or table.format != BlockTableFormat.PACKED or rows.dim() != 2 or not seq_lens.seq_count:
        return table, seq_lens
    bs = cache.block_size
    # a row longer than its table keeps every block: the gather refuses it as before
    skip = [max(f, 0) // bs if 0 <= n <= rows.shape[1] * bs else 0
            for f, n in zip(first_key, seq_lens.lengths.tolist(), strict=True)]
    if not any(skip):
        return table, seq_lens
    cols = torch.arange(rows.shape[1], device=rows.device)[None, :] + torch.tensor(skip, device=rows.device)[:, None]
    shifted = rows.gather(1, cols.clamp_(max=rows.shape[1] - 1))  # past a row's new end: never read
    lens = seq_lens.lengths - torch.tensor(skip, device=seq_lens.lengths.device).to(seq_lens.lengths.dtype) * bs
    return BlockTable.packed(shifted), SeqLens(lens)


def _gather_all(cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, first_key: list[int] | None = None):
    """The sequences' K/V from their first needed block on (`_window_table`) -> (io, lens, starts)."""
    table, seq_lens = _window_table(cache, table, seq_lens, first_key)
    # capped to the C field's range: a longer sequence is then refused by the gather as OUT_OF_RANGE
    max_len = min(int(seq_lens.lengths.max()), UINT32_MAX) if seq_lens.seq_count else 0
    io = gather_kv(cache, GatherDesc(table, seq_lens, max_len))
    # KV_OFFSETS beams are sequences of their own, in (sequence, beam) order (what the gather yields)
    lens = seq_lens.lengths.to(torch.int64).repeat_interleave(table.beam_width).tolist()
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return io, lens, starts


def _first_keys(window: int | None, first_query: list[int]) -> list[int] | None:
    """The first key position each sequence's queries see under `window` (None: no window)."""
    return None if window is None or window < 0 else [p - window for p in first_query]


def _outputs(query: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 (out, lse) as rows without keys leave them: 0, and -inf or the row's sink."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
    if sinks is not None:
        lse.copy_(sinks.expand_as(lse))
    return out, lse


def paged_decode(query: torch.Tensor, cache: CacheDesc, table: BlockTable, seq_lens: SeqLens, *,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, rows_per_seq: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence (`query [B, Hq, D]`) attending over its whole cached sequence (a KV_OFFSETS
    table with beams: one query per (sequence, beam) row, in that order, `B = seqs * beam_width`).

    `rows_per_seq = R > 1` (speculative decoding's verification, R = 1 + k): R consecutive query rows per
    (sequence, beam) row, `B = seqs * beam_width * R`; they are its last R cached tokens (written before attention),
    so row t of a sequence of `n` cached tokens attends causally to its first `n - R + 1 + t` tokens: the prefill
    of R new tokens (`paged_prefill` with `qo_indptr = [0, R, 2R, ...]` computes the same). A sequence with
    `0 < n < R` is refused (INVALID_ARGUMENT); an empty one gives its rows 0 and -inf.

    Returns `(out [B, Hq, D] in query.dtype, lse [B, Hq] FP32)`; empty sequences give 0 and -inf (the sink
    with `sinks [Hq]`, see the module docstring).
    """
    check_args(query, cache, table, seq_lens, "paged_decode", sm_scale=sm_scale, softcap=softcap, window=window,
               sinks=sinks)
    check_rows_per_seq(rows_per_seq)
    r = int(rows_per_seq)
    rows = seq_lens.seq_count * table.beam_width * r
    require(query.shape[0] == rows, Status.INVALID_ARGUMENT,
            f"paged_decode: {query.shape[0]} queries for {seq_lens.seq_count} sequences"
            + (f" x {table.beam_width} beams" if table.beam_width > 1 else "")
            + (f" x {r} rows per sequence" if r > 1 else ""))
    scale = softmax_scale(sm_scale, cache.head_dim)
    sinks = sink_values(sinks, query.shape[1], query.device, "paged_decode")
    lengths = seq_lens.lengths.to(torch.int64).tolist()
    check_rows_fit(r, lengths)  # a sequence's first query row is at position n - r
    io, lens, starts = _gather_all(cache, table, seq_lens, _first_keys(window, [n - r for n in lengths]))
    out, lse = _outputs(query, sinks)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k, v = io.key[starts[b]:starts[b + 1]], io.value[starts[b]:starts[b + 1]]
        pos = torch.arange(n - r, n, device=query.device)
        q0, q1 = b * r, (b + 1) * r
        out[q0:q1], lse[q0:q1] = attend(query[q0:q1], k, v, pos, scale, softcap, window, True, sinks)  # -> FP32
    return out.to(query.dtype), lse


def paged_prefill(query: torch.Tensor, qo_indptr: torch.Tensor, cache: CacheDesc, table: BlockTable,
                  seq_lens: SeqLens, *, causal: bool = True, sm_scale: float | None = None,
                  softcap: float | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None, queries_after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill / extend: sequence b's `q_len` new tokens (rows `qo_indptr[b]:qo_indptr[b+1]` of
    `query [T, Hq, D]`) are its last `q_len` cached tokens (already written); each attends to the
    cached prefix plus itself, causally. `seq_lens` are total cached lengths including the new tokens.
    `causal=False` (no window): each query attends to all `seq_lens[b]` cached tokens, which need not include
    the queries (a chunk's attention over its cached prefix only). `queries_after=True` (needs `causal=False`):
    the queries are the `q_len` tokens right AFTER the cached ones (positions `seq_lens[b] ..`), for the window
    of such a chunk (vLLM's split prefill of a sliding-window layer). `sinks [Hq]`: see the module docstring.
    """
    check_args(query, cache, table, seq_lens, "paged_prefill", sm_scale=sm_scale, softcap=softcap, window=window,
               sinks=sinks, causal=causal, queries_after=queries_after)
    require(table.beam_width == 1, Status.UNSUPPORTED,
            f"paged_prefill: a table of {table.beam_width} beams (prefill runs before beams fork: one beam)")
    cached = seq_lens.lengths.to(torch.int64).tolist()
    ip = check_qo_indptr(qo_indptr, cached, query.shape[0], queries_cached(causal, window, queries_after))
    scale = softmax_scale(sm_scale, cache.head_dim)
    sinks = sink_values(sinks, query.shape[1], query.device, "paged_prefill")
    first_query = [n if queries_after else n - (ip[b + 1] - ip[b]) for b, n in enumerate(cached)]
    io, lens, starts = _gather_all(cache, table, seq_lens, _first_keys(window, first_query))
    out, lse = _outputs(query, sinks)
    for b, n in enumerate(lens):
        q0, q1 = ip[b], ip[b + 1]
        if q1 == q0:
            continue
        k, v = io.key[starts[b]:starts[b + 1]], io.value[starts[b]:starts[b + 1]]
        pos = torch.arange(n, n + q1 - q0, device=query.device) if queries_after else \
            torch.arange(n - (q1 - q0), n, device=query.device)
        out[q0:q1], lse[q0:q1] = attend(query[q0:q1], k, v, pos, scale, softcap, window, causal, sinks)  # -> FP32
    return out.to(query.dtype), lse
