"""Benchmark group shape_grid (issue 17): each workload on the shapes users have, against the best baseline.

Every case of a workload is timed for its baselines (PyTorch eager, torch.compile, and for
attention each SDPA backend alone, in SDPA's fast 4-D layout), its peers (FlexAttention under
torch.compile, Liger-Kernel's softmax) and this project's public op as a user calls it. The CSV
outputs/shape_grid_benchmark.csv has one row per (workload, case, impl); ``speedup`` on a Triton
or peer row is the fastest baseline's time on that case over the row's own (conftest.py's
``BenchGroup.best_of``); ``path`` on a Triton row says what ran: for attention the kernel of its forward
(``flash_plan_of``: "gluon" or "triton"), for softmax(x) @ V "gluon", "fused" or
"materialized" (``fused_softmax_path``). A baseline that refuses a case (an SDPA backend, Liger's softmax on rows
it does not take) or is not installed leaves an empty row with the reason, as does a case that
runs out of memory.

What the grid leaves out, to fit the record (conftest.py's RECORD_PARTS) in minutes rather than
most of an hour on an H100:

- torch.compile and FlexAttention run on the core cases only (``-k core``, ``CORE``: a corner of
  each workload's grid). They compile once per shape, some 570 compiles for the whole grid, most
  of its time; elsewhere the Triton op is set against PyTorch eager (and each SDPA backend), and
  the rows' ``baselines`` column says so.
- Attention in float16 off the core cases: the kernels are the same as in bfloat16, and in the
  whole grid every float16 speed-up was within 2.3 % of its bfloat16 twin's (outputs/README.md,
  design notes: Harness); the core keeps two float16 cases.

Every timed case is marked ``slow``: ``-m "not slow"`` leaves them out.

    pytest --benchmark-only -p no:xdist tests/test_bench_shape_grid.py -k test_shape_grid  # the whole grid
    pytest --benchmark-only -p no:xdist --record-part grid-core                            # its core cases
    pytest --benchmark-only -p no:xdist tests/test_bench_shape_grid.py -k row_softmax      # one workload

Without a GPU the grid is one small case per workload, run through the interpreter, so CI
exercises the group end to end (torch.compile and FlexAttention rows are left out there, as in
the other groups: Inductor compiles C++ for each shape on the CPU).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from conftest import BenchGroup, Unavailable, compiled, group_table, is_resource_limit
from fused_softmax_matmul import (
    FlashAttentionTriton, attention_flops, attention_mask_bounds, attention_visible, check_flash_attention_inputs,
    flash_attention, flash_attention_flops, flash_attention_io_bytes, attention_plan, flash_attention_reference, attention_reference, flash_attention_bytes, flash_plan_of, fused_softmax,
    fused_softmax_bytes, matmul_softmax_flops, matmul_softmax_fused_tiled,
    fused_softmax_path, matmul_softmax_ref, softmax_matmul_flops, softmax_mult, softmax_mult_bytes,
)
from online_softmax import row_softmax, softmax_bytes
from support import (
    DEVICE, DTYPES, ON_GPU, attention_inputs, attention_route, error_bound, matmul_softmax_impl_bytes,
    matmul_softmax_inputs, randn, relative_error, row_softmax_inputs, softmax_matmul_inputs, torch_error_bound,
)
from test_attention_api import Case
from test_bench_flash_attention import attention_bound
from test_bench_matmul_softmax import matmul_softmax_bound, matmul_softmax_error
from test_bench_softmax import softmax_bound, softmax_error

GiB = 2**30

# Implementations by role. Baselines compete for best_baseline_ms; peers and the project's ops
# are compared with the best of them.
SDPA_BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
BASELINES = ("torch", "compile", *SDPA_BACKENDS)
PEERS = ("flex_compile", "liger")
TRITON = "triton"

GROUP = BenchGroup(
    name="shape_grid",
    csv="shape_grid_benchmark.csv",
    columns=("workload", "case", "dtype", "impl", "role", "path", "ms", "best_baseline_ms", "speedup", "baselines",
             "forward_ms_std", "tflops", "pct_of_matmul_peak", "gbps", "pct_of_copy", "rel_error", "forward_peak_MiB"),
    case=("workload", "case"),
    impls=(*BASELINES, *PEERS, TRITON),
    best_of=BASELINES,
    # Few rounds: the grid has some two thousand rows, and its time goes to compiling (one
    # torch.compile per shape) more than to timing; each kernel here runs 0.05 ms or more, long
    # against the event timer's resolution. forward_ms_std says where 15 rounds were too few.
    # The interpreter's own default (1 + 2) applies without a GPU.
    warmup=3,
    rounds=15,
    sort=("workload", "case", "_impl_order"),
    # Baselines have no speedup (empty): the plot shows the Triton op's and the peers' ratios,
    # a dot a case (some five hundred: bars a case made a plot tens of thousands of pixels tall).
    plot=("strip", "speedup"),
)

def role_of(impl: str) -> str:
    return "baseline" if impl in BASELINES else "peer" if impl in PEERS else "triton"


# The subset `-k core` runs (a few minutes on an H100, against the whole grid's most of an hour):
# the shapes issue 17 measured (non-causal (16, 8192, 64), head dim 128, length 3000, (32, 1024,
# 64); rows of 50257 and 128256; the (8, 1000, 3000, 96) softmax @ V in every precision; 512 x
# 2048 x 1000 softmax(x @ W)) and, per workload, one case from each other corner of its grid.
CORE = {
    ("attention", 16, 8192, 64, False, "bfloat16"), ("attention", 16, 8192, 64, True, "bfloat16"),
    ("attention", 16, 4096, 128, False, "bfloat16"), ("attention", 16, 3000, 64, True, "float16"),
    ("attention", 32, 1024, 64, False, "bfloat16"), ("attention", 4, 16384, 128, True, "bfloat16"),
    ("attention", 1, 32768, 64, True, "float16"), ("attention", 32, 1000, 128, False, "bfloat16"),
    ("attention", 16, 4097, 64, False, "bfloat16"),
    ("row_softmax", 50257, GiB // 4, "bfloat16"), ("row_softmax", 50257, 2 * GiB, "float32"),
    ("row_softmax", 128256, 2 * GiB, "bfloat16"), ("row_softmax", 1000, GiB // 4, "float32"),
    ("row_softmax", 4096, 2 * GiB, "bfloat16"), ("row_softmax", 262144, GiB // 4, "bfloat16"),
    ("row_softmax", 151936, 2 * GiB, "float32"),
    *[("softmax_matmul", 1000, 3000, 96, dt, p) for dt, p in
      (("float32", "highest"), ("float32", "high"), ("bfloat16", "n/a"), ("float16", "n/a"))],
    ("softmax_matmul", 4096, 8192, 512, "bfloat16", "n/a"), ("softmax_matmul", 4096, 8192, 512, "float32", "high"),
    ("softmax_matmul", 2048, 1000, 64, "float16", "n/a"),
    ("matmul_softmax", 512, 2048, 1000, "float32"), ("matmul_softmax", 4096, 4096, 128256, "bfloat16"),
    ("matmul_softmax", 32, 768, 50257, "bfloat16"), ("matmul_softmax", 1, 4096, 128256, "bfloat16"),
    ("matmul_softmax", 4096, 768, 10, "float32"), ("matmul_softmax", 32, 2048, 32000, "float32"),
}


COMPILED = ("compile", "flex_compile")  # the implementations that compile once per shape: core cases only


def runs_at(impl: str, core: bool) -> bool:
    """Whether impl runs at a case of the grid: the compiled implementations at the core cases only."""
    return core or impl not in COMPILED


def _params(cases, impls, case_key, case_id):
    """pytest.params of case x implementation (where it runs_at the case), marked slow, ids
    '<case>-<impl>' ending '-core' on the core subset; the last value says whether the case is core."""
    return [pytest.param(*case, impl, core, id=f"{case_id(*case)}-{impl}" + ("-core" if core else ""),
                         marks=pytest.mark.slow)
            for case in cases for core in [case_key(case) in CORE] for impl in impls if runs_at(impl, core)]


def compared_with(impls, core: bool) -> str:
    """The row's ``baselines``: what its case's speed-up is over."""
    ran = [impl for impl in impls if impl in BASELINES and runs_at(impl, core)]
    return ", ".join(ran) + ("" if all(runs_at(impl, core) for impl in impls) else " (compiled baselines: core cases only)")


def implementation(functions: dict, impl: str):
    """A workload's function for impl; the "compile" entry is the Python function torch.compile
    compiles (conftest.compiled: static shapes, one recompile per case). It is the workload's own
    function, so its recompiles count against its own limit, not another group's."""
    fn = functions[impl]
    return compiled(fn) if impl == "compile" else fn


def _first_call(impl: str, call, peers: tuple = (*SDPA_BACKENDS, *PEERS)):
    """call, once untimed. An SDPA backend or a peer library (``peers``) that refuses the case by
    its own rule (SDPA: no kernel for it; Liger: rows wider than it takes) becomes an empty row with
    the reason; PyTorch's own baselines and this project's ops get no such leave: their errors fail the test."""
    if impl not in peers:
        return call
    try:
        call()
    except (RuntimeError, ValueError, AssertionError) as exc:
        if is_resource_limit(exc):
            raise
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unavailable(f"{impl} does not run this case: {text}") from exc
    return call


# ----------------------------------------------------------------------------------------------
# Attention: (batch x heads, length) x d x causal x dtype, forward and forward + backward
# ----------------------------------------------------------------------------------------------
# Lengths that are no multiple of 128 sit beside the power-of-two length nearest them, with its
# batch x heads.
ATTENTION_SHAPES = [(32, 1024), (16, 4096), (16, 8192), (4, 16384), (1, 32768), (32, 1000), (16, 3000), (16, 4097)]
def attention_key(case) -> tuple:
    """An attention case's key in CORE: its shape and dtype, both modes alike."""
    return ("attention", *case[1:])


ATTENTION_GRID = [(mode, bh, n, d, causal, dtype) for mode in ("fwd", "fwd_bwd") for bh, n in ATTENTION_SHAPES
                  for d in (64, 128) for causal in (False, True) for dtype in ("bfloat16", "float16")]
if ON_GPU:
    # float16 on the core cases only: its speed-ups are its bfloat16 twins' (the module's docstring).
    ATTENTION_CASES = [c for c in ATTENTION_GRID if c[-1] == "bfloat16" or attention_key(c) in CORE]
    ATTENTION_IMPLS = (*SDPA_BACKENDS, "compile", "flex_compile", TRITON)
else:
    # One tile of the 16-bit forward (float16: the interpreter's bfloat16 tl.dot is wrong). On the
    # CPU SDPA has its flash backend only: the other two leave empty rows with SDPA's reason.
    ATTENTION_CASES = [(mode, 1, 64, 16, True, "float16") for mode in ("fwd", "fwd_bwd")]
    ATTENTION_IMPLS = (*SDPA_BACKENDS, TRITON)


def _heads(bh: int) -> int:
    """How batch x heads splits into SDPA's 4-D layout: up to 16 heads (a typical model's), the rest batch."""
    return math.gcd(bh, 16)


def _as_4d(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch x heads, length, d) -> (batch, heads, length, d), a view of the same memory."""
    bh, n, d = t.shape
    return t.view(bh // heads, heads, n, d)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def sdpa_with(backend: str):
    """SDPA restricted to one backend, on 3-D (batch x heads, length, d) tensors viewed as 4-D."""
    from torch.nn.attention import sdpa_kernel

    chosen = _sdpa_backend(backend)

    def attention(Q, K, V, is_causal, heads):
        with sdpa_kernel(chosen):
            O = F.scaled_dot_product_attention(_as_4d(Q, heads), _as_4d(K, heads), _as_4d(V, heads), is_causal=is_causal)
        return O.view(Q.shape)

    return attention


def _sdpa_default(Q, K, V, is_causal, heads):
    return F.scaled_dot_product_attention(_as_4d(Q, heads), _as_4d(K, heads), _as_4d(V, heads),
                                          is_causal=is_causal).view(Q.shape)


def _causal(b, h, q, kv):  # noqa: ARG001 - FlexAttention's mask_mod signature
    return q >= kv


def attention_impl(impl: str, n: int, is_causal: bool, heads: int):
    """The attention of impl as f(Q, K, V) on (batch x heads, length, d) tensors."""
    if impl in SDPA_BACKENDS:
        fn = sdpa_with(impl)
        return lambda Q, K, V: fn(Q, K, V, is_causal, heads)
    if impl == "compile":
        fn = compiled(_sdpa_default)
        return lambda Q, K, V: fn(Q, K, V, is_causal, heads)
    if impl == "flex_compile":  # compiled as its documentation says to use it; the mask built once per case
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(_causal, None, None, n, n, device=DEVICE) if is_causal else None
        fn = compiled(flex_attention)
        return lambda Q, K, V: fn(_as_4d(Q, heads), _as_4d(K, heads), _as_4d(V, heads), block_mask=mask).view(Q.shape)
    return lambda Q, K, V: FlashAttentionTriton.apply(Q, K, V, is_causal)


@pytest.mark.parametrize("mode,bh,n,d,is_causal,dtype,impl,core", _params(
    ATTENTION_CASES, ATTENTION_IMPLS, attention_key,
    lambda mode, bh, n, d, is_causal, dtype: f"{mode}-BH{bh}-L{n}-d{d}-{'causal' if is_causal else 'full'}-{dtype}"))
def test_shape_grid_attention(bench, mode, bh, n, d, is_causal, dtype, impl, core):
    torch_dtype = DTYPES[dtype]
    heads = _heads(bh)

    def build():
        Q, K, V = attention_inputs(bh, n, n, d, torch_dtype)
        if impl == TRITON:  # which kernel its forward runs, known once the inputs exist
            row["path"] = flash_plan_of(Q, K, V, is_causal).path("forward")
        fn = attention_impl(impl, n, is_causal, heads)
        if mode == "fwd":
            call = lambda: fn(Q, K, V)  # noqa: E731
            return _first_call(impl, call), (Q, K, V, None)
        leaves = [t.requires_grad_() for t in (Q, K, V)]
        dO = randn((bh, n, d), torch_dtype, seed=7)

        def call():
            # autograd.grad, not backward(): nothing accumulates into .grad between rounds.
            return torch.autograd.grad(fn(*leaves), leaves, dO)
        return _first_call(impl, call), (Q, K, V, dO)

    def error(out, inputs) -> float:
        """The first 64 queries of the first head against float64: their outputs (fwd), or their
        dQ (fwd_bwd: a query's gradient depends on its own row alone, so 64 of them cost 64 rows)."""
        Q, K, V = (t.detach()[:1].double() for t in inputs[:3])
        if mode == "fwd":
            return relative_error(out[:1, :64], attention_reference(Q[:, :64], K, V, is_causal))
        q = Q[:, :64].requires_grad_()
        (dq,) = torch.autograd.grad(attention_reference(q, K, V, is_causal), q, inputs[3][:1, :64].double())
        return relative_error(out[0][:1, :64], dq)

    case = f"BH={bh} heads={heads} L={n} d={d} {'causal' if is_causal else 'full'} {dtype}"
    row = dict(workload=f"attention_{mode}", case=case, dtype=dtype, impl=impl, role=role_of(impl),
               baselines=compared_with(ATTENTION_IMPLS, core))
    bench(GROUP, row, build, bytes_moved=flash_attention_bytes(bh, n, n, d, torch_dtype.itemsize, mode),
          flops=attention_flops(bh, n, n, d, is_causal, mode), dtype=torch_dtype, error=error,
          bound=attention_bound(torch_dtype, n, n))


# ----------------------------------------------------------------------------------------------
# Attention as models call it: flash_attention against SDPA and FlexAttention
# ----------------------------------------------------------------------------------------------
# Model shapes in SDPA's (B, H, N, D) layout, with the options those models use. A group of its
# own: its speed-up is over the faster of SDPA (its default backend: the best it picks) and
# FlexAttention (torch.compile'd, the mask as a block_mask, softcap as a score_mod), the issue's
# bar. SDPA takes bottom-right causal masks as causal_lower_right and windows as a boolean
# attn_mask (which leaves it its slower backends); it has no softcap: an empty row says so.
MODELS_GROUP = BenchGroup(
    name="attention_models",
    csv="attention_models_benchmark.csv",
    columns=("workload", "case", "dtype", "impl", "role", "path", "ms", "best_baseline_ms", "speedup",
             "forward_ms_std", "tflops", "pct_of_matmul_peak", "gbps", "pct_of_copy", "rel_error", "forward_peak_MiB"),
    case=("workload", "case"),
    impls=("sdpa", "flex_compile", TRITON),
    best_of=("sdpa", "flex_compile"),
    warmup=5,
    rounds=30,  # a few dozen rows of 0.1 ms and more: 30 rounds keep the whole group near 4 minutes
    sort=("workload", "case", "_impl_order"),
    plot=("ratio", "speedup"),
)
MODEL_PEERS = ("sdpa", "flex_compile")


def model_case(batch: int, heads: int, kv_heads: int, n_queries: int, n_keys: int, d: int, is_causal: bool = True,
               **options) -> Case:
    """A model's attention call as a test case (test_attention_api.Case): d = dv, GQA where the heads differ."""
    return Case(batch, heads, kv_heads, n_queries, n_keys, d, d,
                dict(is_causal=is_causal, enable_gqa=heads != kv_heads, **options))


def mask_bounds(case: Case) -> tuple:
    o = case.options
    return attention_mask_bounds(case.n_queries, case.n_keys, o["is_causal"], o.get("causal_align", "top_left"),
                                 o.get("window"))


def model_label(model: str, case: Case) -> str:
    o = case.options
    mask = ("causal" + ("-br" if o.get("causal_align") == "bottom_right" else "")) if o["is_causal"] else "full"
    extra = "".join(f" {key}={o[key]}" for key in ("window", "softcap") if o.get(key) is not None)
    return (f"{model} B={case.batch} H={case.heads}/{case.kv_heads} Nq={case.n_queries} Nk={case.n_keys} "
            f"d={case.d} {mask}{extra}")


LLAMA3_8B = dict(heads=32, kv_heads=8, d=128)  # 32 query heads share 8 key/value heads
GEMMA2_9B = dict(heads=16, kv_heads=8, d=256, window=(4095, 0), softcap=50.0)  # local layers: 4096 keys back
if ON_GPU:
    MODEL_CASES = [
        ("fwd", "llama3-8b", model_case(1, n_queries=4096, n_keys=4096, **LLAMA3_8B), "bfloat16"),
        ("fwd_bwd", "llama3-8b", model_case(1, n_queries=4096, n_keys=4096, **LLAMA3_8B), "bfloat16"),
        ("fwd", "llama3-8b", model_case(1, n_queries=8192, n_keys=8192, **LLAMA3_8B), "bfloat16"),
        ("fwd_bwd", "llama3.2-1b", model_case(1, 32, 8, 4096, 4096, 64), "bfloat16"),
        ("fwd", "gpt2", model_case(8, 12, 12, 1024, 1024, 64, is_causal=False), "float16"),
        ("fwd_bwd", "gpt2", model_case(8, 12, 12, 1024, 1024, 64), "bfloat16"),
        ("fwd", "gemma2-9b", model_case(1, n_queries=8192, n_keys=8192, **GEMMA2_9B), "bfloat16"),
        ("fwd_bwd", "gemma2-9b", model_case(1, n_queries=8192, n_keys=8192, **GEMMA2_9B), "bfloat16"),
        ("fwd_bwd", "phi2", model_case(2, 32, 32, 2048, 2048, 80), "float16"),
        ("fwd", "d96", model_case(2, 16, 16, 2048, 2048, 96, is_causal=False), "bfloat16"),
        ("fwd", "llama3-8b-decode", model_case(8, n_queries=1, n_keys=32768, causal_align="bottom_right",
                                               **LLAMA3_8B), "bfloat16"),
        ("fwd", "llama3-8b-chunk", model_case(4, n_queries=128, n_keys=4096, causal_align="bottom_right",
                                              **LLAMA3_8B), "float16"),
        # 28 query heads a group of 7 of 4 key/value heads
        ("fwd", "qwen2-7b-decode", model_case(16, 28, 4, 1, 8192, 128, causal_align="bottom_right"), "bfloat16"),
    ]
    MODEL_IMPLS = ("sdpa", "flex_compile", TRITON)
else:
    # Interpreter: tiny stand-ins with the same options (FlexAttention left out, as elsewhere:
    # Inductor would compile C++ per shape on the CPU).
    MODEL_CASES = [
        ("fwd", "gqa-window-softcap", model_case(1, 4, 2, 16, 40, 24, causal_align="bottom_right", window=(20, 0),
                                                 softcap=5.0), "float16"),
        ("fwd_bwd", "gqa", model_case(1, 4, 2, 32, 32, 16), "float32"),
    ]
    MODEL_IMPLS = ("sdpa", TRITON)


def sdpa_model_attention(case: Case):
    """SDPA as a model calls it for this case: f(q, k, v), or Unavailable where it has no option for it."""
    o = case.options
    if o.get("softcap") is not None:
        raise Unavailable("sdpa does not run this case: F.scaled_dot_product_attention has no logit soft-capping")
    gqa = o["enable_gqa"]
    if o.get("window") is not None:
        mask = attention_visible(case.n_queries, case.n_keys, *mask_bounds(case), device=DEVICE)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if o["is_causal"] and o.get("causal_align") == "bottom_right":
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(case.n_queries, case.n_keys)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=o["is_causal"], enable_gqa=gqa)


def flex_model_attention(case: Case):
    """FlexAttention compiled, the mask as a block_mask built once per case, softcap as a score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lo, hi = mask_bounds(case)

    def shown(b, h, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's mask_mod signature
        gap = kv_idx - q_idx
        return ((gap >= lo) if lo is not None else gap == gap) & ((gap <= hi) if hi is not None else gap == gap)

    cap = case.options.get("softcap")

    def capped(score, b, h, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's score_mod signature
        return cap * torch.tanh(score / cap)

    mask = None if (lo, hi) == (None, None) else create_block_mask(shown, None, None, case.n_queries, case.n_keys,
                                                                    device=DEVICE)
    fn = compiled(flex_attention)
    score_mod = capped if cap is not None else None
    return lambda q, k, v: fn(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=case.options["enable_gqa"])


def model_attention_error(case: Case, mode: str):
    """Against float64 on the first 64 queries of the first head (their key/value head's keys all
    there): out for "fwd", dq for "fwd_bwd" (a query's dq depends on its own row alone)."""
    def error(out, inputs) -> float:
        q, k, v, dout = inputs
        q, k, v = q.detach()[:1, :1, :64].double(), k.detach()[:1, :1].double(), v.detach()[:1, :1].double()
        options = dict(softcap=case.options.get("softcap"), bounds=mask_bounds(case))
        if mode == "fwd":
            return relative_error(out[:1, :1, :64], flash_attention_reference(q, k, v, **options)[0])
        q.requires_grad_()
        (dq,) = torch.autograd.grad(flash_attention_reference(q, k, v, **options)[0], q, dout[:1, :1, :64].double())
        return relative_error(out[0][:1, :1, :64], dq)
    return error


@pytest.mark.parametrize("mode,model,case,dtype,impl", [
    pytest.param(mode, model, case, dtype, impl, marks=pytest.mark.slow,
                 id=f"{mode}-{model_label(model, case).replace(' ', '-')}-{dtype}-{impl}")
    for mode, model, case, dtype in MODEL_CASES for impl in MODEL_IMPLS])
def test_attention_models(bench, mode, model, case, dtype, impl):
    torch_dtype = DTYPES[dtype]

    def build():
        q = randn((case.batch, case.heads, case.n_queries, case.d), torch_dtype, 0)
        k, v = (randn((case.batch, case.kv_heads, case.n_keys, case.d), torch_dtype, seed) for seed in (1, 2))
        fn = {"sdpa": sdpa_model_attention, "flex_compile": flex_model_attention,
              TRITON: lambda case: lambda q, k, v: flash_attention(q, k, v, **case.options)}[impl](case)
        dout = randn(q.shape, torch_dtype, 3)
        if impl == TRITON:  # the course's tuned kernels or the general ones (attention_plan)
            o = case.options
            checked = check_flash_attention_inputs(q, k, v, o["is_causal"], None, o["enable_gqa"],
                                                   o.get("causal_align", "top_left"), o.get("window"), o.get("softcap"))
            row["path"] = attention_route(attention_plan(
                case.d, case.dv, torch_dtype, case.n_queries, case.n_keys, grouped=case.heads // case.kv_heads
                if case.heads != case.kv_heads else False, batch_heads=case.batch * case.heads, **checked))
        if mode == "fwd":
            call = lambda: fn(q, k, v)  # noqa: E731
        else:
            leaves = [t.requires_grad_() for t in (q, k, v)]

            def call():
                # autograd.grad, not backward(): nothing accumulates into .grad between rounds.
                return torch.autograd.grad(fn(*leaves), leaves, dout)
        return _first_call(impl, call, MODEL_PEERS), (q, k, v, dout)

    row = dict(workload=f"attention_models_{mode}", case=model_label(model, case), dtype=dtype, impl=impl,
               role="baseline" if impl in MODEL_PEERS else "triton")
    shape = (case.batch, case.heads, case.kv_heads, case.n_queries, case.n_keys, case.d, case.d)
    bench(MODELS_GROUP, row, build, bytes_moved=flash_attention_io_bytes(*shape, torch_dtype.itemsize, mode),
          flops=flash_attention_flops(case.batch, case.heads, case.n_queries, case.n_keys, case.d, case.d,
                                      *mask_bounds(case), mode),
          dtype=torch_dtype, error=model_attention_error(case, mode),
          bound=attention_bound(torch_dtype, case.n_queries, case.n_keys))


# ----------------------------------------------------------------------------------------------
# Row softmax: LM vocabularies and friends, at 0.25 and 2 GiB per tensor
# ----------------------------------------------------------------------------------------------
ROW_WIDTHS = (1000, 4096, 32000, 50257, 65536, 128256, 151936, 262144)
ROW_GRID = [(N, size, dtype) for N in ROW_WIDTHS for size in (GiB // 4, 2 * GiB) for dtype in ("float32", "bfloat16")]
if ON_GPU:
    ROW_CASES = ROW_GRID
    ROW_IMPLS = ("torch", "compile", "liger", TRITON)
else:
    ROW_CASES = [(100, 6 * 100 * 4, "float32")]  # 6 rows
    ROW_IMPLS = ("torch", "liger", TRITON)


def row_count(N: int, size: int, dtype: str) -> int:
    """Rows of N columns that make a tensor of about ``size`` bytes."""
    return max(1, size // (N * DTYPES[dtype].itemsize))


def _softmax_last(x):
    return torch.softmax(x, dim=-1)


def liger_softmax():
    """Liger-Kernel's softmax as its users call it (its autograd Function), when it is installed."""
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError as exc:
        raise Unavailable(f"liger_kernel is not installed here ({exc})") from exc
    return LigerSoftmaxFunction.apply


ROW_FUNCTIONS = {"torch": _softmax_last, "compile": _softmax_last, TRITON: row_softmax}


@pytest.mark.parametrize("N,size,dtype,impl,core", _params(
    ROW_CASES, ROW_IMPLS, lambda case: ("row_softmax", *case),
    lambda N, size, dtype: f"N{N}-M{row_count(N, size, dtype)}-{dtype}"))
def test_shape_grid_row_softmax(bench, N, size, dtype, impl, core):
    torch_dtype = DTYPES[dtype]
    M = row_count(N, size, dtype)

    def build():
        fn = liger_softmax() if impl == "liger" else implementation(ROW_FUNCTIONS, impl)
        x = row_softmax_inputs(M, N, torch_dtype)
        return _first_call(impl, lambda: fn(x)), (x,)

    row = dict(workload="row_softmax", case=f"M={M} N={N} {dtype}", dtype=dtype, impl=impl, role=role_of(impl),
               baselines=compared_with(ROW_IMPLS, core))
    bench(GROUP, row, build, bytes_moved=softmax_bytes(M, N, torch_dtype.itemsize), error=softmax_error,
          bound=softmax_bound)


# ----------------------------------------------------------------------------------------------
# softmax(x) @ V: d3 x d2 x d1 x the four precisions, batch 8
# ----------------------------------------------------------------------------------------------
PRECISIONS = (("float32", "highest"), ("float32", "high"), ("float16", "n/a"), ("bfloat16", "n/a"))
SMV_GRID = [(d1, d2, d3, dt, p) for d3 in (64, 96, 128, 512) for d2 in (1000, 3000, 4096, 8192)
            for d1 in (1000, 2048, 4096) for dt, p in PRECISIONS]
if ON_GPU:
    SMV_BATCH = 8
    SMV_CASES = SMV_GRID
    SMV_IMPLS = ("torch", "compile", TRITON)
else:
    SMV_BATCH = 1
    SMV_CASES = [(32, 48, 24, "float32", "highest")]
    SMV_IMPLS = ("torch", TRITON)


def _softmax_mult(x, V):
    return softmax_mult(x, V)


def _smv_path(d1: int, d2: int, d3: int, dtype: torch.dtype) -> str:
    """fused_softmax_path for the case's inputs (uninitialised ones of their shape, device and
    dtype: it reads no values), under the float32 matmul setting set now."""
    x, V = (torch.empty(shape, dtype=dtype, device=DEVICE) for shape in ((SMV_BATCH, d1, d2), (SMV_BATCH, d2, d3)))
    return fused_softmax_path(x, V)


SMV_FUNCTIONS = {"torch": softmax_mult, "compile": _softmax_mult, TRITON: fused_softmax}


def smv_error(out: torch.Tensor, inputs) -> float:
    """Against float64 on the first 128 rows of the first batch entry."""
    x, V = inputs[0][:1, :128].double(), inputs[1][:1].double()
    return relative_error(out[:1, :128], torch.softmax(x, dim=-1) @ V)


def smv_bound(inputs) -> float:
    """Twice PyTorch's own error on those rows of the whole case's call, plus the floor (torch_error_bound)."""
    return torch_error_bound(softmax_mult, smv_error, inputs)


@pytest.mark.parametrize("d1,d2,d3,dtype,precision,impl,core", _params(
    SMV_CASES, SMV_IMPLS, lambda case: ("softmax_matmul", *case),
    lambda d1, d2, d3, dtype, precision: f"d1_{d1}-d2_{d2}-d3_{d3}-{dtype}" + (f"-{precision}" if dtype == "float32" else "")))
def test_shape_grid_softmax_matmul(bench, d1, d2, d3, dtype, precision, impl, core):
    torch_dtype = DTYPES[dtype]

    def build():
        fn = implementation(SMV_FUNCTIONS, impl)
        x, V = softmax_matmul_inputs(SMV_BATCH, d1, d2, d3, torch_dtype)
        return _first_call(impl, lambda: fn(x, V)), (x, V)

    case = f"batch={SMV_BATCH} d1={d1} d2={d2} d3={d3} {dtype}" + (f" {precision}" if dtype == "float32" else "")
    row = dict(workload="softmax_matmul", case=case, dtype=dtype, impl=impl, role=role_of(impl),
               baselines=compared_with(SMV_IMPLS, core))
    before = torch.get_float32_matmul_precision()
    try:  # the precision is the case's: every implementation (and the matmul peak) runs under it
        if precision != "n/a":
            torch.set_float32_matmul_precision(precision)
        path = _smv_path(d1, d2, d3, torch_dtype) if impl == TRITON else None
        if impl == TRITON:
            row["path"] = path
        # Both fused kernels (Triton's and Gluon's) keep the softmax on chip.
        model = fused_softmax_bytes if path in ("fused", "gluon") else softmax_mult_bytes
        bench(GROUP, row, build, bytes_moved=model(SMV_BATCH, d1, d2, d3, torch_dtype.itemsize),
              flops=softmax_matmul_flops(SMV_BATCH, d1, d2, d3), dtype=torch_dtype, error=smv_error, bound=smv_bound)
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------------------------------
# softmax(x @ W): B x K x C, float32 (PyTorch's default 'highest') and bfloat16
# ----------------------------------------------------------------------------------------------
MMSM_GRID = [(B, K, C, dtype) for B in (1, 32, 512, 4096) for K in (768, 2048, 4096)
             for C in (10, 1000, 32000, 50257, 128256) for dtype in ("float32", "bfloat16")]
if ON_GPU:
    MMSM_CASES = MMSM_GRID
    MMSM_IMPLS = ("torch", "compile", TRITON)
else:
    MMSM_CASES = [(64, 128, 10, "float32")]
    MMSM_IMPLS = ("torch", TRITON)


def _matmul_softmax(x, W):
    return matmul_softmax_ref(x, W)


MMSM_FUNCTIONS = {"torch": matmul_softmax_ref, "compile": _matmul_softmax, TRITON: matmul_softmax_fused_tiled}


@pytest.mark.parametrize("B,K,C,dtype,impl,core", _params(
    MMSM_CASES, MMSM_IMPLS, lambda case: ("matmul_softmax", *case), lambda B, K, C, dtype: f"B{B}-K{K}-C{C}-{dtype}"))
def test_shape_grid_matmul_softmax(bench, B, K, C, dtype, impl, core):
    torch_dtype = DTYPES[dtype]

    def build():
        fn = implementation(MMSM_FUNCTIONS, impl)
        x, W = matmul_softmax_inputs(B, K, C, torch_dtype)
        return _first_call(impl, lambda: fn(x, W)), (x, W)

    kernel = "triton_fused_tiled" if impl == TRITON else "torch"
    row = dict(workload="matmul_softmax", case=f"B={B} K={K} C={C} {dtype}", dtype=dtype, impl=impl, role=role_of(impl),
               baselines=compared_with(MMSM_IMPLS, core))
    bench(GROUP, row, build, bytes_moved=matmul_softmax_impl_bytes(kernel, B, K, C, torch_dtype, DEVICE),
          flops=matmul_softmax_flops(B, K, C), dtype=torch_dtype, error=matmul_softmax_error,
          bound=matmul_softmax_bound)


# softmax(x @ W) with W as nn.Linear holds it: its weight is (C, K), and the logits are
# x @ weight.t(), a W whose values run along K (strides (1, K)). A few corners of the grid above.
MMSM_LINEAR_GRID = [(B, K, C, dtype) for B, K, C in ((512, 768, 1000), (4096, 4096, 1000), (4096, 768, 50257),
                                                     (4096, 4096, 32000), (32, 4096, 128256))
                    for dtype in ("float32", "bfloat16")]
MMSM_LINEAR_CASES = MMSM_LINEAR_GRID if ON_GPU else [(64, 128, 10, "float32")]


@pytest.mark.parametrize("B,K,C,dtype,impl,core", _params(
    MMSM_LINEAR_CASES, MMSM_IMPLS, lambda case: ("matmul_softmax_linear", *case),
    lambda B, K, C, dtype: f"linear-B{B}-K{K}-C{C}-{dtype}"))
def test_shape_grid_matmul_softmax_linear_weight(bench, B, K, C, dtype, impl, core):
    torch_dtype = DTYPES[dtype]

    def build():
        fn = implementation(MMSM_FUNCTIONS, impl)
        x, W = matmul_softmax_inputs(B, K, C, torch_dtype, layout="W_transposed")
        return _first_call(impl, lambda: fn(x, W)), (x, W)

    kernel = "triton_fused_tiled" if impl == TRITON else "torch"
    row = dict(workload="matmul_softmax", case=f"B={B} K={K} C={C} {dtype} W=weight.t()", dtype=dtype, impl=impl,
               role=role_of(impl), baselines=compared_with(MMSM_IMPLS, core))
    bench(GROUP, row, build, bytes_moved=matmul_softmax_impl_bytes(kernel, B, K, C, torch_dtype, DEVICE, w_kmajor=True),
          flops=matmul_softmax_flops(B, K, C), dtype=torch_dtype, error=matmul_softmax_error,
          bound=matmul_softmax_bound)


# ----------------------------------------------------------------------------------------------
# The harness's best-of columns, on rows made up here (no timing: cheap in CI)
# ----------------------------------------------------------------------------------------------
def test_best_of_columns_divide_the_fastest_baseline_by_each_candidate():
    rows = [dict(workload="w", case="a", impl="torch", forward_ms_mean=4.0),
            dict(workload="w", case="a", impl="compile", forward_ms_mean=2.0),
            dict(workload="w", case="a", impl="sdpa_flash", forward_ms_mean=None),  # failed: not a baseline time
            dict(workload="w", case="a", impl="triton", forward_ms_mean=1.0),
            dict(workload="w", case="a", impl="liger", forward_ms_mean=8.0),
            dict(workload="w", case="b", impl="triton", forward_ms_mean=1.0)]  # no baseline measured
    df = group_table(GROUP, rows).set_index(["case", "impl"])
    assert df.loc[("a", "triton"), "best_baseline_ms"] == 2.0 and df.loc[("a", "triton"), "speedup"] == 2.0
    assert df.loc[("a", "liger"), "speedup"] == 0.25 and df.loc[("a", "triton"), "ms"] == 1.0
    assert all(pd.isna(df.loc[("a", impl), "speedup"]) for impl in ("torch", "compile", "sdpa_flash")), \
        "a baseline's own row is no candidate"
    assert pd.isna(df.loc[("b", "triton"), "best_baseline_ms"]) and pd.isna(df.loc[("b", "triton"), "speedup"])


def test_an_unavailable_implementation_is_an_empty_row_not_a_failure():
    assert is_resource_limit(Unavailable("liger_kernel is not installed here"))
    with pytest.raises(Unavailable, match="sdpa_cudnn does not run this case: no kernel"):
        _first_call("sdpa_cudnn", _raises(RuntimeError("no kernel")))
    with pytest.raises(TypeError):  # a bug in how a peer is called stays a failure
        _first_call("liger", _raises(TypeError("bad call")))
    failing = _raises(RuntimeError("inductor failed"))
    assert _first_call("compile", failing) is failing, "PyTorch's own baselines get no leave: their error fails the test"


def _raises(exc: Exception):
    def call():
        raise exc
    return call


def test_core_subset_names_cases_of_the_gpu_grid():
    grid = {("attention", *case[1:]) for case in ATTENTION_GRID} | {("row_softmax", *case) for case in ROW_GRID} | {
        ("softmax_matmul", *case) for case in SMV_GRID} | {("matmul_softmax", *case) for case in MMSM_GRID}
    assert CORE <= grid, f"core cases outside the grid (-k core would silently skip them): {sorted(CORE - grid)}"
    assert {key[0] for key in CORE} == {"attention", "row_softmax", "softmax_matmul", "matmul_softmax"}


def test_softmax_matmul_bound_is_torchs_error_on_the_timed_call():
    """A PyTorch whose kernel depends on the shape, as cuBLAS's split-K does: exact on a slice, off by
    1e-5 on the whole call. The bound must let that PyTorch pass the case it times (a bound taken on a
    slice, as before, would be the floor alone and fail it) and stay within twice its error."""
    x, V = softmax_matmul_inputs(2, 256, 48, 24, torch.float32)

    def shape_dependent(x, V):
        out = torch.softmax(x.double(), dim=-1) @ V.double()
        return (out * (1 + 1e-5 * (x.shape == (2, 256, 48)))).float()

    own = smv_error(shape_dependent(x, V), (x, V))
    assert 9e-6 < own <= torch_error_bound(shape_dependent, smv_error, (x, V)) <= 2 * own + 4 * 2.0**-24
    on_slice = error_bound(smv_error(shape_dependent(x[:1, :128], V[:1]), (x, V)), x.dtype)
    assert on_slice < own, "the slice's bound would fail PyTorch on its own case"
