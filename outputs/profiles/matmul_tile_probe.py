"""float32 softmax(x @ W) (``matmul_softmax_fused_tiled``) and the plain Triton ``matmul`` by
tile (rows x classes, warps; 32-deep K steps, 3 stages), against the wrapper's own launch, torch
and torch.compile, at the shapes given as BxKxC. do_bench means, ms; torch.float32 matmul
precision as set (default 'highest': the kernels' tf32x3). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/matmul_tile_probe.py 512x2048x1000 4096x4096x4096
"""
import sys

import torch
import triton

import fused_softmax_matmul as fsm
from fused_softmax_matmul import MatmulLaunch


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for B, K, C in (tuple(map(int, arg.split("x"))) for arg in sys.argv[1:]):
    x = torch.randn(B, K, device="cuda")
    W = torch.randn(K, C, device="cuda") / K**0.5
    compiled = torch.compile(lambda a, b: torch.softmax(a @ b, -1))
    compiled(x, W)
    chosen = fsm.tiled_launch(B, C, torch.float32, x.device, K=K)
    line = (f"{B}x{K}x{C} torch {bench(lambda: torch.softmax(x @ W, -1)):.4f} compile {bench(lambda: compiled(x, W)):.4f}"
            f" | chosen {chosen.block_b}x{chosen.block_c}/{chosen.num_warps}w/split {chosen.split_k}"
            f" {bench(lambda: fsm.matmul_softmax_fused_tiled(x, W)):.4f}")
    for block_b in (16, 32, 64):
        for block_c in (64, 128):
            for warps in (4, 8):
                launch = MatmulLaunch(block_b, block_c, 32, group_b=8, num_warps=warps, num_stages=3)
                ms = bench(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch))
                line += f" | {block_b}x{block_c}/{warps}w {ms:.4f}"
    line += f" | matmul: torch {bench(lambda: x @ W):.4f} chosen {bench(lambda: fsm.matmul(x, W)):.4f}"
    print(line, flush=True)
