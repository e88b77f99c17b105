"""Benchmark group matmul_softmax: softmax(x @ W) in PyTorch, torch.compile and three Triton versions.

The conftest.py harness times each case (CUDA events on a GPU, wall clock in the interpreter)
and writes outputs/matmul_softmax_benchmark.csv (outputs/cpu/ in the interpreter). Inputs come
from the builder the correctness tests use, so every timed shape is a tested one.
"""

from __future__ import annotations

import pytest
import torch

from conftest import BenchGroup, compiled_op, graph_replay
from fused_softmax_matmul import (
    MATMUL_SOFTMAX_IMPLS, matmul_softmax_flops, matmul_softmax_impl_bytes, matmul_softmax_ref,
)
from support import DEVICE, DTYPES, ON_GPU, matmul_softmax_inputs

GROUP = BenchGroup(
    name="matmul_softmax",
    csv="matmul_softmax_benchmark.csv",
    columns=("B", "K", "C", "dtype", "impl", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB",
             "bytes_model", "gbps", "tflops", "speedup_vs_torch", "speedup_vs_unfused"),
    case=("B", "K", "C", "dtype"),
    impls=("torch", "compile", "triton_unfused", "triton_fused_simple", "triton_fused_tiled",
           "triton_compiled", "triton_graph"),
    speedups={"speedup_vs_torch": "torch", "speedup_vs_unfused": "triton_unfused"},
    plot=("bar", "speedup_vs_torch"),
)

if ON_GPU:
    # Classifier heads in float32, then LM heads in bfloat16 (C = 32768 and Llama 3's 128256).
    SIZES = [
        (64, 128, 10, "float32"), (256, 512, 50, "float32"), (1024, 1024, 100, "float32"),
        pytest.param(4096, 4096, 32768, "bfloat16", marks=pytest.mark.slow),
        pytest.param(8192, 4096, 128256, "bfloat16", marks=pytest.mark.slow),
    ]
    IMPLS = GROUP.impls
else:
    # The interpreter costs ~3 ms per program per K step: one small size shows the pipeline
    # works. torch.compile is left out: inductor compiling C++ on 2 shared cores takes longer
    # than the rest of the run, and its CPU time says nothing about the GPU.
    SIZES = [(64, 128, 10, "float32")]
    IMPLS = tuple(impl for impl in GROUP.impls if impl != "compile")

_COMPILED: dict[str, object] = {}


def compiled_ref():
    """torch.compile(matmul_softmax_ref), built once per process: its compile time is not timed."""
    if "ref" not in _COMPILED:
        _COMPILED["ref"] = torch.compile(matmul_softmax_ref)
    return _COMPILED["ref"]


# The caller forms (torch.compile(fullgraph=True), CUDA-graph replay) of the tiled kernel, the
# one meant for every size.
CALLER_OF = "triton_fused_tiled"


def impl_function(impl: str):
    if impl == "compile":
        return compiled_ref()
    if impl == "triton_compiled":
        return compiled_op(MATMUL_SOFTMAX_IMPLS[CALLER_OF])
    return MATMUL_SOFTMAX_IMPLS[CALLER_OF if impl == "triton_graph" else impl]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,K,C,dtype", SIZES)
def test_matmul_softmax(bench, B, K, C, dtype, impl):
    kernel = CALLER_OF if impl in ("triton_compiled", "triton_graph") else impl  # the kernel that runs
    bytes_model = matmul_softmax_impl_bytes(kernel, B, K, C, DTYPES[dtype], DEVICE)

    def build():
        x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype])
        fn = impl_function(impl)
        return graph_replay(lambda: fn(x, W)) if impl == "triton_graph" else (lambda: fn(x, W))

    bench(GROUP, dict(B=B, K=K, C=C, dtype=dtype, impl=impl, bytes_model=bytes_model),
          build, bytes_moved=bytes_model, flops=matmul_softmax_flops(B, K, C))
