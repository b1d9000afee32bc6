"""A CONTRACT SHIM of TensorRT-LLM's KV cache connector interface: NOT TensorRT-LLM.

TensorRT-LLM cannot be installed here (its PyPI package downloads the wheel from NVIDIA's own index), so the
connector tests drive KVX's classes through this record of what TRT-LLM calls, copied by hand from
`tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py` and `py_executor.py` at commit 035ab91:
- the method names and parameter names of `KvCacheConnectorWorker` / `KvCacheConnectorScheduler`;
- `SchedulerOutput` / `RequestData` with TRT-LLM's field names;
- `ShimExecutor`: the order the PyTorch executor calls them in one step (`_kv_connector_start_batch`:
  build_connector_meta -> bind_connector_meta -> start_load_kv; per layer wait_for_layer_load / save_kv_layer;
  wait_for_save; get_finished), admission (get_num_new_matched_tokens, then update_state_after_alloc with the
  request's blocks), chunked context, the `computed_position` of a new request with the matched tokens
  subtracted, and `request_finished` with the request's block ids. Its "model" writes a deterministic K/V per
  (layer, position, token) into the pool rows `[block, layer, kv, H*T*D]` (HND inside a block).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

WORKER_METHODS = {  # name -> parameter names (self excluded), verbatim from TRT-LLM 035ab91
    "__init__": ["llm_args"],
    "bind_connector_meta": ["metadata"],
    "register_kv_caches": ["kv_cache_tensor"],
    "start_load_kv": ["stream"],
    "wait_for_layer_load": ["layer_idx", "stream"],
    "save_kv_layer": ["layer_idx", "stream"],
    "wait_for_save": ["stream"],
    "get_finished": ["finished_gen_req_ids", "started_loading_req_ids"],
}
SCHEDULER_METHODS = {
    "__init__": ["llm_args"],
    "build_connector_meta": ["scheduler_output"],
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "request_finished": ["request", "cache_block_ids"],
    "update_state_after_alloc": ["request", "block_ids"],
}


@dataclass
class RequestData:
    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


@dataclass
class ShimRequest:
    request_id: int
    tokens: list[int]

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


def model_kv(layer: int, positions: torch.Tensor, tokens: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The shim model's K (kv=0) and V (kv=1) of tokens at positions: `[2, n, H, D]` bf16, a fixed function."""
    kv = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(heads).view(1, 1, -1, 1)
    d = torch.arange(head_dim).view(1, 1, 1, -1)
    x = (tokens.view(1, -1, 1, 1) * 0.37 + positions.view(1, -1, 1, 1) * 0.113 + layer * 1.3 + kv * 0.9 + h * 0.71
         + d * 0.053)
    return (torch.sin(x) * 4).to(torch.bfloat16)


class ShimExecutor:
    """TRT-LLM's executor loop around one connector pair, on a CPU pool `[blocks, layers, 2, H*T*D]` (bf16, or FP8
    written as TRT-LLM does: `x * kv_scale_orig_quant` cast to FP8, with `kv_scales` = per-layer
    `kv_scale_quant_orig`)."""

    def __init__(self, scheduler, worker, *, num_blocks: int, num_layers: int, heads: int, head_dim: int,
                 tokens_per_block: int, chunk: int, dtype: torch.dtype = torch.bfloat16,
                 kv_scales: list[float] | None = None):
        self.sched, self.worker = scheduler, worker
        self.t, self.h, self.d, self.L, self.chunk = tokens_per_block, heads, head_dim, num_layers, chunk
        self.kv_scales = kv_scales
        self.pool = torch.zeros(num_blocks, num_layers, 2, heads * tokens_per_block * head_dim, dtype=dtype)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.worker.register_kv_caches(self.pool)
        self.finished: list[tuple[list[int], list[int]]] = []

    def blocks_view(self) -> torch.Tensor:
        return self.pool.view(self.pool.shape[0], self.L, 2, self.h, self.t, self.d)

    def _alloc(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def run(self, request: ShimRequest, *, decode_steps: int = 1, computed_on_device: int = 0,
            release: set[int] = frozenset()) -> list[int]:
        """Admit, prefill in chunks and decode one request; its block ids. `release`: block positions the
        engine reports as -1 (released by a sliding window) from admission on."""
        prompt = request.tokens
        matched, load_async = self.sched.get_num_new_matched_tokens(request, computed_on_device)
        assert load_async is False
        pos = computed_on_device + matched
        blocks = self._alloc(-(-min(pos + self.chunk, len(prompt)) // self.t))
        reported = [-1 if i in release else b for i, b in enumerate(blocks)]
        self.sched.update_state_after_alloc(request, reported)
        first, tokens = True, list(prompt)
        while True:
            if pos < len(prompt):
                n = min(self.chunk, len(prompt) - pos)
            elif decode_steps > 0:
                tokens.append(1000 + len(tokens))
                request.tokens = tokens
                n, decode_steps = 1, decode_steps - 1
            else:
                break
            need = -(-(pos + n) // self.t)
            new = self._alloc(need - len(blocks))
            blocks += new
            if first:
                data = RequestData(request.request_id, list(prompt), reported + new, pos - matched, n)
                out = SchedulerOutput(new_requests=[data])
            else:
                data = RequestData(request.request_id, tokens[-n:] if pos >= len(prompt) else [], new, pos, n)
                out = SchedulerOutput(cached_requests=[data])
            reported = reported + new
            first = False
            meta = self.sched.build_connector_meta(out)
            self.worker.bind_connector_meta(meta)
            self.worker.start_load_kv(None)
            for layer in range(self.L):
                self.worker.wait_for_layer_load(layer, None)
                self._forward_layer(layer, blocks, tokens, pos, n)
                self.worker.save_kv_layer(layer, None)
            self.worker.wait_for_save(None)
            self.finished.append(self.worker.get_finished([], []))
            pos += n
        assert self.sched.request_finished(request, reported) is False
        self.finished.append(self.worker.get_finished([request.request_id], []))
        return blocks

    def _forward_layer(self, layer: int, blocks: list[int], tokens: list[int], pos: int, n: int) -> None:
        p = torch.arange(pos, pos + n)
        kv = model_kv(layer, p, torch.tensor(tokens[pos:pos + n]), self.h, self.d)
        if self.kv_scales is not None:
            kv = (kv.float() * (1 / self.kv_scales[layer])).to(self.pool.dtype)
        b = torch.tensor(blocks)[p // self.t]
        self.blocks_view()[b, layer, :, :, p % self.t] = kv.permute(1, 0, 2, 3)  # [n, 2, H, D]

    def stored(self, blocks: list[int], n: int) -> torch.Tensor:
        """K/V of the first n positions as stored: `[L, 2, n, H, D]`."""
        p = torch.arange(n)
        b = torch.tensor(blocks)[p // self.t]
        return self.blocks_view()[b, :, :, :, p % self.t].permute(1, 2, 0, 3, 4)

    def expected(self, tokens: list[int], n: int) -> torch.Tensor:
        p = torch.arange(n)
        return torch.stack([model_kv(layer, p, torch.tensor(tokens[:n]), self.h, self.d) for layer in range(self.L)])
