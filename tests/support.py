"""Input builders and accuracy checks shared by the correctness tests and the benchmarks.

A benchmarked shape is built by the same function as a tested one, so what is timed is what is
checked. The conftest.py at the project root has already chosen compiled Triton (a GPU) or the
interpreter (no GPU) before this module imports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from fused_softmax_matmul import (
    matmul_softmax_fused_bytes, matmul_softmax_fused_simple, matmul_softmax_fused_tiled, matmul_softmax_ref,
    matmul_softmax_plan, matmul_softmax_tiled_bytes, matmul_softmax_unfused, matmul_softmax_unfused_bytes,
    presplit_bytes, split_k_bytes, _device_facts,
)
from online_softmax import INTERPRET

# The kernel modules' INTERPRET is the one interpreter flag; a GPU is also needed for compiled runs.
ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU running compiled Triton")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Unit roundoff of each dtype: the scale of one rounding error, used as an error floor where
# PyTorch's own error can be zero (tiny problems whose result is exactly representable).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


# The committed records: outputs/<GPU>/ for each GPU kind's, outputs/cpu/ for the interpreter's.
OUTPUTS = Path(__file__).resolve().parent.parent / "outputs"


def record_files(pattern: str) -> list[Path]:
    """Every committed record's files whose name matches pattern, in a stable order."""
    return sorted(OUTPUTS.rglob(pattern))


def attention_route(plan) -> str:
    """A flash_attention plan's path as the record names it: "course", "general", or "general (Gluon
    forward)" where the general path's forward runs the Hopper Gluon kernel."""
    return plan.path + (" (Gluon forward)" if plan.path == "general" and plan.gluon_forward else "")


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Normal values drawn on the device in float32, scaled, then rounded to dtype."""
    t = torch.randn(shape, generator=generator(seed), device=DEVICE, dtype=torch.float32)
    return (t * scale).to(dtype)


def softmax_matmul_inputs(batch, d1, d2, d3, dtype, seed=0, scale=1.0):
    """x: (batch, d1, d2) logits times ``scale``, V: (batch, d2, d3)."""
    return randn((batch, d1, d2), dtype, seed, scale), randn((batch, d2, d3), dtype, seed + 1)


def row_softmax_inputs(M, N, dtype, seed=0, scale=1.0):
    return randn((M, N), dtype, seed, scale)


def attention_inputs(batch, n_queries, n_keys, d, dtype, seed=0, scale=1.0):
    """Q: (batch, n_queries, d), K, V: (batch, n_keys, d). Q times ``scale`` sharpens the softmax
    (logits of size ``scale`` after the 1/sqrt(d)), so its running maximum moves between key tiles."""
    return (randn((batch, n_queries, d), dtype, seed, scale), randn((batch, n_keys, d), dtype, seed + 1),
            randn((batch, n_keys, d), dtype, seed + 2))


INF = float("inf")


@pytest.fixture
def matmul_precision():
    """A setter of torch's float32 matmul precision for one test ("n/a", a 16-bit case's, leaves
    it); the precision before the test is restored after."""
    before = torch.get_float32_matmul_precision()
    yield lambda p: torch.set_float32_matmul_precision(p) if p != "n/a" else None
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def fresh_compile():
    """torch.compile from scratch: Inductor's on-disk caches do not key a graph by the schemas of
    the custom ops it calls, so a graph cached before an op changed would call it wrongly."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


# ----------------------------------------------------------------------------------------------
# Edge-case logits: exact shifts, masks, the ends of each dtype's range
# ----------------------------------------------------------------------------------------------
def dyadic_logits(shape, dtype, seed=0) -> torch.Tensor:
    """Logits k / 8 with integer |k| <= 16: exact in every dtype, and after a shift by SHIFT[dtype]."""
    k = torch.randint(-16, 17, shape, generator=generator(seed), device=DEVICE)
    return (k / 8).to(dtype)


# A constant that each dtype adds to k / 8 (|k| <= 16) exactly: the sum stays on the dtype's grid
# (float32: spacing 1/16 and 1/8 either side of 2^20; float16: 1/32 and 1/16 either side of 64;
# bfloat16: 1/32 and 1/16 either side of 8).
SHIFT = {torch.float32: 2.0**20, torch.float16: 64.0, torch.bfloat16: 8.0}

# Logits near the top of each dtype's range: 2 x BIG overflows float32, so x - max is -inf.
BIG = {torch.float32: 3e38, torch.float16: 6e4, torch.bfloat16: 3e38}


def masked_logits(shape, dtype, seed=0) -> torch.Tensor:
    """Normal logits with about a third set to -inf (masked), and rows that test the edges.

    Row 0 is masked over its first 20 columns: one or more whole tiles of only -inf before any
    finite logit (the running max is -inf there, and exp(-inf - -inf) must not become NaN).
    Row 1 is all -inf: torch gives NaN. Row 2 keeps only its last column: exactly 1 there.
    """
    x = randn(shape, dtype, seed)
    x[torch.rand(shape, generator=generator(seed + 1), device=DEVICE) < 1 / 3] = -INF
    x[..., 0, :20] = -INF
    x[..., 1, :] = -INF
    x[..., 2, :-1] = -INF
    x[..., 2, -1] = 0.5
    return x


def extreme_logits(shape, dtype, seed=0) -> torch.Tensor:
    """Normal logits with +-BIG[dtype] planted: the row max's subtraction overflows to -inf.

    Row 0: one +BIG (probability 1) and one -BIG (x - max = -inf). Row 1: all -BIG (uniform).
    Row 2: +BIG at both ends (1/2 each). Row 3: every other logit -BIG (weight 0).
    """
    big = BIG[dtype]
    x = randn(shape, dtype, seed)
    x[..., 0, 3], x[..., 0, 7] = big, -big
    x[..., 1, :] = -big
    x[..., 2, 0], x[..., 2, -1] = big, big
    x[..., 3, ::2] = -big
    return x


# ----------------------------------------------------------------------------------------------
# Accuracy: judged against float64, low precision by PyTorch's own error at that precision
# ----------------------------------------------------------------------------------------------
def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the finite entries of ref, in float64."""
    ok = torch.isfinite(ref)
    diff = (out.double() - ref)[ok]
    return (diff.norm() / ref[ok].norm().clamp_min(1e-300)).item()


def error_bound(torch_error: float, dtype: torch.dtype, factor: float = 2.0) -> float:
    """What an error against float64 may be at most: ``factor`` times PyTorch's own error at the
    same precision, plus four units of roundoff of dtype (PyTorch's error can be exactly zero)."""
    return factor * torch_error + 4 * UNIT_ROUNDOFF[dtype]


def torch_error_bound(torch_fn, error, inputs: tuple, factor: float = 2.0) -> float:
    """error_bound of PyTorch's own error on the call the case times, ``torch_fn(*inputs)``, measured by
    the rows' ``error``. Not on a slice of the inputs: cuBLAS picks its kernel by shape, and a float32
    sum's error grows like sqrt of the terms summed in one run, so a slice it splits over K can err
    several times less than the whole (see outputs/README.md, design notes: float32 sum error)."""
    return error_bound(error(torch_fn(*inputs), inputs), inputs[0].dtype, factor)


def at_one_case(cases, impls, at, only=("triton_compiled",)) -> list:
    """pytest.params of every case x implementation, case by case, each the case's values then the
    implementation's (as stacked parametrize decorators order and name them), but the
    implementations named in ``only`` at the case ``at`` alone: a compile per shape, its time
    within a few percent of the eager launch's (tests/test_bench_softmax_matmul.py says why). A
    case is a tuple or a pytest.param (its marks kept); an implementation a name or a tuple led by it."""
    values = [tuple(getattr(case, "values", case)) for case in cases]
    at = tuple(getattr(at, "values", at))
    if at not in values:
        raise ValueError(f"at={at!r} is none of the cases: the implementations {only} would run nowhere")
    impls = [impl if isinstance(impl, tuple) else (impl,) for impl in impls]
    return [pytest.param(*case_values, *impl, marks=getattr(case, "marks", ()))
            for case, case_values in zip(cases, values) for impl in impls
            if impl[0] not in only or case_values == at]


def matmul_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of a product's operands in dtype under torch's float32 matmul precision (the
    kernels follow it): TF32 keeps 10 fraction bits ("high"), bfloat16 7 ("medium")."""
    if dtype == torch.float32:
        return {"high": 2.0**-11, "medium": 2.0**-8}.get(torch.get_float32_matmul_precision(), 2.0**-24)
    return UNIT_ROUNDOFF[dtype]


# A benchmark row whose reference costs too much to repeat in PyTorch at the case's dtype (an
# LM head's loss) is bounded by this many units of roundoff: a few roundings of the operands and
# of the result, each a unit at most, with room for a long sum's growth; a kernel that drops a
# rescale or a tile is off by tens of percent, hundreds of units.
ROUNDOFF_FACTOR = 16


def describe_mismatch(out: torch.Tensor, ref: torch.Tensor, tol: float) -> str:
    """How many elements are far from ref, and the worst one: where to look when a test fails."""
    err = (out.double() - ref).abs().nan_to_num(nan=float("inf"))
    scale = ref.abs().nan_to_num().max().clamp_min(1e-300)
    bad = err > tol * scale
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return (f"{int(bad.sum())} of {err.numel()} elements off by more than {tol:.1e} x max|ref|; "
            f"worst at {worst}: got {out[worst].item()!r}, want {ref[worst].item()!r}")


def assert_close(out: torch.Tensor, ref64: torch.Tensor, torch_out: torch.Tensor | None = None,
                 factor: float = 2.0, algorithm_error: float = 0.0) -> None:
    """out must carry ref64's NaNs exactly, and elsewhere be as accurate as PyTorch (FlashAttention's rule).

    ``torch_out`` is PyTorch's answer in out's dtype; out's error against the float64 reference
    may be at most ``factor`` times PyTorch's, plus a few units of roundoff of out's dtype
    (PyTorch's error can be exactly zero on small exact cases). Without ``torch_out`` the bound is
    the roundoff floor alone scaled by ``factor``. ``algorithm_error`` is a relative error the
    algorithm under test incurs by design and PyTorch's does not; the caller derives it and says why.
    """
    assert out.shape == ref64.shape, f"shape {tuple(out.shape)}, want {tuple(ref64.shape)}"
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref64)
    assert torch.equal(nan_out, nan_ref), (
        f"NaN pattern differs: {int(nan_out.sum())} NaNs, reference has {int(nan_ref.sum())}")
    assert torch.isfinite(out[torch.isfinite(ref64)]).all(), "non-finite values where the reference is finite"
    floor = 4 * UNIT_ROUNDOFF[out.dtype]
    torch_err = relative_error(torch_out, ref64) if torch_out is not None else 0.0
    bound = error_bound(torch_err, out.dtype, factor) + algorithm_error
    err = relative_error(out, ref64)
    assert err <= bound, (f"relative error {err:.3e} > {bound:.3e} (= {factor} x torch's {torch_err:.3e} "
                          f"+ {floor:.1e} + {algorithm_error:.1e}); " + describe_mismatch(out, ref64, bound))


def matmul_softmax_inputs(B, K, C, dtype, seed=0, scale=1.0, layout="contiguous"):
    """x: (B, K) times ``scale``, W: (K, C) with entries of size 1/sqrt(K) (nn.Linear's scale),
    so the logits are of size ``scale`` whatever K is.

    layout "x_strided": x is every other column of a (B, 2K) tensor (row stride 2K, column
    stride 2); "W_transposed": W is the transpose of a contiguous (C, K) tensor (strides 1, K);
    "x_transposed": x is the transpose of a contiguous (K, B) tensor (strides 1, B), as x^T in
    a backward's dW = x^T @ dz; "both_transposed": both.
    """
    if layout == "x_strided":
        x = randn((B, 2 * K), dtype, seed, scale)[:, ::2]
    elif layout in ("x_transposed", "both_transposed"):
        x = randn((K, B), dtype, seed, scale).t()
    else:
        x = randn((B, K), dtype, seed, scale)
    if layout in ("W_transposed", "both_transposed"):
        W = randn((C, K), dtype, seed + 1, max(K, 1) ** -0.5).t()
    else:
        W = randn((K, C), dtype, seed + 1, max(K, 1) ** -0.5)
    return x, W


# Each version of softmax(x @ W) under the name the tests and the benchmarks give it.
MATMUL_SOFTMAX_IMPLS = {
    "torch": matmul_softmax_ref,
    "triton_unfused": matmul_softmax_unfused,
    "triton_fused_simple": matmul_softmax_fused_simple,
    "triton_fused_tiled": matmul_softmax_fused_tiled,
}


def matmul_softmax_impl_bytes(impl: str, B: int, K: int, C: int, dtype: torch.dtype, device,
                              w_kmajor: bool = False) -> int:
    """The least traffic of each version (its bytes_model): PyTorch, torch.compile (cuBLAS or an
    extern mm, then a softmax kernel) and Triton unfused write and re-read the logits; the simple
    kernel writes once; the tiled one as ``matmul_softmax_tiled_bytes`` with the tiles its
    wrapper's plan picks (for W's layout: ``w_kmajor``). Where the plan splits K, the Triton versions
    also move their partials; where it splits float32 operands into TF32 parts (path "presplit"),
    the pass and the parts' reads."""
    elt = dtype.itemsize
    if impl == "triton_fused_simple":
        return matmul_softmax_fused_bytes(B, K, C, elt)
    plan = matmul_softmax_plan("matmul_softmax_fused_tiled", B, K, C, dtype, w_kmajor, False,
                               *_device_facts(torch.device(device)), torch.get_float32_matmul_precision())
    parts = presplit_bytes(B, K, C) if impl.startswith("triton_") and plan.path == "presplit" else 0
    if impl == "triton_fused_tiled":
        return matmul_softmax_tiled_bytes(B, K, C, elt, plan.launch) + parts
    partials = split_k_bytes(B, K, plan.launch, C) if impl == "triton_unfused" else 0
    return matmul_softmax_unfused_bytes(B, K, C, elt) + partials + parts
