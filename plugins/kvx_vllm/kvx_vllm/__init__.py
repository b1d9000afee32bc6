"""KVX plugin for vLLM: `--kv-cache-dtype kvx_nvfp4` (and kvx_mxfp4, kvx_int4, kvx_int8, kvx_k8v4).

`register` is the `vllm.general_plugins` entry point. vLLM calls it in every process (API server,
engine core, workers) before arguments are parsed, possibly more than once, so it is idempotent:
it checks the vLLM version and its APIs (`compat`, `api_check`: 0.26-0.33; 0.26 on CUDA and 0.32 on CPU are
verified end to end, the others accepted with one warning when the API checks pass), adds the `kvx_*` cache
dtypes (`dtypes`), installs the page-size hook of the detected page model and registers the KVX
attention backend (as `CUSTOM`, and behind the platform's default backend path, `CPU_ATTN` / `FLASH_ATTN`,
which then delegates to vLLM's own backend for every non-KVX dtype), the `KvxConnector` KV connector and the
out-of-tree `ParallelLMHead` of the `lm_head` option (`lm_head`).
"""
from __future__ import annotations

import os

from .dtypes import KVX_CACHE_DTYPES

_registered = False


def register() -> None:
    """Entry point: make vLLM accept `kvx_*` cache dtypes and route them to the KVX backend."""
    global _registered
    if _registered:
        return
    from vllm.logger import init_logger

    from .compat import check_registration, check_vllm_version
    from .dtypes import add_cache_dtypes
    from .selection import register_backends
    from .spec026 import install_version_hooks

    verdict = check_vllm_version()
    add_cache_dtypes(verdict.dtype_mode)
    install_version_hooks(verdict.page_mode)
    register_backends()
    warning = check_registration(verdict)
    _register_connector()
    from .lm_head import install as install_lm_head

    install_lm_head()  # the "lm_head" option's out-of-tree ParallelLMHead
    _registered = True
    logger = init_logger("vllm.plugins.kvx")
    if warning is not None:
        logger.warning(warning)
    logger.info("KVX plugin registered in pid %d: kv cache dtypes %s", os.getpid(), ", ".join(KVX_CACHE_DTYPES))


def _register_connector() -> None:
    """`--kv-transfer-config '{"kv_connector": "KvxConnector", ...}'` (see `connector`)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from .options import CONNECTOR

    if CONNECTOR[0] not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(*CONNECTOR)


__all__ = ["KVX_CACHE_DTYPES", "register"]
