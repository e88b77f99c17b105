"""The attention backward's dK/dV on Hopper: the Gluon kernel against the Triton one, both
forced through FlashAttentionTriton (dQ is the Triton kernel on both). First the gradients
against float64 (attention_reference under autograd) on ragged and causal shapes, then forward +
backward GPU time from CUDA graphs beside cuDNN's; "host": host time of one eager forward +
backward on each path (its launches kept and replayed), beside cuDNN's. From the repository root
on an H100: PYTHONPATH=. python3 outputs/profiles/gluon_dkdv_probe.py [check] [time] [host]"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fused_softmax_matmul as fsm
from probe_timing import attention_training_step, graph_ms, host_us

CHOSEN = fsm.flash_dkdv_path


def on_path(path):
    fsm.flash_dkdv_path = CHOSEN if path is None else (lambda *args: path)
    fsm._FLASH_BACKWARDS.clear()


def rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check():
    print("gradients against float64 (max |error| / max |reference|), Triton dK/dV then Gluon dK/dV")
    shapes = [(2, 256, 256, 64), (2, 1000, 1000, 128), (3, 200, 200, 128), (1, 333, 333, 64), (2, 64, 192, 128),
              (2, 300, 130, 64), (1, 4097, 4097, 128), (4, 128, 128, 64)]
    for dtype in (torch.bfloat16, torch.float16):
        for b, nq, nk, d in shapes:
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(1)
                q = torch.randn(b, nq, d, device="cuda", dtype=dtype, generator=g)
                k = torch.randn(b, nk, d, device="cuda", dtype=dtype, generator=g)
                v = torch.randn(b, nk, d, device="cuda", dtype=dtype, generator=g)
                go = torch.randn(b, nq, d, device="cuda", dtype=dtype, generator=g)
                ref_in = [t.double().requires_grad_() for t in (q, k, v)]
                ref = torch.autograd.grad(fsm.attention_reference(*ref_in, causal), ref_in, go.double())
                line = []
                for path in ("triton", "gluon"):
                    on_path(path)
                    ins = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = fsm.FlashAttentionTriton.apply(*ins, causal)
                    grads = torch.autograd.grad(out, ins, go)
                    torch.cuda.synchronize()
                    line.append(" ".join(f"{rel(gr, r):.1e}" for gr, r in zip(grads, ref)))
                print(f"{str(dtype)[6:]:9} ({b},{nq},{nk},{d}) causal={causal!s:5}: dQ dK dV triton {line[0]} | gluon {line[1]}",
                      flush=True)
    on_path(None)


def cudnn_step(b, n, d, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, 1, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    go = torch.randn_like(q)

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(o, (q, k, v), go)
    return step


def time_paths():
    print("forward + backward ms from CUDA graphs, bf16: dK/dV by the Triton kernel, by the Gluon kernel; cuDNN")
    shapes = [(32, 1024), (32, 1000), (16, 3000), (16, 4096), (16, 4097), (16, 8192), (4, 16384), (1, 32768)]
    for d in (64, 128):
        for b, n in shapes:
            for causal in (False, True):
                step, _, _ = attention_training_step(fsm, b, n, d, causal)
                times = {}
                for path in ("triton", "gluon"):
                    on_path(path)
                    times[path] = graph_ms(step)
                times["triton again"] = (on_path("triton"), graph_ms(step))[1]  # drift check
                cudnn = graph_ms(cudnn_step(b, n, d, causal))
                base = min(times["triton"], times["triton again"])
                print(f"({b},{n},{d}) {'causal' if causal else 'full  '}: triton {times['triton']:.4f} "
                      f"({times['triton again']:.4f} again) gluon {times['gluon']:.4f} cudnn {cudnn:.4f} | "
                      f"gluon/triton speed {base / times['gluon']:.2f}x, vs cuDNN: triton {cudnn / base:.2f}x "
                      f"gluon {cudnn / times['gluon']:.2f}x", flush=True)
    on_path(None)


def host(switch=None, kernel="dK/dV"):
    """Host time of an eager forward + backward with ``kernel`` on each path (``switch(path)``
    forces one, ``switch(None)`` restores the rule; this probe's ``on_path`` by default)."""
    switch = switch or on_path
    print("host us per eager forward + backward (enqueued while the GPU spins), bf16, three runs each")
    for b, n, d in ((32, 1024, 128), (16, 4096, 128), (16, 4096, 64)):
        step, _, _ = attention_training_step(fsm, b, n, d, False)
        cudnn = cudnn_step(b, n, d, False)
        for run in range(3):
            times = {}
            for path in ("triton", "gluon"):
                switch(path)
                step()  # keeps this path's launches
                times[path] = host_us(step, n=50)
            print(f"({b},{n},{d}) full, run {run}: {kernel} triton {times['triton']:.1f}, gluon {times['gluon']:.1f}, "
                  f"cuDNN {host_us(cudnn, n=50):.1f}", flush=True)
    switch(None)


if __name__ == "__main__":
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {fsm.triton.__version__}")
    parts = sys.argv[1:] or ["check", "time"]
    if "check" in parts:
        check()
    if "time" in parts:
        time_paths()
    if "host" in parts:
        host()
