"""Which attention forward FlashAttentionTriton should run, measured as a caller sees it: each
forward path (the Gluon kernel, the Triton kernel) forced through the Function, with its kept
launch replayed; host time per call (enqueued while the GPU spins) beside SDPA and an empty
kernel's launch, a cProfile table of the Gluon path, then GPU time from CUDA graphs over shapes
of both head dims, most of them off the shape grid. From the repository root on an H100:
PYTHONPATH=. python3 outputs/profiles/gluon_path_probe.py [host] [gpu] [rule] [all]"""
import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fused_softmax_matmul as fsm
from probe_timing import graph_ms, host_us

CHOSEN = fsm.flash_forward_path


def on_path(path):
    """FlashAttentionTriton.apply with its forward forced onto ``path`` (None: its own choice)."""
    fsm.flash_forward_path = CHOSEN if path is None else (lambda *args: path)
    fsm._FLASH_FORWARDS.clear()
    fsm._FLASH_BACKWARDS.clear()


@triton.jit
def empty_kernel(x):
    pass


def cudnn(Q, K, V, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None], is_causal=causal)


def host():
    x0 = torch.zeros(1, device="cuda")
    for b, n, d in ((16, 4096, 128), (32, 1024, 128), (32, 1024, 64)):
        Q, K, V = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for rep in range(3):
            t = {"empty launch": host_us(lambda: empty_kernel[(1,)](x0))}
            with torch.no_grad():
                for path in ("gluon", "triton"):
                    on_path(path)
                    t[f"forward {path}"] = host_us(lambda: fsm.FlashAttentionTriton.apply(Q, K, V, False))
                t["forward SDPA"] = host_us(lambda: F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None]))
            print(f"host us ({b}, {n}, {d}) full bf16, run {rep}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
    on_path("gluon")
    Q, K, V = (torch.randn(16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        for _ in range(3):
            fsm.FlashAttentionTriton.apply(Q, K, V, False)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 0.05))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            fsm.FlashAttentionTriton.apply(Q, K, V, False)
        profile.disable()
    torch.cuda.synchronize()
    print("cProfile, 300 forwards on the Gluon path, (16, 4096, 128) full bf16:")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(18)
    on_path(None)


# (batch x heads, length, d, causal): the grid's lengths and others between and beside them.
CASES = [(64, 512, 128, False), (64, 512, 128, True), (32, 1000, 128, False), (32, 1024, 128, True),
         (16, 1500, 128, False), (16, 1500, 128, True), (16, 2048, 128, True), (8, 2048, 128, True),
         (16, 3000, 128, False), (16, 3000, 128, True), (4, 4096, 128, True), (8, 4096, 128, True),
         (2, 8192, 128, True), (1, 16384, 128, True), (4, 8192, 128, False),
         (64, 512, 64, False), (64, 512, 64, True), (32, 1000, 64, False), (32, 1024, 64, False),
         (16, 2048, 64, False), (16, 2048, 64, True), (16, 3000, 64, False), (8, 4096, 64, False),
         (8, 4096, 64, True), (16, 4096, 64, False), (16, 4097, 64, False), (4, 8192, 64, False),
         (4, 8192, 64, True), (16, 8192, 64, False), (16, 8192, 64, True), (2, 16384, 64, False),
         (1, 32768, 64, False), (1, 32768, 64, True)]


# Checks of the rule drawn from CASES (gluon_flash_forward_wins): causal d = 128 at 1-3 waves of
# 128-query programs on 132 SMs, causal d = 64 near its 16384-key threshold, full d = 64 near 2048.
RULE_CASES = [(1, 32768, 128, True), (2, 16384, 128, True), (3, 8192, 128, True), (6, 4096, 128, True),
              (12, 2048, 128, True), (24, 1024, 128, True), (40, 512, 128, True), (20, 2048, 128, True),
              (12, 4096, 128, True), (48, 1024, 128, True), (96, 1024, 128, True), (16, 4097, 128, True),
              (8, 1500, 128, False), (48, 2048, 128, False),
              (1, 16384, 64, True), (2, 16384, 64, True), (8, 16384, 64, True), (2, 12288, 64, True),
              (32, 1500, 64, False), (4, 2048, 64, False), (64, 2048, 64, False), (8, 3000, 64, False)]


def gpu(cases=CASES):
    print("GPU ms per call from CUDA graphs (bf16): the Function's forward on each path, cuDNN; "
          "'chosen' is the path flash_forward_path takes", flush=True)
    with torch.no_grad():
        for b, n, d, causal in cases:
            g = torch.Generator(device="cuda").manual_seed(0)
            Q, K, V = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            t = {}
            for path in ("gluon", "triton"):
                on_path(path)
                t[path] = graph_ms(lambda: fsm.FlashAttentionTriton.apply(Q, K, V, causal))
            on_path(None)
            t["cudnn"] = graph_ms(lambda: cudnn(Q, K, V, causal))
            flops = fsm.attention_flops(b, n, n, d, causal)
            print(f"({b},{n},{d}) {'causal' if causal else 'full'} {flops / 1e9:.1f} GFLOP: "
                  + " ".join(f"{k} {v:.4f}" for k, v in t.items())
                  + f" | triton/gluon {t['triton'] / t['gluon']:.2f}, gluon/cuDNN {t['cudnn'] / t['gluon']:.2f}x,"
                  f" triton/cuDNN {t['cudnn'] / t['triton']:.2f}x, chosen {CHOSEN(Q, K, V, causal)}", flush=True)


if __name__ == "__main__":
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    parts = sys.argv[1:] or ["host", "gpu"]
    if "host" in parts:
        host()
    if "gpu" in parts:
        gpu()
    if "rule" in parts:
        gpu(RULE_CASES)
    if "all" in parts:
        gpu(CASES + RULE_CASES)
