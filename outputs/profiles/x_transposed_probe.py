"""The backward's dW = x^T @ dz through ``matmul``, with x^T's K stride divided by the vector
(X_TRANSPOSED, as it runs now) against the arguments before it (x^T's row stride of 1 among the
divided strides: no vectors, so dz's and dW's rows went element by element where C is no
multiple of 16), beside torch's product; then softmax(x @ W)'s forward + backward, ours against
torch's, both argument sets.

Products: GPU ms a call from CUDA graphs of 20 calls, median of 10 replays. Forward + backward:
do_bench means (host time included where it is longer than the GPU's). From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/x_transposed_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import bench, replay_median_ms as graph_ms

now_args = fsm._matmul_args


def before_args(x, W, out):
    """The arguments before X_TRANSPOSED: x's row stride always among the divided ones."""
    (B, K), C = x.shape, W.shape[1]
    (xb, xk), (wk, wc), (ob, oc) = (tuple(t.stride()) for t in (x, W, out))
    kmajor = fsm._w_kmajor(W)
    vec = fsm.vector_align((xb, wc if kmajor else wk, ob, K, C), x.element_size())
    w_strides = (wk, wc // vec) if kmajor else (wk // vec, wc)
    return (B, K // vec, C // vec, xb // vec, xk, *w_strides, ob // vec, oc), dict(VEC=vec, W_KMAJOR=kmajor)


def under(args_fn, time, fn):
    fsm._matmul_args = args_fn
    fsm._MATMUL_REPLAYS.clear()
    try:
        return time(fn)
    finally:
        fsm._matmul_args = now_args


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("B x K x C bf16: dW = x^T @ dz: torch | before | now (speed-up against torch) || softmax(x @ W) forward + "
      "backward: torch | before | now")
for B, K, C in ((4096, 4096, 1000), (4096, 2048, 1000), (4096, 768, 1000), (2048, 4096, 1000), (1024, 4096, 1000),
                (8192, 4096, 1000), (16384, 1024, 1000), (4096, 4096, 3000), (4096, 4096, 2048), (4096, 4096, 32000),
                (1000, 4096, 1000)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(K, C, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    dz = torch.randn(B, C, device="cuda", dtype=torch.bfloat16, generator=g) / C
    t = graph_ms(lambda: x.t() @ dz)
    b = under(before_args, graph_ms, lambda: fsm.matmul(x.t(), dz))
    n = under(now_args, graph_ms, lambda: fsm.matmul(x.t(), dz))
    diff = (under(now_args, lambda f: f(), lambda: fsm.matmul(x.t(), dz)).float() - (x.t() @ dz).float()).abs().max()
    xg, Wg = x.clone().requires_grad_(), W.clone().requires_grad_()

    def step(op):
        def run():
            op(xg, Wg).backward(dz)
        return run

    ft = bench(step(lambda a, w: torch.softmax(a @ w, -1)))
    fb = under(before_args, bench, step(fsm.matmul_softmax_fused_tiled))
    fn = under(now_args, bench, step(fsm.matmul_softmax_fused_tiled))
    print(f"{B} x {K} x {C}: {t:.4f} | {b:.4f} ({t / b:.2f}x) | {n:.4f} ({t / n:.2f}x) [max |ours - torch| {diff:.1e}]"
          f" || {ft:.4f} | {fb:.4f} ({ft / fb:.2f}x) | {fn:.4f} ({ft / fn:.2f}x)", flush=True)
