"""The public Python API: `kvx_core` exports the dispatching ops and the names an engine needs, and importing
the package stays cheap (no torch, no triton) until a name is used."""
from __future__ import annotations

import subprocess
import sys

import kvx_core
from kvx_core import cache, descriptors, errors, formats
from kvx_core.ops import dispatch

PUBLIC = {
    "CacheDesc": descriptors, "TensorDesc": descriptors, "BlockTable": descriptors, "SlotMapping": descriptors,
    "SeqLens": descriptors, "QuantDesc": descriptors, "ScaleDesc": descriptors, "WriteDesc": descriptors,
    "GatherDesc": descriptors, "KvIoDesc": descriptors,
    "get_format": formats, "list_formats": formats,
    "PagedKVCache": cache,
    "plan_decode": dispatch, "plan_prefill": dispatch, "bind": dispatch, "write_kv": dispatch,
    "gather_kv": dispatch, "paged_decode": dispatch, "paged_prefill": dispatch,
    "KvxError": errors, "Status": errors,
}


def test_all_lists_exactly_the_public_names():
    assert sorted(kvx_core.__all__) == sorted(PUBLIC)


def test_public_names_are_the_dispatching_ones():
    for name, module in PUBLIC.items():
        assert getattr(kvx_core, name) is getattr(module, name), name
    assert kvx_core.write_kv is dispatch.write_kv
    assert kvx_core.gather_kv is dispatch.gather_kv
    assert kvx_core.paged_decode is dispatch.paged_decode
    assert kvx_core.paged_prefill is dispatch.paged_prefill


def test_star_import_gives_the_public_names():
    namespace: dict = {}
    exec("from kvx_core import *", namespace)
    assert {name for name in namespace if not name.startswith("__")} == set(PUBLIC)


def test_ops_package_exports_no_op():
    """One public name per op: the torch reference is `kvx_core.ops.reference.write_kv`, not `ops.write_kv`."""
    import kvx_core.ops as ops
    for name in ("write_kv", "gather_kv", "paged_decode", "paged_prefill"):
        assert not hasattr(ops, name), name


def test_unknown_name_is_an_attribute_error():
    try:
        kvx_core.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("kvx_core.no_such_name resolved")


def _fresh(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_kvx_core_is_cheap():
    _fresh("import sys, kvx_core; assert 'triton' not in sys.modules; assert 'torch' not in sys.modules")


def test_using_the_public_api_does_not_import_triton():
    _fresh("import sys, kvx_core; kvx_core.write_kv; kvx_core.PagedKVCache; kvx_core.plan_decode; "
           "assert 'triton' not in sys.modules, 'triton imported'")
