"""16-bit softmax(x @ W) with 1000 classes: row blocks thinned below the warpgroup MMA's 64 rows
(the wrapper's choice at a47a953) against 64- and 128-row blocks with K split over the SMs.
``matmul_softmax_fused_tiled`` under each launch beside torch: ms per call replayed from a CUDA graph
of ten calls (GPU time alone: these calls take less GPU time than host time).

A one-off diagnostic, not part of the benchmark suite. From the repository root on a GPU:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/matmul_split_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from fused_softmax_matmul import MatmulLaunch
from probe_timing import graph_ms

SHAPES = [(512, 4096, 1000), (512, 2048, 1000), (512, 768, 1000), (1024, 4096, 1000), (256, 4096, 1000),
          (32, 4096, 1000), (32, 2048, 1000), (1, 4096, 1000), (512, 4096, 2000), (4096, 4096, 1000)]
# (block_b, block_c, warps, split_k), block_k 64, 4 stages
LAUNCHES = [(64, 256, 8, 1), (64, 256, 8, 2), (64, 256, 8, 4), (128, 256, 8, 4), (128, 256, 8, 8),
            (64, 128, 4, 2), (64, 128, 4, 4), (32, 256, 4, 8), (16, 256, 4, 16), (32, 128, 4, 8)]


def bench(fn):
    return graph_ms(fn)


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for B, K, C in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
        W = (torch.randn(K, C, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
        want = torch.softmax(x.float() @ W.float(), -1)
        chosen = fsm.tiled_launch(B, C, torch.bfloat16, x.device, K=K)
        parts = [f"torch {bench(lambda: torch.softmax(x @ W, -1)):.4f}",
                 f"chosen {chosen.block_b}x{chosen.block_c}/{chosen.num_warps}w/k{chosen.split_k} "
                 f"{bench(lambda: fsm.matmul_softmax_fused_tiled(x, W)):.4f}"]
        for b, c, w, split in LAUNCHES:
            if b > max(16, triton.next_power_of_2(B)):
                continue
            launch = MatmulLaunch(b, c, 64, group_b=8, num_warps=w, num_stages=4, split_k=split)
            err = (fsm.matmul_softmax_fused_tiled(x, W, launch).float() - want).abs().max().item()
            assert err < 2e-2, (B, K, C, launch, err)
            parts.append(f"{b}x{c}/{w}w/k{split} {bench(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch)):.4f}")
        print(f"{B}x{K}x{C}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
