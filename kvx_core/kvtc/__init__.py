"""KVTC: KV cache transform coding (arXiv 2511.01815) for storage and transfer: calibration (per layer group: mean,
PCA basis, a bit allocation by dynamic programming), a torch codec (CPU reference, same code on a GPU) and a
self-describing buffer with a global header, range headers and a checksum. `kvx kvtc` drives it from the CLI."""
from .calibration import Calibration, SideCalibration, calibrate, load_calibration
from .codec import KvtcDecoded, KvtcHeader, compress, decompress, read_header

__all__ = ["Calibration", "KvtcDecoded", "KvtcHeader", "SideCalibration", "calibrate", "compress", "decompress",
           "load_calibration", "read_header"]
