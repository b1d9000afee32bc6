"""KVX ops: reference (torch) implementations; GPU kernels register beside them."""
from .reference import gather_kv, write_kv

__all__ = ["gather_kv", "write_kv"]
