"""Benchmark group matmul_softmax: softmax(x @ W) in PyTorch, torch.compile and three Triton versions.

The conftest.py harness times each case (CUDA events on a GPU, wall clock in the interpreter)
and writes outputs/matmul_softmax_benchmark.csv (outputs/cpu/ in the interpreter). Inputs come
from the builder the correctness tests use, so every timed shape is a tested one.

The group's triton_compiled row is at its first case (test_bench_softmax_matmul.py says why).
"""

from __future__ import annotations

import pytest
import torch

from candidates import candidate_call, candidate_impls
from conftest import BenchGroup, caller_form, compiled, compiled_op
from fused_softmax_matmul import (
    matmul_softmax_flops, matmul_softmax_fused_simple, matmul_softmax_fused_tiled, matmul_softmax_ref,
    matmul_softmax_unfused,
)
from support import DEVICE, DTYPES, ON_GPU, at_one_case, torch_error_bound, matmul_softmax_impl_bytes, matmul_softmax_inputs, relative_error

GROUP = BenchGroup(
    name="matmul_softmax",
    csv="matmul_softmax_benchmark.csv",
    columns=("B", "K", "C", "dtype", "impl", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB",
             "bytes_model", "gbps", "tflops", "speedup_vs_torch", "speedup_vs_unfused"),
    case=("B", "K", "C", "dtype"),
    impls=("torch", "compile", "triton_unfused", "triton_fused_simple", "triton_fused_tiled",
           "triton_compiled", "triton_graph", *candidate_impls("matmul_softmax")),
    speedups={"speedup_vs_torch": "torch", "speedup_vs_unfused": "triton_unfused"},
    plot=("bar", "speedup_vs_torch"),
)

# The caller forms (torch.compile(fullgraph=True), CUDA-graph replay) of the tiled kernel, the
# one meant for every size.
CALLER_OF = "triton_fused_tiled"
# Each factory returns f(x, W). matmul_softmax_impl_bytes knows the Triton versions by these names.
IMPLS = {
    "torch": lambda: matmul_softmax_ref,
    "compile": lambda: compiled(matmul_softmax_ref),
    "triton_unfused": lambda: matmul_softmax_unfused,
    "triton_fused_simple": lambda: matmul_softmax_fused_simple,
    "triton_fused_tiled": lambda: matmul_softmax_fused_tiled,
    "triton_compiled": lambda: compiled_op(matmul_softmax_fused_tiled),
    "triton_graph": lambda: matmul_softmax_fused_tiled,
    # --candidate's matmul_softmax_* names (tests/candidates.py), called f(x, W)
    **{impl: lambda impl=impl: candidate_call(impl) for impl in candidate_impls("matmul_softmax")},
}

if ON_GPU:
    # Classifier heads in float32, then LM heads in bfloat16 (C = 32768 and Llama 3's 128256).
    CASES = [
        (64, 128, 10, "float32"), (256, 512, 50, "float32"), (1024, 1024, 100, "float32"),
        pytest.param(4096, 4096, 32768, "bfloat16", marks=pytest.mark.slow),
        pytest.param(8192, 4096, 128256, "bfloat16", marks=pytest.mark.slow),
    ]
    IMPL_NAMES = GROUP.impls
else:
    # The interpreter costs ~3 ms per program per K step: one small size shows the pipeline
    # works. torch.compile is left out: inductor compiling C++ on 2 shared cores takes longer
    # than the rest of the run, and its CPU time says nothing about the GPU.
    CASES = [(64, 128, 10, "float32")]
    IMPL_NAMES = tuple(impl for impl in GROUP.impls if impl != "compile")


def matmul_softmax_error(out: torch.Tensor, inputs) -> float:
    """The first 16 rows against float64 logits, W converted a slice of classes at a time (a
    float64 copy of a 4096 x 128256 W would be 4 GiB)."""
    x, W = inputs
    x = x[:16].double()
    logits = torch.cat([x @ W[:, c:c + 16384].double() for c in range(0, W.shape[1], 16384)], dim=1)
    return relative_error(out[:16], torch.softmax(logits, dim=-1))


def matmul_softmax_bound(inputs) -> float:
    """Twice PyTorch's own error at x's dtype (and float32 matmul precision) on the timed call,
    plus the roundoff floor."""
    return torch_error_bound(matmul_softmax_ref, matmul_softmax_error, inputs)


@pytest.mark.parametrize("B,K,C,dtype,impl", at_one_case(CASES, IMPL_NAMES, at=CASES[0]))
def test_matmul_softmax(bench, B, K, C, dtype, impl):
    kernel = CALLER_OF if impl in ("triton_compiled", "triton_graph") else impl  # the kernel that runs
    if kernel.startswith("candidate:"):
        kernel = "triton_fused_simple"  # a candidate is charged the least traffic: one pass, logits on chip
    bytes_model = matmul_softmax_impl_bytes(kernel, B, K, C, DTYPES[dtype], DEVICE)

    def build():
        x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype])
        fn = IMPLS[impl]()
        return caller_form(impl, lambda: fn(x, W)), (x, W)

    bench(GROUP, dict(B=B, K=K, C=C, dtype=dtype, impl=impl, bytes_model=bytes_model),
          build, bytes_moved=bytes_model, flops=matmul_softmax_flops(B, K, C),
          error=matmul_softmax_error, bound=matmul_softmax_bound)
