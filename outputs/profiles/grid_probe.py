"""The whole softmax(x) @ V and softmax(x @ W) grids of issue 17 by do_bench: torch eager against
the public Triton op and the other way this suite can compute it.

A one-off diagnostic, not part of the benchmark suite (the harness's shape-grid group times the
same cases with torch.compile too, but takes most of an hour on them). From the repository
root on an H100:

    PYTHONPATH=. python3 outputs/profiles/grid_probe.py [smv|mmsm|all]

softmax(x) @ V, batch 8: torch (softmax then matmul), ``fused_softmax``'s fused kernel
(materialize=False) and the unfused pair ``row_softmax`` then torch.bmm; the grid's shapes, then a few off it (d3 192 to 384, d2 2000
and 6000). softmax(x @ W): torch, ``matmul_softmax_fused_tiled`` and ``matmul_softmax_unfused``.
Times: do_bench means, ms. Ratios: torch's time / the op's.
"""
import sys

import torch
import triton

from fused_softmax_matmul import (fused_softmax, matmul_softmax_fused_tiled, matmul_softmax_ref,
                                  matmul_softmax_unfused, softmax_mult)
from online_softmax import row_softmax
from tests.support import matmul_softmax_inputs, softmax_matmul_inputs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PRECISIONS = (("float32", "highest"), ("float32", "high"), ("float16", "n/a"), ("bfloat16", "n/a"))
SMV = [(d1, d2, d3, dt, p) for d3 in (64, 96, 128, 512) for d2 in (1000, 3000, 4096, 8192)
       for d1 in (1000, 2048, 4096) for dt, p in PRECISIONS]
SMV_OFF = [(d1, d2, d3, dt, p) for d3 in (192, 256, 384) for d2, d1 in ((2000, 2048), (6000, 1000), (8192, 4096))
           for dt, p in PRECISIONS]
MMSM = [(B, K, C, dtype) for B in (1, 32, 512, 4096) for K in (768, 2048, 4096)
        for C in (10, 1000, 32000, 50257, 128256) for dtype in ("float32", "bfloat16")]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def fused_kernel(x, V):
    return fused_softmax(x, V, materialize=False)


def unfused_softmax_mult(x, V):
    return torch.bmm(row_softmax(x), V)


def smv(cases, label):
    print(f"\n## softmax(x) @ V, batch 8 ({label}): ms, and torch / op", flush=True)
    print(f"{'d1':>5} {'d2':>5} {'d3':>4} {'precision':<16} {'torch':>8} {'fused':>8} {'unfused':>8} "
          f"{'x fused':>8} {'x unfused':>9}", flush=True)
    for d1, d2, d3, dt, p in cases:
        if p != "n/a":
            torch.set_float32_matmul_precision(p)
        x, V = softmax_matmul_inputs(8, d1, d2, d3, DTYPES[dt])
        t = [bench(lambda f=f, x=x, V=V: f(x, V)) for f in (softmax_mult, fused_kernel, unfused_softmax_mult)]
        name = dt + (f" {p}" if p != "n/a" else "")
        print(f"{d1:>5} {d2:>5} {d3:>4} {name:<16} {t[0]:8.4f} {t[1]:8.4f} {t[2]:8.4f} "
              f"{t[0] / t[1]:8.2f} {t[0] / t[2]:9.2f}", flush=True)
        del x, V
        torch.set_float32_matmul_precision("highest")


def mmsm():
    print("\n## softmax(x @ W): ms, and torch / op", flush=True)
    print(f"{'B':>5} {'K':>5} {'C':>6} {'dtype':<9} {'torch':>8} {'tiled':>8} {'unfused':>8} "
          f"{'x tiled':>8} {'x unfused':>9}", flush=True)
    for B, K, C, dt in MMSM:
        x, W = matmul_softmax_inputs(B, K, C, DTYPES[dt])
        t = [bench(lambda f=f, x=x, W=W: f(x, W))
             for f in (matmul_softmax_ref, matmul_softmax_fused_tiled, matmul_softmax_unfused)]
        print(f"{B:>5} {K:>5} {C:>6} {dt:<9} {t[0]:8.4f} {t[1]:8.4f} {t[2]:8.4f} "
              f"{t[0] / t[1]:8.2f} {t[0] / t[2]:9.2f}", flush=True)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if which in ("smv", "all"):
        smv(SMV, "the grid")
        smv(SMV_OFF, "off the grid")
    if which in ("mmsm", "all"):
        mmsm()


if __name__ == "__main__":
    main()
