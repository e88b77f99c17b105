"""The 16-bit tile rule for a W that stays in L2 (``_l2_bound_tile``) against the rule before it
(the same code with L2_RESIDENT_W_BYTES = 0), on softmax(x @ W) with W row-major and K-major
and on the backward's two products through ``matmul``: dx = dz @ W^T and dW = x^T @ dz (x^T and
W^T read in place), each beside torch on the same operands.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays; the two rules run
one after the other on each case. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/l2_tile_rule_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

NEW_BYTES = fsm.L2_RESIDENT_W_BYTES


def under(rule_bytes, fn):
    fsm.L2_RESIDENT_W_BYTES = rule_bytes
    fsm._tiled_launch.cache_clear()
    fsm._MATMUL_REPLAYS.clear()
    return graph_ms(fn)


def launch_name(B, K, C, rule_bytes, w_kmajor):
    fsm.L2_RESIDENT_W_BYTES = rule_bytes
    fsm._tiled_launch.cache_clear()
    launch = fsm.tiled_launch(B, C, torch.bfloat16, torch.device("cuda"), K=K, w_kmajor=w_kmajor)
    return f"{launch.block_b}x{launch.block_c} w{launch.num_warps} k{launch.split_k}"


def compare(label, B, K, C, w_kmajor, ours, theirs):
    torch_ms = graph_ms(theirs)
    before, after = under(0, ours), under(NEW_BYTES, ours)
    print(f"{label}: torch {torch_ms:.4f} | before {launch_name(B, K, C, 0, w_kmajor)} {before:.4f} "
          f"({torch_ms / before:.2f}x) | now {launch_name(B, K, C, NEW_BYTES, w_kmajor)} {after:.4f} "
          f"({torch_ms / after:.2f}x) | now/before {after / before:.3f}", flush=True)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for B, K, C in ((4096, 4096, 1000), (4096, 2048, 1000), (4096, 768, 1000), (2048, 4096, 1000), (2048, 2048, 1000),
                (1024, 4096, 1000), (1024, 2048, 1000), (8192, 4096, 1000), (4096, 4096, 3000), (4096, 4096, 5000),
                (4096, 4096, 2048), (2048, 4096, 4000), (16384, 1024, 1000), (4096, 1024, 8192)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(C, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    for layout, W in (("row-major", weight.t().contiguous()), ("K-major", weight.t())):
        compare(f"softmax(x @ W) {B} x {K} x {C} W {layout}", B, K, C, layout == "K-major",
                lambda: fsm.matmul_softmax_fused_tiled(x, W), lambda: torch.softmax(x @ W, -1))
    W = weight.t().contiguous()
    dz = torch.randn(B, C, device="cuda", dtype=torch.bfloat16, generator=g)
    compare(f"  dx = dz @ W^T ({B} x {C} x {K})", B, C, K, True, lambda: fsm.matmul(dz, W.t()), lambda: dz @ W.t())
    compare(f"  dW = x^T @ dz ({K} x {B} x {C})", K, B, C, False, lambda: fsm.matmul(x.t(), dz), lambda: x.t() @ dz)
