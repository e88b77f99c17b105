"""Benchmark group flash_attention -> flash_attention_benchmark.csv (harness: conftest.BenchGroup, ``bench``).

Every implementation is timed on inputs from the same builder as the correctness tests in
test_flash_attention.py, which check flash_pytorch and flash_triton at these dtypes (and, on a GPU,
at the benchmark's bfloat16 length).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import BenchGroup, Unavailable, compiled_op, graph_replay
from fused_softmax_matmul import (
    FlashAttentionPytorch, FlashAttentionTriton, attention_flops, attention_reference, flash_attention_bytes,
)
from support import DTYPES, ON_GPU, attention_inputs, randn

BENCH = BenchGroup(
    name="flash_attention",
    csv="flash_attention_benchmark.csv",
    columns=("batch", "n_queries", "n_keys", "d", "dtype", "is_causal", "mode", "impl",
             "forward_ms_mean", "forward_ms_std", "forward_peak_MiB", "tflops"),
    case=("batch", "n_queries", "n_keys", "d", "dtype", "is_causal", "mode"),
    impls=("reference", "sdpa", "sdpa_compile", "flash_pytorch", "flash_triton", "triton_compiled", "triton_graph"),
    plot=("line", "n_queries"),
)


def sdpa(Q, K, V, is_causal):
    # SDPA's fused backends (flash, memory-efficient) take only 4-d inputs and fall back to the
    # materialising math backend on 3-d ones: give it one head, as (batch, 1, n, d) views.
    return F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None], is_causal=is_causal)[:, 0]


_COMPILED = {}


def sdpa_compiled(Q, K, V, is_causal):
    if "sdpa" not in _COMPILED:  # compiled once per process; each new shape recompiles inside
        _COMPILED["sdpa"] = torch.compile(sdpa)
    return _COMPILED["sdpa"](Q, K, V, is_causal)


BENCH_IMPLS = {
    "reference": attention_reference,
    "sdpa": sdpa,
    "sdpa_compile": sdpa_compiled,
    "flash_pytorch": FlashAttentionPytorch.apply,
    "flash_triton": FlashAttentionTriton.apply,
    "triton_graph": FlashAttentionTriton.apply,  # replayed from a CUDA graph below
}

if ON_GPU:
    BENCH_CASES = [
        # float32 sweep: where the materialised reference runs out of memory its row stays empty.
        *[(8, n, n, 64, "float32", True, "fwd") for n in (256, 512, 1024, 2048, 4096, 8192)],
        pytest.param(8, 16384, 16384, 64, "float32", True, "fwd", marks=pytest.mark.slow),
        (16, 8192, 8192, 64, "bfloat16", True, "fwd"),
        (16, 8192, 8192, 64, "bfloat16", True, "fwd_bwd"),
    ]
else:
    # Interpreter smoke run: one tile of the wrapper's float32 launch (64 x 64), both modes. The
    # compiled SDPA stays in: inductor on CPU compiles it in about 25 s, once per mode.
    BENCH_CASES = [(1, 64, 64, 16, "float32", True, "fwd"), (1, 64, 64, 16, "float32", True, "fwd_bwd")]


@pytest.mark.parametrize("impl", BENCH.impls)
@pytest.mark.parametrize("batch,n_queries,n_keys,d,dtype,is_causal,mode", BENCH_CASES)
def test_flash_attention_benchmark(bench, batch, n_queries, n_keys, d, dtype, is_causal, mode, impl):
    def build():
        Q, K, V = attention_inputs(batch, n_queries, n_keys, d, DTYPES[dtype])
        if impl == "triton_compiled" and not ON_GPU:
            # The Function launches its kernels in its own methods, so torch.compile traces the
            # launches themselves; Dynamo cannot trace an interpreted kernel.
            raise Unavailable("torch.compile traces FlashAttentionTriton's Triton launches, which needs compiled Triton (a GPU)")
        fn = compiled_op(FlashAttentionTriton.apply) if impl == "triton_compiled" else BENCH_IMPLS[impl]
        if mode == "fwd":
            call = lambda: fn(Q, K, V, is_causal)  # noqa: E731
            return graph_replay(call) if impl == "triton_graph" else call
        leaves = [t.requires_grad_() for t in (Q, K, V)]
        dO = randn((batch, n_queries, d), DTYPES[dtype], seed=7)  # one fixed upstream gradient

        def forward_backward():
            # autograd.grad, not backward(): nothing accumulates into .grad between rounds.
            return torch.autograd.grad(fn(*leaves, is_causal), leaves, dO)
        return graph_replay(forward_backward) if impl == "triton_graph" else forward_backward

    bench(BENCH, dict(batch=batch, n_queries=n_queries, n_keys=n_keys, d=d, dtype=dtype, is_causal=is_causal,
                      mode=mode, impl=impl),
          build, bytes_moved=flash_attention_bytes(batch, n_queries, n_keys, d, DTYPES[dtype].itemsize, mode),
          flops=attention_flops(batch, n_queries, n_keys, d, is_causal, mode))
