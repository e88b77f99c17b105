"""Compile the flash attention kernels for an H100 (sm_90) the way torch.compile re-launches them.

The course's kernels, and flash_attention's general ones at the launches ``attention_plan``
chooses (their shared memory must fit an H100's 227 KB a block: d = 256 is the test).

Inductor passes a user kernel's Python float arguments typed fp64; the kernels must still
compile (an fp64 scale once made tl.dot's accumulator fp64 and tl.dot refused it). Triton's CUDA
backend compiles to a cubin without a GPU, so this runs on a machine without one, but not under
TRITON_INTERPRET=1 (kernels are interpreted there): ``python tests/compile_flash_kernels.py``.
Exit status 0 when every kernel compiled; the failures are printed otherwise.
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fused_softmax_matmul as fsm  # noqa: E402

FLOAT_ARGS = ("qk_scale", "sm_scale", "cap2")
FLOAT32_POINTERS = ("lse_ptr", "delta_ptr", "dlse_ptr")
H100_SHARED_MEMORY = 227 * 1024  # the most one block may take


def signature(kernel, element: str, constexprs: dict) -> dict:
    """Every argument typed as Inductor types it: tensors as pointers, floats fp64, ints i32."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*fp32" if name in FLOAT32_POINTERS else f"*{element}"
        else:
            types[name] = "fp64" if name in FLOAT_ARGS else "i32"
    return types


def compile_one(kernel, element: str, constexprs: dict, options: dict | None = None) -> int:
    """Compile for sm_90; returns the shared memory the kernel takes."""
    source = ASTSource(fn=kernel, signature=signature(kernel, element, constexprs),
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=options or dict(num_warps=4, num_stages=2))
    return compiled.metadata.shared


def attention_cases() -> list:
    """flash_attention's three kernels at the plan's launches: (kernel, element, constexprs, options)."""
    import torch

    elements = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    kernels = {"forward": fsm.attention_forward_kernel, "dq": fsm.attention_backward_dq_kernel,
               "dkdv": fsm.attention_backward_dkdv_kernel}
    cases = []
    # (d, dv, dtype, window, softcap, kernels): Gemma-2-like (d 256, every switch on), float32 at
    # 256 (the most shared memory); tails in tf32x3 (80 = 64 + 16, dv 40 = 32 + 8 of 16, a dv tail shorter than its
    # tile) and in bfloat16 (40). Each compile takes seconds of CI.
    for d, dv, dtype, window, softcap, names in ((256, 256, torch.bfloat16, (4095, 0), True, ("forward", "dq", "dkdv")),
                                                 (256, 256, torch.float32, None, False, ("dq", "dkdv")),
                                                 (80, 40, torch.float32, (10, 10), True, ("forward", "dq", "dkdv")),
                                                 (40, 40, torch.bfloat16, None, False, ("dq", "dkdv"))):
        plan = fsm.attention_plan(d, dv, dtype, 4096, 4096, is_causal=True, window=window)
        for name in names:
            kernel = kernels[name]
            launch = getattr(plan, name)
            constexprs = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HAS_LO=plan.lo is not None, HAS_HI=True,
                              SOFTCAP=softcap, PRECISION=fsm.dot_precision(dtype), UPCAST=False,
                              **fsm.attention_head_dims(d, dv))
            if name == "dq":
                constexprs["HAS_DLSE"] = True
            if name == "forward":
                constexprs["HEADS"] = plan.heads_in_tile
            cases.append((kernel, elements[dtype], constexprs,
                          dict(num_warps=launch.num_warps, num_stages=launch.num_stages)))
    # A decode step of Llama-3-8B-like grouped heads: the forward's tile holds 4 heads of a group.
    plan = fsm.attention_plan(128, 128, torch.bfloat16, 1, 32768, is_causal=True, causal_align="bottom_right",
                              batch_heads=256, grouped=4)
    assert plan.heads_in_tile == 4, plan
    for d in (128, 80):  # 80: the tile's four heads with tails
        cases.append((fsm.attention_forward_kernel, "bf16", dict(
            BLOCK_M=plan.forward.block_m, BLOCK_N=plan.forward.block_n, HAS_LO=False, HAS_HI=True, SOFTCAP=False,
            PRECISION="ieee", UPCAST=False, HEADS=4, **fsm.attention_head_dims(d, d)),
            dict(num_warps=plan.forward.num_warps, num_stages=plan.forward.num_stages)))
    # Inductor passes ints equal to 1 as constants: one head per group, bounds of 1.
    cases.append((fsm.attention_backward_dkdv_kernel, "fp16", dict(
        BLOCK_M=64, BLOCK_N=64, HAS_LO=True, HAS_HI=True, SOFTCAP=False, PRECISION="ieee", UPCAST=False, group=1, lo=1,
        hi=1, **fsm.attention_head_dims(64, 64)), None))
    return cases


CASES = [
    # (kernel, element type, constexprs): bf16 causal (the course's leaderboard), fp32 tf32x3 full.
    (fsm.flash_attention_forward_kernel, "bf16", dict(IS_CAUSAL=True, PRECISION="ieee")),
    (fsm.flash_attention_backward_dkdv_kernel, "bf16", dict(IS_CAUSAL=True, PRECISION="ieee")),
    (fsm.flash_attention_backward_dq_kernel, "bf16", dict(IS_CAUSAL=True, PRECISION="ieee")),
    (fsm.flash_attention_forward_kernel, "fp32", dict(IS_CAUSAL=False, PRECISION="tf32x3")),
    # Inductor also passes ints equal to 1 as constants: one batch element, one query, one key.
    # (A (batch, n, d) input is one head: n_heads = 1.)
    (fsm.flash_attention_backward_dkdv_kernel, "fp16", dict(IS_CAUSAL=False, PRECISION="ieee", n_batch=1, n_queries=1,
                                                            n_heads=1)),
    (fsm.flash_attention_forward_kernel, "fp16", dict(IS_CAUSAL=True, PRECISION="ieee", n_batch=1, n_keys=1,
                                                      n_heads=1)),
    (fsm.flash_attention_backward_dq_kernel, "fp16", dict(IS_CAUSAL=True, PRECISION="ieee", n_queries=1, n_keys=1,
                                                          n_heads=1)),
]


def main() -> int:
    failed = 0
    cases = []
    for kernel, element, extra in CASES:
        constexprs = dict(HEAD_DIM=64, BLOCK_M=64, **extra)
        if "BLOCK_N" in kernel.arg_names:
            constexprs.update(BLOCK_N=64, UPCAST=False)
        if "FULL_TILE_MASKS" in kernel.arg_names:
            constexprs.update(FULL_TILE_MASKS=False)
        cases.append((kernel, element, constexprs, None))
    only = sys.argv[1] if len(sys.argv) > 1 else None  # "course" or "attention": one family
    if only == "course":
        selected = cases
    elif only == "attention":
        selected = attention_cases()
    else:
        selected = cases + attention_cases()
    for kernel, element, constexprs, options in selected:
        try:
            shared = compile_one(kernel, element, constexprs, options)
            if shared > H100_SHARED_MEMORY:
                raise RuntimeError(f"takes {shared} bytes of shared memory, past an H100's {H100_SHARED_MEMORY}")
            print(f"ok      {kernel.__name__} {element} {constexprs} {options}: {shared} bytes shared")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED  {kernel.__name__} {element} {constexprs} {options}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
