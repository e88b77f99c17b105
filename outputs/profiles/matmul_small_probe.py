"""softmax(x @ W) where the grid of issue 17 found ``matmul_softmax_fused_tiled`` slowest against
torch (C = 1000 at every B and K, few rows with long K): the wrapper's launch, other tiles, the
plain Triton ``matmul`` and torch's matmul alone, and W's rows 1024 apart instead of 1000 (the same
values: whether C's row stride is what costs). do_bench means, ms; float32 at 'highest'.

A one-off diagnostic, not part of the benchmark suite. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/matmul_small_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from fused_softmax_matmul import MatmulLaunch

SHAPES = [(4096, 4096, 1000, torch.bfloat16), (4096, 4096, 1024, torch.bfloat16), (512, 2048, 1000, torch.bfloat16),
          (32, 4096, 1000, torch.bfloat16), (1, 4096, 1000, torch.float32), (32, 768, 1000, torch.float32),
          (512, 2048, 1000, torch.float32), (512, 4096, 10, torch.bfloat16), (512, 4096, 10, torch.float32),
          (32, 2048, 10, torch.bfloat16), (32, 768, 50257, torch.bfloat16), (1, 768, 50257, torch.bfloat16)]
# (block_b, block_c, block_k, warps, stages, split_k) tried beside the wrapper's
OTHERS = {torch.bfloat16: [(64, 128, 64, 4, 4, 1), (128, 128, 64, 8, 4, 1), (64, 256, 64, 8, 3, 1), (16, 64, 128, 4, 4, 1)],
          torch.float32: [(16, 64, 32, 4, 3, 1), (32, 64, 32, 4, 3, 1), (16, 32, 64, 4, 3, 1)]}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=80)


def launch_name(launch):
    return f"{launch.block_b}x{launch.block_c}x{launch.block_k}/{launch.num_warps}w/{launch.num_stages}s/k{launch.split_k}"


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for B, K, C, dtype in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
        W = (torch.randn(K, C, device="cuda", generator=g) / K**0.5).to(dtype)
        chosen = fsm.tiled_launch(B, C, dtype, x.device, K=K)
        parts = [f"torch {bench(lambda: torch.softmax(x @ W, -1)):.4f}", f"torch mm {bench(lambda: x @ W):.4f}",
                 f"tiled [{launch_name(chosen)}] {bench(lambda: fsm.matmul_softmax_fused_tiled(x, W)):.4f}",
                 f"triton mm {bench(lambda: fsm.matmul(x, W)):.4f}"]
        if C % 64:
            wide = torch.zeros(K, (C + 63) // 64 * 64, device="cuda", dtype=dtype)
            wide[:, :C] = W
            Wp = wide[:, :C]
            parts.append(f"tiled W rows {Wp.stride(0)} apart {bench(lambda: fsm.matmul_softmax_fused_tiled(x, Wp)):.4f}")
        for b, c, k, w, s, split in OTHERS[dtype]:
            launch = MatmulLaunch(b, c, k, group_b=8, num_warps=w, num_stages=s, split_k=split)
            try:
                ms = f"{bench(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch)):.4f}"
            except Exception as exc:  # noqa: BLE001 - a launch that does not fit is a result too
                ms = type(exc).__name__
            parts.append(f"{launch_name(launch)} {ms}")
        print(f"{B}x{K}x{C} {str(dtype)[6:]}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
