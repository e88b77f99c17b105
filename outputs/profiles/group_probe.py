"""Program groups (``tile_coords``'s GROUP_B) on launches the L2 rule leaves alone: a row-major
W of whole 32-byte sectors that stays in L2 (16-bit), float32 products, and a W read from DRAM,
each under the wrapper's launch with groups of 8 (its choice) and with none (group_b 1).
GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/group_probe.py
"""
from dataclasses import replace

import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for B, K, C, dtype in ((4096, 4096, 2048, torch.bfloat16), (2048, 4096, 4000, torch.bfloat16),
                       (4096, 1024, 8192, torch.bfloat16), (4096, 4096, 1000, torch.float32),
                       (4096, 2048, 1000, torch.float32), (512, 4096, 1000, torch.float32),
                       (4096, 4096, 32000, torch.bfloat16), (4096, 768, 32000, torch.bfloat16)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
    W = torch.randn(K, C, device="cuda", dtype=dtype, generator=g) * K ** -0.5
    chosen = fsm.tiled_launch(B, C, dtype, x.device, K=K)
    parts = [f"torch {graph_ms(lambda: torch.softmax(x @ W, -1)):.4f}"]
    for group in (chosen.group_b, 1, 4):
        launch = replace(chosen, group_b=group)
        fsm._MATMUL_REPLAYS.clear()
        parts.append(f"g{group} {graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch)):.4f}")
    print(f"{B} x {K} x {C} {str(dtype)[6:]} ({chosen.block_b}x{chosen.block_c} w{chosen.num_warps} "
          f"k{chosen.split_k}): " + " | ".join(parts), flush=True)
