"""The PTX of the Triton kernels whose bytes are pinned to the torch reference (the fused write, the import
conversion that encodes through it, KVTC pack / unpack), compiled here for sm_90 without a GPU (Triton's NVIDIA
backend runs on the host): every FP32 division is the IEEE `div.rn.f32` and no instruction carries `.ftz` (flush
subnormal operands and results to zero). Before Triton 3.6, `tl.math.div_rn` compiled to `div.rn.ftz.f32` (libdevice
linked with nvvm-reflect-ftz); `quant.div_ieee` states the instruction, so this holds whatever Triton the engine
brings. The compile runs in a subprocess without TRITON_INTERPRET (the test session defines the kernels for the
interpreter)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The write kernel's side constexprs per encoder: (format code name, group, groups per row (D = 128), RCEIL)
WRITE_FORMATS = {"int8": ("F_INT8", 16, 8, False), "int4": ("F_INT4", 16, 8, False), "fp8": ("F_FP8", 16, 8, False),
                 "nvfp4": ("F_NVFP4", 16, 8, False), "mxfp4": ("F_MXFP4", 32, 4, True)}


def compile_ptx() -> dict[str, str]:
    """{kernel: PTX} for sm_90 with the launchers' options (ASM on, no FP fusion, 4 warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvx_core.ops.triton import convert, dequant, kvtc, write

    def ptx(fn, types: dict[str, str], consts: dict) -> str:
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        opts = {"enable_fp_fusion": False, "num_warps": 4}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=opts).asm["ptx"]

    def side(prefix: str, name: str) -> dict:
        code, grp, ngp, rceil = WRITE_FORMATS[name]
        return {prefix + "F": int(getattr(dequant, code)), prefix + "GRP": grp, prefix + "NGP": ngp,
                prefix + "E5": False, prefix + "RCEIL": rceil}

    out = {}
    ptrs = {"SLOT": "*i64", "KX": "*bf16", "VX": "*fp32", "KD": "*u8", "VD": "*u8", "KS": "*u8", "VS": "*u8",
            "KG": "*fp32", "VG": "*fp32"}
    for name in WRITE_FORMATS:
        consts = {"D": 128, "DP": 128, "BT": 32, "BS": 16, "ASM": True, **side("K", name), **side("V", name)}
        out[f"write/{name}"] = ptx(write._write_kernel, ptrs, consts)
    # import conversion from INT8 rows into (K, V) = (NVFP4, MXFP4) and (FP8, INT4)
    ptrs |= {"KX": "*fp32", "KR": "*u8", "VR": "*u8", "KRS": "*u8", "VRS": "*u8", "KRG": "*fp32", "VRG": "*fp32"}
    for k, v in (("nvfp4", "mxfp4"), ("fp8", "int4")):
        source = {"S" + key: val for key, val in (side("K", "int8") | side("V", "int8")).items() if "RCEIL" not in key}
        consts = {"D": 128, "DP": 128, "BT": 32, "BS": 16, "ENCODE": True, "ASM": True, **source, **side("K", k),
                  **side("V", v)}
        out[f"convert/{k}+{v}"] = ptx(convert._convert_kernel, ptrs, consts)
    out["kvtc/pack"] = ptx(kvtc._pack_kernel, {"Y": "*fp32", "MN": "*fp32", "ST": "*fp32", "SC": "*fp32", "T": "*i64",
                                               "HDR": "*u8", "OUT": "*u8"}, {"BM": 64, "JB": 16, "CB": 16, "ASM": True})
    out["kvtc/unpack"] = ptx(kvtc._unpack_kernel, {"BODY": "*u8", "SC": "*fp32", "T": "*i64", "Y": "*fp32"},
                             {"BM": 64, "JB": 16})
    return out


def _instructions(ptx: str) -> list[str]:
    """PTX instruction lines, guard predicates dropped (no comments, directives or labels)."""
    lines = (re.sub(r"^@!?%\w+\s+", "", line.split("//")[0].strip()) for line in ptx.splitlines())
    return [line for line in lines if line and not line.startswith((".", "$", "{", "}")) and not line.endswith(":")]


def test_pinned_kernels_divide_in_ieee_and_never_flush_subnormals():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = "import json, tests.kernels.test_triton_ptx as t; print(json.dumps(t.compile_ptx()))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    kernels = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(kernels) == {f"write/{n}" for n in WRITE_FORMATS} | {"convert/nvfp4+mxfp4", "convert/fp8+int4",
                                                                    "kvtc/pack", "kvtc/unpack"}
    for name, ptx in kernels.items():
        ins = _instructions(ptx)
        assert ins, name
        assert not [i for i in ins if ".ftz" in i], name
        divs = {op for op in (i.split()[0] for i in ins) if re.fullmatch(r"div\.[\w.]*f(16|32|64)", op)}
        assert divs <= {"div.rn.f32"}, (name, divs)
        if name != "kvtc/unpack":  # every encoder divides
            assert divs == {"div.rn.f32"}, name
