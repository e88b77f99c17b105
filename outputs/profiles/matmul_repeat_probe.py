"""softmax(x @ W) at 1 x 4096 x 32000 float32, timed again and again: whether the bimodal times
one grid run gave this case (0.187 to 0.953 ms over 15 rounds at 615a134) repeat. CUDA-graph
times and do_bench means, ms, each of five tries.

A one-off diagnostic, not part of the benchmark suite. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/matmul_repeat_probe.py
"""
import sys

import torch
import triton

import fused_softmax_matmul as fsm

sys.path.insert(0, "outputs/profiles")
from probe_timing import graph_ms  # noqa: E402


def main():
    for B, K, C, dtype in [(1, 4096, 32000, torch.float32), (1, 2048, 32000, torch.float32),
                           (1, 4096, 32000, torch.bfloat16)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
        W = (torch.randn(K, C, device="cuda", generator=g) / K**0.5).to(dtype)
        launch = fsm.tiled_launch(B, C, dtype, x.device, K=K)
        ours = [graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W)) for _ in range(5)]
        bench = [triton.testing.do_bench(lambda: fsm.matmul_softmax_fused_tiled(x, W), warmup=10, rep=100)
                 for _ in range(5)]
        torch_ms = [graph_ms(lambda: torch.softmax(x @ W, -1)) for _ in range(3)]
        print(f"{B}x{K}x{C} {str(dtype)[6:]} {launch}: graph {' '.join(f'{t:.4f}' for t in ours)} | do_bench "
              f"{' '.join(f'{t:.4f}' for t in bench)} | torch graph {' '.join(f'{t:.4f}' for t in torch_ms)}",
              flush=True)


if __name__ == "__main__":
    main()
