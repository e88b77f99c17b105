"""The attention backward's dQ on Hopper: the Gluon kernel against the Triton one, each forced
through FlashAttentionTriton (dK/dV by whichever kernel flash_dkdv_path picks, the same on both).
First the gradients against float64 (attention_reference under autograd) on ragged and causal
shapes, then forward + backward GPU time from CUDA graphs for the Triton dQ and the Gluon dQ at
each (keys a step, ring slots) tried, beside cuDNN's; "host": host time of one eager forward +
backward on each dQ path (its launches kept and replayed), beside cuDNN's. From the repository
root on an H100: PYTHONPATH=. python3 outputs/profiles/gluon_dq_probe.py [check] [time] [host]"""
import sys

import torch

import fused_softmax_matmul as fsm
from gluon_dkdv_probe import cudnn_step, rel
from gluon_dkdv_probe import host as dkdv_probe_host
from probe_timing import attention_training_step, graph_ms

CHOSEN, LAUNCH = fsm.flash_dq_path, fsm._gluon_flash_dq
# (keys a step, ring slots) tried for the Gluon dQ, by head dimension; the first was the default when
# it ran (the rule drawn from it, gluon_dq_block_n, takes 128 keys at d = 128 from 8192 keys).
VARIANTS = {64: [(128, 2), (64, 2), (128, 3)], 128: [(64, 2), (128, 2), (64, 3)]}


def on_path(path, block_n=None, stages=None):
    """Force the dQ kernel: "triton", "gluon" (with keys a step and ring slots), None: the rule's."""
    fsm.flash_dq_path = CHOSEN if path is None else (lambda *args: path)
    fsm._gluon_flash_dq = LAUNCH
    if block_n is not None:
        def launch(*args, **kwargs):
            return LAUNCH(*args, block_n=block_n, stages=stages, **kwargs)
        fsm._gluon_flash_dq = launch
    fsm._FLASH_BACKWARDS.clear()


def check():
    print("gradients against float64 (max |error| / max |reference|), Triton dQ then Gluon dQ at each variant")
    shapes = [(2, 256, 256, 64), (2, 1000, 1000, 128), (3, 200, 200, 128), (1, 333, 333, 64), (2, 64, 192, 128),
              (2, 300, 130, 64), (1, 4097, 4097, 128), (4, 128, 128, 64), (2, 130, 300, 64), (1, 2048, 2048, 64)]
    worst = 0.0
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
                line, errors = [], []
                for path, variant in [("triton", (None, None))] + [("gluon", vr) for vr in VARIANTS[d]]:
                    on_path(path, *variant)
                    ins = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = fsm.FlashAttentionTriton.apply(*ins, causal)
                    grads = torch.autograd.grad(out, ins, go)
                    torch.cuda.synchronize()
                    errs = [rel(gr, r) for gr, r in zip(grads, ref)]
                    errors.append(errs)
                    line.append(" ".join(f"{e:.1e}" for e in errs))
                worst = max(worst, max(e[0] / max(errors[0][0], 1e-30) for e in errors[1:]))
                print(f"{str(dtype)[6:]:9} ({b},{nq},{nk},{d}) causal={causal!s:5}: dQ dK dV triton {line[0]} | "
                      f"gluon {' | '.join(line[1:])}", flush=True)
    print(f"largest Gluon dQ error over the Triton dQ's: {worst:.2f}x")
    on_path(None)


def time_paths(shapes=None):
    print("forward + backward ms from CUDA graphs, bf16: dQ by the Triton kernel, by the Gluon kernel at each "
          "(keys a step, slots); cuDNN")
    shapes = shapes or [(32, 1024), (32, 1000), (16, 3000), (16, 4096), (16, 4097), (16, 8192), (4, 16384), (1, 32768)]
    for d in (64, 128):
        for b, n in shapes:
            for causal in (False, True):
                step, _, _ = attention_training_step(fsm, b, n, d, causal)
                on_path("triton")
                triton_ms = graph_ms(step)
                gluon = {}
                for variant in VARIANTS[d]:
                    on_path("gluon", *variant)
                    gluon[variant] = graph_ms(step)
                on_path("triton")
                again = graph_ms(step)  # drift check
                cudnn = graph_ms(cudnn_step(b, n, d, causal))
                base = min(triton_ms, again)
                best = min(gluon, key=gluon.get)
                print(f"({b},{n},{d}) {'causal' if causal else 'full  '}: triton {triton_ms:.4f} ({again:.4f} again) "
                      + " ".join(f"gluon{bn}x{st} {ms:.4f}" for (bn, st), ms in gluon.items())
                      + f" cudnn {cudnn:.4f} | gluon/triton speed "
                      + " ".join(f"{base / ms:.2f}x" for ms in gluon.values())
                      + f"; vs cuDNN: triton {cudnn / base:.2f}x best gluon ({best[0]}x{best[1]}) "
                        f"{cudnn / gluon[best]:.2f}x", flush=True)
    on_path(None)


def host():
    dkdv_probe_host(on_path, "dQ")


if __name__ == "__main__":
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {fsm.triton.__version__}")
    parts = sys.argv[1:] or ["check", "time"]
    if "check" in parts:
        check()
    if "time" in parts:
        time_paths()
    if "host" in parts:
        host()
