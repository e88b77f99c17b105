"""softmax(x) @ V: the fused kernel against float64, its float32 matmul precision, edges and bad input.

``fused_softmax`` is judged against ``softmax_mult`` computed in float64 on the same (rounded)
inputs; it may err at most twice as much as ``softmax_mult`` in the inputs' own dtype
(FlashAttention's rule, ``support.assert_close``). Float32 products follow
``torch.get_float32_matmul_precision()``, so every test pins it (an autouse fixture, 'highest'
unless a test asks for more) and compares with PyTorch under the same setting.

In interpreter mode tiles are 16 to 64 wide and shapes tens of elements, so a small problem still
spans several d1 tiles, d2 steps and, with a launch override, d3 tiles, each with a ragged last
one. In the interpreter tl.dot on bfloat16 is wrong, so the kernel upcasts bfloat16 operands
there (``upcast_dot_operands``); the bfloat16 tensor-core path is tested on a GPU (``needs_gpu``).
"""

from __future__ import annotations

import csv
import re

import pytest
import torch

import fused_softmax_matmul as fsm
from fused_softmax_matmul import (
    FUSED_MAX_D3, FusedLaunch, GluonSoftmaxLaunch, dot_precision, fused_softmax, fused_softmax_path, fused_softmax_plan,
    softmax_mult, upcast_dot_operands,
)
from online_softmax import INTERPRET, KernelCapacityError
import support
from support import (
    DEVICE, DTYPES, INF, ON_GPU, SHIFT, assert_close, dyadic_logits, extreme_logits, masked_logits, needs_gpu, randn,
    record_files, softmax_matmul_inputs,
)


@pytest.fixture(autouse=True)
def float32_matmul_precision(request):
    """Pin torch's float32 matmul precision ('highest', or the test's indirect parameter); restore it after."""
    before = torch.get_float32_matmul_precision()
    precision = getattr(request, "param", "highest")
    torch.set_float32_matmul_precision(precision)
    yield precision
    torch.set_float32_matmul_precision(before)


def check_fused(out: torch.Tensor, x: torch.Tensor, V: torch.Tensor) -> None:
    """out is softmax(x) @ V: x's dtype, shape (batch, d1, d3), as accurate as PyTorch under the same setting."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], x.shape[1], V.shape[2]), (out.dtype, tuple(out.shape))
    assert_close(out, softmax_mult(x.double(), V.double()), softmax_mult(x, V))


# ----------------------------------------------------------------------------------------------
# Against float64: shapes, tiles, dtypes, logit scales
# ----------------------------------------------------------------------------------------------
# (batch, d1, d2, d3), (BLOCK_1, BLOCK_2), launch override (a FusedLaunch) or None for the wrapper's, logit scale: the code path each exercises.
CASES = {
    # One live element of x and of V in 16-wide tiles: softmax is exactly 1, the output V itself.
    "1x1x1x1": ((1, 1, 1, 1), (16, 16), None, 1.0),
    # d1 and d2 one past a block (a row tile of 1 live row, a last d2 step of 1), d3 = 24.
    "17x17x24 past block": ((2, 17, 17, 24), (16, 16), None, 1.0),
    # Odd everything; d3 = 5 padded to the 16 columns tl.dot needs.
    "9x37x5": ((1, 9, 37, 5), (16, 16), None, 1.0),
    "blocks 32": ((2, 33, 70, 20), (32, 32), None, 1.0),
    "blocks 64": ((1, 40, 80, 12), (64, 64), None, 1.0),
    # The largest tiles the wrapper takes: one tile, mostly masked, covers the whole problem.
    "blocks 128": ((1, 20, 80, 7), (128, 128), None, 1.0),
    "blocks 256": ((1, 20, 80, 7), (256, 256), None, 1.0),
    # Lopsided tiles: rows and the d2 step need not match.
    "blocks 16x64": ((1, 20, 80, 10), (16, 64), None, 1.0),
    "blocks 64x16": ((1, 20, 80, 10), (64, 16), None, 1.0),
    # 16-wide d3 tiles over d3 = 40: three programs share each row tile, the last has 8 live columns.
    "d3 tiles": ((1, 20, 40, 40), (16, 16), FusedLaunch(16, 4, 1), 1.0),
    # Lazy rescale forced on: logits of size 8 move a row's max by more than 8 between some d2 steps
    # (rescale) and by less at others (stale max, weights up to e^8).
    "lazy rescale": ((1, 20, 80, 24), (16, 16), FusedLaunch(16, 4, 1, lazy_rescale=True), 8.0),
    # The transposed kernel (V^T @ P^T), eager and lazy, over two d3 tiles with a ragged last.
    "transposed": ((1, 20, 40, 40), (16, 16), FusedLaunch(32, 4, 1, transposed=True), 8.0),
    "transposed lazy": ((1, 20, 40, 40), (16, 16), FusedLaunch(32, 4, 1, lazy_rescale=True, transposed=True), 8.0),
    # Logits of size 100 and 1e4: earlier steps' weights underflow to 0 when the max grows;
    # the answer is nearly a row of V and must still match float64.
    "scale 100": ((2, 9, 50, 12), (16, 16), None, 100.0),
    "scale 1e4": ((2, 9, 50, 12), (16, 16), None, 1e4),
}


# On a GPU, float32 256 x 256 tiles need 320 KiB of shared memory for even one d2 step of x and
# V tiles, past an H100's 227 KiB: the wrapper refuses them by name before launching.
TOO_BIG_FOR_SHARED_MEMORY = {("float32", (256, 256))} if ON_GPU else set()


@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,blocks,launch,scale", list(CASES.values()), ids=list(CASES))
def test_matches_float64(shape, blocks, launch, scale, dtype):
    x, V = softmax_matmul_inputs(*shape, DTYPES[dtype], seed=sum(shape), scale=scale)
    assert torch.isfinite(x).all(), "scale overflowed the dtype: choose another seed"
    if (dtype, blocks) in TOO_BIG_FOR_SHARED_MEMORY:
        with pytest.raises(KernelCapacityError, match="BLOCK_1 x BLOCK_2"):
            fused_softmax(x, V, *blocks, launch=launch)
        return
    check_fused(fused_softmax(x, V, *blocks, launch=launch), x, V)


# ----------------------------------------------------------------------------------------------
# Float32 matmul precision: the kernel follows torch's switch
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("float32_matmul_precision,expected", [("highest", "tf32x3"), ("high", "tf32"), ("medium", "tf32")],
                         indirect=["float32_matmul_precision"])
def test_dot_precision_follows_torch(float32_matmul_precision, expected):
    assert dot_precision(torch.float32) == expected
    # 16-bit operands multiply exactly whatever the setting; only bf16 in the interpreter is upcast.
    assert dot_precision(torch.float16) == dot_precision(torch.bfloat16) == "ieee"
    assert upcast_dot_operands(torch.bfloat16) == INTERPRET
    assert not upcast_dot_operands(torch.float16) and not upcast_dot_operands(torch.float32)


PRECISION_SHAPE = (4, 512, 1024, 96) if ON_GPU else (2, 33, 70, 20)
PRECISION_INPUTS = {
    "normal": lambda: softmax_matmul_inputs(*PRECISION_SHAPE, torch.float32, seed=20),
    # Logits of size 8: the max moves between d2 steps, so acc is rescaled (lazily under 'high').
    "peaked": lambda: softmax_matmul_inputs(*PRECISION_SHAPE, torch.float32, seed=21, scale=8.0),
    # Leading all -inf tiles, a row of only -inf (NaN) and a row of one finite logit.
    "masked": lambda: (masked_logits(PRECISION_SHAPE[:3], torch.float32, seed=22),
                       softmax_matmul_inputs(*PRECISION_SHAPE, torch.float32, seed=22)[1]),
}


@pytest.mark.parametrize("float32_matmul_precision", ["highest", "high"], indirect=True)
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("inputs", PRECISION_INPUTS)
def test_float32_matmul_precision(float32_matmul_precision, block, inputs):
    """Under 'highest' as accurate as a float32 matmul; under 'high' as PyTorch's own TF32 product.

    check_fused computes PyTorch's answer under the pinned setting, so the bound is 2 x torch's
    float32 error under 'highest' and 2 x its TF32 error under 'high' (on a GPU; a CPU and the
    interpreter multiply in float32 either way). Under 'high' the kernel rounds its operands to
    TF32 as cuBLAS does (``round_to_tf32``): the tensor cores' own truncation gave 2.7 x torch's
    error on an H100 and would fail this bound.
    """
    x, V = PRECISION_INPUTS[inputs]()
    check_fused(fused_softmax(x, V, block, block), x, V)


# ----------------------------------------------------------------------------------------------
# Masks, extreme logits, shift invariance, strides, empty shapes
# ----------------------------------------------------------------------------------------------
# BLOCK_3 = 16 over d3 = 24: two d3 tiles; lazy rescale off and on (the wrapper picks on only for
# float32 under 'high', so forcing it covers 16-bit too).
LAUNCHES = {"eager": FusedLaunch(16, 4, 1), "lazy": FusedLaunch(16, 4, 1, lazy_rescale=True),
            "transposed": FusedLaunch(16, 4, 1, lazy_rescale=True, transposed=True)}
EDGE_SHAPE = (2, 20, 40, 24)  # 2 row tiles, 3 d2 steps (the last of 8), 2 d3 tiles


def edge_V(dtype: torch.dtype, seed: int) -> torch.Tensor:
    batch, _, d2, d3 = EDGE_SHAPE
    return randn((batch, d2, d3), dtype, seed)


def fused_on(make_x, dtype: str, seed: int, launch) -> torch.Tensor:
    """fused_softmax on logits from make_x at EDGE_SHAPE, checked against float64; its output."""
    x = make_x(EDGE_SHAPE[:3], DTYPES[dtype], seed)
    V = edge_V(DTYPES[dtype], seed + 1)
    out = fused_softmax(x, V, 16, 16, launch=launch)
    check_fused(out, x, V)
    return out


@pytest.mark.memcheck
@pytest.mark.parametrize("launch", list(LAUNCHES.values()), ids=list(LAUNCHES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_logits(dtype, launch):
    """-inf logits weigh 0; a row of only -inf gives a NaN output row exactly where torch does."""
    out = fused_on(masked_logits, dtype, 23, launch)  # check_fused: NaN patterns must match
    assert torch.isnan(out[:, 1]).all()


@pytest.mark.parametrize("launch", list(LAUNCHES.values()), ids=list(LAUNCHES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits_stay_finite(dtype, launch):
    """Logits of +-3e38 (+-6e4 in float16): x - max overflows to -inf, which must weigh 0, not NaN."""
    assert torch.isfinite(fused_on(extreme_logits, dtype, 25, launch)).all()


@pytest.mark.parametrize("launch", list(LAUNCHES.values()), ids=list(LAUNCHES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_shift_invariance(dtype, launch):
    """softmax(x + c) @ V == softmax(x) @ V bit for bit, for a c the dtype adds exactly.

    The kernel subtracts the running max (and compares maxima 8 apart, lazily) in float32, where
    (x + c) - (max + c) is exact for logits on the 1/8 grid, so every later step sees the same bits.
    """
    dtype = DTYPES[dtype]
    x = dyadic_logits(EDGE_SHAPE[:3], dtype, seed=27)
    V = edge_V(dtype, seed=28)
    shifted = x + SHIFT[dtype]
    assert torch.equal(shifted.double() - SHIFT[dtype], x.double()), "the shift is not exact in this dtype"
    assert torch.equal(fused_softmax(shifted, V, launch=launch), fused_softmax(x, V, launch=launch))


# Views read in place: x every other column (column stride 2) or transposed (column stride d1),
# V transposed (row stride 1) or every other row, and every other batch element of both.
def strided_x(stride="contiguous", dtype=torch.float32):
    batch, d1, d2, _ = EDGE_SHAPE
    if stride == "columns":
        return randn((batch, d1, 2 * d2), dtype, seed=29)[..., ::2]
    if stride == "transposed":
        return randn((batch, d2, d1), dtype, seed=29).transpose(1, 2)
    if stride == "batch":
        return randn((2 * batch, d1, d2), dtype, seed=29)[::2]
    return randn((batch, d1, d2), dtype, seed=29)


def strided_V(stride="contiguous", dtype=torch.float32):
    batch, _, d2, d3 = EDGE_SHAPE
    if stride == "rows":
        return randn((batch, 2 * d2, d3), dtype, seed=30)[:, ::2]
    if stride == "transposed":
        return randn((batch, d3, d2), dtype, seed=30).transpose(1, 2)
    if stride == "batch":
        return randn((2 * batch, d3, d2), dtype, seed=30)[::2].transpose(1, 2)
    return randn((batch, d2, d3), dtype, seed=30)


STRIDED = {
    "x every other column": ("columns", "contiguous"),
    "x transposed": ("transposed", "contiguous"),
    "V transposed": ("contiguous", "transposed"),
    "V every other row": ("contiguous", "rows"),
    "both, every other batch": ("batch", "batch"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_stride,V_stride", list(STRIDED.values()), ids=list(STRIDED))
def test_strided_inputs(x_stride, V_stride, dtype):
    x, V = strided_x(x_stride, DTYPES[dtype]), strided_V(V_stride, DTYPES[dtype])
    assert not (x.is_contiguous() and V.is_contiguous())
    out = fused_softmax(x, V)
    check_fused(out, x, V)


@pytest.mark.parametrize("batch,d1,d2,d3", [(0, 3, 5, 4), (2, 0, 5, 4), (2, 3, 5, 0), (2, 3, 0, 4)],
                         ids=["batch=0", "d1=0", "d3=0", "d2=0"])
def test_empty(batch, d1, d2, d3):
    """Empty shapes launch nothing; d2 = 0 (an empty softmax times an empty V) is zeros, as torch gives."""
    x, V = softmax_matmul_inputs(batch, d1, d2, d3, torch.float16)
    out = fused_softmax(x, V)
    want = softmax_mult(x, V)
    assert out.shape == want.shape == (batch, d1, d3) and out.dtype == x.dtype
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------------------------
# On a GPU: the compiled kernel at a benchmark-like size, bf16 on tensor cores
# ----------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_sized_case(dtype, block):
    """The compiled tl.dot at each dtype; bfloat16 here is the only test of its tensor-core path."""
    x, V = softmax_matmul_inputs(4, 512, 1024, 96, DTYPES[dtype], seed=31, scale=4.0)
    check_fused(fused_softmax(x, V, block, block), x, V)


@needs_gpu
@pytest.mark.parametrize("which", ["x", "V"])
def test_cpu_tensor_refused_on_gpu(which):
    """Compiled kernels read device memory: a CPU tensor is refused by name before any launch."""
    x, V = softmax_matmul_inputs(2, 8, 16, 8, torch.float32)
    x, V = (x.cpu(), V) if which == "x" else (x, V.cpu())
    with pytest.raises(ValueError, match=rf"{which} is on cpu, but compiled Triton kernels need a CUDA tensor"):
        fused_softmax(x, V)


# ----------------------------------------------------------------------------------------------
# Bad input: one case per check, the error naming the argument
# ----------------------------------------------------------------------------------------------
def _good(batch=2, d2=16, dtype=torch.float32):
    return softmax_matmul_inputs(batch, 8, d2, 8, dtype)


BAD_INPUTS = [
    # (id, (x, V, BLOCK_1, BLOCK_2) builder, exception, message pattern)
    ("x-not-tensor", lambda: ([[[1.0]]], _good()[1], 16, 16), TypeError, r"x must be a torch\.Tensor, got list"),
    ("V-not-tensor", lambda: (_good()[0], None, 16, 16), TypeError, r"V must be a torch\.Tensor, got NoneType"),
    ("x-2d", lambda: (_good()[0][0], _good()[1], 16, 16), ValueError, r"x must have 3 dimensions, got shape \(8, 16\)"),
    ("V-4d", lambda: (_good()[0], _good()[1][None], 16, 16), ValueError, r"V must have 3 dimensions"),
    ("x-int", lambda: (_good()[0].int(), _good()[1], 16, 16), TypeError,
     r"x must be float32, float16 or bfloat16, got torch\.int32"),
    ("V-float64", lambda: (_good()[0], _good()[1].double(), 16, 16), TypeError, r"V must be float32.*got torch\.float64"),
    ("V-other-dtype", lambda: (_good()[0], _good()[1].half(), 16, 16), TypeError,
     r"V has dtype torch\.float16 but x has torch\.float32"),
    ("V-wrong-device", lambda: (_good()[0], _good()[1].to("meta"), 16, 16), ValueError, r"V is on meta"),
    ("V-other-batch", lambda: (_good()[0], _good(batch=3)[1], 16, 16), ValueError,
     r"V must have x's batch size 2, got V of shape \(3, 16, 8\)"),
    ("V-other-d2", lambda: (_good()[0], _good(d2=24)[1], 16, 16), ValueError,
     r"V must have d2 = 16 rows \(x's last dimension\), got V of shape \(2, 24, 8\)"),
    ("BLOCK_1-24", lambda: (*_good(), 24, 16), ValueError, r"BLOCK_1 must be a power of two between 16 and 256, got 24"),
    # tl.dot needs every tile dimension >= 16.
    ("BLOCK_2-8", lambda: (*_good(), 16, 8), ValueError, r"BLOCK_2 must be a power of two between 16 and 256, got 8"),
    ("BLOCK_1-512", lambda: (*_good(), 512, 16), ValueError, r"BLOCK_1 must be a power of two .* got 512"),
    ("BLOCK_2-float", lambda: (*_good(), 16, 16.0), TypeError, r"BLOCK_2 must be an int, got float"),
]


@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input(make_args, error, pattern):
    with pytest.raises(error, match=pattern):
        fused_softmax(*make_args())


# ----------------------------------------------------------------------------------------------
# Launch overrides: a FusedLaunch, every field checked by name
# ----------------------------------------------------------------------------------------------
BAD_LAUNCHES = {
    # Each of these reached the kernel before and failed inside it, or was silently accepted.
    "block_3 zero": (FusedLaunch(0, 4, 2), ValueError, r"launch\.block_3 must be a power of two between 16 and 512, got 0"),
    "block_3 48": (FusedLaunch(48, 4, 2), ValueError, r"launch\.block_3 must be a power of two .* got 48"),
    "num_warps zero": (FusedLaunch(16, 0, 2), ValueError, r"launch\.num_warps must be a power of two .* got 0"),
    "num_warps 3": (FusedLaunch(16, 3, 2), ValueError, r"launch\.num_warps"),
    "num_stages zero": (FusedLaunch(16, 4, 0), ValueError, r"launch\.num_stages must be an int from 1 to 8, got 0"),
    "num_stages float": (FusedLaunch(16, 4, 2.0), TypeError, r"launch\.num_stages must be an int, got float"),
    "lazy_rescale int": (FusedLaunch(16, 4, 2, 1), TypeError, r"launch\.lazy_rescale must be a bool, got int"),
    "transposed None": (FusedLaunch(16, 4, 2, False, None), TypeError, r"launch\.transposed must be a bool, got NoneType"),
    # The positional tuples of old: refused by type, not unpacked.
    "tuple": ((16, 4, 2, False, False), TypeError, r"launch must be a FusedLaunch or a GluonSoftmaxLaunch, got tuple"),
}


@pytest.mark.parametrize("case", BAD_LAUNCHES)
def test_bad_launch(case):
    launch, error, pattern = BAD_LAUNCHES[case]
    with pytest.raises(error, match=pattern):
        fused_softmax(*_good(), launch=launch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_1", [16, 32, 64, 128])
def test_default_launches_are_valid(dtype, block_1):
    """The plan's launch for each tile height passes the override's checks, its d3 tile within d3."""
    plan = fused_softmax_plan(2, 64, 64, 512, DTYPES[dtype], BLOCK_1=block_1, BLOCK_2=block_1)
    plan.launch.check()
    assert plan.path == "fused" and plan.BLOCK_1 == block_1 and plan.launch.block_3 <= 512


# ----------------------------------------------------------------------------------------------
# Fully masked tiles in every position, and rows of only -inf, forward and backward
# ----------------------------------------------------------------------------------------------
def masked_tiles(shape, dtype, seed=0) -> torch.Tensor:
    """Normal logits where, in 16-wide d2 steps, row 0's first step, row 3's middle step and
    row 4's last (ragged) step are all -inf; row 1 is all -inf (NaN, as torch gives); row 5
    keeps only its middle step."""
    x = randn(shape, dtype, seed)
    x[..., 0, :16] = -INF
    x[..., 3, 16:32] = -INF
    x[..., 4, 32:] = -INF
    x[..., 1, :] = -INF
    x[..., 5, :16] = -INF
    x[..., 5, 32:] = -INF
    return x


@pytest.mark.parametrize("launch", list(LAUNCHES.values()), ids=list(LAUNCHES))
def test_masked_tiles_in_any_position(launch):
    x = masked_tiles(EDGE_SHAPE[:3], torch.float32, seed=40).requires_grad_()
    V = edge_V(torch.float32, seed=41).requires_grad_()
    check_gradients(x, V, launch)


# ----------------------------------------------------------------------------------------------
# Autograd: dx and dV against float64, double backward refused
# ----------------------------------------------------------------------------------------------
def check_gradients(x: torch.Tensor, V: torch.Tensor, launch=None, blocks=(16, 16), seed=0) -> None:
    """Forward and (dx, dV) of fused_softmax against torch autograd in float64; PyTorch's own
    gradients in the inputs' dtype set the bound (``assert_close``)."""
    out = fused_softmax(x, V, *blocks, launch=launch)
    dout = randn(out.shape, out.dtype, seed)
    grads = torch.autograd.grad(out, (x, V), dout)
    x64, V64 = (t.detach().double().requires_grad_() for t in (x, V))
    out64 = softmax_mult(x64, V64)
    grads64 = torch.autograd.grad(out64, (x64, V64), dout.double())
    xt, Vt = (t.detach().requires_grad_() for t in (x, V))
    outt = softmax_mult(xt, Vt)
    grads_torch = torch.autograd.grad(outt, (xt, Vt), dout)
    assert_close(out.detach(), out64.detach(), outt.detach())
    for name, got, want, theirs in zip(("dx", "dV"), grads, grads64, grads_torch):
        assert got.dtype == theirs.dtype and got.shape == theirs.shape, name
        assert_close(got, want, theirs)


# (batch, d1, d2, d3), (BLOCK_1, BLOCK_2), launch: the backward's paths.
GRAD_CASES = {
    # Odd everything: ragged row tiles, d2 steps and d3 columns in both backward kernels.
    "odd": ((2, 17, 37, 20), (16, 16), None),
    # The forward over d3 tiles, transposed and lazy: the saved log-sum-exp from the first d3 tile.
    "transposed lazy": ((1, 20, 40, 40), (16, 16), FusedLaunch(16, 4, 1, lazy_rescale=True, transposed=True)),
    # 32-wide blocks, d3 = 70 over 64-wide backward d3 steps (two, the last of 6).
    "blocks 32": ((1, 33, 40, 70), (32, 32), None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,blocks,launch", list(GRAD_CASES.values()), ids=list(GRAD_CASES))
def test_gradients_match_float64(shape, blocks, launch, dtype):
    x, V = softmax_matmul_inputs(*shape, DTYPES[dtype], seed=sum(shape), scale=2.0)
    check_gradients(x.requires_grad_(), V.requires_grad_(), launch, blocks, seed=7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d2", [35, 36, 32])
@pytest.mark.parametrize("row_stride", [40, 38, 37], ids=["16-byte rows", "rows 2 elements apart", "odd stride"])
def test_gradients_of_rows_at_any_stride(row_stride, d2, dtype):
    """x and V as views of wider tensors whose row strides divide by 16 bytes, by 2 elements
    only, or by nothing, and d2 odd, a multiple of 4 or of 16: the kernels get strides and d2
    divided by as much (``vector_strides``, ``vector_align``) and must multiply them back,
    forward and backward."""
    wide_x, wide_V = softmax_matmul_inputs(2, 19, row_stride, row_stride, DTYPES[dtype], seed=row_stride, scale=2.0)
    x, V = wide_x[:, :, :d2].requires_grad_(), wide_V[:, :d2, :20].requires_grad_()
    check_gradients(x, V, None, (16, 16), seed=row_stride + 1)


def test_vector_strides_divide_by_the_largest_power_of_two_up_to_16_bytes():
    from online_softmax import vector_align, vector_strides

    assert vector_strides(torch.empty(2, 3, 1000)) == ((750, 250, 1), 4)
    assert vector_strides(torch.empty(2, 3, 1000, dtype=torch.bfloat16)) == ((375, 125, 1), 8)
    assert vector_strides(torch.empty(2, 3, 18)) == ((27, 9, 1), 2)
    assert vector_strides(torch.empty(2, 3, 17)) == ((51, 17, 1), 1)
    assert vector_strides(torch.empty(2, 3, 1000).transpose(1, 2)) == ((3000, 1, 1000), 1)  # a row stride of 1
    assert vector_strides(torch.empty(4, 8, 20), dims=(1,)) == ((160, 5, 1), 4)
    # Multiples of 16 elements, which Triton knows already, and 64-bit strides stay whole.
    assert vector_strides(torch.empty(2, 3, 1024)) == ((3072, 1024, 1), 1)
    assert vector_align((2**31 + 8, 8), 2) == 1 and vector_align((2**31 - 8, 8), 2) == 8


@pytest.mark.skipif(ON_GPU, reason="on an H100 torch's own products at these small sizes came out float32-accurate "
                    "under 'high' (error 1.2e-7), no yardstick for TF32 ones: test_gpu_gradients checks the GPU")
@pytest.mark.parametrize("float32_matmul_precision", ["high"], indirect=True)
@pytest.mark.parametrize("inputs", ["odd", "masked tiles"])
def test_gradients_under_tf32_setting(inputs, float32_matmul_precision):
    """Under 'high' the dx kernel sums delta = rowsum(P * dP) from its own dP (a first pass over
    d2) rather than rowsum(dO * O): that pass on ragged tiles, and on rows of -inf (NaN rows stay
    NaN, -inf tiles add nothing). The TF32 error it cancels shows only on a GPU (test_gpu_gradients)."""
    if inputs == "odd":
        shape, blocks, _ = GRAD_CASES["odd"]
        x, V = softmax_matmul_inputs(*shape, torch.float32, seed=5, scale=2.0)
    else:
        blocks = (16, 16)
        x, V = masked_tiles(EDGE_SHAPE[:3], torch.float32, seed=40), edge_V(torch.float32, seed=41)
    check_gradients(x.requires_grad_(), V.requires_grad_(), None, blocks, seed=9)


@needs_gpu
@pytest.mark.parametrize("block", [16, 64])
# The setting changes float32 products only: 'high' for float32 alone.
@pytest.mark.parametrize("dtype,float32_matmul_precision", [(dtype, "highest") for dtype in DTYPES] + [("float32", "high")],
                         indirect=["float32_matmul_precision"])
def test_gpu_gradients(dtype, block, float32_matmul_precision):
    """The compiled backward kernels on tensor cores (bf16 here only: the interpreter upcasts it);
    float32 under 'high' against torch's TF32 gradients (its operands rounded to TF32 as cuBLAS does)."""
    x, V = softmax_matmul_inputs(4, 512, 1024, 96, DTYPES[dtype], seed=32, scale=4.0)
    check_gradients(x.requires_grad_(), V.requires_grad_(), None, (block, block), seed=33)


def test_gradient_of_sum_reads_a_broadcast_gradient():
    """out.sum().backward() hands the backward a stride-0 gradient: read through its strides."""
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(2, 9, 20, 12, torch.float32, seed=3))
    fused_softmax(x, V).sum().backward()
    x64, V64 = (t.detach().double().requires_grad_() for t in (x, V))
    softmax_mult(x64, V64).sum().backward()
    xt, Vt = (t.detach().requires_grad_() for t in (x, V))
    softmax_mult(xt, Vt).sum().backward()
    assert_close(x.grad, x64.grad, xt.grad)
    assert_close(V.grad, V64.grad, Vt.grad)


def test_gradient_of_one_input():
    """Only V needs a gradient (x a constant): dV as torch's, and x gets none."""
    x, V = softmax_matmul_inputs(1, 9, 20, 12, torch.float32, seed=4)
    V.requires_grad_()
    fused_softmax(x, V).sum().backward()
    V64 = V.detach().double().requires_grad_()
    softmax_mult(x.double(), V64).sum().backward()
    assert x.grad is None
    assert_close(V.grad, V64.grad, None, factor=1.0)


@pytest.mark.parametrize("batch,d1,d2,d3", [(2, 0, 5, 4), (2, 3, 5, 0), (2, 3, 0, 4)], ids=["d1=0", "d3=0", "d2=0"])
def test_gradients_of_empty_shapes(batch, d1, d2, d3):
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(batch, d1, d2, d3, torch.float32))
    fused_softmax(x, V).sum().backward()
    xt, Vt = (t.detach().requires_grad_() for t in (x, V))
    softmax_mult(xt, Vt).sum().backward()
    assert torch.equal(x.grad, xt.grad) and torch.equal(V.grad, Vt.grad)


def test_double_backward_is_refused():
    """The backward is not itself differentiable: a second derivative raises, never a silent zero,
    in the library's words (where to get one), not torch's advice to register a formula."""
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(1, 9, 20, 12, torch.float32, seed=5))
    (dx,) = torch.autograd.grad(fused_softmax(x, V).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^fused_softmax: double backward .* torch\.func\.hessian") as raised:
        torch.autograd.grad(dx.sum(), V)
    assert "register_autograd" not in str(raised.value)


# ----------------------------------------------------------------------------------------------
# The materialised path: row_softmax, then torch.bmm, where V is wide (fused_softmax_path)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
def test_materialized_rule(setting):
    """Past FUSED_MAX_D3 columns of V, 16-bit and TF32 products materialise the softmax; tf32x3
    ('highest') and narrower V keep the fused kernel; TF32 at 64 < d3 <= 128 materialises where
    the fused kernel's programs are fewer than TF32_FUSED_MIN_PROGRAMS_PER_SM a SM (none known:
    fused). A forced choice or the fused kernel's own parameters win over the rule."""
    tf32 = setting != "highest"
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        def path(d3, batch=1, sms=None, **options):
            return fused_softmax_plan(batch, 40, 16, d3, dtype, sms=sms, setting=setting, **options).path
        assert path(FUSED_MAX_D3) == "fused"
        assert path(FUSED_MAX_D3 + 1) == ("materialized" if dtype != torch.float32 or tf32 else "fused")
        assert path(FUSED_MAX_D3 + 1, materialize=False) == path(FUSED_MAX_D3 + 1, BLOCK_1=16) == "fused"
        assert path(8, materialize=True) == "materialized"
        # The wrapper's 32-row programs of x (batch, 40, 16): 2 a batch element.
        for d3 in (64, 96, FUSED_MAX_D3):
            for batch in (132, 2 * 132):
                few = batch * 2 < fsm.TF32_FUSED_MIN_PROGRAMS_PER_SM * 132
                want = dtype == torch.float32 and tf32 and d3 > 64 and few
                assert path(d3, batch, 132) == ("materialized" if want else "fused"), (dtype, d3, batch)
            assert path(d3, 1, None) == "fused"
    x, V = softmax_matmul_inputs(1, 2, 3, FUSED_MAX_D3 + 8, torch.bfloat16)
    assert fused_softmax_path(x, V) == "materialized"
    assert fused_softmax_path(x, V, materialize=False) == fused_softmax_path(x, V, 16, 16) == "fused"


def _count_row_softmax(monkeypatch) -> list:
    calls, original = [], fsm.row_softmax

    def counted(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)
    monkeypatch.setattr(fsm, "row_softmax", counted)
    return calls


@pytest.mark.parametrize("materialize", [None, True, False], ids=["rule", "forced", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_materialized_path_against_float64(monkeypatch, dtype, materialize):
    """V of FUSED_MAX_D3 + 3 columns, odd d1 and d2: the rule's path (materialised in 16-bit, fused
    in float32 'highest'), the materialised one forced, or the fused kernel forced; each as
    accurate as PyTorch, forward and gradients, and the one asked for runs."""
    calls = _count_row_softmax(monkeypatch)
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(2, 9, 37, FUSED_MAX_D3 + 3, DTYPES[dtype], seed=41))
    path = fused_softmax_path(x, V, materialize=materialize)
    assert path == ("fused" if materialize is False or (materialize is None and dtype == "float32") else "materialized")
    out = fused_softmax(x, V, materialize=materialize)
    assert calls == ([tuple(x.shape)] if path == "materialized" else [])
    check_fused(out.detach(), x.detach(), V.detach())
    dout = randn(out.shape, out.dtype, 42)
    grads = torch.autograd.grad(out, (x, V), dout)
    x64, V64 = (t.detach().double().requires_grad_() for t in (x, V))
    grads64 = torch.autograd.grad(softmax_mult(x64, V64), (x64, V64), dout.double())
    xt, Vt = (t.detach().requires_grad_() for t in (x, V))
    grads_torch = torch.autograd.grad(softmax_mult(xt, Vt), (xt, Vt), dout)
    for got, want, theirs in zip(grads, grads64, grads_torch):
        assert got.dtype == theirs.dtype and got.shape == theirs.shape
        assert_close(got, want, theirs)


def test_materialize_refuses_what_it_cannot_honour():
    x, V = softmax_matmul_inputs(1, 4, 16, 8, torch.float32)
    with pytest.raises(TypeError, match="materialize must be None, True or False, got str"):
        fused_softmax(x, V, materialize="yes")
    with pytest.raises(ValueError, match="BLOCK_1, BLOCK_2 and launch are parameters of the fused kernel"):
        fused_softmax(x, V, 16, 16, materialize=True)
    with pytest.raises(ValueError, match="BLOCK_1, BLOCK_2 and launch are parameters of the fused kernel"):
        fused_softmax(x, V, launch=FusedLaunch(16), materialize=True)


@pytest.mark.parametrize("materialize", [True, False], ids=["materialized", "fused"])
def test_autocast_changes_neither_dtype_nor_values(materialize):
    """fused_softmax does not autocast (README: the x @ W ops and the loss do): under
    torch.autocast either path returns x's dtype and the values and gradients it gives outside."""
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(2, 9, 20, 24, torch.float32, seed=7))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fused_softmax(x, V, materialize=materialize)
    xe, Ve = (t.detach().requires_grad_() for t in (x, V))
    eager = fused_softmax(xe, Ve, materialize=materialize)
    assert out.dtype == x.dtype
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    dout = randn(out.shape, out.dtype, 8)
    for got, want in zip(torch.autograd.grad(out, (x, V), dout), torch.autograd.grad(eager, (xe, Ve), dout)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# ----------------------------------------------------------------------------------------------
fresh_compile = support.fresh_compile  # the fixture, under this module's name for pytest
COMPILE_BACKENDS = ["inductor"] if ON_GPU else ["aot_eager", "inductor"]


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.usefixtures("fresh_compile")
def test_compiles_without_graph_break(backend):
    """fullgraph=True: the op traces with no graph break, forward and backward, and a launch
    override passes through as plain ints."""
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(2, 17, 20, 24, torch.float32, seed=6))
    launch = FusedLaunch(16, 4, 1, lazy_rescale=True)
    compiled = torch.compile(lambda x, V: fused_softmax(x, V, launch=launch).sin(), fullgraph=True, backend=backend)
    out = compiled(x, V)
    out.sum().backward()
    xe, Ve = (t.detach().requires_grad_() for t in (x, V))
    eager = fused_softmax(xe, Ve, launch=launch).sin()
    eager.sum().backward()
    # The compiled graph runs the same kernels; only the surrounding sin may differ by a rounding.
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(V.grad, Ve.grad)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_ops_fakes_match_their_kernels(dtype):
    """torch.library.opcheck: the forward and backward ops' fakes give the kernels' shapes, dtypes and strides
    (the saved lse is float32 whatever x's dtype), which torch.compile traces with."""
    x, V = softmax_matmul_inputs(2, 17, 20, 24, DTYPES[dtype], seed=6)
    plan = fsm._plan_call(x, V, None, None, None, False)
    torch.library.opcheck(torch.ops.softmax_kernels.fused_softmax, (x, V, *plan.op_args),
                          test_utils=("test_faketensor",))
    out, lse = torch.ops.softmax_kernels.fused_softmax(x, V, *plan.op_args)
    torch.library.opcheck(torch.ops.softmax_kernels.fused_softmax_backward,
                          (x, V, out, lse, torch.randn_like(out), *plan.op_args[:2], True, True),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.usefixtures("fresh_compile")
def test_materialized_path_compiles_without_graph_break(backend):
    """fullgraph=True over the materialised path (row_softmax's op, then torch.bmm), forward and backward."""
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(2, 9, 20, FUSED_MAX_D3 + 8, torch.float16, seed=12))
    assert fused_softmax_path(x, V) == "materialized"
    compiled = torch.compile(lambda x, V: fused_softmax(x, V).sin(), fullgraph=True, backend=backend)
    out = compiled(x, V)
    out.sum().backward()
    xe, Ve = (t.detach().requires_grad_() for t in (x, V))
    eager = fused_softmax(xe, Ve).sin()
    eager.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(V.grad, Ve.grad)


@needs_gpu
def test_cuda_graph_replay_matches_eager():
    x, V = softmax_matmul_inputs(3, 100, 300, 70, torch.float16, seed=8)
    want = fused_softmax(x, V)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_softmax(x, V)
    x.copy_(softmax_matmul_inputs(3, 100, 300, 70, torch.float16, seed=9)[0])
    graph.replay()
    torch.testing.assert_close(out, fused_softmax(x, V), rtol=0, atol=0)
    assert not torch.equal(out, want), "the replay read the new x"


@needs_gpu
@pytest.mark.usefixtures("fresh_compile")
def test_reduce_overhead_compile_with_backward():
    """torch.compile's CUDA graphs around the op, forward and backward, equal eager."""
    x, V = (t.requires_grad_() for t in softmax_matmul_inputs(3, 100, 300, 70, torch.float32, seed=11))
    compiled = torch.compile(lambda x, V: fused_softmax(x, V, 32, 32), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x.grad = V.grad = None
        out = compiled(x, V)
        out.sum().backward()
    xe, Ve = (t.detach().requires_grad_() for t in (x, V))
    eager = fused_softmax(xe, Ve, 32, 32)
    eager.sum().backward()
    torch.testing.assert_close(out.detach().clone(), eager.detach())
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(V.grad, Ve.grad)


@needs_gpu
def test_batch_past_grid_axis_limit():
    """70000 batch elements: more than CUDA's 65535 on grid axes 1 and 2; the grid is one axis."""
    x, V = softmax_matmul_inputs(70000, 2, 16, 16, torch.float32, seed=10)
    check_fused(fused_softmax(x, V), x, V)


def test_sparse_input_refused():
    x, V = _good()
    with pytest.raises(TypeError, match=r"x must be a dense \(strided\) tensor, got layout torch\.sparse_coo"):
        fused_softmax(x.to_sparse(), V)
    with pytest.raises(TypeError, match=r"V must be a dense \(strided\) tensor, got layout torch\.sparse_coo"):
        fused_softmax(x, V.to_sparse())


def test_grid_past_axis_limit_refused():
    """Past 2^31 - 1 programs even CUDA's axis 0 cannot hold the grid: refused by name, not launched."""
    from online_softmax import one_axis_grid

    assert one_axis_grid(70000 * 3, "fused_softmax_kernel") == (210000,)
    assert one_axis_grid(2**31 - 1, "fused_softmax_kernel") == (2**31 - 1,)
    with pytest.raises(KernelCapacityError, match="fused_softmax_kernel would need 2147483648 programs"):
        one_axis_grid(2**31, "fused_softmax_kernel")


# Run in a fresh process with TRITON_INTERPRET=0: the launch functions that the compiled-mode ops
# (triton_op) run, traced with fake tensors, which needs no GPU: CUDA ones of static shapes, and
# CPU ones of symbolic shapes (what torch.compile's dynamic shapes pass; a CPU-only torch cannot
# make symbolic CUDA fakes, and tracing does not look at the device). Each must become
# triton_kernel_wrapper nodes, with no raw launch that tracing cannot see.
_TRACE_COMPILED_BODIES = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
import fused_softmax_matmul as f
f._sm_count = lambda device: 132  # an H100's SMs: the split-K choice without a device to ask
SHAPES = [(2, 17, 20), (2, 20, 24), (2, 17, 24), (2, 17), (1024, 1024), (1024, 100), (1024, 100)]
bodies = {
    "fused_softmax": (lambda x, V, *_: f._fused_softmax_forward(x, V, f._fused_constants(
        torch.float32, "tf32x3", 16, 16, 32, 4, 2, False, False), store_lse=True, wrap=True), 1),
    "fused_softmax_backward": (lambda x, V, out, lse, *_: f._fused_softmax_backward(x, V, out, lse, out, 16, 16,
                                                                                    True, True, wrap=True), 2),
    "matmul (split K)": (lambda *a: f._family_forward("matmul", a[4], a[5], None, wrap=True), 1),
    "simple": (lambda *a: f._family_forward("matmul_softmax_fused_simple", a[4], a[5], None, wrap=True), 1),
    "tiled (class tiles)": (lambda *a: f._family_forward("matmul_softmax_fused_tiled", a[4], a[5],
                                                         f.MatmulLaunch(16, 32, 16), wrap=True), 2),
    "matmul_softmax_backward": (lambda *a: f._matmul_backward(a[4], a[5], f._softmax_grad(a[6], a[6], wrap=True),
                                                              True, True, wrap=True), 3),
}
static = FakeTensorMode()
with static:
    fakes = [torch.empty(shape, device="cuda") for shape in SHAPES]
symbolic = FakeTensorMode(shape_env=ShapeEnv())
dynamic = [symbolic.from_tensor(torch.empty(shape), symbolic_context=StatelessSymbolicContext(
    dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))) for shape in SHAPES]
for mode, args in ((static, fakes), (symbolic, dynamic)):
    for name, (fn, launches) in bodies.items():
        with mode:
            nodes = [n for n in make_fx(fn)(*args).graph.nodes if "triton_kernel_wrapper" in str(n.target)]
        assert len(nodes) == launches, (name, len(nodes))
        if mode is symbolic and name == "fused_softmax":
            # x's strides reach the launch symbolic: the body must not pin d1 and d2 (int() would)
            launched = nodes[0].kwargs["kwargs"]
            assert all(isinstance(launched[k], torch.fx.Node) for k in ("stride_xb", "stride_x1")), launched
print("traced", 2 * len(bodies))
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the compiled tests run the ops themselves")
def test_compiled_op_bodies_trace_to_triton_kernels():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", _TRACE_COMPILED_BODIES], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert run.returncode == 0 and "traced 12" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("d2,d3,dtype,precision,aligned,block", [
    (8192, 512, torch.bfloat16, "highest", True, 64), (256, 64, torch.float16, "highest", True, 64),
    (128, 512, torch.bfloat16, "highest", True, 32), (64, 64, torch.float32, "highest", True, 32),
    (8192, 512, torch.float32, "highest", True, 64), (8192, 64, torch.float32, "highest", True, 32),
    (8192, 512, torch.float32, "high", True, 32), (8192, 64, torch.float32, "high", True, 64),
    (1001, 64, torch.float32, "high", False, 16), (1001, 512, torch.bfloat16, "highest", False, 32),
])
def test_default_blocks_follow_the_measured_rule(d2, d3, dtype, precision, aligned, block):
    """fused_softmax's blocks when none are given: 64 for 16-bit rows, for float32 by the product
    and d3 (tf32x3: 32 to d3 = 64, TF32: 64 to d3 = 64), 32 below d2 = 256, smaller for rows
    whose stride is no multiple of 16 bytes."""
    from fused_softmax_matmul import fused_blocks

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert fused_blocks(d2, d3, dtype, aligned) == block
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("d2,dtype,aligned", [(8192, torch.float32, True), (1000, torch.bfloat16, True),
                                              (1000, torch.float32, True), (1001, torch.float32, False)])
def test_default_block_reads_the_alignment_of_the_inputs(d2, dtype, aligned):
    """The wrapper's block for contiguous inputs: rows of 16-byte multiples are aligned, whatever
    Triton already knows of them (8192 columns: strides passed whole)."""
    from fused_softmax_matmul import fused_blocks

    x, V = torch.empty(2, 16, d2, dtype=dtype, device=DEVICE), torch.empty(2, d2, 64, dtype=dtype, device=DEVICE)
    assert fsm._plan_call(x, V, None, None, None, False).BLOCK_1 == fused_blocks(d2, 64, dtype, aligned)
    sliced = fsm._plan_call(x[:, :, : d2 - 1], V[:, : d2 - 1], None, None, None, False)
    assert sliced.BLOCK_1 == fused_blocks(d2 - 1, 64, dtype, aligned)


def test_explicit_zero_block_is_refused_not_replaced():
    x, V = randn((1, 16, 16), torch.float32, seed=3), randn((1, 16, 16), torch.float32, seed=4)
    with pytest.raises(ValueError, match="BLOCK_1 must be a power of two"):
        fused_softmax(x, V, 0, 16)


# ----------------------------------------------------------------------------------------------
# The plan (fused_softmax_plan): every branch on the CPU, the GPU's facts passed in
# ----------------------------------------------------------------------------------------------
H100 = dict(sms=132, capability=(9, 0))


@pytest.mark.parametrize("options,error,pattern", [
    (dict(materialize="yes"), TypeError, "materialize must be None, True or False, got str"),
    (dict(launch=(64, 4, 3)), TypeError, "launch must be a FusedLaunch or a GluonSoftmaxLaunch, got tuple"),
    (dict(BLOCK_1=16, materialize=True), ValueError, "BLOCK_1, BLOCK_2 and launch are parameters"),
    (dict(launch=GluonSoftmaxLaunch(16, 16), materialize=False), ValueError, "materialize=False asks for the Triton"),
    (dict(launch=GluonSoftmaxLaunch(16, 16), call="op", **H100), ValueError, "runs in eager calls only"),
    (dict(launch=GluonSoftmaxLaunch(16, 16)), ValueError, "the Gluon kernel cannot take these inputs"),
    (dict(launch=GluonSoftmaxLaunch(16, 16), sms=132, capability=(8, 0)), ValueError, "this GPU is sm_80"),
    (dict(launch=GluonSoftmaxLaunch(16, 16), tma="x's rows", **H100), ValueError, "cannot take these inputs: x's rows"),
    (dict(launch=GluonSoftmaxLaunch(48, 16), **H100), ValueError, "block_n must be a power of two"),
    (dict(launch=GluonSoftmaxLaunch(16, 256), **H100), KernelCapacityError, "at most 128 under tf32x3"),
    (dict(BLOCK_1=24), ValueError, "BLOCK_1 must be a power of two between 16 and 256, got 24"),
    (dict(BLOCK_2=16.0), TypeError, "BLOCK_2 must be an int, got float"),
    (dict(launch=FusedLaunch(48)), ValueError, r"launch\.block_3 must be a power of two"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_plan_refuses_bad_options_by_name(options, error, pattern):
    with pytest.raises(error, match=pattern):
        fused_softmax_plan(1, 16, 16, 16, torch.float32, **options)


@pytest.mark.parametrize("shape,reason", [((0, 16, 16, 16), "empty inputs"), ((70000, 1, 16, 16), "a batch of 70000")])
def test_plan_refuses_a_gluon_launch_the_kernel_cannot_take(shape, reason):
    with pytest.raises(ValueError, match=reason):
        fused_softmax_plan(*shape, torch.bfloat16, launch=GluonSoftmaxLaunch(16, 16), **H100)


def test_plan_paths_follow_the_call():
    """The rule's Gluon kernel serves plain eager calls only, on sm_90 with its SMs known and
    inputs TMA reads; the options that ask for a path win over the rule."""
    def path(**options):
        return fused_softmax_plan(16, 2048, 8192, 64, torch.bfloat16, **{**H100, **options}).path
    assert path() == "gluon"
    assert path(call="autograd") == path(call="op") == path(tma="V's last dimension") == "fused"
    assert path(capability=None) == path(capability=(10, 0)) == path(sms=None) == "fused"
    assert path(BLOCK_1=64) == path(launch=FusedLaunch(64)) == path(materialize=False) == "fused"
    assert path(materialize=True) == "materialized"
    assert path(launch=GluonSoftmaxLaunch(64, 64), call="autograd") == "gluon"


def test_plan_fields():
    """Tiles, launch and precision as the kernels take them; the custom op's ints from them."""
    assert fused_softmax_plan(2, 64, 1024, 512, torch.bfloat16) == fsm.FusedSoftmaxPlan("materialized")
    plan = fused_softmax_plan(2, 64, 1024, 64, torch.float32, setting="high", call="autograd")
    assert (plan.path, plan.call, plan.BLOCK_1, plan.BLOCK_2, plan.precision) == ("fused", "autograd", 64, 64, "tf32")
    assert plan.launch == FusedLaunch(64, 4, 2, lazy_rescale=True, transposed=True)  # block_3 cut to d3
    assert plan.op_args == (64, 64, 64, 4, 2, True, True)
    constants = fsm._fused_constants(torch.float32, plan.precision, *plan.op_args)
    assert constants["ROUND_TF32"] == constants["ROUND_V"] == (not INTERPRET) and constants["PRECISION"] == "tf32"
    tuned = fused_softmax_plan(2, 64, 1024, 64, torch.float16, BLOCK_1=16, BLOCK_2=32, launch=FusedLaunch(16, 4, 1))
    assert (tuned.BLOCK_1, tuned.BLOCK_2, tuned.launch, tuned.precision) == (16, 32, FusedLaunch(16, 4, 1), "ieee")
    gluon = fused_softmax_plan(16, 2048, 8192, 512, torch.float32, **H100)
    assert (gluon.path, gluon.launch, gluon.precision) == ("gluon", GluonSoftmaxLaunch(64, 128, 2), "tf32x3")
    assert gluon.BLOCK_1 == gluon.BLOCK_2 == 64  # the Triton backward's tiles


def test_plans_of_the_same_call_are_kept():
    """A call's plan is made once for its facts and options; options that compare equal but are
    not the same (16 and 16.0) are not taken for each other."""
    x, V = softmax_matmul_inputs(1, 8, 16, 8, torch.float32)
    assert fsm._plan_call(x, V, 16, None, None, None) is fsm._plan_call(x, V, 16, None, None, None)
    with pytest.raises(TypeError, match="BLOCK_1 must be an int, got float"):
        fsm._plan_call(x, V, 16.0, None, None, None)
    with pytest.raises(TypeError, match="BLOCK_1 must be an int, got list"):
        fsm._plan_call(x, V, [16], None, None, None)


# The committed records of softmax(x) @ V with the path each case ran: the shape grid's table.
RECORD = "shape_grid_benchmark.csv"
CASE = re.compile(r"batch=(\d+) d1=(\d+) d2=(\d+) d3=(\d+) (\w+)(?: (\w+))?")


def _recorded_paths() -> list:
    """(file, case, path) of every softmax_matmul row of the records' RECORD that has a path."""
    rows = []
    for found in record_files(RECORD):
        with open(found, newline="") as f:
            rows += [(str(found.relative_to(found.parents[1])), row["case"], row["path"]) for row in csv.DictReader(f)
                     if row.get("workload") == "softmax_matmul" and row.get("path")]
    return rows


def test_plan_gives_the_recorded_path():
    """Each recorded case (contiguous inputs, a plain eager call) planned as on the H100 that ran it."""
    rows = _recorded_paths()
    if not rows:
        pytest.skip(f"no softmax_matmul row with a path in any outputs/**/{RECORD}")
    wrong = []
    for name, case, recorded in rows:
        batch, d1, d2, d3, dtype, setting = CASE.fullmatch(case).groups()
        batch, d1, d2, d3, dtype = int(batch), int(d1), int(d2), int(d3), DTYPES[dtype]
        rows_aligned = d2 * dtype.itemsize % 16 == 0
        tma = None if rows_aligned and (dtype == torch.float32 or d3 * dtype.itemsize % 16 == 0) else "unaligned rows"
        plan = fused_softmax_plan(batch, d1, d2, d3, dtype, x_aligned=rows_aligned, tma=tma, setting=setting or "highest",
                                  **H100)
        if plan.path != recorded:
            wrong.append(f"{name}: {case}: recorded {recorded}, planned {plan.path}")
    assert not wrong, "\n".join(wrong)

