"""softmax(x @ W) in bfloat16 with W's rows off 128-byte lines (C = 1000: rows 2000 bytes apart),
row-major and K-major, under the wrapper's launch and under others; then W K-major at
4096 x 4096 x 32000 with its columns 8 KiB apart or padded, and other program groupings.

The question: does a tile shape that reads fewer W lines a flop (256 x 128: W's tile is a third
of a step's bytes, 128 x 256: two thirds) win wherever W's rows are not whole 128-byte lines,
and does the K-major loss at 32000 classes come from the power-of-two column pitch.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/w_lines_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

L = fsm.MatmulLaunch
LAUNCHES = {
    "256x128 s4": L(256, 128, 64, 8, 8, 4), "256x128 s3": L(256, 128, 64, 8, 8, 3),
    "128x256 s4": L(128, 256, 64, 8, 8, 4), "128x128 w8": L(128, 128, 64, 8, 8, 4),
    "64x128 w4": L(64, 128, 64, 8, 4, 4), "128x64 w4": L(128, 64, 64, 8, 4, 4),
}


def make(B, K, C, layout, pitch=None, dtype=torch.bfloat16):
    """x (B, K) and W (K, C): row-major with rows `pitch` apart, or K-major (nn.Linear's weight
    transposed) with columns `pitch` apart."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
    if layout == "K-major":
        w = torch.randn(C, pitch or K, device="cuda", dtype=dtype, generator=g)[:, :K] * K ** -0.5
        return x, w.t()
    return x, torch.randn(K, pitch or C, device="cuda", dtype=dtype, generator=g)[:, :C] * K ** -0.5


def row(x, W, names, extra=()):
    torch_ms = graph_ms(lambda: torch.softmax(x @ W, -1))
    chosen = fsm.tiled_launch(x.shape[0], W.shape[1], x.dtype, x.device, K=x.shape[1], w_kmajor=fsm._w_kmajor(W))
    parts = [f"torch {torch_ms:.4f}"]
    fsm._MATMUL_REPLAYS.clear()
    ms = graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W))
    parts.append(f"wrapper {chosen.block_b}x{chosen.block_c} w{chosen.num_warps} s{chosen.num_stages} "
                 f"k{chosen.split_k} {ms:.4f} ({torch_ms / ms:.2f}x)")
    for name in names:
        launch = LAUNCHES[name] if isinstance(name, str) else name
        name = name if isinstance(name, str) else f"{launch.block_b}x{launch.block_c} g{launch.group_b}"
        try:
            fsm._MATMUL_REPLAYS.clear()
            ms = graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch))
            parts.append(f"{name} {ms:.4f} ({torch_ms / ms:.2f}x)")
        except Exception as e:  # out of shared memory, say
            parts.append(f"{name} {type(e).__name__}")
    return " | ".join(parts)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("# part 1: W's rows off 128-byte lines; ms (speed-up against torch on the same W)")
big = ["256x128 s4", "256x128 s3", "128x256 s4", "128x128 w8"]
for B, K, C in ((4096, 4096, 1000), (4096, 2048, 1000), (4096, 768, 1000), (2048, 4096, 1000),
                (1024, 4096, 1000), (512, 4096, 1000), (4096, 4096, 3000), (4096, 4096, 5000),
                (4096, 4096, 1500), (8192, 4096, 1000)):
    names = big if B >= 2048 else ["256x128 s4", "128x256 s4", "128x128 w8", "64x128 w4", "128x64 w4"]
    for layout in ("row-major", "K-major"):
        x, W = make(B, K, C, layout)
        print(f"{B} x {K} x {C} {layout}: {row(x, W, names)}", flush=True)
    x, W = make(B, K, C, "row-major", pitch=triton.cdiv(C, 64) * 64)
    print(f"{B} x {K} x {C} row-major, rows padded to 128 B: {row(x, W, names[:3])}", flush=True)

print("# part 2: 4096 x 4096 x 32000, W's column pitch and the program grouping (group_b)")
groups = [L(bb, bc, 64, g, 8, 4) for bb, bc in ((128, 256), (256, 128)) for g in (4, 16, 32)]
for layout, pitch in (("K-major", None), ("K-major", 4096 + 64), ("K-major", 4096 + 8), ("row-major", None)):
    x, W = make(4096, 4096, 32000, layout, pitch)
    print(f"{layout}, pitch {W.stride()}: {row(x, W, ['256x128 s4'] + groups)}", flush=True)
