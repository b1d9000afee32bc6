"""CUDA-graph capture of sync-free KVX calls, as engines capture their decode steps (tests and benchmarks use it
to prove the kernels, plans and merges capture and replay)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `fn` up on a side stream (as torch requires before capture), then capture it: (graph, its result
    tensors, which each replay overwrites)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
