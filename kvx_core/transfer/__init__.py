"""Cross-engine KV handoff: the KVX bundle (`bundle`), raw row access by slot (`rows`) and export / import with
conversion between formats, layouts and block sizes (`handoff`). Needs the `xxhash` package (checksums)."""
from .bundle import BundleReader, BundleWriter
from .handoff import ModelFingerprint, export_bundle, fingerprint_from_files, import_bundle

__all__ = ["BundleReader", "BundleWriter", "ModelFingerprint", "export_bundle", "fingerprint_from_files",
           "import_bundle"]
