"""Drive TGI's real model server over gRPC the way its Rust router does, for the KVX backend tests.

`InProcessServer`: TGI's `get_model_with_lora_adapters` + `TextGenerationService` + a grpc.aio server on a unix
socket, on an event loop in a background thread (TGI's `server.serve` does the same but installs signal
handlers, which only the main thread may). The tests talk to it through `Router` over the socket, and read the
model's KVX caches in process. `launch()` starts the `kvx-tgi-server` launcher as a subprocess instead.

`Router`: what the Rust router does for the server: block allocation (block 0 reserved, as TGI's router
reserves it for health checks), slots, `cache_len` for prefix reuse, `chunk_len` for chunked prefill,
Warmup / Prefill / Decode / FilterBatch / ClearCache calls.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from text_generation_server.pb import generate_pb2 as pb, generate_pb2_grpc as pb_grpc

from ..procs import HANG_S, hung
from .checks import slots_of


class InProcessServer:
    """TGI's service for `model_id` (KVX `fmt`) on `unix://{uds}`, in this process."""

    def __init__(self, model_id: str, uds: str, fmt: str, dtype: str = "bfloat16") -> None:
        import kvx_tgi

        kvx_tgi.install(fmt)
        from grpc import aio
        from text_generation_server.cache import Cache
        from text_generation_server.models import get_model_with_lora_adapters
        from text_generation_server.models.globals import set_adapter_to_index
        from text_generation_server.server import TextGenerationService

        if torch.cuda.is_available():
            # TGI captures every CUDA graph of its process into one pool made at import; a test process serves
            # several models in turn, so each gets the fresh pool its own TGI process would have
            from text_generation_server.models import flash_causal_lm

            flash_causal_lm.MEM_POOL = torch.cuda.graph_pool_handle()
        adapters: dict[str, int] = {}
        self.model = get_model_with_lora_adapters(model_id, [], None, False, None, None, dtype, None, False,
                                                  None, adapters)
        set_adapter_to_index(adapters)  # as `server.serve` does
        self.url = f"unix://{uds}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

        async def start():
            server = aio.server()
            pb_grpc.add_TextGenerationServiceServicer_to_server(TextGenerationService(self.model, Cache(), [self.url]),
                                                                server)
            server.add_insecure_port(self.url)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)

    def _serve(self) -> None:
        torch.set_grad_enabled(False)  # TGI's models/__init__ turns grad off in its (main) thread; this one serves
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


def launcher() -> list[str]:
    """The `kvx-tgi-server` command: the installed console script, else its module (a PYTHONPATH checkout)."""
    exe = Path(sys.executable).parent / "kvx-tgi-server"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvx_tgi.launcher"]


def launch(model_id: str, uds: str, env: dict[str, str], log: Path, *extra: str) -> subprocess.Popen:
    """`kvx-tgi-server serve MODEL --uds-path UDS` as a subprocess (its socket is `UDS-0`)."""
    with open(log, "wb") as f:
        return subprocess.Popen([*launcher(), "serve", model_id, "--uds-path", uds, *extra], env={**os.environ, **env},
                                stdout=f, stderr=subprocess.STDOUT)


def wait_for_socket(url: str, proc: subprocess.Popen | None = None, timeout: float = HANG_S) -> grpc.Channel:
    """A channel to `url` once the server answers Health (raises if `proc` exits first; past `timeout`, a hang,
    the test fails with `procs.hung`'s message). A fresh channel per attempt: a channel that failed to connect backs
    off for up to minutes before it tries again."""
    start = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        channel = grpc.insecure_channel(url)
        try:
            pb_grpc.TextGenerationServiceStub(channel).Health(pb.HealthRequest(), timeout=5)
            return channel
        except grpc.RpcError as e:
            channel.close()
            if time.monotonic() > start + timeout:
                raise AssertionError(hung(f"the TGI server at {url} (no Health answer)", time.monotonic() - start,
                                          str(e))) from None
            time.sleep(0.5)


@dataclass
class Seq:
    """One request as the router tracks it."""

    id: int
    text: str
    max_new_tokens: int
    blocks: list[int]
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


class Router:
    """The router's side of TGI's gRPC protocol, with a block allocator."""

    def __init__(self, channel: grpc.Channel, block_size: int, num_blocks: int | None = None) -> None:
        self.stub = pb_grpc.TextGenerationServiceStub(channel)
        self.block_size = block_size
        self.free: list[int] = []
        self.next_batch = 0
        self.next_request = 0
        self.seqs: dict[int, Seq] = {}
        self.num_blocks = num_blocks
        self.info = self.stub.Info(pb.InfoRequest())

    # ------------------------------------------------------------ memory
    def set_capacity(self, max_supported_total_tokens: int) -> None:
        self.num_blocks = max_supported_total_tokens // self.block_size
        self.free = list(range(self.num_blocks - 1, 0, -1))  # block 0 reserved (the router's health check)

    def alloc(self, n: int) -> list[int]:
        assert len(self.free) >= n, f"out of KV blocks: need {n}, have {len(self.free)}"
        return [self.free.pop() for _ in range(n)]

    def release(self, seq: Seq, keep: int = 0) -> None:
        self.free.extend(seq.blocks[keep:])

    # ------------------------------------------------------------ requests
    @staticmethod
    def _request(rid: int, text: str, max_new_tokens: int, ignore_eos: bool, **fields) -> pb.Request:
        return pb.Request(
            id=rid, inputs=text, input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]), truncate=100_000,
            parameters=pb.NextTokenChooserParameters(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0,
                                                     do_sample=False, seed=0, repetition_penalty=1.0,
                                                     frequency_penalty=0.0),
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens,
                                                              ignore_eos_token=ignore_eos),
            top_n_tokens=0, add_special_tokens=False, **fields)

    def warmup_request(self, text: str, max_new_tokens: int) -> pb.Request:
        """A warmup request: no blocks (the server lays the warmup batch out from block 0, as for the router's)."""
        return self._request(1 << 62, text, max_new_tokens, True)

    def request(self, text: str, *, max_new_tokens: int, prompt_len: int, prefill_logprobs: bool = False,
                shared: Seq | None = None, cache_len: int = 0, chunk_len: int | None = None,
                ignore_eos: bool = True) -> tuple[pb.Request, Seq]:
        """A Request with its blocks and slots; `shared`'s first `cache_len` tokens (whole blocks) are reused."""
        total = prompt_len + max_new_tokens - 1
        need = -(-total // self.block_size)
        reuse = []
        if shared is not None:
            assert cache_len % self.block_size == 0
            reuse = shared.blocks[:cache_len // self.block_size]
        blocks = reuse + self.alloc(need - len(reuse))
        rid = self.next_request
        self.next_request += 1
        seq = Seq(rid, text, max_new_tokens, blocks)
        self.seqs[rid] = seq
        req = self._request(rid, text, max_new_tokens, ignore_eos, prefill_logprobs=prefill_logprobs, blocks=blocks,
                            slots=slots_of(blocks, self.block_size, need * self.block_size), cache_len=cache_len)
        if chunk_len is not None:
            req.chunk_len = chunk_len
        return req, seq

    def batch(self, reqs: list[pb.Request]) -> pb.Batch:
        bid = self.next_batch
        self.next_batch += 1
        return pb.Batch(id=bid, requests=reqs, size=len(reqs), max_tokens=sum(len(r.slots) for r in reqs),
                        max_blocks=max(len(r.blocks) for r in reqs))

    # ------------------------------------------------------------ calls
    def warmup(self, reqs: list[pb.Request], max_total_tokens: int, max_prefill_tokens: int) -> pb.WarmupResponse:
        resp = self.stub.Warmup(pb.WarmupRequest(batch=self.batch(reqs), max_prefill_tokens=max_prefill_tokens,
                                                 max_total_tokens=max_total_tokens,
                                                 max_input_tokens=max_total_tokens - 1))
        self.set_capacity(resp.max_supported_total_tokens)
        return resp

    def _take(self, generations) -> None:
        for g in generations:
            s = self.seqs[g.request_id]
            if g.prefill_tokens.ids:
                s.prompt_ids.extend(g.prefill_tokens.ids)
                s.prompt_logprobs.extend(g.prefill_tokens.logprobs)
            s.tokens.extend(g.tokens.ids)
            if g.HasField("generated_text"):
                s.finished = True

    def prefill(self, reqs: list[pb.Request], cached: pb.CachedBatch | None = None) -> pb.CachedBatch | None:
        r = self.stub.Prefill(pb.PrefillRequest(batch=self.batch(reqs), cached_batch=cached))
        self._take(r.generations)
        return r.batch if r.HasField("batch") else None

    def decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        r = self.stub.Decode(pb.DecodeRequest(batches=batches))
        self._take(r.generations)
        return r.batch if r.HasField("batch") else None

    def filter(self, batch: pb.CachedBatch, keep: list[int]) -> pb.CachedBatch:
        return self.stub.FilterBatch(pb.FilterBatchRequest(batch_id=batch.id, request_ids=keep)).batch

    def clear(self) -> None:
        self.stub.ClearCache(pb.ClearCacheRequest())

    def run_to_end(self, batch: pb.CachedBatch | None) -> None:
        """Decode until every request finished, filtering finished ones out as the router does."""
        while batch is not None:
            batch = self.decode([batch])
            if batch is not None:
                live = [i for i in batch.request_ids if not self.seqs[i].finished]
                if len(live) < len(batch.request_ids):
                    batch = self.filter(batch, live) if live else None
