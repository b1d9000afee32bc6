"""The served model's fingerprint (`kvx_core.transfer.ModelFingerprint`), which KV bundles (the connector) and the
KV-cache calibration file (`calibration`) are checked against."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvx_core.transfer import ModelFingerprint, fingerprint_from_files

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def model_fingerprint(vllm_config: VllmConfig) -> ModelFingerprint:
    """The served model's fingerprint from its local config.json and tokenizer.json (ValueError when absent)."""
    mc = vllm_config.model_config
    paths = []
    for root, name in ((mc.model, "config.json"), (mc.tokenizer or mc.model, "tokenizer.json")):
        p = os.path.join(root, name)
        if not os.path.isfile(p):
            from huggingface_hub import try_to_load_from_cache

            p = try_to_load_from_cache(root, name, revision=mc.revision)
        if not isinstance(p, str) or not os.path.isfile(p):
            raise ValueError(f"KVX: cannot find {name} of {root!r} locally; the model fingerprint (KV bundles, KV "
                             "calibration) hashes the model's config.json and tokenizer.json (serve a local "
                             "checkpoint directory)")
        paths.append(p)
    return fingerprint_from_files(*paths)
