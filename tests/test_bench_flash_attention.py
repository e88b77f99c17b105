"""Benchmark group flash_attention: causal attention forward (and forward + backward) in PyTorch,
SDPA (eager and compiled), FlashAttentionPytorch and FlashAttentionTriton; and group leaderboard,
the course leaderboard's one case.

Every implementation is timed on inputs from the same builder as the correctness tests in
test_flash_attention.py, which check flash_pytorch and flash_triton at these dtypes (and, on a GPU,
at the benchmark's bfloat16 length).

The group's triton_compiled row is at its last case (test_bench_softmax_matmul.py says why; here
it was within 1.8 % of the eager Function's time at every case in the record before).

    pytest --benchmark-only -p no:xdist tests/test_bench_flash_attention.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from candidates import candidate_call, candidate_impls
from conftest import BenchGroup, Unavailable, caller_form, compiled, compiled_op
from fused_softmax_matmul import (
    FlashAttentionPytorch, FlashAttentionTriton, attention_flops, attention_reference, flash_attention_bytes,
)
from support import DTYPES, ON_GPU, ROUNDOFF_FACTOR, attention_inputs, at_one_case, matmul_roundoff, randn, relative_error
from test_flash_attention import accumulation_error

GROUP = BenchGroup(
    name="flash_attention",
    csv="flash_attention_benchmark.csv",
    columns=("batch", "n_queries", "n_keys", "d", "dtype", "is_causal", "mode", "impl",
             "forward_ms_mean", "forward_ms_std", "forward_peak_MiB", "tflops"),
    case=("batch", "n_queries", "n_keys", "d", "dtype", "is_causal", "mode"),
    impls=("reference", "sdpa", "sdpa_compile", "flash_pytorch", "flash_triton", "triton_compiled", "triton_graph",
           *candidate_impls("attention")),
    plot=("line", "n_queries"),
)


def sdpa(Q, K, V, is_causal):
    # SDPA's fused backends (flash, memory-efficient) take only 4-d inputs and fall back to the
    # materialising math backend on 3-d ones: give it one head, as (batch, 1, n, d) views.
    return F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None], is_causal=is_causal)[:, 0]


def triton_compiled():
    if not ON_GPU:
        # The Function launches its kernels in its own methods, so torch.compile traces the
        # launches themselves; Dynamo cannot trace an interpreted kernel.
        raise Unavailable("torch.compile traces FlashAttentionTriton's Triton launches, which needs compiled Triton (a GPU)")
    return compiled_op(FlashAttentionTriton.apply)


# Each factory returns f(Q, K, V, is_causal).
IMPLS = {
    "reference": lambda: attention_reference,
    "sdpa": lambda: sdpa,
    "sdpa_compile": lambda: compiled(sdpa),
    "flash_pytorch": lambda: FlashAttentionPytorch.apply,
    "flash_triton": lambda: FlashAttentionTriton.apply,
    "triton_compiled": triton_compiled,
    "triton_graph": lambda: FlashAttentionTriton.apply,  # replayed from a CUDA graph
    # --candidate's FlashAttentionPytorch / FlashAttentionTriton (tests/candidates.py), f(Q, K, V, is_causal)
    **{impl: lambda impl=impl: candidate_call(impl) for impl in candidate_impls("attention")},
}

if ON_GPU:
    CASES = [
        # float32 sweep: where the materialised reference runs out of memory its row stays empty.
        *[(8, n, n, 64, "float32", True, "fwd") for n in (256, 512, 1024, 2048, 4096, 8192)],
        pytest.param(8, 16384, 16384, 64, "float32", True, "fwd", marks=pytest.mark.slow),
        (16, 8192, 8192, 64, "bfloat16", True, "fwd"),
        (16, 8192, 8192, 64, "bfloat16", True, "fwd_bwd"),
    ]
else:
    # Interpreter smoke run: one tile of the wrapper's float32 launch (64 x 64), both modes. The
    # compiled SDPA stays in: inductor on CPU compiles it in about 25 s, once per mode.
    CASES = [(1, 64, 64, 16, "float32", True, "fwd"), (1, 64, 64, 16, "float32", True, "fwd_bwd")]


def flash_attention_error(out, inputs) -> float:
    """Against float64 on the first batch entry: the forward's first 64 queries (mode fwd; a float64
    copy of a long sequence's logits would be GiBs), or the worst of dQ, dK, dV (mode fwd_bwd)."""
    Q, K, V, is_causal, dO = inputs
    Q, K, V = (t.detach()[:1].double() for t in (Q, K, V))
    if dO is None:
        return relative_error(out[:1, :64], attention_reference(Q[:, :64], K, V, is_causal))
    leaves = [t.requires_grad_() for t in (Q, K, V)]
    grads = torch.autograd.grad(attention_reference(*leaves, is_causal), leaves, dO[:1].double())
    return max(relative_error(got[:1], want) for got, want in zip(out, grads))


def attention_bound(dtype: torch.dtype, n_queries: int, n_keys: int) -> float:
    """ROUNDOFF_FACTOR units of the products' roundoff in dtype, plus what the flash algorithm's
    float32 sums over the longer length add by design (test_flash_attention.accumulation_error):
    PyTorch's own error at dtype would need the materialised attention of a long sequence again."""
    return ROUNDOFF_FACTOR * matmul_roundoff(dtype) + accumulation_error(max(n_queries, n_keys))


@pytest.mark.parametrize("batch,n_queries,n_keys,d,dtype,is_causal,mode,impl",
                         at_one_case(CASES, GROUP.impls, at=CASES[-1]))
def test_flash_attention(bench, batch, n_queries, n_keys, d, dtype, is_causal, mode, impl):
    def build():
        Q, K, V = attention_inputs(batch, n_queries, n_keys, d, DTYPES[dtype])
        fn = IMPLS[impl]()
        if mode == "fwd":
            return caller_form(impl, lambda: fn(Q, K, V, is_causal)), (Q, K, V, is_causal, None)
        leaves = [t.requires_grad_() for t in (Q, K, V)]
        dO = randn((batch, n_queries, d), DTYPES[dtype], seed=7)  # one fixed upstream gradient

        def forward_backward():
            # autograd.grad, not backward(): nothing accumulates into .grad between rounds.
            return torch.autograd.grad(fn(*leaves, is_causal), leaves, dO)
        return caller_form(impl, forward_backward), (Q, K, V, is_causal, dO)

    bench(GROUP, dict(batch=batch, n_queries=n_queries, n_keys=n_keys, d=d, dtype=dtype, is_causal=is_causal,
                      mode=mode, impl=impl),
          build, bytes_moved=flash_attention_bytes(batch, n_queries, n_keys, d, DTYPES[dtype].itemsize, mode),
          flops=attention_flops(batch, n_queries, n_keys, d, is_causal, mode), error=flash_attention_error,
          bound=attention_bound(DTYPES[dtype], n_queries, n_keys))


# ----------------------------------------------------------------------------------------------
# The course leaderboard: one case, timed as the course times a FlashAttentionTriton
# ----------------------------------------------------------------------------------------------
# bfloat16 (16, 8192, 64), causal; the Function under torch.compile (graph breaks allowed), one
# call = forward, o.sum(), backward, timed as the course times it: one
# triton.testing.do_bench(fn, warmup=1000, rep=10000) (ms of warm-up, then of timed calls), its
# mean the row's forward_ms_mean. SDPA, compiled the same way, is the course's yardstick.
LEADERBOARD = BenchGroup(
    name="leaderboard",
    csv="leaderboard_benchmark.csv",
    columns=("batch", "n", "d", "dtype", "is_causal", "impl", "forward_ms_mean", "forward_ms_std", "forward_ms_median",
             "tflops", "speedup_vs_sdpa_compile"),
    case=("batch", "n", "d", "dtype", "is_causal"),
    impls=("sdpa_compile", "flash_triton", *candidate_impls("attention", leaderboard=True)),
    speedups={"speedup_vs_sdpa_compile": "sdpa_compile"},
    plot=("bar", "forward_ms_mean"),
    timer=("do_bench", {"warmup": 1000, "rep": 10000}),
)
# Interpreter stand-in: one 64 x 64 tile in float32 (bfloat16 tl.dot is wrong in the interpreter),
# eager (Dynamo cannot trace an interpreted kernel), without the compiled SDPA (Inductor compiling
# C++ on the CPU, tens of seconds, would time nothing of the GPU's); timed by the harness's two
# wall-clock rounds, as every group there: do_bench needs a GPU driver, and 11 s of it a row is no smoke test.
LEADERBOARD_CASE = (16, 8192, 64, "bfloat16", True) if ON_GPU else (1, 64, 16, "float32", True)
LEADERBOARD_RUN = LEADERBOARD.impls if ON_GPU else tuple(i for i in LEADERBOARD.impls if i != "sdpa_compile")


def leaderboard_form(fn):
    """fn as the leaderboard runs it: torch.compile(fn) with graph breaks allowed, on a GPU."""
    return compiled(fn) if ON_GPU else fn


LEADERBOARD_IMPLS = {
    "sdpa_compile": lambda: sdpa,
    "flash_triton": lambda: FlashAttentionTriton.apply,
    **{impl: lambda impl=impl: candidate_call(impl) for impl in candidate_impls("attention", leaderboard=True)},
}


@pytest.mark.parametrize("impl", LEADERBOARD_RUN)
def test_leaderboard(bench, impl):
    batch, n, d, dtype, is_causal = LEADERBOARD_CASE

    def build():
        Q, K, V = (t.requires_grad_() for t in attention_inputs(batch, n, n, d, DTYPES[dtype]))
        fn = leaderboard_form(LEADERBOARD_IMPLS[impl]())

        def step():
            # The course's step: forward, o.sum().backward(); the gradients are set to None
            # first, so rounds do not accumulate into them (a few microseconds of host time).
            for t in (Q, K, V):
                t.grad = None
            o = fn(Q, K, V, is_causal)
            o.sum().backward()
            return o.detach(), Q.grad, K.grad, V.grad
        return step, (Q, K, V, is_causal, torch.ones_like(Q))

    bench(LEADERBOARD, dict(batch=batch, n=n, d=d, dtype=dtype, is_causal=is_causal, impl=impl), build,
          flops=attention_flops(batch, n, n, d, is_causal, "fwd_bwd"), error=leaderboard_error,
          bound=attention_bound(DTYPES[dtype], n, n))


def leaderboard_error(out, inputs) -> float:
    """The worst of O, dQ, dK, dV against float64 on the first batch entry's first 64 queries (O) or
    whole (gradients of o.sum())."""
    o, *grads = out
    Q, K, V, is_causal, ones = inputs
    errors = [flash_attention_error(o, (Q, K, V, is_causal, None))]
    return max(errors + [flash_attention_error(tuple(grads), (Q, K, V, is_causal, ones))])
