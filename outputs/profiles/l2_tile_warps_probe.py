"""The L2 rule's 256 x 128 tile (softmax(x @ W), bf16, no program groups) over 8 and 16 warps,
beside 128 x 256 and 128 x 128 on 16 warps: whether more warpgroups a program hide more of the
tile's load latency. GPU milliseconds a call from CUDA graphs of 20 calls, median of 10
replays. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/l2_tile_warps_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

L = fsm.MatmulLaunch
LAUNCHES = {"256x128 w8": L(256, 128, 64, 1, 8, 4), "256x128 w16": L(256, 128, 64, 1, 16, 4),
            "256x128 w16 s3": L(256, 128, 64, 1, 16, 3), "128x256 w16": L(128, 256, 64, 1, 16, 4),
            "128x128 w8": L(128, 128, 64, 1, 8, 4), "128x128 w16": L(128, 128, 64, 1, 16, 4)}
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for B, K, C in ((4096, 4096, 1000), (4096, 2048, 1000), (8192, 4096, 1000), (4096, 4096, 3000), (2048, 4096, 1000)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(K, C, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    parts = [f"torch {graph_ms(lambda: torch.softmax(x @ W, -1)):.4f}"]
    for name, launch in LAUNCHES.items():
        try:
            fsm._MATMUL_REPLAYS.clear()
            parts.append(f"{name} {graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch)):.4f}")
        except Exception as e:  # out of registers or shared memory, say
            parts.append(f"{name} {type(e).__name__}")
    print(f"{B} x {K} x {C}: " + " | ".join(parts), flush=True)
