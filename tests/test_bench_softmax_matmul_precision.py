"""Benchmark group softmax_matmul_precision: softmax(x) @ V in float32 (matmul precision 'highest'
and 'high'), bfloat16 and float16, with the implementations of the softmax_matmul group.

The group's triton_compiled row is at bfloat16, d2 the largest (test_bench_softmax_matmul.py says why).

    pytest --benchmark-only -p no:xdist tests/test_bench_softmax_matmul_precision.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import BenchGroup
from fused_softmax_matmul import softmax_matmul_flops
import support
from support import DTYPES, ON_GPU, at_one_case
# The softmax_matmul group's implementations, shape and builders, at every precision.
from test_bench_softmax_matmul import (
    CALLER_FORMS, COMPILE, IMPLS, SPEC, SPEC_BLOCKS, build_softmax_matmul, softmax_matmul_bound, softmax_matmul_bytes, softmax_matmul_error,
    wrapper_block,
)

GROUP = BenchGroup(
    name="softmax_matmul_precision",
    csv="softmax_matmul_precision.csv",
    columns=("batch_size", "d1", "d2", "d3", "dtype", "precision", "impl", "BLOCK", "forward_ms_mean",
             "forward_ms_std", "forward_peak_MiB", "gbps", "tflops"),
    case=("batch_size", "d1", "d2", "d3", "dtype", "precision"),
    impls=tuple(IMPLS),
    plot=("line", "d2"),
)

# (dtype, float32 matmul precision): the precision setting only matters for float32.
VARIANTS = [("float32", "highest"), ("float32", "high"), ("bfloat16", "n/a"), ("float16", "n/a")]
if ON_GPU:
    # d2 1024 and 8192 for every variant; bfloat16 also at every other d2 >= 256 of the spec grid,
    # where the fused kernel must beat PyTorch too. Triton at every block size of the spec grid.
    CASES = [(dt, p, d2) for dt, p in VARIANTS for d2 in (1024, 8192)] + [
        ("bfloat16", "n/a", d2) for d2 in (256, 512, 2048, 4096)]
    BLOCKS = SPEC_BLOCKS
else:
    CASES = [(dt, p, 48) for dt, p in VARIANTS]
    BLOCKS = [16]
IMPL_BLOCKS = [(impl, None) for impl in ("torch", *COMPILE)] + [("triton", b) for b in BLOCKS] + [
    (impl, None) for impl in CALLER_FORMS]

matmul_precision = support.matmul_precision  # the fixture, under this module's name for pytest


@pytest.mark.parametrize("dtype,precision,d2,impl,block",
                         at_one_case(CASES, IMPL_BLOCKS, at=("bfloat16", "n/a", max(c[2] for c in CASES))))
def test_softmax_matmul_precision(bench, matmul_precision, dtype, precision, d2, impl, block):
    matmul_precision(precision)
    batch, d1, d3 = SPEC["batch_size"], SPEC["d1"], SPEC["d3"]
    torch_dtype = DTYPES[dtype]
    row = dict(batch_size=batch, d1=d1, d2=d2, d3=d3, dtype=dtype, precision=precision, impl=impl,
               BLOCK=wrapper_block(impl, block, d2, d3, torch_dtype))
    bench(GROUP, row, lambda: build_softmax_matmul(impl, block, batch, d1, d2, d3, torch_dtype),
          bytes_moved=softmax_matmul_bytes(impl, batch, d1, d2, d3, torch_dtype.itemsize),
          flops=softmax_matmul_flops(batch, d1, d2, d3), dtype=torch_dtype, error=softmax_matmul_error,
          bound=softmax_matmul_bound)
