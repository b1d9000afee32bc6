"""Which of a model's KV heads each tensor-parallel rank holds, as vLLM splits them (`QKVParallelLinear`): with
fewer ranks than KV heads each rank holds `heads / tp_size` consecutive heads; with at least as many ranks, each
holds one head, replicated over `tp_size / heads` consecutive ranks. The connectors export and import these ranges,
and a tensor-parallel store entry holds one bundle per distinct range (`shard_ranges`)."""
from __future__ import annotations

from ..errors import Status, require


def _checked(num_kv_heads: int, tp_size: int) -> None:
    require(type(num_kv_heads) is int and type(tp_size) is int and num_kv_heads >= 1 and tp_size >= 1,
            Status.INVALID_ARGUMENT, f"KV heads {num_kv_heads!r} and tensor-parallel size {tp_size!r} must be "
            "positive integers")
    require(num_kv_heads % tp_size == 0 if tp_size < num_kv_heads else tp_size % num_kv_heads == 0,
            Status.UNSUPPORTED, f"{num_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks (one "
            "must divide the other, as vLLM requires)")


def tp_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads `[start, stop)` of the model's `num_kv_heads` that rank `tp_rank` of `tp_size` holds."""
    _checked(num_kv_heads, tp_size)
    require(type(tp_rank) is int and 0 <= tp_rank < tp_size, Status.INVALID_ARGUMENT,
            f"tensor-parallel rank must be an integer in [0, {tp_size}), got {tp_rank!r}")
    if tp_size >= num_kv_heads:
        head = tp_rank // (tp_size // num_kv_heads)
        return head, head + 1
    per = num_kv_heads // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def shard_ranges(num_kv_heads: int, tp_size: int) -> list[tuple[int, int]]:
    """The distinct head ranges of the ranks, in order: they tile `[0, num_kv_heads)` (one per replicated head)."""
    _checked(num_kv_heads, tp_size)
    n = min(num_kv_heads, tp_size)
    return [(i * num_kv_heads // n, (i + 1) * num_kv_heads // n) for i in range(n)]


def writes_shard(num_kv_heads: int, tp_size: int, tp_rank: int) -> bool:
    """Whether `tp_rank` is the first rank holding its range (the one that exports it; its replicas do not)."""
    mine = tp_head_range(num_kv_heads, tp_size, tp_rank)
    return tp_rank == 0 or tp_head_range(num_kv_heads, tp_size, tp_rank - 1) != mine


def ranks_reading(heads: tuple[int, int], num_kv_heads: int, tp_size: int) -> int:
    """How many of `tp_size` ranks hold any of the KV heads `[start, stop)`: the readers of a shard holding them."""
    return sum(a < heads[1] and heads[0] < b
               for a, b in (tp_head_range(num_kv_heads, tp_size, r) for r in range(tp_size)))
