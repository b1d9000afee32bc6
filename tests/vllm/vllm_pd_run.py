"""One vLLM instance (CPU, SmolLM2-135M) of a prefill/decode handoff through `KvxConnector`; prints one JSON line.

    python tests/vllm/vllm_pd_run.py CKPT CACHE_DTYPE BLOCK_SIZE STORE ROLE [--consume NAME] [--produce NAMES]
                                     [--prefix NAME] [--ttft NAME] [--reload] [--damage] [--kvtc CAL]

ROLE is vLLM's kv_role. `--consume NAME`: generate the prompt set NAME with the prompts' KV loaded from STORE (the
disaggregated decode), then again computing everything locally (`skip_reading_prefix_cache`: the single-instance
reference with this instance's cache dtype). `--produce NAMES`: compute the prompt sets NAMES (comma-separated; one
output token each), which stores the prompts' KV. `--ttft NAME`: per prompt of set NAME, alone, the wall time to its
first output token with its KV loaded from STORE, then computing it locally (after `--consume`: kernels warm).
`--prefix NAME`: prefix reuse: a prompt of the first 90% of the tokens of set NAME's last
prompt (stored) plus new tokens, generated after dropping vLLM's prefix cache (its stored prefix loaded from STORE)
and again computing everything locally. `--reload`: offload and reload: generate a new prompt (stored), drop vLLM's
prefix cache, generate it again (loaded from STORE). `--damage`: before consuming, flip one byte in the last chunk
of the store entry of the consumed set's last prompt (a faulty disk). The load-failure policy is "recompute" on vLLM
0.32 (that request is recomputed) and "fail" on 0.26 (it ends with finish_reason "error"; the connector refuses
"recompute" there). `--kvtc CAL`: the connector's `kvtc` setting (store entries KVTC-coded with calibration CAL).
"""
from __future__ import annotations

import json
import os
import sys
import time

BASE = ("In a quiet harbour town, the lighthouse keeper kept a journal of every ship that passed. "
        "Each entry noted the weather, the colour of the sails and the name painted on the hull. ")
PROMPTS = {name: [BASE * (3 + i) + f"Entry {k}{i}: the ship" for i in range(3)]
           for k, name in enumerate(("a", "b", "c"))}
RELOAD = BASE * 5 + "The last entry of the journal, kept in {}, reads:"
NEW = " That night a storm broke, and the keeper wrote only one line:"
GEN = 16
# the store's prefix-lookup block (the `store_prefix_block` setting), the same for every instance of a store
PREFIX_BLOCK = 16


def _result(req) -> dict:
    o = req.outputs[0]
    return {"prompt_tokens": len(req.prompt_token_ids), "cached": req.num_cached_tokens,
            "finish_reason": o.finish_reason,
            "tokens": list(o.token_ids),
            "logprobs": [sorted((k, v.logprob) for k, v in lp.items()) for lp in o.logprobs]}


def _damage(llm, store: str, prompt: str) -> None:
    from kvx_core.transfer import BundleStore
    from kvx_vllm.connector import model_fingerprint

    ids = llm.get_tokenizer()(prompt)["input_ids"]
    path = BundleStore(store).path(model_fingerprint(llm.llm_engine.vllm_config), ids)
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0x10  # inside the last layer's payload
    path.write_bytes(bytes(blob))


def _prefix(llm, prompt: str, greedy: dict) -> dict:
    """Generate the first 90% of `prompt`'s tokens plus `NEW` with vLLM's prefix cache dropped (the stored prefix
    loaded from the store), then computing everything locally; the prompt's shared and stored token counts."""
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    stored = tok(prompt)["input_ids"]
    ids = stored[:len(stored) * 9 // 10] + tok(NEW, add_special_tokens=False)["input_ids"]
    llm.reset_prefix_cache()
    hit = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**greedy), use_tqdm=False)[0]
    local = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**greedy, skip_reading_prefix_cache=True),
                         use_tqdm=False)[0]
    return {"stored": len(stored), "shared": len(os.path.commonprefix([stored, ids])), "block": PREFIX_BLOCK,
            "hit": _result(hit), "local": _result(local)}


def _ttft(llm, prompts: list[str]) -> list[dict]:
    """Per prompt, alone: seconds to the first output token with the KV handed over, then computed locally."""
    from vllm import SamplingParams

    out = []
    for prompt in prompts:
        row = {}
        for how, extra in (("handoff", {}), ("local", {"skip_reading_prefix_cache": True})):
            t0 = time.perf_counter()
            r = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, **extra),
                             use_tqdm=False)[0]
            row[how] = {"seconds": round(time.perf_counter() - t0, 4), **_result(r)}
        out.append(row)
    return out


def main(ckpt: str, dtype: str, block: int, store: str, role: str, consume: str | None, produce: str | None,
         reload: bool, damage: bool, kvtc: str | None = None, prefix: str | None = None,
         ttft: str | None = None) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    policy = "fail" if vllm.__version__.startswith("0.26") else "recompute"  # the connector refuses it on 0.26
    llm = LLM(model=ckpt, dtype="bfloat16", kv_cache_dtype=dtype, block_size=block, max_model_len=1024,
              enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=512, enable_prefix_caching=True, seed=0,
              distributed_executor_backend="uni",
              kv_transfer_config={"kv_connector": "KvxConnector", "kv_role": role,
                                  "kv_load_failure_policy": policy},
              additional_config={"kvx": {"store": store, "store_prefix_block": PREFIX_BLOCK,
                                         **({"kvtc": kvtc} if kvtc else {})}})
    out: dict = {"dtype": dtype, "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                 "failure_policy": policy}
    greedy = dict(temperature=0.0, max_tokens=GEN, logprobs=5, ignore_eos=True)
    if damage:
        _damage(llm, store, PROMPTS[consume][-1])
    if consume:
        handed = llm.generate(PROMPTS[consume], SamplingParams(**greedy), use_tqdm=False)
        local = llm.generate(PROMPTS[consume], SamplingParams(**greedy, skip_reading_prefix_cache=True),
                             use_tqdm=False)
        out["consumed"] = {"handoff": [_result(r) for r in handed], "local": [_result(r) for r in local]}
    if ttft:
        out["ttft"] = _ttft(llm, PROMPTS[ttft])
    if produce:
        out["produced"] = {}
        for name in produce.split(","):
            done = llm.generate(PROMPTS[name], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            out["produced"][name] = [len(r.prompt_token_ids) for r in done]
    if prefix:
        out["prefix"] = _prefix(llm, PROMPTS[prefix][-1], greedy)
    if reload:
        prompt = RELOAD.format(dtype)
        first = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
        llm.reset_prefix_cache()
        again = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
        out["reload"] = {"first": _result(first), "again": _result(again)}
    return out


if __name__ == "__main__":
    args = sys.argv[1:]

    def opt(name: str) -> str | None:
        return args[args.index(name) + 1] if name in args else None

    res = main(args[0], args[1], int(args[2]), args[3], args[4], opt("--consume"), opt("--produce"),
               "--reload" in args, "--damage" in args, opt("--kvtc"), opt("--prefix"), opt("--ttft"))
    print("KVX_RESULT " + json.dumps(res), flush=True)
