"""Benchmark group linear_cross_entropy: the LM-head loss cross_entropy(x @ W^T, target).

Implementations: torch (F.cross_entropy of F.linear, the logits upcast to float32), compile (the
same under torch.compile), liger (Liger-Kernel's fused linear cross entropy), cce (Apple's
cut-cross-entropy), triton (``linear_cross_entropy``). The two peers are timed where their
packages import; otherwise their rows are empty with the reason.

Each case runs twice: mode "fwd" (the loss alone, nothing requires a gradient) and "fwd_bwd"
(the loss and its gradients dx, dW by ``torch.autograd.grad``); the JSON keeps both, and the CSV
has one row per case and implementation (the group's ``pivot``): fwd_ms from mode fwd, the rest
from mode fwd_bwd. peak_MiB is the peak allocated during one forward+backward above what the
inputs held (dx and dW included). loss_rel_error and grad_rel_error (the worse of dx and dW) are
relative errors against a float32 computation of the same inputs on a GPU (float64 in the
interpreter), of the forward+backward call's results. Inputs come from the builder of
test_linear_cross_entropy.py, so every timed shape is tested.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from conftest import BenchGroup, Unavailable, caller_form, compiled, compiled_op
from fused_softmax_matmul import (
    linear_cross_entropy, linear_cross_entropy_flops, linear_cross_entropy_launch, linear_cross_entropy_ref,
)
from support import DTYPES, ON_GPU, ROUNDOFF_FACTOR, matmul_roundoff, relative_error
from test_linear_cross_entropy import linear_cross_entropy_inputs

GROUP = BenchGroup(
    name="linear_cross_entropy",
    csv="linear_cross_entropy_benchmark.csv",
    columns=("BT", "H", "V", "dtype", "impl", "chunk_rows", "block_v", "num_warps", "programs",
             "fwd_ms", "fwd_bwd_ms", "fwd_bwd_ms_std", "peak_MiB", "tflops", "loss_rel_error", "grad_rel_error"),
    case=("BT", "H", "V", "dtype", "mode"),
    impls=("torch", "compile", "liger", "cce", "triton", "triton_compiled", "triton_graph"),
    speedups={"speedup_vs_torch": "torch"},
    plot=("bar", "speedup_vs_torch"),
    pivot=("mode", {"fwd_ms": ("fwd", "forward_ms_mean"), "fwd_bwd_ms": ("fwd_bwd", "forward_ms_mean"),
                    "fwd_bwd_ms_std": ("fwd_bwd", "forward_ms_std"), "peak_MiB": ("fwd_bwd", "forward_extra_MiB"),
                    "tflops": ("fwd_bwd", "tflops"), "loss_rel_error": ("fwd_bwd", "loss_rel_error"),
                    "grad_rel_error": ("fwd_bwd", "grad_rel_error"), "host_us": ("fwd_bwd", "host_us")}),
)

if ON_GPU:
    # Llama 3 (8192 tokens, H 4096, V 128256), a 32k vocabulary, Qwen 2's 151936 at H 2048.
    CASES = [(8192, 4096, 128256, "bfloat16"), (4096, 4096, 32768, "bfloat16"), (16384, 2048, 151936, "bfloat16")]
    # Beside the launch's own choice, the Triton rows at 256 and 4096 rows per chunk (what the
    # buffer's size, i.e. memory, buys in time), and with one row-kernel program per SM taking
    # 16 KiB tiles (fewer rows in flight, so the gradient pass finds more of its row in L2).
    VARIANTS = [*((impl, {}) for impl in GROUP.impls), ("triton", {"chunk_rows": 256}),
                ("triton", {"chunk_rows": 4096}), ("triton", {"programs": "sms", "block_v": "16KiB", "num_warps": 16})]
else:
    # Interpreter smoke run: a ragged vocabulary, one chunk. torch.compile is left out, as in the
    # matmul_softmax group: inductor compiling C++ on 2 shared cores outlasts the rest of the run.
    CASES = [(64, 32, 300, "float32")]
    VARIANTS = [(impl, {}) for impl in GROUP.impls if impl != "compile"]
MODES = ("fwd", "fwd_bwd")
# The caller forms run at the smallest case only: the larger ones take seconds a call, where a
# caller's host time and the graph's saving are noise.
CALLER_FORMS = ("triton_compiled", "triton_graph")
CALLER_CASE = min(CASES, key=lambda case: case[0] * case[1] * case[2])


def liger(x, W, target):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as fn

    # apply takes positional arguments: bias, ce_weight, ignore_index, lse_square_scale,
    # label_smoothing, reduction; it returns a tuple, the loss first.
    out = fn.apply(x, W, target, None, None, -100, 0.0, 0.0, "mean")
    return out[0] if isinstance(out, tuple) else out


def cce(x, W, target):
    from cut_cross_entropy import linear_cross_entropy as fn

    return fn(x, W, target, ignore_index=-100, reduction="mean")


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
# others) and returns loss(x, W, target).
IMPLS = {
    "torch": lambda launch: linear_cross_entropy_ref,
    "compile": lambda launch: compiled(linear_cross_entropy_ref),
    "liger": peer("liger_kernel.ops.fused_linear_cross_entropy", liger),
    "cce": peer("cut_cross_entropy", cce),
    "triton": lambda launch: functools.partial(linear_cross_entropy, launch=launch),
    # The op as a caller may run it, at its own launch: under torch.compile(fullgraph=True), and
    # replayed from a CUDA graph (its eager target check, a host sync, is skipped while capturing).
    "triton_compiled": lambda launch: compiled_op(linear_cross_entropy),
    "triton_graph": lambda launch: linear_cross_entropy,
}

_REFERENCE: dict = {}


def reference(x, W, target):
    """(loss, dx, dW) from float32 (GPU) or float64 (interpreter) copies of the inputs. The builder
    is seeded, so one case's inputs are the same for every implementation and mode: the last
    case's answer is kept (on the LM-head sizes it costs a second of float32 matmuls)."""
    key = (tuple(x.shape), tuple(W.shape), x.dtype)
    if key not in _REFERENCE:
        _REFERENCE.clear()
        wide = torch.float32 if ON_GPU else torch.float64
        x, W = x.detach().to(wide).requires_grad_(), W.detach().to(wide).requires_grad_()
        loss = F.cross_entropy(F.linear(x, W), target)
        _REFERENCE[key] = (loss.detach(), *torch.autograd.grad(loss, (x, W)))
    return _REFERENCE[key]


def linear_cross_entropy_error(out, inputs) -> dict:
    """loss_rel_error, and for mode fwd_bwd grad_rel_error (the worse of dx and dW)."""
    ref_loss, ref_dx, ref_dW = reference(*inputs)
    if not isinstance(out, tuple):  # mode fwd: the loss alone
        return {"loss_rel_error": relative_error(out.detach(), ref_loss)}
    return {"loss_rel_error": relative_error(out[0].detach(), ref_loss),
            "grad_rel_error": max(relative_error(out[1], ref_dx), relative_error(out[2], ref_dW))}


def linear_cross_entropy_bound(mode: str, dtype: torch.dtype) -> dict:
    """ROUNDOFF_FACTOR units of the products' roundoff in dtype for each error: PyTorch's own
    error at dtype would cost an LM head's loss and gradients again."""
    bound = ROUNDOFF_FACTOR * matmul_roundoff(dtype)
    return {"loss_rel_error": bound} if mode == "fwd" else {"loss_rel_error": bound, "grad_rel_error": bound}


def _variant_id(impl: str, overrides: dict) -> str:
    return "-".join([impl, *(f"{k}={v}" for k, v in overrides.items())])


def resolve(overrides: dict, dtype: torch.dtype) -> dict:
    """Launch fields from a variant: "sms" is the GPU's SM count, "16KiB" a tile of that many bytes."""
    sizes = {"sms": torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 2,
             "16KiB": 16384 // dtype.itemsize}
    return {k: sizes.get(v, v) if isinstance(v, str) else v for k, v in overrides.items()}


# Each case with every variant, but the caller forms at CALLER_CASE only.
CASE_VARIANTS = [(*case, *variant) for case in CASES for variant in VARIANTS
                 if variant[0] not in CALLER_FORMS or case == CALLER_CASE]


@pytest.mark.parametrize("BT,H,V,dtype,impl,overrides", CASE_VARIANTS,
                         ids=["-".join([*map(str, cv[:4]), _variant_id(*cv[4:])]) for cv in CASE_VARIANTS])
@pytest.mark.parametrize("mode", MODES)
def test_linear_cross_entropy(bench, BT, H, V, dtype, mode, impl, overrides):
    launch = None
    launch_columns = dict(chunk_rows=None, block_v=None, num_warps=None, programs=None)
    if impl == "triton":
        launch = dataclasses.replace(linear_cross_entropy_launch(BT, V, H, DTYPES[dtype]),
                                     **resolve(overrides, DTYPES[dtype]))
        launch_columns = dataclasses.asdict(launch)
    row = dict(BT=BT, H=H, V=V, dtype=dtype, mode=mode, impl=impl, **launch_columns)

    def build():
        fn = IMPLS[impl](launch)  # a peer that does not import: the harness keeps its row, empty with the reason
        x, W, target = linear_cross_entropy_inputs(BT, H, V, DTYPES[dtype])
        if mode == "fwd":
            return caller_form(impl, lambda: fn(x, W, target)), (x, W, target)
        x.requires_grad_()
        W.requires_grad_()

        def forward_backward():
            # autograd.grad, not backward(): nothing accumulates into .grad between rounds.
            loss = fn(x, W, target)
            return (loss, *torch.autograd.grad(loss, (x, W)))
        return caller_form(impl, forward_backward), (x, W, target)

    bench(GROUP, row, build, flops=linear_cross_entropy_flops(BT, H, V, mode), dtype=DTYPES[dtype],
          error=linear_cross_entropy_error, bound=linear_cross_entropy_bound(mode, DTYPES[dtype]))
