"""fused_softmax at d2 = 1000 and 3000: x's rows contiguous (stride d2) or padded to a multiple of
16 elements (a view of a wider tensor), beside d2 = 1024 and 3072; blocks 16, 32 and 64.

A one-off diagnostic, not part of the benchmark suite (triton.testing.do_bench means, ms). From
the repository root on a GPU: PYTHONPATH=. python3 outputs/profiles/fused_stride_probe.py
It separated the two suspects for slow ragged rows: the masked last step costs little, a row
stride Triton cannot prove a multiple of 16 elements costs up to 2.5x (see ``vector_strides``).
The committed .txt was taken before ``vector_strides``.
"""
import itertools, torch, triton
from fused_softmax_matmul import fused_softmax, softmax_mult
print(torch.cuda.get_device_name(), triton.__version__, flush=True)
for (d2, pad, d3), (dt, prec) in itertools.product(
        ((1000, 0, 64), (1000, 24, 64), (1024, 0, 64), (1000, 0, 512), (1000, 24, 512), (1024, 0, 512), (3000, 0, 96), (3000, 8, 96), (3072, 0, 96)),
        (("float32", "highest"), ("float32", "high"), ("bfloat16", "n/a"))):
    if prec != "n/a":
        torch.set_float32_matmul_precision(prec)
    dtype = getattr(torch, dt)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((8, 2048, d2 + pad), device="cuda", dtype=dtype, generator=g)[..., :d2]
    V = torch.randn((8, d2, d3), device="cuda", dtype=dtype, generator=g)
    tt = triton.testing.do_bench(lambda: softmax_mult(x, V), warmup=20, rep=60)
    parts = []
    for b in (16, 32, 64):
        t = triton.testing.do_bench(lambda: fused_softmax(x, V, b, b), warmup=20, rep=60)
        parts.append(f"{b}: {t:.4f}")
    print(f"d2 {d2} stride {d2 + pad} d3 {d3} {dt} {prec}: torch {tt:.4f}; " + "; ".join(parts), flush=True)
