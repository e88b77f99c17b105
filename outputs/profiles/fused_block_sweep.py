"""fused_softmax's blocks (BLOCK_1 = BLOCK_2 = 16, 32, 64) on shapes of the shape grid, against torch.

A one-off diagnostic, not part of the benchmark suite. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/fused_block_sweep.py

For each (batch, d1, d2, d3) and dtype / float32 precision it prints each block's
``triton.testing.do_bench`` mean, its program count (batch x row tiles x d3 tiles), the
wrapper's default (``fused_blocks``) and torch's time: what a launch rule that also weighs the
number of row tiles must reproduce.
"""

from __future__ import annotations

import itertools

import torch
import triton

from fused_softmax_matmul import cdiv, fused_blocks, fused_launch, fused_softmax, softmax_mult

PRECISIONS = (("float32", "highest"), ("float32", "high"), ("float16", "n/a"), ("bfloat16", "n/a"))
SHAPES = [(8, d1, d2, d3) for d1, d2, d3 in itertools.product((1000, 4096), (1000, 8192), (64, 512))] + [
    (8, 1000, 3000, 96), (8, 2048, 1000, 64), (8, 2048, 4096, 128), (32, 1000, 1000, 64)]


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    for (batch, d1, d2, d3), (dtype_name, precision) in itertools.product(SHAPES, PRECISIONS):
        if precision != "n/a":
            torch.set_float32_matmul_precision(precision)
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn((batch, d1, d2), device="cuda", dtype=dtype, generator=gen)
        V = torch.randn((batch, d2, d3), device="cuda", dtype=dtype, generator=gen)
        t_torch = triton.testing.do_bench(lambda: softmax_mult(x, V), warmup=20, rep=60)
        parts = []
        for block in (16, 32, 64):
            programs = batch * cdiv(d1, block) * cdiv(d3, fused_launch(d3, block, dtype).block_3)
            try:
                t = triton.testing.do_bench(lambda: fused_softmax(x, V, block, block), warmup=20, rep=60)
                parts.append(f"{block}: {t:.4f} ms ({programs} programs, {t_torch / t:.2f}x)")
            except Exception as exc:
                parts.append(f"{block}: failed {type(exc).__name__} ({programs} programs)")
        print(f"({batch}, {d1}, {d2}, {d3}) {dtype_name} {precision}: torch {t_torch:.4f} ms; default "
              f"{fused_blocks(d2, d3, dtype, d2 * dtype.itemsize % 16 == 0)}; " + "; ".join(parts), flush=True)
    torch.set_float32_matmul_precision("highest")


if __name__ == "__main__":
    main()
