"""softmax(x @ W) with W row-major, 16-bit: the TMA tile kernels against the pointer kernels under
the wrapper's launch, and TMA under the other of 128 x 256 / 256 x 128; then the backward's
dx = dz @ W^T (W^T K-major: the TMA path) against the pointer kernel, beside torch.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/rowmajor_tma_probe.py
"""
import dataclasses

import torch
import triton

import fused_softmax_matmul as fsm
from kmajor_tma_probe import ours
from probe_timing import replay_median_ms as graph_ms


def other_tile(launch):
    swapped = {(128, 256): (256, 128), (256, 128): (128, 256)}.get((launch.block_b, launch.block_c))
    if swapped is None:
        return None
    return dataclasses.replace(launch, block_b=swapped[0], block_c=swapped[1])


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("softmax(x @ W), B x K x C dtype: torch | pointer | TMA (launch) | TMA, other tile | torch / TMA")
    shapes = ((4096, 4096, 1000), (4096, 2048, 1000), (2048, 4096, 1000), (1024, 4096, 1000), (512, 4096, 1000),
              (512, 2048, 1000), (4096, 768, 1000), (4096, 4096, 3000), (4096, 4096, 2048), (2048, 4096, 4000),
              (4096, 4096, 32000), (512, 4096, 32000), (4096, 4096, 128256), (32, 4096, 32000))
    for B, K, C in shapes:
        for dtype in (torch.bfloat16, torch.float16):
            if dtype == torch.float16 and (B, K, C) not in ((4096, 4096, 1000), (4096, 4096, 32000)):
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
            W = torch.randn(K, C, device="cuda", dtype=dtype, generator=g) * K ** -0.5
            now = fsm.tiled_launch(B, C, dtype, x.device, K=K, w_kmajor=False)
            torch_ms = graph_ms(lambda: torch.softmax(x @ W, -1))
            ptr_ms, ptr_out = ours(fsm.matmul_softmax_fused_tiled, x, W, now, False)
            tma_ms, tma_out = ours(fsm.matmul_softmax_fused_tiled, x, W, now, True)
            other = other_tile(now)
            other_part = "-"
            if other is not None:
                other_part = f"{ours(fsm.matmul_softmax_fused_tiled, x, W, other, True)[0]:.4f}"
            diff = (tma_out.float() - ptr_out.float()).abs().max().item()
            print(f"{B} x {K} x {C} {str(dtype)[6:]}: {torch_ms:.4f} | {ptr_ms:.4f} | {tma_ms:.4f} "
                  f"({now.block_b}x{now.block_c}x{now.block_k} g{now.group_b} w{now.num_warps} s{now.num_stages} "
                  f"k{now.split_k}) | {other_part} | {torch_ms / tma_ms:.3f}x  (max |TMA - pointer| {diff:.1e})",
                  flush=True)
            del x, W, ptr_out, tma_out
            torch.cuda.empty_cache()
    print("dx = dz @ W^T, B x C x K dtype: torch | pointer | TMA (launch) | torch / TMA")
    for B, C, K in ((4096, 1000, 4096), (8192, 1000, 4096), (4096, 32000, 4096), (4096, 3000, 4096), (512, 1000, 4096)):
        g = torch.Generator(device="cuda").manual_seed(0)
        dz = torch.randn(B, C, device="cuda", dtype=torch.bfloat16, generator=g)
        W = torch.randn(K, C, device="cuda", dtype=torch.bfloat16, generator=g)
        Wt = W.t()
        launch = fsm.tiled_launch(B, K, torch.bfloat16, dz.device, K=C, w_kmajor=True)
        torch_ms = graph_ms(lambda: dz @ Wt)
        ptr_ms = ours(fsm.matmul, dz, Wt, launch, False)[0]
        tma_ms = ours(fsm.matmul, dz, Wt, launch, True)[0]
        print(f"{B} x {C} x {K} bfloat16: {torch_ms:.4f} | {ptr_ms:.4f} | {tma_ms:.4f} "
              f"({launch.block_b}x{launch.block_c}x{launch.block_k} g{launch.group_b} w{launch.num_warps} "
              f"s{launch.num_stages} k{launch.split_k}) | {torch_ms / tma_ms:.3f}x", flush=True)


if __name__ == "__main__":
    main()
