"""softmax(x @ W) by ``matmul_softmax_fused_tiled`` with W's rows C apart (as given) and 16, 64
and 128 elements apart (the same values in a wider buffer, W a slice of it): whether the row
pitch is what costs, under the wrapper's launch and a few others; and the copy that would
re-pitch W. do_bench means, ms; float32 at 'highest'.

A one-off diagnostic, not part of the benchmark suite. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/matmul_pitch_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from fused_softmax_matmul import MatmulLaunch

# (B, K, C, dtype, launches: None is the wrapper's); MatmulLaunch(block_b, block_c, block_k, group_b, warps, stages)
CASES = [
    (4096, 4096, 1000, torch.bfloat16, [None, MatmulLaunch(128, 256, 64, 8, 8, 4), MatmulLaunch(128, 128, 64, 8, 8, 4),
                                        MatmulLaunch(64, 128, 64, 8, 4, 4)]),
    (4096, 768, 1000, torch.bfloat16, [None, MatmulLaunch(128, 256, 64, 8, 8, 4)]),
    (512, 2048, 1000, torch.bfloat16, [None, MatmulLaunch(64, 128, 64, 8, 4, 4)]),
    (512, 2048, 1000, torch.float32, [None]),
    (4096, 2048, 50257, torch.bfloat16, [None]),
    (512, 4096, 10, torch.float32, [None]),
    (32, 2048, 10, torch.bfloat16, [None]),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def name(launch):
    return (f"{launch.block_b}x{launch.block_c}x{launch.block_k}/{launch.num_warps}w/{launch.num_stages}s"
            f"/k{launch.split_k}")


def main():
    for B, K, C, dtype, launches in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
        W = (torch.randn(K, C, device="cuda", generator=g) / K**0.5).to(dtype)
        line = f"{B}x{K}x{C} {str(dtype)[6:]}: torch {bench(lambda: torch.softmax(x @ W, -1)):.4f}"
        for pitch in (C, (C + 15) // 16 * 16, (C + 63) // 64 * 64, (C + 127) // 128 * 128):
            wide = torch.zeros(K, pitch, device="cuda", dtype=dtype)
            wide[:, :C] = W
            pitched = wide[:, :C]
            for launch in launches:
                chosen = launch or fsm.tiled_launch(B, C, dtype, x.device, K=K)
                ms = bench(lambda: fsm.matmul_softmax_fused_tiled(x, pitched, launch))
                line += f" | pitch {pitch} {name(chosen)} {ms:.4f}"
        line += f" | copy to pitch {(C + 63) // 64 * 64}: {bench(lambda: wide[:, :C].copy_(W)):.4f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
