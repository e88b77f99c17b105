"""Host time of softmax(x @ W)'s eager forward + backward (the tiled op, bf16), and where it goes:
time per step with the GPU kept busy (``host_us``), then cProfile of 30 steps, the functions of
most own time and of most time below them. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/matmul_backward_host_profile.py
"""
import cProfile
import io
import pstats

import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import host_us

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
B, K, C = 1024, 4096, 1000
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
W = (torch.randn(K, C, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5).requires_grad_()
dz = torch.randn(B, C, device="cuda", dtype=torch.bfloat16, generator=g)


def ours():
    fsm.matmul_softmax_fused_tiled(x, W).backward(dz)


def theirs():
    torch.softmax(x @ W, -1).backward(dz)


def forward_only():
    with torch.no_grad():
        fsm.matmul_softmax_fused_tiled(x, W)


def forward_with_grad():
    fsm.matmul_softmax_fused_tiled(x, W)


out = fsm.matmul_softmax_fused_tiled(x, W).detach()


def backward_op():
    fsm._matmul_softmax_backward_op(x, W, out, dz, True, True)


def backward_body():
    fsm._matmul_backward(x, W, fsm._softmax_grad(out, dz, wrap=False), True, True, wrap=False)


def softmax_grad_only():
    fsm._softmax_grad(out, dz, wrap=False)


def dx_only():
    fsm._matmul_forward(dz, W.t(), None, False)


def dw_only():
    fsm._matmul_forward(x.t(), dz, None, False)


for name, fn in (("ours fwd+bwd", ours), ("torch fwd+bwd", theirs), ("ours forward, no grad", forward_only),
                 ("ours forward, grad recorded", forward_with_grad), ("the backward op", backward_op),
                 ("its body", backward_body), ("softmax_grad", softmax_grad_only), ("dx = dz @ W^T", dx_only),
                 ("dW = x^T @ dz", dw_only)):
    print(f"{name}: host {min(host_us(fn, 30) for _ in range(3)):.1f} us a step", flush=True)
for _ in range(3):
    ours()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(30):
    ours()
prof.disable()
torch.cuda.synchronize()
for key in ("tottime", "cumtime"):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(25)
    print(f"== by {key}, 30 steps\n" + "\n".join(line[:200] for line in out.getvalue().splitlines()[6:]), flush=True)
