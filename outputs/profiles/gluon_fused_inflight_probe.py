"""softmax(x) @ V by the Gluon kernel with each step's products waited for in the step, against
92ed370's kernel, whose products stayed in flight across the loop's back edge (ptxas serialised
every warpgroup MMA there: its C7512), and PyTorch: do_bench medians (L2 flushed), error against
float64 on batch element 0. One-off diagnostic; its .txt ran at 6eb4090. From the repository
root on an H100, with 92ed370's module beside it:

    mkdir -p outputs/profiles/head_tree
    git show 92ed370:fused_softmax_matmul.py > outputs/profiles/head_tree/fsm_92ed370.py
    PYTHONPATH=.:outputs/profiles:outputs/profiles/head_tree python3 outputs/profiles/gluon_fused_inflight_probe.py
"""
import sys

import torch
import triton

import fsm_92ed370 as before
import fused_softmax_matmul as fsm
from probe_timing import median_ms as ms, softmax_matmul_error as error

L = fsm.GluonSoftmaxLaunch
CASES = [(16, 2048, 8192, 512), (16, 2048, 8192, 256), (16, 2048, 8192, 128), (16, 2048, 8192, 64),
         (8, 2048, 4096, 64), (16, 2048, 1024, 256), (16, 4096, 4096, 128), (8, 1000, 8192, 512)]
LAUNCHES = {"128x256x2": L(128, 256, 2), "64x256x2": L(64, 256, 2), "64x256x3": L(64, 256, 3),
            "64x256x4": L(64, 256, 4), "128x128x2": L(128, 128, 2), "64x256x2_pp": L(64, 256, 2, pingpong=True),
            "64x256x2_eager": L(64, 256, 2, lazy_rescale=False)}


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; do_bench medians (ms), "
      "L2 flushed; err: ||out - float64|| / ||float64|| on batch element 0", flush=True)
cases = [c + ("bf16",) for c in CASES] + [(16, 2048, 8192, 512, "high"), (16, 2048, 8192, 512, "highest"),
                                          (16, 2048, 8192, 128, "high"), (16, 2048, 8192, 128, "highest")]
if len(sys.argv) > 1:
    cases = [c for c in cases if c[-1] in sys.argv[1:]]
with torch.no_grad():
    for b, d1, d2, d3, kind in cases:
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        if dtype == torch.float32:
            torch.set_float32_matmul_precision(kind)
        g = torch.Generator(device="cuda").manual_seed(d2 + d3)
        x = torch.randn(b, d1, d2, device="cuda", dtype=dtype, generator=g)
        V = torch.randn(b, d2, d3, device="cuda", dtype=dtype, generator=g)
        t = {"torch": ms(lambda: fsm.softmax_mult(x, V)),
             "before": ms(lambda: before.fused_softmax_gluon(x, V))}
        errs = {"torch": error(fsm.softmax_mult(x, V), x, V), "before": error(before.fused_softmax_gluon(x, V), x, V),
                "after": error(fsm.fused_softmax_gluon(x, V), x, V)}
        t["after"] = ms(lambda: fsm.fused_softmax_gluon(x, V))
        if dtype == torch.bfloat16:
            for name, launch in LAUNCHES.items():
                if launch.block_d3 <= max(16, triton.next_power_of_2(d3)) and launch.block_n <= max(16, triton.next_power_of_2(d2)):
                    t[name] = ms(lambda: fsm.fused_softmax_gluon(x, V, launch=launch))
        best = min((v, k) for k, v in t.items() if k not in ("torch", "before"))
        print(f"({b},{d1},{d2},{d3}) {kind}: " + " ".join(f"{k} {v:.4f}" for k, v in t.items())
              + f" | after/before {t['before'] / t['after']:.3f}x, vs torch: before {t['torch'] / t['before']:.2f}x,"
              f" after {t['torch'] / t['after']:.2f}x, best {best[1]} {t['torch'] / best[0]:.2f}x | err "
              + " ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
        torch.set_float32_matmul_precision("highest")
