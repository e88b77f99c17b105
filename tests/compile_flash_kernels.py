"""Compile the flash attention kernels for an H100 (sm_90) the way torch.compile re-launches them.

The course's kernels, and flash_attention's general ones at the launches ``attention_plan``
chooses (their shared memory must fit an H100's 227 KB a block: d = 256 is the test). The Gluon
kernels too (attention's and softmax(x) @ V's), through their host functions on CPU tensors, each
launch compiled (``warmup``) under a stand-in for the CUDA driver that names an sm_90 target:
Gluon's API moves between Triton versions.

Inductor passes a user kernel's Python float arguments typed fp64; the kernels must still
compile (an fp64 scale once made tl.dot's accumulator fp64 and tl.dot refused it). Triton's CUDA
backend compiles to a cubin without a GPU, so this runs on a machine without one, but not under
TRITON_INTERPRET=1 (kernels are interpreted there): ``python tests/compile_flash_kernels.py``.
Exit status 0 when every kernel compiled; the failures are printed otherwise.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fused_softmax_matmul as fsm  # noqa: E402
import online_softmax as osm  # noqa: E402

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
    # 256 (the most shared memory); 192 / 128 (a tail's tiles at 256); tails in tf32x3 (80 = 64 + 16,
    # dv 40 = 32 + 8 of 16, a dv tail shorter than its tile) and in bfloat16 (40). Each compile takes
    # seconds of CI.
    for d, dv, dtype, window, softcap, names in ((256, 256, torch.bfloat16, (4095, 0), True, ("forward", "dq", "dkdv")),
                                                 (256, 256, torch.float32, None, False, ("dq", "dkdv")),
                                                 (192, 128, torch.bfloat16, None, False, ("forward", "dq", "dkdv")),
                                                 (80, 40, torch.float32, (10, 10), True, ("forward", "dq", "dkdv")),
                                                 (40, 40, torch.bfloat16, None, False, ("dq", "dkdv"))):
        plan = fsm.attention_plan(d, dv, dtype, 4096, 4096, is_causal=True, window=window)
        for name in names:
            kernel = kernels[name]
            launch = getattr(plan, name)
            constexprs = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HAS_LO=plan.lo is not None, HAS_HI=True,
                              SOFTCAP=softcap, PRECISION=fsm.dot_precision(dtype), UPCAST=False,
                              ROW_ALIGN=math.gcd(16, d, dv), **fsm.attention_head_dims(d, dv))
            if name == "dq":
                constexprs["HAS_DLSE"] = True
            if name == "forward":
                heads = plan.heads_in_tile
                constexprs.update(HEADS=heads, QUERIES=fsm._tile_queries(launch.block_m, heads))
            cases.append((kernel, elements[dtype], constexprs,
                          dict(num_warps=launch.num_warps, num_stages=launch.num_stages)))
    # A decode step of grouped heads: the forward's tile holds a group of 4 (Llama-3-8B-like) or 7 (Qwen2-7B-like,
    # 8 rows with the last masked).
    for group in (4, 7):
        plan = fsm.attention_plan(128, 128, torch.bfloat16, 1, 32768, is_causal=True, causal_align="bottom_right",
                                  batch_heads=32 * group, grouped=group)
        assert plan.heads_in_tile == group, plan
        for d in (128, 80):  # 80: the tile's heads with tails
            cases.append((fsm.attention_forward_kernel, "bf16", dict(
                BLOCK_M=plan.forward.block_m, BLOCK_N=plan.forward.block_n, HAS_LO=False, HAS_HI=True, SOFTCAP=False,
                PRECISION="ieee", UPCAST=False, HEADS=group, QUERIES=fsm._tile_queries(plan.forward.block_m, group),
                ROW_ALIGN=16, **fsm.attention_head_dims(d, d)),
                dict(num_warps=plan.forward.num_warps, num_stages=plan.forward.num_stages)))
    # Inductor passes ints equal to 1 as constants: one head per group, bounds of 1.
    cases.append((fsm.attention_backward_dkdv_kernel, "fp16", dict(
        BLOCK_M=64, BLOCK_N=64, HAS_LO=True, HAS_HI=True, SOFTCAP=False, PRECISION="ieee", UPCAST=False, group=1, lo=1,
        hi=1, ROW_ALIGN=1, **fsm.attention_head_dims(64, 64)), None))
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


def gluon_cases() -> list:
    """(name, call): the Gluon kernels' host functions on CPU tensors (attention: d 128 causal with grouped heads,
    the general path's forward; d 64 full on a persistent grid; dQ and dK/dV; softmax(x) @ V), launches
    compiled, not run."""
    def tensors(batch, heads, kv_heads, n, d):
        q, o, do, dq = (torch.empty((batch, heads, n, d), dtype=torch.bfloat16) for _ in range(4))
        k, v, dk, dv = (torch.empty((batch, kv_heads, n, d), dtype=torch.bfloat16) for _ in range(4))
        lse, delta = torch.empty((batch, heads, n)), torch.empty((batch * heads, n))
        return q, k, v, o, do, dq, dk, dv, lse, delta

    q, k, v, o, _, _, _, _, lse, _ = tensors(1, 8, 2, 512, 128)
    cases = [("forward d 128 causal, 8 / 2 heads", lambda: fsm._gluon_flash_forward(q, k, v, True, o, lse, scale=0.1))]
    q6, k6, v6, o6, do6, dq6, dk6, dv6, lse6, delta6 = tensors(2, 4, 4, 640, 64)
    cases.append(("forward d 64 full, persistent", lambda: fsm._gluon_flash_forward(
        q6, k6, v6, False, o6, lse6, persistent=True, programs=132)))
    cases.append(("dQ d 64 full", lambda: fsm._gluon_flash_dq(q6, k6, v6, o6, do6, lse6, delta6, dq6, False)))
    cases.append(("dK/dV d 64 causal", lambda: fsm._gluon_flash_dkdv(q6, k6, v6, do6, lse6, delta6, dk6, dv6, True)))
    # softmax(x) @ V (fused_softmax's Gluon route): bfloat16, and float32 as TF32 parts (V's parts kernel first)
    for dtype in (torch.bfloat16, torch.float32):
        x, V, out = torch.empty((2, 256, 1024), dtype=dtype), torch.empty((2, 1024, 64), dtype=dtype), \
            torch.empty((2, 256, 64), dtype=dtype)
        cases.append((f"softmax(x) @ V {dtype}", lambda x=x, V=V, out=out: fsm._gluon_fused_forward(x, V, out, None)))
    return cases


def row_stride_cases() -> list:
    """(name, call, check): the general kernels as a call at d 88 launches them (rows 176 bytes apart, a multiple
    of 16 bytes but not of 16 elements, which Triton marks alone): each kernel's tiles must load by 16-byte
    async copies (``_row_strides``; without the hint, an element at a time)."""
    q, k, v, out, dout = (torch.empty((2, 4, 256, 88), dtype=torch.bfloat16) for _ in range(5))
    lse = torch.empty((2, 4, 256))
    plan = fsm.attention_plan(88, 88, torch.bfloat16, 256, 256, batch_heads=8)
    *options, launches = fsm._attention_args(88 ** -0.5, None, plan)
    tiles = [launches[4:8], launches[8:12]]

    def async_copies(kernels) -> None:
        for kernel in kernels:
            if "cp.async" not in kernel.asm["ptx"]:
                raise RuntimeError(f"{kernel.name}'s tiles load without cp.async: the row strides' hint was lost")
    return [("forward d 88: row strides hinted", lambda: fsm._run_attention_forward(
                q, k, v, *options, launches, traced=False), async_copies),
            ("dQ, dK/dV d 88: row strides hinted", lambda: fsm._run_attention_backward(
                q, k, v, out, lse, dout, None, *options, *tiles, traced=False), async_copies)]


def compile_host_calls(cases: list) -> int:
    """Run each case (name, call[, check of the kernels it compiled]) with its launches compiled for sm_90; the
    failures (past the shared memory of a block, the most any of its kernels takes). The stand-in driver stays active (Triton builds its default one only where a GPU is): the
    script's last step."""
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class Sm90(CudaDriver):
        def __init__(self):  # no libcuda: the target is all a compile asks of it
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    built = []

    def compiled(kernel, grid, args, options, *rest, **keywords):
        built.append(kernel.warmup(*args, grid=grid, **options))

    class Compiled:
        """A kernel whose launches (``kernel[grid](...)``) compile it instead."""

        def __init__(self, kernel):
            self.kernel = kernel

        def warmup(self, *args, **options):
            return self.kernel.warmup(*args, **options)

        def __getitem__(self, grid):
            return lambda *args, **options: compiled(self.kernel, grid, args, options)

    launches = fsm.launch_kept, osm.launch_kept, fsm.jit_kernel
    fsm.launch_kept = osm.launch_kept = compiled  # launch_and_keep calls online_softmax's
    fsm.jit_kernel = lambda kernel, traced: Compiled(kernel)
    driver.set_active(Sm90())
    failed = 0
    try:
        for name, call, *check in cases:
            try:
                before = len(built)
                call()
                shared = max(kernel.metadata.shared for kernel in built[before:])
                if shared > H100_SHARED_MEMORY:
                    raise RuntimeError(f"takes {shared} bytes of shared memory, past {H100_SHARED_MEMORY}")
                for each in check:
                    each(built[before:])
                print(f"ok      {name}: {shared} bytes shared")
            except Exception as e:  # noqa: BLE001 - report every kernel, then fail
                failed += 1
                print(f"FAILED  {name}: {type(e).__name__}: {e}")
    finally:
        fsm.launch_kept, osm.launch_kept, fsm.jit_kernel = launches
    return failed


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
    only = sys.argv[1] if len(sys.argv) > 1 else None  # "course", "attention" or "gluon": one family
    if only == "course":
        selected = cases
    elif only == "attention":
        selected = attention_cases()
    elif only == "gluon":
        selected = []
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
    host_calls = row_stride_cases() if only in (None, "attention") else []
    if only in (None, "gluon"):
        if fsm._GLUON is None:
            print(f"not run: the Gluon kernels ({fsm.GLUON_UNAVAILABLE})")
        else:
            host_calls += [(f"Gluon {name}", call) for name, call in gluon_cases()]
    if host_calls:
        failed += compile_host_calls(host_calls)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
