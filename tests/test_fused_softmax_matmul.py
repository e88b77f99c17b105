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

import pytest
import torch

from fused_softmax_matmul import FusedLaunch, dot_precision, fused_softmax, softmax_mult, upcast_dot_operands
from online_softmax import INTERPRET, KernelCapacityError
from support import (
    DTYPES, ON_GPU, SHIFT, assert_close, dyadic_logits, extreme_logits, masked_logits, needs_gpu, randn,
    softmax_matmul_inputs,
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
