"""Cross-engine KV handoff: the KVX bundle (`bundle`), raw row access by slot (`rows`) and export / import with
conversion between formats, layouts, block sizes and tensor-parallel shards (`handoff`), and a directory store for
offload / reload (`store`). Needs the `xxhash` package (checksums)."""
from .bundle import BundleReader, BundleWriter
from .handoff import (
           ModelFingerprint,
           checkpoint_fingerprint,
           convert_bundle,
           export_bundle,
           fingerprint_from_files,
           import_bundle,
)
from .store import BundleStore

__all__ = ["BundleReader", "BundleStore", "BundleWriter", "ModelFingerprint", "convert_bundle", "export_bundle",
           "checkpoint_fingerprint", "fingerprint_from_files", "import_bundle"]
