"""softmax(x @ W) in bfloat16 with W K-major (nn.Linear's weight transposed) and row-major: the
tiled op under launches other than the wrapper's, to see whether W's layout wants other tiles.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays (as kmajor_probe.py).
From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/kmajor_tile_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms


LAUNCHES = [fsm.MatmulLaunch(*a) for a in (
    (128, 256, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3), (128, 256, 32, 8, 8, 6), (128, 256, 128, 8, 8, 2),
    (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (256, 128, 64, 8, 8, 4), (64, 256, 64, 8, 4, 4),
    (128, 128, 128, 8, 8, 3))]
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for B, K, C, layout in ((4096, 4096, 32000, "K-major"), (4096, 4096, 32000, "row-major"), (4096, 4096, 1000, "K-major"),
                        (4096, 4096, 1000, "row-major"), (4096, 768, 128256, "K-major")):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
    W = (torch.randn(C, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5).t()
    W = W if layout == "K-major" else W.contiguous()
    chosen = fsm.tiled_launch(B, C, torch.bfloat16, x.device, K=K, w_kmajor=fsm._w_kmajor(W))
    torch_ms = graph_ms(lambda: torch.softmax(x @ W, -1))
    print(f"== {B} x {K} x {C} bf16, W {layout}: torch {torch_ms:.4f} ms; the wrapper's launch "
          f"{chosen.block_b}x{chosen.block_c}x{chosen.block_k} w{chosen.num_warps} s{chosen.num_stages}", flush=True)
    for launch in LAUNCHES:
        try:
            fsm._MATMUL_REPLAYS.clear()
            ms = graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch))
            print(f"  {launch.block_b}x{launch.block_c}x{launch.block_k} w{launch.num_warps} s{launch.num_stages}: "
                  f"{ms:.4f} ms ({torch_ms / ms:.2f}x torch)", flush=True)
        except Exception as e:  # out of shared memory, say
            print(f"  {launch}: {type(e).__name__}", flush=True)
