"""Compile the decode kernel for sm_90a on a machine WITHOUT a GPU and print ptxas registers/spills.

Usage: python benchmarks/aot_resources.py nvfp4 bf16 ...  (uses the ptxas bundled with triton)
"""
import sys, torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvx_core.ops.triton.decode import _decode_kernel, default_block_n
from kvx_core.ops.triton.launch import dot_type, fp8_type
from kvx_core.ops.kernel_format import kernel_format
from kvx_core.formats import get_format
target = GPUTarget("cuda", 90, 32)

def sig_for(fn, consts, ptr_types):
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if name in consts: sig[name] = "constexpr"
        elif name in ptr_types: sig[name] = ptr_types[name]
        elif name in ("sm_scale", "softcap"): sig[name] = "fp32"
        else: sig[name] = "i32"
    return sig

def compile_decode(name, d=128, bs=16, qh=4, block_n=None, num_warps=4, num_stages=2, softcap=False, window=False):
    fmt = get_format(name)
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    def p(dt): return "*" + {torch.bfloat16:"bf16", torch.float16:"fp16", torch.float32:"fp32"}.get(dt, "u8")
    block_n = block_n or default_block_n(kk, kv, d)
    consts = dict(BS=bs, QH=qh, BM=max(16, qh), D=d, BLOCK_N=block_n, KF=kk.code, VF=kv.code, KGRP=kk.group or 16, VGRP=kv.group or 16,
        KDT=dot_type(kk, torch.bfloat16), VDT=dot_type(kv, torch.bfloat16), KIEEE=kk.storage==torch.float32, VIEEE=kv.storage==torch.float32,
        KGS=kk.global_scale, VGS=kv.global_scale, K8=fp8_type(kk), V8=fp8_type(kv), SOFTCAP=softcap, WINDOW=window, ASM=True)
    ptrs = dict(Q="*bf16", KD=p(kk.storage), KS="*u8", VD=p(kv.storage), VS="*u8", KG="*fp32", VG="*fp32", BT="*i32", SEQ="*i32", MO="*fp32", ML="*fp32")
    sig = sig_for(_decode_kernel, consts, ptrs)
    # the JIT marks pointers and ints divisible by 16 (tt.divisibility); mirror the benchmark's shapes
    div16 = set(ptrs) | {"s_qb", "s_qh", "s_kdb", "s_kdh", "s_kdt", "s_vdb", "s_vdh", "s_vdt", "s_ksb", "s_ksh",
                         "s_vsb", "s_vsh", "s_btb", "s_mob", "s_moh", "s_mos"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(_decode_kernel.arg_names) if n in div16}
    src = ASTSource(_decode_kernel, sig, consts, attrs)
    k = triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
    return k


def ptxas_info(k, tag="x"):
    import subprocess, os, tempfile, triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    return " ".join(l.split(":",2)[-1].strip() for l in out.stderr.splitlines() if "registers" in l or "spill" in l)

if __name__ == "__main__":
    for name in sys.argv[1:]:
        k = compile_decode(name)
        print(name, ptxas_info(k), "shared", k.metadata.shared)
