"""softmax(x) @ V by the Gluon kernel with the weights as the products' register operand or
through shared memory (``GluonSoftmaxLaunch(p_smem=True)``): do_bench medians (L2 flushed) and
the error against float64 on batch element 0, bf16. One-off diagnostic. Its .txt ran on the tree
between 057f8d7 and 354d63f, where the default launch kept the weights in registers; since, the
"registers" launch asks for them. From the repository root on an H100:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/gluon_fused_psmem_probe.py
"""
import dataclasses

import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import median_ms as ms, softmax_matmul_error as error

CASES = [(16, 2048, 8192, 512), (16, 2048, 8192, 256), (16, 2048, 8192, 128), (8, 2048, 4096, 64),
         (8, 1000, 8192, 512), (16, 2048, 1024, 256), (8, 4096, 3000, 512)]


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; do_bench medians (ms), "
      "L2 flushed; err: ||out - float64|| / ||float64|| on batch element 0", flush=True)
with torch.no_grad():
    for b, d1, d2, d3 in CASES:
        g = torch.Generator(device="cuda").manual_seed(d2 + d3)
        x = torch.randn(b, d1, d2, device="cuda", dtype=torch.bfloat16, generator=g)
        V = torch.randn(b, d2, d3, device="cuda", dtype=torch.bfloat16, generator=g)
        default = fsm.gluon_softmax_launch(d2, d3)
        launches = {"registers": dataclasses.replace(default, p_smem=False), "smem": dataclasses.replace(default, p_smem=True),
                    "smem_64": dataclasses.replace(default, block_n=64, p_smem=True),
                    "smem_64x3": dataclasses.replace(default, block_n=64, stages=3, p_smem=True)}
        t = {"torch": ms(lambda: fsm.softmax_mult(x, V))}
        errs = {"torch": error(fsm.softmax_mult(x, V), x, V)}
        for name, launch in launches.items():
            t[name] = ms(lambda: fsm.fused_softmax_gluon(x, V, launch=launch))
            errs[name] = error(fsm.fused_softmax_gluon(x, V, launch=launch), x, V)
        best = min((v, k) for k, v in t.items() if k != "torch")
        print(f"({b},{d1},{d2},{d3}): " + " ".join(f"{k} {v:.4f}" for k, v in t.items())
              + f" | smem/registers {t['registers'] / t['smem']:.3f}x, best {best[1]} {t['registers'] / best[0]:.3f}x"
              f" registers' speed, {t['torch'] / best[0]:.2f}x torch | err " + " ".join(f"{k} {v:.2e}" for k, v in errs.items()),
              flush=True)
