"""Benchmark group linear_cross_entropy: the LM-head loss cross_entropy(x @ W^T, target), forward and backward.

Implementations: torch (F.cross_entropy of F.linear, the logits upcast to float32, soft-capped in
float32 where the case has a softcap), compile (the same under torch.compile), liger (Liger-Kernel's
fused linear cross entropy), cce (Apple's cut-cross-entropy), triton (``linear_cross_entropy``),
and the latter as a caller may run it (compiled, CUDA graph). The two peers are timed where their
packages import; otherwise their rows are empty with the reason. Every one takes the case's
softcap. Inputs are shaped like a trained LM head's (``lm_head_inputs``: a loss near 3.5 nats, most
probabilities tiny), so cut-cross-entropy, which skips the gradient's blocks under its threshold,
meets what a real model gives it; the other implementations take as long on any logits. Targets
have about 10 % of rows ignore_index.

Each case times a forward and backward (mode "fwd_bwd": the loss, then dx and dW by
``torch.autograd.grad``), one CSV row per case and implementation. peak_MiB is the peak
allocated during one forward+backward above what the inputs held (dx and dW included);
pct_of_gemm_floor the share of the three products' time at cuBLAS's measured rate.
loss_rel_error and grad_rel_error (the worse of dx and dW) are relative errors against a
float32 computation of the same inputs on a GPU (float64 in the interpreter), of the timed
call's own results. Inputs come from the builder of test_linear_cross_entropy.py, so every
timed shape is tested.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest
import torch

from candidates import candidate_call, candidate_impls
from conftest import BenchGroup, Unavailable, caller_form, compiled, compiled_op
from fused_softmax_matmul import (
    linear_cross_entropy, linear_cross_entropy_flops, linear_cross_entropy_plan, linear_cross_entropy_ref,
)
from support import DEVICE, DTYPES, ON_GPU, ROUNDOFF_FACTOR, at_one_case, matmul_roundoff, relative_error
from test_linear_cross_entropy import lm_head_inputs

GROUP = BenchGroup(
    name="linear_cross_entropy",
    csv="linear_cross_entropy_benchmark.csv",
    columns=("BT", "H", "V", "softcap", "dtype", "impl", "chunk_rows", "block_v", "num_warps",
             "fwd_bwd_ms", "fwd_bwd_ms_std", "peak_MiB", "tflops", "pct_of_gemm_floor", "loss_rel_error",
             "grad_rel_error"),
    case=("BT", "H", "V", "softcap", "dtype", "mode"),
    impls=("torch", "compile", "liger", "cce", "triton", "triton_compiled", "triton_graph",
           *candidate_impls("linear_cross_entropy")),
    speedups={"speedup_vs_torch": "torch"},
    plot=("bar", "speedup_vs_torch"),
    # pct_of_gemm_floor: the three products' flops at the run's measured cuBLAS bfloat16 rate
    # (conftest's matmul_peak_tflops), over the measured time: the harness's pct_of_matmul_peak.
    pivot=("mode", {"fwd_bwd_ms": ("fwd_bwd", "forward_ms_mean"), "fwd_bwd_ms_std": ("fwd_bwd", "forward_ms_std"),
                    "peak_MiB": ("fwd_bwd", "forward_extra_MiB"), "tflops": ("fwd_bwd", "tflops"),
                    "pct_of_gemm_floor": ("fwd_bwd", "pct_of_matmul_peak"),
                    "loss_rel_error": ("fwd_bwd", "loss_rel_error"), "grad_rel_error": ("fwd_bwd", "grad_rel_error"),
                    "host_us": ("fwd_bwd", "host_us")}),
    # Few rounds: a call takes 2 to 100 ms, so 10 rounds are 0.02-1 s a row against the event
    # timer's resolution of microseconds; torch at the Qwen and Gemma sizes holds ~30 GB a call.
    # fwd_bwd_ms_std says where 10 were too few.
    warmup=2,
    rounds=10,
)

# (BT, H, V, softcap, dtype): GPT-2 (50257, and 50304 padded to a multiple of 64) at H 768; a 32k
# vocabulary; Llama 3 (128256); Qwen 2 (151936) at H 2048; Gemma 2 (256000) with its soft-capping
# of the final logits at 30.
GPU_CASES = [(2048, 768, 50257, None, "bfloat16"), (8192, 768, 50304, None, "bfloat16"),
             (4096, 4096, 32768, None, "bfloat16"), (8192, 4096, 128256, None, "bfloat16"),
             (16384, 2048, 151936, None, "bfloat16"), (8192, 2304, 256000, 30.0, "bfloat16")]
if ON_GPU:
    CASES = GPU_CASES
    IMPL_NAMES = GROUP.impls
else:
    # Interpreter smoke run: a ragged vocabulary, one chunk, with and without softcap. torch.compile
    # is left out, as in the matmul_softmax group: inductor compiling C++ on 2 shared cores
    # outlasts the rest of the run.
    CASES = [(64, 32, 300, None, "float32"), (64, 32, 300, 30.0, "float32")]
    IMPL_NAMES = tuple(impl for impl in GROUP.impls if impl != "compile")
# Forward and backward, as a training step runs the loss (the forward alone is in the tests).
MODES = ("fwd_bwd",)
# The caller forms run at the smallest case only: the larger ones take tens of milliseconds a
# call, where a caller's host time and the graph's saving are noise.
CALLER_FORMS = ("triton_compiled", "triton_graph")
CASE_MODES = [(*case, mode) for case in CASES for mode in MODES]
CALLER_CASE = min(CASE_MODES, key=lambda case: case[0] * case[1] * case[2])


def liger(x, W, target, softcap=None):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as fn

    # apply takes positional arguments: bias, ce_weight, ignore_index, lse_square_scale,
    # label_smoothing, reduction, softcap; it returns a tuple, the loss first.
    out = fn.apply(x, W, target, None, None, -100, 0.0, 0.0, "mean", softcap)
    return out[0] if isinstance(out, tuple) else out


def cce(x, W, target, softcap=None):
    from cut_cross_entropy import linear_cross_entropy as fn

    return fn(x, W, target, ignore_index=-100, softcap=softcap, reduction="mean")


def torch_loss(x, W, target, softcap=None):
    return linear_cross_entropy_ref(x, W, target, softcap=softcap)


def without_options(fn):
    """fn(x, W, target) called as the group calls every implementation."""
    return lambda x, W, target, softcap=None: fn(x, W, target)


def peer(module: str, fn):
    """A factory returning fn once its package imports here; otherwise the row stays empty with the reason."""
    def factory(launch):  # noqa: ARG001 - a peer chooses its own launch
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure is the row's reason
            raise Unavailable(f"{module} does not import: {type(exc).__name__}: {exc}") from exc
        return fn
    return factory


# Each factory takes the row's launch (a LinearCrossEntropyLaunch for triton, None for the
# others) and returns loss(x, W, target, softcap=None). Every peer here takes softcap; one that
# did not would raise Unavailable for a case with it, leaving its row empty with the reason.
IMPLS = {
    "torch": lambda launch: torch_loss,
    "compile": lambda launch: compiled(torch_loss),
    "liger": peer("liger_kernel.ops.fused_linear_cross_entropy", liger),
    "cce": peer("cut_cross_entropy", cce),
    "triton": lambda launch: functools.partial(linear_cross_entropy, launch=launch),
    # The op as a caller may run it, at its own launch: under torch.compile(fullgraph=True), and
    # replayed from a CUDA graph (its target check, a device-side assertion, is skipped while capturing).
    "triton_compiled": lambda launch: compiled_op(linear_cross_entropy),
    "triton_graph": lambda launch: linear_cross_entropy,
    # --candidate's linear_cross_entropy (tests/candidates.py), called f(x, W, target): a case
    # with softcap leaves its row empty (build() says why)
    **{impl: lambda launch, impl=impl: without_options(candidate_call(impl))
       for impl in candidate_impls("linear_cross_entropy")},
}

_REFERENCE: dict = {}


def reference(x, W, target, softcap=None):
    """(loss, dx, dW) from float32 (GPU) or float64 (interpreter) copies of the inputs, the logits
    soft-capped in that precision. The builder is seeded, so one case's inputs are the same for
    every implementation: the last case's answer is kept (at the LM-head sizes it costs a second
    of float32 matmuls and, at the Gemma size, ~35 GB for the moment)."""
    key = (tuple(x.shape), tuple(W.shape), x.dtype, softcap)
    if key not in _REFERENCE:
        _REFERENCE.clear()
        wide = torch.float32 if ON_GPU else torch.float64
        x, W = x.detach().to(wide).requires_grad_(), W.detach().to(wide).requires_grad_()
        loss = linear_cross_entropy_ref(x, W, target, softcap=softcap)
        _REFERENCE[key] = (loss.detach(), *torch.autograd.grad(loss, (x, W)))
    return _REFERENCE[key]


def linear_cross_entropy_error(out, inputs) -> dict:
    """loss_rel_error and grad_rel_error (the worse of dx and dW) of a forward+backward's results."""
    ref_loss, ref_dx, ref_dW = reference(*inputs)
    return {"loss_rel_error": relative_error(out[0].detach(), ref_loss),
            "grad_rel_error": max(relative_error(out[1], ref_dx), relative_error(out[2], ref_dW))}


def linear_cross_entropy_bound(mode: str, dtype: torch.dtype) -> dict:
    """ROUNDOFF_FACTOR units of the products' roundoff in dtype for each error: PyTorch's own
    error at dtype would cost an LM head's loss and gradients again."""
    bound = ROUNDOFF_FACTOR * matmul_roundoff(dtype)
    return {"loss_rel_error": bound} if mode == "fwd" else {"loss_rel_error": bound, "grad_rel_error": bound}


@pytest.mark.parametrize("BT,H,V,softcap,dtype,mode,impl",
                         at_one_case(CASE_MODES, IMPL_NAMES, at=CALLER_CASE, only=CALLER_FORMS))
def test_linear_cross_entropy(bench, BT, H, V, softcap, dtype, mode, impl):
    launch = None
    launch_columns = dict(chunk_rows=None, block_v=None, num_warps=None)
    if impl == "triton":
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if ON_GPU else None
        launch = linear_cross_entropy_plan(BT, H, V, DTYPES[dtype], sms=sms).launch
        launch_columns = dataclasses.asdict(launch)
    # A string, "none" without: a case column must compare equal to itself (pandas makes None NaN)
    # and sort against its other values (no mix of str and float).
    row = dict(BT=BT, H=H, V=V, softcap=str(softcap).lower(), dtype=dtype, mode=mode, impl=impl, **launch_columns)

    def build():
        if softcap is not None and impl.startswith("candidate:"):
            raise Unavailable("a candidate's linear_cross_entropy is called f(x, W, target), without softcap")
        fn = IMPLS[impl](launch)  # a peer that does not import: the harness keeps its row, empty with the reason
        x, W, target = lm_head_inputs(BT, H, V, DTYPES[dtype])
        x.requires_grad_()
        W.requires_grad_()

        def forward_backward():
            # autograd.grad, not backward(): nothing accumulates into .grad between rounds.
            loss = fn(x, W, target, softcap=softcap)
            return (loss, *torch.autograd.grad(loss, (x, W)))
        return caller_form(impl, forward_backward), (x, W, target, softcap)

    bench(GROUP, row, build, flops=linear_cross_entropy_flops(BT, H, V, mode), dtype=DTYPES[dtype],
          error=linear_cross_entropy_error, bound=linear_cross_entropy_bound(mode, DTYPES[dtype]))
