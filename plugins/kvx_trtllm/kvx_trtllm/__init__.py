"""KVX for TensorRT-LLM: its KV pools and offset tables as KVX descriptors (`describe_trtllm_cache`) and a KV cache
connector over KVX bundles (`kvx_trtllm.connector`). TensorRT-LLM itself is imported only by the connector, and
only where it is installed."""
from .cache import TrtllmLayer, describe_trtllm_cache, layer_views

__all__ = ["TrtllmLayer", "describe_trtllm_cache", "layer_views"]
