"""Why a K-major W read from DRAM (nn.Linear's weight, 32000 classes) runs slower than a row-major
one: the product alone (the module's matmul kernel and three plain GEMM loops written here for
comparison: W's tile loaded as (K, C) or as (C, K) and transposed, and by TMA descriptors), then
softmax(x @ W) under other launches. bf16.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/kmajor_gemm_probe.py
"""
import torch
import triton
import triton.language as tl

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms


@triton.jit
def grouped_tile(pid, B, C, BB: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr):
    n_b, n_c = tl.cdiv(B, BB), tl.cdiv(C, BC)
    per_group = GROUP * n_c
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_b - first, GROUP)
    within = pid % per_group
    return first + within % size, within // size


@triton.jit
def gemm_pointer(x_ptr, w_ptr, o_ptr, B, K, C, swk, swc,
                 BB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                 TRANSPOSED_LOAD: tl.constexpr):
    """o = x @ W with no masks (shapes divide the tiles); W's tile loaded (BK, BC), or with
    TRANSPOSED_LOAD as (BC, BK) and transposed for the product."""
    tb, tc = grouped_tile(tl.program_id(0), B, C, BB, BC, GROUP)
    rows = tb * BB + tl.arange(0, BB)
    cols = tc * BC + tl.arange(0, BC)
    ks = tl.arange(0, BK)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    if TRANSPOSED_LOAD:
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * swc + ks[None, :] * swk
    else:
        w_ptrs = w_ptr + ks[:, None] * swk + cols[None, :].to(tl.int64) * swc
    acc = tl.zeros((BB, BC), tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
        if TRANSPOSED_LOAD:
            acc = tl.dot(a, w.T, acc)
        else:
            acc = tl.dot(a, w, acc)
        x_ptrs += BK
        w_ptrs += BK * swk
    tl.store(o_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], acc.to(o_ptr.dtype.element_ty))


@triton.jit
def gemm_tma(x_ptr, w_ptr, o_ptr, B, K, C,
             BB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """o = x @ W^T for W stored (C, K) row-major (K-major as x @ W sees it), x and W by TMA."""
    tb, tc = grouped_tile(tl.program_id(0), B, C, BB, BC, GROUP)
    xd = tl.make_tensor_descriptor(x_ptr, shape=[B, K], strides=[K, 1], block_shape=[BB, BK])
    wd = tl.make_tensor_descriptor(w_ptr, shape=[C, K], strides=[K, 1], block_shape=[BC, BK])
    acc = tl.zeros((BB, BC), tl.float32)
    for k in range(0, K, BK):
        a = xd.load([tb * BB, k])
        w = wd.load([tc * BC, k])
        acc = tl.dot(a, w.T, acc)
    rows = tb * BB + tl.arange(0, BB)
    cols = tc * BC + tl.arange(0, BC)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], acc.to(o_ptr.dtype.element_ty))


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for B, K, C in ((4096, 4096, 32000), (8192, 4096, 32000), (4096, 2048, 32000)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
        weight = torch.randn(C, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
        Wk = weight.t()  # K-major (nn.Linear's weight as x @ W sees it)
        Wr = Wk.contiguous()  # the same values row-major
        out = torch.empty(B, C, device="cuda", dtype=torch.bfloat16)
        tflop = 2 * B * K * C / 1e9

        def show(name, fn):
            try:
                ms = graph_ms(fn)
                print(f"  {name}: {ms:.4f} ms ({tflop / ms:.0f} TFLOP/s)", flush=True)
            except Exception as e:  # out of shared memory, a missing feature
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)

        print(f"{B} x {K} x {C}", flush=True)
        show("torch x @ W, W K-major", lambda: x @ Wk)
        show("torch x @ W, W row-major", lambda: x @ Wr)
        chosen = fsm.tiled_launch(B, C, torch.bfloat16, x.device, K=K, w_kmajor=True)
        print(f"  wrapper's launch: {chosen}")
        show("module matmul, W K-major", lambda: fsm.matmul(x, Wk))
        show("module matmul, W row-major", lambda: fsm.matmul(x, Wr))
        for bb, bc, bk, warps, stages in ((128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 4),
                                          (128, 128, 64, 4, 4), (128, 256, 32, 8, 5)):
            grid = (B // bb * (C // bc),)
            for name, w, swk, swc, tr in (("(K, C) load, K-major", Wk, 1, K, False),
                                          ("(C, K) load + trans, K-major", Wk, 1, K, True),
                                          ("(K, C) load, row-major", Wr, C, 1, False)):
                show(f"plain {bb}x{bc}x{bk} w{warps} s{stages} {name}",
                     lambda: gemm_pointer[grid](x, w, out, B, K, C, swk, swc, bb, bc, bk, 8, tr,
                                                num_warps=warps, num_stages=stages))
            show(f"TMA {bb}x{bc}x{bk} w{warps} s{stages} K-major",
                 lambda: gemm_tma[grid](x, weight, out, B, K, C, bb, bc, bk, 8, num_warps=warps, num_stages=stages))
        show("torch softmax(x @ W), W K-major", lambda: torch.softmax(x @ Wk, -1))
        fsm._MATMUL_REPLAYS.clear()
        show("module fused tiled, K-major, wrapper's launch", lambda: fsm.matmul_softmax_fused_tiled(x, Wk))
        show("module fused tiled, row-major, wrapper's launch", lambda: fsm.matmul_softmax_fused_tiled(x, Wr))
        for launch in (fsm.MatmulLaunch(128, 256, 64, 8, 8, 3), fsm.MatmulLaunch(256, 128, 64, 8, 8, 4),
                       fsm.MatmulLaunch(128, 256, 64, 16, 8, 4), fsm.MatmulLaunch(128, 256, 32, 8, 8, 5)):
            fsm._MATMUL_REPLAYS.clear()
            show(f"module fused tiled, K-major, {launch}", lambda: fsm.matmul_softmax_fused_tiled(x, Wk, launch))


if __name__ == "__main__":
    main()
