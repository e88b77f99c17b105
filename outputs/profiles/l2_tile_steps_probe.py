"""The tiles ``_l2_bound_tile`` picks (softmax(x @ W), bf16, 1000 classes) under other K steps,
stages and program groupings, to see whether the launch around the tile leaves time on the table.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/l2_tile_steps_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for B, K, C in ((4096, 4096, 1000), (4096, 2048, 1000), (2048, 4096, 1000), (1024, 4096, 1000), (512, 4096, 1000)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(K, C, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    chosen = fsm.tiled_launch(B, C, torch.bfloat16, x.device, K=K)
    torch_ms = graph_ms(lambda: torch.softmax(x @ W, -1))
    fsm._MATMUL_REPLAYS.clear()
    parts = [f"torch {torch_ms:.4f}", f"wrapper {chosen.block_b}x{chosen.block_c}x{chosen.block_k} g{chosen.group_b} "
             f"w{chosen.num_warps} s{chosen.num_stages} k{chosen.split_k} "
             f"{graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W)):.4f}"]
    bb, bc, w = chosen.block_b, chosen.block_c, chosen.num_warps
    variants = [(64, 8, 3), (128, 8, 2), (128, 8, 3), (32, 8, 6), (64, 4, 4), (64, 16, 4), (64, 1, 4)]
    if chosen.split_k == 1:
        variants += [(64, 8, 4, 2), (64, 8, 4, 4)]
    for v in variants:
        block_k, group, stages, *split = v
        launch = fsm.MatmulLaunch(bb, bc, block_k, group, w, stages, *(split or [1]))
        try:
            fsm._MATMUL_REPLAYS.clear()
            ms = graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch))
            parts.append(f"k{block_k} g{group} s{stages}{' split ' + str(split[0]) if split else ''} {ms:.4f}")
        except Exception as e:  # out of shared memory, say
            parts.append(f"k{block_k} g{group} s{stages} {type(e).__name__}")
    print(f"{B} x {K} x {C}: " + " | ".join(parts), flush=True)
