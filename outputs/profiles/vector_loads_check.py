"""Which global loads and stores the row kernel and the softmax(x @ W) tile kernel compile to for
an H100 (sm_90) on a ragged shape, with and without the vector factor the wrappers pass.

A one-off diagnostic, not part of the benchmark suite; it needs no GPU, only a triton whose
bundled compiler targets sm_90 (the GPU machine's triton 3.6: ``pip download --no-deps
triton==3.6.0`` and put the unpacked wheel first on PYTHONPATH). From the repository root:

    PYTHONPATH=/path/to/triton36:. python3 outputs/profiles/vector_loads_check.py

Each line counts the PTX instructions that touch global memory: ``ld.global.v4.b32`` loads four
float32 values at once, ``ld.global.b32`` one; ``cp.async 0x10`` stages 16 bytes into shared
memory, ``0x4`` four.
"""

from __future__ import annotations

import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import fused_softmax_matmul as fsm
import online_softmax as osm


def memory_ops(kernel, constants: dict, divisible: tuple = (), unit_strides: tuple = (), num_warps: int = 4,
               pointer: str = "*fp32") -> Counter:
    """Compile ``kernel`` for sm_90 with ``pointer`` pointers; int arguments in ``divisible`` are
    known multiples of 16 (as Triton specialises them at a launch), those in ``unit_strides`` equal 1."""
    signature, fixed, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants or name in unit_strides:
            signature[name] = "constexpr"
            fixed[(i,)] = constants.get(name, 1)
        elif name.endswith("_ptr"):
            signature[name] = pointer
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, fixed, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    ops = re.findall(r"(?:ld|st)\.global[.\w]*", ptx)
    ops += ["cp.async " + size for size in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], (0x\w+)", ptx)]
    return Counter(ops)


def main() -> None:
    print(f"# triton {triton.__version__}, sm_90")
    for vec in (1, 4):
        ops = memory_ops(osm.softmax_row_kernel, dict(BLOCK_SIZE=1024, VEC=vec, ROWS=1))
        print(f"softmax_row_kernel, rows of 1000 float32, VEC {vec}: {dict(ops)}")
    for vec in (1, 4):
        constants = dict(BLOCK_B=16, BLOCK_C=128, BLOCK_K=32, GROUP_B=8, PRECISION="tf32x3", UPCAST=False, VEC=vec)
        ops = memory_ops(fsm.matmul_softmax_tile_kernel, constants, divisible=("stride_xb", "K"),
                         unit_strides=("stride_xk", "stride_wc", "stride_oc"))
        print(f"matmul_softmax_tile_kernel, 512 x 2048 x 1000 float32, VEC {vec}: {dict(ops)}")
    for k_align in (1, 8):
        constants = dict(BLOCK_1=64, BLOCK_2=64, BLOCK_3=128, PRECISION="ieee", UPCAST=False, LAZY_RESCALE=False,
                         TRANSPOSED=True, ROUND_TF32=False, ROUND_V=False, STORE_LSE=False, X_ALIGN=8, V_ALIGN=1,
                         K_ALIGN=k_align)
        ops = memory_ops(fsm.fused_softmax_kernel, constants, num_warps=8, pointer="*bf16",
                         divisible=("d3", "stride_vb", "stride_v2", "stride_ob", "stride_o1"),
                         unit_strides=("stride_x2", "stride_v3", "stride_o3"))
        print(f"fused_softmax_kernel, (8, 2048, 1000, 64) bfloat16, X_ALIGN 8, K_ALIGN {k_align}: {dict(ops)}")


if __name__ == "__main__":
    main()
