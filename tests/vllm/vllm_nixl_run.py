"""One vLLM instance (CPU, SmolLM2-135M) of a prefill/decode handoff through `KvxConnector`'s NIXL transport.

    python tests/vllm/vllm_nixl_run.py CKPT CACHE_DTYPE BLOCK_SIZE producer|consumer

producer: prefill prompt set "a" of `vllm_pd_run.py` (one output token) with `kv_transfer_params`
{"do_remote_decode": true}, as vLLM's P/D proxies send it; print "KVX_PARAMS <json>", the requests' returned
`kv_transfer_params` (the tickets), then keep the NIXL buffer published until a line arrives on stdin.
consumer: read that JSON line from stdin (the proxy's part), generate each prompt with its producer's
`kv_transfer_params`, then the last prompt again with a stale ticket (a seq the producer never published), then all
prompts computing everything locally (`skip_reading_prefix_cache`: the single-instance reference); print
"KVX_RESULT <json>".
"""
from __future__ import annotations

import json
import sys

from vllm_pd_run import GEN, PROMPTS, _result

NIXL = {"transport": "nixl", "nixl_buffer": "64MiB", "nixl_slots": 4, "nixl_hold_s": 600}


def main(ckpt: str, dtype: str, block: int, role: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt, dtype="bfloat16", kv_cache_dtype=dtype, block_size=block, max_model_len=1024,
              enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=512, enable_prefix_caching=True, seed=0,
              distributed_executor_backend="uni",
              kv_transfer_config={"kv_connector": "KvxConnector", "kv_role": f"kv_{role}",
                                  "kv_load_failure_policy": "recompute"},
              additional_config={"kvx": NIXL})
    prompts = PROMPTS["a"]
    if role == "producer":
        done = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1,
                                                    extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
                            use_tqdm=False)
        print("KVX_PARAMS " + json.dumps([r.kv_transfer_params for r in done]), flush=True)
        sys.stdin.readline()  # the buffer stays published until the consumer is done
        return
    params = json.loads(sys.stdin.readline())
    stale = {"kvx_ticket": {**params[-1]["kvx_ticket"], "seq": params[-1]["kvx_ticket"]["seq"] + 1000}}
    greedy = dict(temperature=0.0, max_tokens=GEN, logprobs=5, ignore_eos=True)
    handed = llm.generate(prompts, [SamplingParams(**greedy, extra_args={"kv_transfer_params": p}) for p in params],
                          use_tqdm=False)
    llm.reset_prefix_cache()  # the stale ticket's prompt must not hit vLLM's own cache of the loaded one
    refused = llm.generate(prompts[-1:], SamplingParams(**greedy, extra_args={"kv_transfer_params": stale}),
                           use_tqdm=False)
    local = llm.generate(prompts, SamplingParams(**greedy, skip_reading_prefix_cache=True), use_tqdm=False)
    out = {"dtype": dtype, "handoff": [_result(r) for r in handed], "stale": _result(refused[0]),
           "local": [_result(r) for r in local]}
    print("KVX_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
