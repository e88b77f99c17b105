"""softmax(x @ W) with W laid out K-major (nn.Linear's weight transposed, strides (1, K)): the
tiled op with W's class stride divided by the vector (W_KMAJOR, as it runs now) against the
arguments as they were before it (every stride and K, C undivided where W's K stride is 1),
and torch on the same W; the op with W row-major beside them.

GPU milliseconds a call from CUDA graphs of 20 calls (no host time, no L2 clearing: W and x
stay in L2 where they fit), median of 10 replays. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/kmajor_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

now_args = fsm._matmul_args


def before_args(x, W, out):
    """The arguments before W_KMAJOR: W's K stride among the row strides, whatever W's layout."""
    (B, K), C = x.shape, W.shape[1]
    (xb, xk), (wk, wc), (ob, oc) = (tuple(t.stride()) for t in (x, W, out))
    vec = fsm.vector_align((xb, wk, ob, K, C), x.element_size())
    return (B, K // vec, C // vec, xb // vec, xk, wk // vec, wc, ob // vec, oc), dict(VEC=vec)


def ours(args_fn, x, W):
    fsm._matmul_args = args_fn
    fsm._MATMUL_REPLAYS.clear()
    return graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W))


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("B x K x C dtype (launch): ours K-major before | ours K-major now | torch K-major | ours row-major | torch row-major")
for B, K, C, dt in ((512, 768, 1000, torch.bfloat16), (4096, 768, 1000, torch.bfloat16), (4096, 2048, 1000, torch.bfloat16),
                    (4096, 4096, 1000, torch.bfloat16), (512, 4096, 1000, torch.bfloat16), (32, 768, 1000, torch.bfloat16),
                    (512, 768, 1000, torch.float32), (512, 2048, 1000, torch.float32), (4096, 4096, 1000, torch.float32),
                    (1, 2048, 1000, torch.float32), (512, 768, 50257, torch.bfloat16), (4096, 4096, 32000, torch.bfloat16)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=dt, generator=g)
    Wk = (torch.randn(C, K, device="cuda", dtype=dt, generator=g) * K ** -0.5).t()
    Wr = Wk.contiguous()
    fsm._matmul_args = now_args
    assert torch.allclose(fsm.matmul_softmax_fused_tiled(x, Wk).float(), fsm.matmul_softmax_fused_tiled(x, Wr).float(),
                          atol=1e-2, rtol=0)
    launch = fsm.tiled_launch(B, C, dt, x.device, K=K, w_kmajor=True)  # the K-major runs' (row-major may differ)
    t = [ours(before_args, x, Wk), ours(now_args, x, Wk), graph_ms(lambda: torch.softmax(x @ Wk, -1)),
         ours(now_args, x, Wr), graph_ms(lambda: torch.softmax(x @ Wr, -1))]
    fsm._matmul_args = now_args
    print(f"{B} x {K} x {C} {str(dt)[6:]} ({launch.block_b}x{launch.block_c}x{launch.block_k}, split {launch.split_k}, "
          f"w{launch.num_warps} s{launch.num_stages}): " + " | ".join(f"{v:.4f}" for v in t) +
          f"   (K-major vs torch: {t[2] / t[0]:.2f}x -> {t[2] / t[1]:.2f}x)", flush=True)
