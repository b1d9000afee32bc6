"""KVX C ABI conformance (spec §9 "ABI size checks for all public structs", §3 versioning).

The oracle is the C compiler: a probe program generated from the ctypes mirror's `_fields_` and
from kvx_core/enums.py includes kvx_abi.h and prints sizeof/offsetof of every field and the value of
every constant. The header text is also parsed, so a field, constant, macro or function added on
one side only fails. No C compiler is a failure, not a skip (CI has gcc).
"""
from __future__ import annotations

import ctypes
import enum
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvx_core import abi as kvx_abi, enums
from kvx_core.abi import (
    ABI_VERSION,
    C_NAMES,
    CACHE_DESC_V1_0_SIZE,
    HEADER_PATH,
    MAX_DIMS,
    QUANT_DESC_V1_1_SIZE,
    QUANT_DESC_V1_2_SIZE,
    V1_0_SIZES,
    CacheDescC,
    PoolDescC,
    QuantDescC,
    TensorDescC,
    VersionC,
    center_of,
    check_struct_size,
    get_version,
    negotiate,
    new,
    quant_of,
    smoothing_of,
)
from kvx_core.enums import BlockTableFormat, DType, Layout, Memory, QuantFormat, ScaleGranularity
from kvx_core.errors import KvxError, Status

from .procs import run

# --------------------------------------------------------------------------------------------
# What the header must declare, derived from the Python side
# --------------------------------------------------------------------------------------------

#: C enum typedef -> (constant prefix, Python enum). Layouts other than UNSPECIFIED are spelled
#: KVX_LAYOUT_BLOCK_<name> in C (spec §4.2).
C_ENUMS = {
    "kvx_status_t": ("KVX_STATUS_", Status),
    "kvx_dtype_t": ("KVX_DTYPE_", DType),
    "kvx_layout_t": ("KVX_LAYOUT_", Layout),
    "kvx_memory_type_t": ("KVX_MEMORY_", Memory),
    "kvx_block_table_format_t": ("KVX_BLOCK_TABLE_", BlockTableFormat),
    "kvx_scale_granularity_t": ("KVX_SCALE_GRANULARITY_", ScaleGranularity),
    "kvx_quant_format_t": ("KVX_QUANT_FORMAT_", QuantFormat),
}


def _c_constant(prefix: str, member: enum.IntEnum) -> str:
    if isinstance(member, Layout) and member is not Layout.UNSPECIFIED:
        return f"{prefix}BLOCK_{member.name}"
    return prefix + member.name


#: C enum typedef -> {constant name: value}.
ENUM_CONSTANTS: dict[str, dict[str, int]] = {
    c_type: {_c_constant(prefix, m): int(m) for m in py_enum} for c_type, (prefix, py_enum) in C_ENUMS.items()
}

#: Every object-like KVX_ macro with a value, and the Python constant it mirrors.
MACROS: dict[str, int] = {
    "KVX_VERSION_MAJOR": ABI_VERSION[0],
    "KVX_VERSION_MINOR": ABI_VERSION[1],
    "KVX_VERSION_PATCH": ABI_VERSION[2],
    "KVX_MAX_DIMS": MAX_DIMS,
    "KVX_BLOCK_TABLE_FLAG_KVCACHEINDEX": enums.BLOCK_TABLE_FLAG_KVCACHEINDEX,
    "KVX_KVCACHEINDEX_SECONDARY_BIT": enums.KVCACHEINDEX_SECONDARY_BIT,
    "KVX_KVCACHEINDEX_NULL": enums.KVCACHEINDEX_NULL,
    "KVX_QUANT_FLAG_HADAMARD": enums.QUANT_FLAG_HADAMARD,
    "KVX_QUANT_FLAG_MX_SCALE_FLOOR": enums.QUANT_FLAG_MX_SCALE_FLOOR,
    "KVX_QUANT_FLAG_V_SCALE_INTERLEAVE4": enums.QUANT_FLAG_V_SCALE_INTERLEAVE4,
    "KVX_QUANT_FLAG_KEY_SMOOTHING": enums.QUANT_FLAG_KEY_SMOOTHING,
    "KVX_QUANT_FLAG_KEY_CENTERING": enums.QUANT_FLAG_KEY_CENTERING,
    "KVX_CACHE_DESC_V1_0_SIZE": CACHE_DESC_V1_0_SIZE,
    "KVX_QUANT_DESC_V1_1_SIZE": QUANT_DESC_V1_1_SIZE,
    "KVX_QUANT_DESC_V1_2_SIZE": QUANT_DESC_V1_2_SIZE,
}
#: Object-like macros that carry no value (include guard, export attribute).
NON_VALUE_MACROS = {"KVX_ABI_H", "KVX_API"}

#: Entry points (spec §7): name -> (return type, parameter types).
PROTOTYPES: dict[str, tuple[str, str]] = {
    "kvx_get_version": ("kvx_status_t", "kvx_version_t*"),
    "kvx_validate_cache_desc": ("kvx_status_t", "const kvx_cache_desc_t*"),
    "kvx_write_kv": ("kvx_status_t", "const kvx_cache_desc_t*, const kvx_write_desc_t*, void*"),
    "kvx_gather_kv": ("kvx_status_t", "const kvx_cache_desc_t*, const kvx_gather_desc_t*, void*"),
}

STRICT_C = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"]
STRICT_CXX = ["-std=c++11", "-Wall", "-Wextra", "-Werror", "-pedantic"]


# --------------------------------------------------------------------------------------------
# Compilers and the header text
# --------------------------------------------------------------------------------------------


def _compiler(env: str, *names: str) -> str:
    found = os.environ.get(env) or next(filter(None, map(shutil.which, names)), None)
    if not found:
        pytest.fail(f"no compiler found (${env} or {' / '.join(names)}): the ABI checks need one")
    return found


@pytest.fixture(scope="module")
def cc() -> str:
    return _compiler("CC", "cc", "gcc", "clang")


@pytest.fixture(scope="module")
def cxx() -> str:
    return _compiler("CXX", "c++", "g++", "clang++")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return run(cmd)


def _compile(cmd: list[str]) -> None:
    proc = _run(cmd)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"


def _header_code() -> str:
    """kvx_abi.h without comments."""
    text = HEADER_PATH.read_text()
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def _header_structs() -> dict[str, list[tuple[str, str]]]:
    """typedef name -> [(field name, C type)] in declaration order, as written in the header
    (one field per declaration; types normalised to e.g. `const float*`, `int64_t[KVX_MAX_DIMS]`)."""
    out = {}
    for tag, body, name in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", _header_code(), re.S):
        assert tag == name, f"struct tag {tag} != typedef {name}"
        fields = []
        for decl in filter(None, (" ".join(d.split()) for d in body.split(";"))):
            m = re.fullmatch(r"([\w\s*]+?)\s*\b(\w+)\s*(\[\w+\])?", decl)
            assert m, f"{name}: cannot parse field declaration {decl!r} (one field per declaration)"
            fields.append((m.group(2), m.group(1).replace(" *", "*") + (m.group(3) or "")))
        out[name] = fields
    return out


def _c_type(ctype: type) -> str:
    """The C type a ctypes field type mirrors; "enum" for the c_int32 that stands for a C enum."""
    if ctype in C_NAMES:
        return C_NAMES[ctype]
    if issubclass(ctype, ctypes.Array):
        assert ctype._length_ == MAX_DIMS
        return f"{_c_type(ctype._type_)}[KVX_MAX_DIMS]"
    if issubclass(ctype, ctypes._Pointer):  # typed pointers in the ABI are all pointers to const
        return f"const {_c_type(ctype._type_)}*"
    scalars = {ctypes.c_uint32: "uint32_t", ctypes.c_int64: "int64_t", ctypes.c_int32: "enum",
               ctypes.c_void_p: "void*", ctypes.c_float: "float"}
    return scalars[ctype]


def _header_enums() -> dict[str, list[str]]:
    found = re.findall(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", _header_code(), re.S)
    return {name: re.findall(r"(\w+)\s*=", body) for _tag, body, name in found}


# --------------------------------------------------------------------------------------------
# The probe: sizeof / alignment / offsetof / constants as the compiler sees them
# --------------------------------------------------------------------------------------------


def _probe_source() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvx_abi.h"', ""]
    for c_name in C_NAMES.values():
        lines.append(f"typedef struct {{ char c; {c_name} t; }} align_{c_name};")
    lines += ["", "int main(void) {"]

    def emit(key: str, expr: str) -> None:
        lines.append(f'    printf("{key} %lld\\n", (long long)({expr}));')

    for cls, c_name in C_NAMES.items():
        emit(f"sizeof {c_name}", f"sizeof({c_name})")
        emit(f"alignof {c_name}", f"offsetof(align_{c_name}, t)")
        for field, _ctype in cls._fields_:
            emit(f"offsetof {c_name}.{field}", f"offsetof({c_name}, {field})")
            emit(f"sizeof {c_name}.{field}", f"sizeof((({c_name}*)0)->{field})")
    for c_type, constants in ENUM_CONSTANTS.items():
        emit(f"sizeof {c_type}", f"sizeof({c_type})")
        for name in constants:
            emit(f"value {name}", name)
    for name in MACROS:
        emit(f"value {name}", name)
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def _expected_probe() -> dict[str, int]:
    exp = {}
    for cls, c_name in C_NAMES.items():
        exp[f"sizeof {c_name}"] = ctypes.sizeof(cls)
        exp[f"alignof {c_name}"] = ctypes.alignment(cls)
        for field, _ctype in cls._fields_:
            exp[f"offsetof {c_name}.{field}"] = getattr(cls, field).offset
            exp[f"sizeof {c_name}.{field}"] = getattr(cls, field).size
    for c_type, constants in ENUM_CONSTANTS.items():
        exp[f"sizeof {c_type}"] = 4
        exp.update({f"value {name}": value for name, value in constants.items()})
    exp.update({f"value {name}": value for name, value in MACROS.items()})
    return exp


@pytest.fixture(scope="module", params=["c", "c++"])
def probe(request, tmp_path_factory, cc, cxx) -> dict[str, int]:
    """Compile and run the probe as C99 or C++11 (strict warnings), parse its output."""
    lang = request.param
    tmp = tmp_path_factory.mktemp(f"abi_probe_{lang.replace('+', 'x')}")
    src = tmp / ("probe.c" if lang == "c" else "probe.cpp")
    src.write_text(_probe_source())
    exe = tmp / "probe"
    compiler, flags = (cc, STRICT_C) if lang == "c" else (cxx, STRICT_CXX)
    _compile([compiler, *flags, "-I", str(HEADER_PATH.parent), str(src), "-o", str(exe)])
    proc = _run([str(exe)])
    assert proc.returncode == 0, proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        key, value = line.rsplit(" ", 1)
        out[key] = int(value)
    return out


def test_probe_covers_every_mirrored_item(probe):
    assert set(probe) == set(_expected_probe())


@pytest.mark.parametrize("cls", list(C_NAMES), ids=lambda c: C_NAMES[c])
def test_struct_layout_matches_header(probe, cls):
    """§9: sizeof, alignment and every field's offset and size agree between C and ctypes."""
    c_name = C_NAMES[cls]
    exp = {k: v for k, v in _expected_probe().items() if k.split(" ", 1)[1].split(".")[0] == c_name}
    got = {k: probe[k] for k in exp}
    assert got == exp


@pytest.mark.parametrize("c_type", list(ENUM_CONSTANTS))
def test_enum_values_match_enums_py(probe, c_type):
    assert probe[f"sizeof {c_type}"] == 4
    got = {name: probe[f"value {name}"] for name in ENUM_CONSTANTS[c_type]}
    assert got == ENUM_CONSTANTS[c_type]


def test_macro_values_match_python(probe):
    assert {name: probe[f"value {name}"] for name in MACROS} == MACROS


# --------------------------------------------------------------------------------------------
# The header declares exactly what the mirror knows: no extra field, constant, macro or function
# --------------------------------------------------------------------------------------------


def test_header_struct_fields_equal_mirror():
    """Same fields, same order, same C types (signedness included) in the header and the mirror."""
    header = _header_structs()
    assert set(header) == set(C_NAMES.values())
    for cls, c_name in C_NAMES.items():
        assert [f for f, _ in header[c_name]] == [f for f, _ in cls._fields_], c_name
        for (field, c_type), (_, ctype) in zip(header[c_name], cls._fields_, strict=True):
            want = _c_type(ctype)
            ok = c_type in ENUM_CONSTANTS if want == "enum" else c_type == want
            assert ok, f"{c_name}.{field} is {c_type} in the header, the mirror says {want}"
        assert header[c_name][0] == ("size", "uint32_t"), f"{c_name} must start with uint32_t size"


def test_header_enum_constants_equal_enums_py():
    header = _header_enums()
    assert set(header) == set(ENUM_CONSTANTS)
    for c_type, names in header.items():
        assert names == list(ENUM_CONSTANTS[c_type]), c_type


def test_header_macros_equal_python_constants():
    defined = set(re.findall(r"^\s*#\s*define\s+(KVX_\w+)\b(?!\()", _header_code(), re.M))
    assert defined == set(MACROS) | NON_VALUE_MACROS


def test_header_functions_equal_spec():
    declared = re.findall(r"KVX_API\s+(\w+)\s+(kvx_\w+)\s*\(", _header_code())
    assert {name: ret for ret, name in declared} == {name: ret for name, (ret, _) in PROTOTYPES.items()}


# --------------------------------------------------------------------------------------------
# The header compiles cleanly as C99 and C++, with the documented prototypes
# --------------------------------------------------------------------------------------------


def _prototype_tu() -> str:
    members = "\n".join(f"    {ret} (*{name})({params});" for name, (ret, params) in PROTOTYPES.items())
    inits = ", ".join(f"&{name}" for name in PROTOTYPES)
    return (
        '#include "kvx_abi.h"\n'
        f"struct kvx_abi_prototypes {{\n{members}\n}};\n"
        f"struct kvx_abi_prototypes kvx_abi_prototypes_check = {{ {inits} }};\n"
    )


def test_header_compiles_strict_c99(tmp_path, cc):
    src = tmp_path / "tu.c"
    src.write_text(_prototype_tu())
    _compile([cc, *STRICT_C, "-I", str(HEADER_PATH.parent), "-c", str(src), "-o", str(tmp_path / "tu.o")])


def test_header_compiles_strict_cxx(tmp_path, cxx):
    src = tmp_path / "tu.cpp"
    src.write_text(_prototype_tu())
    _compile([cxx, *STRICT_CXX, "-fsyntax-only", "-I", str(HEADER_PATH.parent), str(src)])
    _compile([cxx, *STRICT_CXX, "-fsyntax-only", "-x", "c++", str(HEADER_PATH)])


def test_header_rejects_short_enums(tmp_path, cc):
    """Enum-typed fields are 4 bytes; the header's static asserts refuse -fshort-enums."""
    src = tmp_path / "tu.c"
    src.write_text('#include "kvx_abi.h"\n')
    proc = _run([cc, "-fshort-enums", "-I", str(HEADER_PATH.parent), "-c", str(src), "-o", str(tmp_path / "tu.o")])
    assert proc.returncode != 0 and "kvx_abi_static_assert_" in proc.stderr


def test_header_ships_with_package():
    assert HEADER_PATH == Path(kvx_abi.__file__).with_name("kvx_abi.h") and HEADER_PATH.is_file()


# --------------------------------------------------------------------------------------------
# Versioning and size guards (spec §3, §6)
# --------------------------------------------------------------------------------------------


def test_get_version():
    v = get_version()
    assert isinstance(v, VersionC)
    assert v.size == ctypes.sizeof(VersionC) == 16
    assert (v.major, v.minor, v.patch) == ABI_VERSION == (1, 3, 0)


def test_negotiate_accepts_same_major_any_minor():
    negotiate(get_version())
    negotiate((1, 0, 0))  # older minor
    negotiate((1, 7, 3))  # newer minor: structs are size-guarded
    bigger = VersionC(ctypes.sizeof(VersionC) + 8, 1, 9, 0)  # newer minor with a grown struct
    negotiate(bigger)


@pytest.mark.parametrize("provider", [(0, 9, 0), (2, 0, 0), VersionC(16, 2, 1, 0)])
def test_negotiate_rejects_major_mismatch(provider):
    with pytest.raises(KvxError) as e:
        negotiate(provider)
    assert e.value.status is Status.INCOMPATIBLE


@pytest.mark.parametrize("provider", [VersionC(0, 1, 1, 0), VersionC(12, 1, 1, 0), (1, 1), (1, -1, 0)])
def test_negotiate_rejects_malformed_version(provider):
    with pytest.raises(KvxError) as e:
        negotiate(provider)
    assert e.value.status is Status.INVALID_ARGUMENT


def test_cache_desc_v1_0_size_is_offset_of_quant():
    assert CACHE_DESC_V1_0_SIZE == CacheDescC.quant.offset
    assert CACHE_DESC_V1_0_SIZE + ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(CacheDescC)
    assert V1_0_SIZES[CacheDescC] == CACHE_DESC_V1_0_SIZE
    ptr = ctypes.sizeof(ctypes.c_void_p)
    assert V1_0_SIZES[QuantDescC] == QUANT_DESC_V1_1_SIZE == QuantDescC.k_smoothing.offset == 272
    assert QUANT_DESC_V1_2_SIZE == QuantDescC.k_center.offset == QUANT_DESC_V1_1_SIZE + ptr == 280
    assert QUANT_DESC_V1_2_SIZE + ptr == ctypes.sizeof(QuantDescC) == 288


def test_quant_flags_are_distinct_bits():
    """v1.3's KVX_QUANT_FLAG_KEY_CENTERING takes a bit no earlier flag uses."""
    flags = [getattr(enums, n) for n in dir(enums) if n.startswith("QUANT_FLAG_")]
    assert len(flags) == 5 and all(f & (f - 1) == 0 for f in flags) and len(set(flags)) == len(flags)
    assert enums.QUANT_FLAG_KEY_CENTERING == 0x10


def test_v1_0_cache_desc_is_accepted_with_quant_absent():
    desc = new(CacheDescC, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64)
    quant = new(QuantDescC, format=QuantFormat.NVFP4, group_size=16)
    desc.quant = ctypes.pointer(quant)
    desc.size = CACHE_DESC_V1_0_SIZE  # a v1.0 producer: the tail is not there
    assert check_struct_size(desc, CacheDescC) == CACHE_DESC_V1_0_SIZE
    assert check_struct_size(CACHE_DESC_V1_0_SIZE, CacheDescC, CACHE_DESC_V1_0_SIZE) == CACHE_DESC_V1_0_SIZE
    assert quant_of(desc) is None


def test_v1_1_cache_desc_carries_quant():
    desc = new(CacheDescC, num_blocks=4)
    assert quant_of(desc) is None  # NULL quant: unquantized
    gscale = (ctypes.c_float * 2)(1.0, 0.5)
    quant = new(
        QuantDescC,
        format=QuantFormat.NVFP4,
        flags=enums.QUANT_FLAG_HADAMARD,
        group_size=16,
        k_data_dtype=DType.FP4_E2M1X2,
        v_data_dtype=DType.FP4_E2M1X2,
        k_global_scale=ctypes.cast(gscale, ctypes.POINTER(ctypes.c_float)),
        global_scale_count=2,
    )
    desc.quant = ctypes.pointer(quant)
    got = quant_of(desc)
    assert got.format == QuantFormat.NVFP4 and got.group_size == 16 and got.k_scales.size == ctypes.sizeof(TensorDescC)
    assert got.k_global_scale[1] == 0.5 and not got.v_global_scale
    desc.size = ctypes.sizeof(CacheDescC) + 32  # a newer minor appended fields: still read
    assert quant_of(desc) is not None
    quant.size = 8  # a truncated quant descriptor is malformed
    with pytest.raises(KvxError) as e:
        quant_of(desc)
    assert e.value.status is Status.INVALID_ARGUMENT


@pytest.mark.parametrize("size", [0, 4, CACHE_DESC_V1_0_SIZE - 1])
def test_cache_desc_smaller_than_v1_0_is_rejected(size):
    desc = new(CacheDescC)
    desc.size = size
    for arg in (desc, size):
        with pytest.raises(KvxError) as e:
            check_struct_size(arg, CacheDescC, CACHE_DESC_V1_0_SIZE)
        assert e.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(KvxError):
        quant_of(desc)


def test_check_struct_size_accepts_newer_and_rejects_wrong_type():
    assert check_struct_size(ctypes.sizeof(PoolDescC) + 64, PoolDescC) == ctypes.sizeof(PoolDescC)
    with pytest.raises(KvxError) as e:
        check_struct_size(new(PoolDescC), CacheDescC)
    assert e.value.status is Status.INVALID_ARGUMENT


def test_new_sets_sizes_recursively_and_fills_arrays():
    desc = new(CacheDescC, k=new(TensorDescC, dtype=DType.BF16, layout=Layout.NHD, ndim=4, shape=[4, 16, 2, 64]))
    assert desc.size == ctypes.sizeof(CacheDescC)
    assert desc.v.size == desc.k.size == ctypes.sizeof(TensorDescC)
    assert desc.pool.size == ctypes.sizeof(PoolDescC)
    assert list(desc.k.shape) == [4, 16, 2, 64, 0] and desc.k.dtype == DType.BF16
    with pytest.raises(KvxError):
        new(TensorDescC, shape=[1] * (MAX_DIMS + 1))
    with pytest.raises(KvxError):
        new(TensorDescC, no_such_field=1)


KEY_VECTOR_CASES = [  # (reader, field, its flag, the size of the version before the field)
    pytest.param(smoothing_of, "k_smoothing", enums.QUANT_FLAG_KEY_SMOOTHING, QUANT_DESC_V1_1_SIZE,
                 id="v1.2_smoothing"),
    pytest.param(center_of, "k_center", enums.QUANT_FLAG_KEY_CENTERING, QUANT_DESC_V1_2_SIZE, id="v1.3_centering"),
]


@pytest.mark.parametrize("reader, field, flag, older_size", KEY_VECTOR_CASES)
def test_key_vector_needs_its_flag_and_a_size_that_holds_it(reader, field, flag, older_size):
    """`k_smoothing` (v1.2) / `k_center` (v1.3) is read only from a descriptor whose size holds it, and only
    together with its flag (which an older consumer does not know and so refuses); an older-sized one has none."""
    s = (ctypes.c_float * 4)(1.0, 2.0, 0.5, 4.0)
    ptr = ctypes.cast(s, ctypes.POINTER(ctypes.c_float))
    quant = new(QuantDescC, format=QuantFormat.NVFP4, group_size=16, flags=flag, **{field: ptr})
    assert ctypes.addressof(reader(quant).contents) == ctypes.addressof(s)
    assert reader(new(QuantDescC, format=QuantFormat.NVFP4)) is None
    older = new(QuantDescC, format=QuantFormat.NVFP4)
    older.size = older_size  # an older producer: whatever lies beyond is not its
    setattr(older, field, ptr)
    assert check_struct_size(older, QuantDescC) == older_size and reader(older) is None
    for bad in (new(QuantDescC, flags=flag),  # flag, no vector
                new(QuantDescC, **{field: ptr})):  # vector, no flag: an older consumer would misread the keys
        with pytest.raises(KvxError) as e:
            reader(bad)
        assert e.value.status is Status.INVALID_ARGUMENT
    older.flags = flag  # a flag in a struct too small to hold the vector
    with pytest.raises(KvxError):
        reader(older)


def test_a_v1_2_descriptor_keeps_its_smoothing_and_has_no_centering():
    """A v1.2-sized descriptor: k_smoothing is read, k_center is not (even when bytes lie beyond the size)."""
    s = (ctypes.c_float * 4)(1.0, 2.0, 0.5, 4.0)
    ptr = ctypes.cast(s, ctypes.POINTER(ctypes.c_float))
    q = new(QuantDescC, format=QuantFormat.NVFP4, flags=enums.QUANT_FLAG_KEY_SMOOTHING, k_smoothing=ptr, k_center=ptr)
    q.size = QUANT_DESC_V1_2_SIZE
    assert ctypes.addressof(smoothing_of(q).contents) == ctypes.addressof(s) and center_of(q) is None
    both = new(QuantDescC, flags=enums.QUANT_FLAG_KEY_SMOOTHING | enums.QUANT_FLAG_KEY_CENTERING, k_smoothing=ptr,
               k_center=ptr)
    assert smoothing_of(both) is not None and center_of(both) is not None
