"""softmax(x @ W) with W's rows on a pitch that is no multiple of 128 bytes (C = 1000: 2000 or
4000 bytes) or of 16 bytes (C = 50257): the tiled op as the grid calls it, on a copy of W whose
rows are padded to 128 bytes (the copy made beforehand, and made in the call), on W laid out
K-major (nn.Linear's weight transposed), and torch on each.

GPU milliseconds from triton.testing.do_bench (L2 cleared before each run, median). From the
repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/w_pitch_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def padded(W):
    """W's values in rows padded to 128 bytes (a view of the first C columns)."""
    K, C = W.shape
    per = 128 // W.element_size()
    out = torch.empty((K, (C + per - 1) // per * per), dtype=W.dtype, device=W.device)[:, :C]
    out.copy_(W)
    return out


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("B x K x C dtype: torch | ours | ours on padded W (copy apart) | the copy | ours with the copy in the call |"
      " ours on K-major W | torch on K-major W")
cases = [(B, K, C, dt) for dt in (torch.bfloat16, torch.float32) for C in (1000, 50257) for B in (512, 4096)
         for K in (768, 4096)]
cases += [(1, 768, 50257, torch.bfloat16), (32, 768, 50257, torch.bfloat16), (32, 4096, 50257, torch.bfloat16),
          (1, 2048, 1000, torch.float32), (512, 2048, 1000, torch.float32), (4096, 2048, 1000, torch.bfloat16)]
for B, K, C, dt in cases:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=dt, generator=g)
    W = (torch.randn(K, C, device="cuda", dtype=dt, generator=g) * K ** -0.5)
    Wp = padded(W)
    Wk = W.t().contiguous().t()
    rep = 200 if B * K * C < 4096 * 4096 * 20000 else 1000
    t = [bench(lambda: torch.softmax(x @ W, -1), rep),
         bench(lambda: fsm.matmul_softmax_fused_tiled(x, W), rep),
         bench(lambda: fsm.matmul_softmax_fused_tiled(x, Wp), rep),
         bench(lambda: Wp.copy_(W), rep),
         bench(lambda: fsm.matmul_softmax_fused_tiled(x, padded(W)), rep),
         bench(lambda: fsm.matmul_softmax_fused_tiled(x, Wk), rep),
         bench(lambda: torch.softmax(x @ Wk, -1), rep)]
    print(f"{B} x {K} x {C} {str(dt)[6:]}: " + " | ".join(f"{v:.4f}" for v in t) +
          f"   (vs torch: as is {t[0] / t[1]:.2f}x, copy in call {t[0] / t[4]:.2f}x, K-major {t[6] / t[5]:.2f}x)",
          flush=True)
