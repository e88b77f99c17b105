"""softmax(x) @ V as a user calls it, where fused_softmax takes the Gluon kernel: the path with and
without grad; the forward and a training step (forward + torch.autograd.grad of both inputs),
do_bench means with the L2 flushed; host time per call (enqueued while the GPU spins); and the
compiled call (torch.compile fullgraph, the Triton path). Beside torch and fused_softmax's Triton
paths forced (materialize=False / True). From the repository root on an H100:
PYTHONPATH=.:tests:outputs/profiles python3 outputs/profiles/gluon_fused_user_probe.py [b,d1,d2,d3 ...]
(shapes given replace the default four)."""
import sys

import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import bench, host_us
from support import softmax_matmul_inputs

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
FNS = {"torch": fsm.softmax_mult, "auto": fsm.fused_softmax,
       "triton": lambda x, V: fsm.fused_softmax(x, V, materialize=False),
       "materialized": lambda x, V: fsm.fused_softmax(x, V, materialize=True)}


def step(fn, x, V, dout):
    return lambda: torch.autograd.grad(fn(x, V), (x, V), dout)


SHAPES = [tuple(int(n) for n in arg.split(",")) for arg in sys.argv[1:]] or [
    (8, 2048, 4096, 64), (8, 2048, 8192, 128), (16, 2048, 1024, 256), (8, 1000, 2048, 64)]
for shape in SHAPES:
    x, V = softmax_matmul_inputs(*shape, torch.bfloat16)
    with torch.no_grad():
        path = fsm.fused_softmax_path(x, V)
        fwd = {k: bench(lambda f=f: f(x, V)) for k, f in FNS.items()}
        host = {k: host_us(lambda f=f: f(x, V)) for k, f in FNS.items()}
    xg, Vg = x.clone().requires_grad_(), V.clone().requires_grad_()
    grad_path = fsm.fused_softmax_path(xg, Vg)
    dout = torch.randn(shape[0], shape[1], shape[3], device="cuda", dtype=torch.bfloat16)
    train = {k: bench(step(f, xg, Vg, dout)) for k, f in FNS.items()}
    print(f"{shape} bf16: path {path}, with grad {grad_path}", flush=True)
    print("  forward ms   " + "  ".join(f"{k} {v:.4f}" for k, v in fwd.items())
          + f"  | auto {fwd['torch'] / fwd['auto']:.2f}x torch, {fwd['triton'] / fwd['auto']:.2f}x triton, "
          f"{fwd['materialized'] / fwd['auto']:.2f}x materialized", flush=True)
    print("  host us      " + "  ".join(f"{k} {v:.1f}" for k, v in host.items()), flush=True)
    print("  train ms     " + "  ".join(f"{k} {v:.4f}" for k, v in train.items())
          + f"  | auto {train['torch'] / train['auto']:.2f}x torch, {train['triton'] / train['auto']:.2f}x triton", flush=True)
    if shape == SHAPES[0]:
        compiled = torch.compile(fsm.fused_softmax, fullgraph=True)
        with torch.no_grad():
            compiled(x, V)
            print(f"  compiled fullgraph forward ms {bench(lambda: compiled(x, V)):.4f} (the Triton path), "
                  f"host us {host_us(lambda: compiled(x, V)):.1f}", flush=True)
    del x, V, xg, Vg
