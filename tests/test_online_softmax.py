"""Row softmax: the online kernel (forward and backward), the row kernels and the references.

Every answer is judged against ``torch.softmax`` in float64 on the same (rounded) inputs; low
precision is allowed PyTorch's own error at that precision (FlashAttention's rule,
``support.assert_close``). Beyond matching the reference the kernels must keep softmax's
invariants: rows sum to 1, values lie in [0, 1], adding a constant to a row changes nothing,
extreme logits stay finite, -inf logits get weight 0 and a row of only -inf gives NaN as torch.

In interpreter mode a program costs ~3 ms per loop step, so shapes are tens of elements and the
tiles small (8 to 64), so that a small row still spans several tiles and a ragged last one. The
long rows that take the split-row kernel exist only on a GPU (``needs_gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from online_softmax import (
    OnlineSoftmax, naive_softmax, online_softmax, online_softmax_backward, online_softmax_tiles, row_softmax,
    softmax_reference,
)
from support import (
    DEVICE, DTYPES, SHIFT, UNIT_ROUNDOFF, assert_close, dyadic_logits, extreme_logits, masked_logits,
    needs_gpu, randn,
)

INF = float("inf")


def row_sum_bound(dtype: torch.dtype, d2: int, block_2: int = 8) -> float:
    """How far a row of a softmax computed in float32 and stored in dtype may sum from 1.

    With p = exp(x - max) rounded and l their float32 sum, the row sums to (sum p) / l up to one
    rounding per element. l's relative error: log2(d2) for the tree sum of a tile, and per
    column step of the online kernels about 3 more (the rescale factor, the product, the add);
    4 for the division and the float64 sum's slack. Stored in 16 bits, each element moves by up
    to one unit in the last place (2u: the interpreter truncates to bfloat16 rather than
    rounding), which moves the p-weighted sum by at most 2u. block_2 = 8: the most steps any
    kernel here takes.
    """
    steps = math.ceil(d2 / block_2)
    fp32 = (3 * steps + math.ceil(math.log2(max(d2, 2))) + 4) * UNIT_ROUNDOFF[torch.float32]
    return fp32 + (0.0 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype])


def check_softmax(out: torch.Tensor, x: torch.Tensor) -> None:
    """out is softmax(x) over the last dimension: x's dtype and shape, as accurate as torch."""
    assert out.dtype == x.dtype and out.shape == x.shape, (out.dtype, tuple(out.shape))
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


# ----------------------------------------------------------------------------------------------
# online_softmax against float64: shapes, tiles, dtypes, logit scales
# ----------------------------------------------------------------------------------------------
# (batch, d1, d2), (BLOCK_1, BLOCK_2), logit scale: the code path each exercises.
ONLINE_CASES = {
    # One live element in a 16 x 16 tile: 15 masked rows and columns; the answer is exactly 1.
    "1x1x1": ((1, 1, 1), (16, 16), 1.0),
    # d1 = 17 and d2 = 33 one past a multiple of 16: a row tile of 1 live row, a column step of 1.
    "17x33 past block": ((2, 17, 33), (16, 16), 1.0),
    # The smallest tiles the issue asks for: 5 column steps over an odd row, 1 partial row tile.
    "5x37 blocks 8": ((1, 5, 37), (8, 8), 1.0),
    # d2 = 80 in 8-column steps (10 steps, each moving the max at scale 4) in 32-row tiles.
    "40x80 blocks 32x8": ((2, 40, 80), (32, 8), 4.0),
    # Wide 64-column tiles, 8 rows: 2 column steps, the second holding 6 of 64.
    "3x70 blocks 8x64": ((1, 3, 70), (8, 64), 1.0),
    # A 64 x 64 tile larger than the whole problem.
    "9x23 blocks 64": ((1, 9, 23), (64, 64), 1.0),
    # What row_softmax's long-row fallback uses (online_softmax_tiles): 1 x 4096, 2 steps.
    "row tiles 1x4096": ((1, 2, 5000), (1, 4096), 1.0),
    # Logits of size 100 and 1e4: exp(m_old - m_new) underflows to 0 between steps; the answer
    # is close to one-hot and must still match float64.
    "scale 100": ((2, 9, 50), (8, 16), 100.0),
    "scale 1e4": ((2, 9, 50), (8, 16), 1e4),
}


@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,blocks,scale", list(ONLINE_CASES.values()), ids=list(ONLINE_CASES))
def test_online_softmax_matches_float64(shape, blocks, scale, dtype):
    x = randn(shape, DTYPES[dtype], seed=sum(shape), scale=scale)
    assert torch.isfinite(x).all(), "scale overflowed the dtype: choose another seed"
    check_softmax(online_softmax(x, *blocks), x)


@pytest.mark.parametrize("block_1,block_2", [(8, 8), (16, 16), (32, 32), (64, 64), (8, 128), (128, 8)])
def test_online_softmax_block_sizes(block_1, block_2):
    """Every power-of-two tile from 8 up, square and lopsided, on a shape no tile divides."""
    x = randn((2, 19, 45), torch.float32, seed=block_1 + block_2)
    check_softmax(online_softmax(x, block_1, block_2), x)


# x as a view, read in place: column stride 2, transposed (column stride d1, row stride 1), every
# other batch element and rows from the second. (Not bit for bit the answer on a contiguous copy:
# compiled, Triton lays a tile out by its strides, and with the layout the order of tl.sum's
# additions can change.)
STRIDED = {
    "every other column": lambda x: x[..., ::2],
    "transposed": lambda x: x.transpose(1, 2),
    "batch and row offsets": lambda x: x[::2, 1:],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", list(STRIDED.values()), ids=list(STRIDED))
def test_online_softmax_strided_input(view, dtype):
    x = view(randn((3, 34, 34), DTYPES[dtype], seed=5))
    assert not x.is_contiguous()
    out = online_softmax(x, 16, 16)
    assert out.is_contiguous()
    check_softmax(out, x)


@pytest.mark.parametrize("impl", ["online_softmax", "OnlineSoftmax.apply", "naive_softmax"])
@pytest.mark.parametrize("shape", [(0, 3, 5), (2, 0, 5), (2, 3, 0)], ids=["batch=0", "d1=0", "d2=0"])
def test_online_softmax_empty(impl, shape):
    """An empty input gives an empty output of its shape and dtype, as torch, and a zero-size gradient."""
    x = torch.zeros(shape, device=DEVICE, requires_grad=True)
    calls = {"online_softmax": lambda: online_softmax(x, 16, 16),
             "OnlineSoftmax.apply": lambda: OnlineSoftmax.apply(x, 16, 16), "naive_softmax": lambda: naive_softmax(x)}
    out = calls[impl]()
    assert out.shape == torch.softmax(x, dim=-1).shape and out.dtype == x.dtype
    if impl == "OnlineSoftmax.apply":
        out.backward(torch.ones_like(out))
        assert x.grad.shape == x.shape


def test_naive_softmax_of_a_scalar_is_one():
    """A 0-d tensor is one row of one column to torch.softmax: 1."""
    assert torch.equal(naive_softmax(torch.tensor(1.5, device=DEVICE)), torch.softmax(torch.tensor(1.5, device=DEVICE), -1))


# ----------------------------------------------------------------------------------------------
# Invariants of every row softmax
# ----------------------------------------------------------------------------------------------
# name -> softmax over the last dimension of a 3-D x, and the path it takes at the tests' sizes.
ROW_KERNELS = {
    "online 8x8": lambda x: online_softmax(x, 8, 8),  # several row tiles and column steps
    "online 64x64": lambda x: online_softmax(x, 64, 64),  # one tile covers everything
    "row_softmax": row_softmax,  # one program holds a whole row (softmax_row_kernel)
    "row_softmax BLOCK_SIZE=8": lambda x: row_softmax(x, BLOCK_SIZE=8),  # forced online 1 x 8 tiles
    "naive": naive_softmax,  # the five-step PyTorch baseline
}
INVARIANT_SHAPE = (2, 6, 40)  # 6 rows: the planted rows of masked_ and extreme_logits, and more


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ROW_KERNELS)
def test_rows_sum_to_one_in_unit_interval(impl, dtype):
    x = randn(INVARIANT_SHAPE, DTYPES[dtype], seed=11, scale=3.0)
    out = ROW_KERNELS[impl](x)
    check_softmax(out, x)
    err = (out.double().sum(dim=-1) - 1).abs().max().item()
    assert err <= row_sum_bound(out.dtype, x.shape[-1]), err
    assert ((out >= 0) & (out <= 1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ROW_KERNELS)
def test_shift_invariance(impl, dtype):
    """softmax(x + c) == softmax(x) bit for bit, for a c the dtype adds exactly.

    Every kernel subtracts the row max before anything else, and (x + c) - (max + c) is exact in
    float32 (and in 16 bits, for naive): both operands lie on the 1/8 grid and their difference
    is small. From there both inputs see the same bits, so the outputs must be equal, not close.
    """
    dtype = DTYPES[dtype]
    x = dyadic_logits(INVARIANT_SHAPE, dtype, seed=3)
    shifted = x + SHIFT[dtype]
    assert torch.equal(shifted.double() - SHIFT[dtype], x.double()), "the shift is not exact in this dtype"
    assert torch.equal(ROW_KERNELS[impl](shifted), ROW_KERNELS[impl](x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ROW_KERNELS)
def test_extreme_logits_stay_finite(impl, dtype):
    x = extreme_logits(INVARIANT_SHAPE, DTYPES[dtype], seed=4)
    out = ROW_KERNELS[impl](x)
    assert torch.isfinite(out).all()
    check_softmax(out, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ROW_KERNELS)
def test_masked_logits(impl, dtype):
    """-inf logits weigh 0; a row of only -inf is NaN exactly where torch's is (assert_close)."""
    x = masked_logits(INVARIANT_SHAPE, DTYPES[dtype], seed=6)
    out = ROW_KERNELS[impl](x)
    check_softmax(out, x)
    finite_rows = ~torch.isneginf(x).all(dim=-1, keepdim=True)
    assert (out[torch.isneginf(x) & finite_rows] == 0).all()
    assert (out[:, 2, -1] == 1).all() and torch.isnan(out[:, 1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_reference_is_torch(dtype):
    x = randn((3, 7, 29), DTYPES[dtype], seed=2)
    assert torch.equal(softmax_reference(x), torch.softmax(x, dim=-1))


# ----------------------------------------------------------------------------------------------
# OnlineSoftmax: backward against float64 autograd
# ----------------------------------------------------------------------------------------------
def online_grad(x: torch.Tensor, dy: torch.Tensor, blocks) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_()
    OnlineSoftmax.apply(leaf, *blocks).backward(dy)
    assert leaf.grad.shape == x.shape and leaf.grad.dtype == x.dtype
    return leaf.grad


def torch_grad(x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d softmax(x) / dx times dy, by torch autograd in ``dtype``."""
    leaf = x.detach().to(dtype).requires_grad_()
    return torch.autograd.grad(torch.softmax(leaf, dim=-1), leaf, dy.to(dtype))[0]


# dy as the caller's autograd hands it: contiguous, a transposed view, or a row broadcast over
# batch and rows (strides 0, 0, 1), read in place by the backward kernel.
DY_LAYOUTS = {
    "contiguous": lambda shape, dtype: randn(shape, dtype, seed=8),
    "transposed": lambda shape, dtype: randn((shape[0], shape[2], shape[1]), dtype, seed=8).transpose(1, 2),
    "broadcast row": lambda shape, dtype: randn(shape[-1:], dtype, seed=8).expand(shape),
}
# (batch, d1, d2), (BLOCK_1, BLOCK_2): ragged tiles in both directions, and the smallest tiles.
BACKWARD_CASES = {"17x33 blocks 16": ((2, 17, 33), (16, 16)), "5x37 blocks 8x16": ((1, 5, 37), (8, 16))}


@pytest.mark.parametrize("dy_layout", DY_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,blocks", list(BACKWARD_CASES.values()), ids=list(BACKWARD_CASES))
def test_online_softmax_backward_matches_float64(shape, blocks, dtype, dy_layout):
    x = randn(shape, DTYPES[dtype], seed=9, scale=2.0)
    dy = DY_LAYOUTS[dy_layout](shape, DTYPES[dtype])
    assert_close(online_grad(x, dy, blocks), torch_grad(x, dy, torch.float64), torch_grad(x, dy, x.dtype))


def test_online_softmax_backward_through_transposed_input():
    """x is a transposed view of the leaf: the forward reads it in place, the gradient lands transposed."""
    leaf = randn((2, 21, 13), torch.float32, seed=12).requires_grad_()
    dy = randn((2, 13, 21), torch.float32, seed=13)
    OnlineSoftmax.apply(leaf.transpose(1, 2), 16, 16).backward(dy)
    x = leaf.detach().transpose(1, 2)
    assert_close(leaf.grad.transpose(1, 2), torch_grad(x, dy, torch.float64), torch_grad(x, dy, torch.float32))


def test_online_softmax_backward_returns_none_for_blocks():
    """backward gives (dx, None, None): a gradient for x alone, none for the two tile sizes."""
    x = randn((1, 5, 20), torch.float32, seed=14).requires_grad_()
    y = OnlineSoftmax.apply(x, 8, 16)
    dy = randn(y.shape, torch.float32, seed=15)
    grads = y.grad_fn.apply(dy)  # the ctx of a custom Function runs its backward directly
    assert len(grads) == 3 and grads[1] is None and grads[2] is None
    assert grads[0].shape == x.shape
    assert torch.equal(grads[0], online_softmax_backward(y.detach(), dy, 8, 16))


# ----------------------------------------------------------------------------------------------
# row_softmax: any rank, forced or chosen block, strided input
# ----------------------------------------------------------------------------------------------
# shape, BLOCK_SIZE: the path each takes (full = next power of two of the row length).
ROW_CASES = {
    "1-D 37": ((37,), None),  # one row, one program, 27 masked columns
    "2-D 5x100": ((5, 100), None),  # one block of 8 rows (ROW_BLOCK_VALUES // 128 is 16), 3 past the end
    "2-D 70x100": ((70, 100), None),  # 5 blocks of 16 rows, the last of 6; the interpreter's 4 programs loop
    "3-D 2x3x33": ((2, 3, 33), None),
    "4-D 2x2x3x17": ((2, 2, 3, 17), None),
    "1x1": ((1, 1), None),
    "BLOCK_SIZE 8 < row": ((3, 4, 45), 8),  # forced online tiles of 1 x 8, 6 steps
    "BLOCK_SIZE 32 < row": ((6, 100), 32),  # forced online tiles, last step of 4
    "BLOCK_SIZE = full": ((6, 100), 128),  # one-pass kernel at the given block
    "BLOCK_SIZE > full": ((6, 100), 1024),  # one-pass kernel with a wider block than needed
    # 32769 columns: a 65536-wide fp32 block would not fit on chip (ROW_BYTES_ON_CHIP), so the
    # wrapper picks the split-row kernel on a GPU and the online kernel in the interpreter.
    "long row 2x32769": ((2, 32769), None),
}


@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", list(ROW_CASES.values()), ids=list(ROW_CASES))
def test_row_softmax_matches_float64(shape, block, dtype):
    x = randn(shape, DTYPES[dtype], seed=len(shape), scale=3.0)
    check_softmax(row_softmax(x, block), x)


# Non-contiguous x: rows with a gap (row stride 2N, unit column stride: read in place), every other
# column and a transposed matrix (copied to unit column stride by the wrapper).
# Each is 12 rows of 40.
ROW_STRIDED = {
    "row gap": lambda: randn((12, 80), torch.float32, seed=16)[:, :40],
    # A row stride that is no multiple of the row's width's vector: the vector must follow the stride too.
    "odd row gap": lambda: randn((12, 42), torch.float32, seed=16)[:, :40],
    "every other column": lambda: randn((12, 80), torch.float32, seed=16)[:, ::2],
    "transposed": lambda: randn((40, 12), torch.float32, seed=16).t(),
}


@pytest.mark.parametrize("block", [None, 16], ids=["one-pass", "BLOCK_SIZE 16"])
@pytest.mark.parametrize("make_x", list(ROW_STRIDED.values()), ids=list(ROW_STRIDED))
def test_row_softmax_strided_input(make_x, block):
    x = make_x()
    assert not x.is_contiguous()
    out = row_softmax(x, block)
    check_softmax(out, x)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (2, 0, 3), (2, 3, 0)])
def test_row_softmax_empty(shape):
    x = torch.zeros(shape, device=DEVICE, dtype=torch.float16)
    out = row_softmax(x)
    assert out.shape == torch.softmax(x, dim=-1).shape and out.dtype == x.dtype


# ----------------------------------------------------------------------------------------------
# On a GPU: compiled kernels at real sizes, the split-row kernel, bf16 at scale
# ----------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize("M,N,dtype", [
    (1024, 65536, "float32"),  # 256 KiB rows: split-row kernel, 16 programs of 4096 columns per row
    (3, 200_000, "float32"),  # 32 programs per row: chunk 24 ragged, chunks 25 to 31 all masked
    (8192, 8192, "bfloat16"),  # the benchmark's square bf16 case, one-pass kernel
    (4096, 1000, "float16"),  # odd rows, two rows a program (ROW_BLOCK_VALUES)
])
def test_row_softmax_on_gpu(M, N, dtype):
    x = randn((M, N), DTYPES[dtype], seed=M, scale=3.0)
    check_softmax(row_softmax(x), x)


@pytest.mark.memcheck
@needs_gpu
def test_split_row_masked_chunks_on_gpu():
    """Whole 8192-column chunks of -inf contribute nothing to the split-row (max, sum) swap."""
    x = randn((3, 200_000), torch.float32, seed=17)
    x[0, :100_000] = -INF  # the first 12 chunks of row 0 are all -inf
    x[1] = -INF  # NaN, as torch
    out = row_softmax(x)
    check_softmax(out, x)
    assert (out[0, :100_000] == 0).all()


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [(16, 16), online_softmax_tiles(1024)], ids=["16x16", "wrapper tiles"])
def test_online_softmax_on_gpu(dtype, blocks):
    shape = (4, 512, 1024)
    x = randn(shape, DTYPES[dtype], seed=18, scale=3.0)
    check_softmax(online_softmax(x, *blocks), x)
    dy = randn(shape, DTYPES[dtype], seed=19)
    assert_close(online_grad(x, dy, blocks), torch_grad(x, dy, torch.float64), torch_grad(x, dy, x.dtype))


# ----------------------------------------------------------------------------------------------
# Bad input: one case per check, the error naming the argument
# ----------------------------------------------------------------------------------------------
def _x(shape=(2, 3, 5), dtype=torch.float32):
    return randn(shape, dtype, seed=0)


WRONG_DEVICE = "meta"  # a device no kernel reads, in interpreter mode or compiled

ONLINE_BAD_INPUTS = [
    # (id, (x, BLOCK_1, BLOCK_2) builder, exception, message pattern)
    ("x-not-tensor", lambda: ([[[1.0]]], 16, 16), TypeError, r"x must be a torch\.Tensor, got list"),
    ("x-0d", lambda: (_x(()), 16, 16), ValueError, r"x must have at least 1 dimensions, got shape \(\)"),
    ("x-sparse", lambda: (_x().to_sparse(), 16, 16), TypeError, r"x must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    ("x-int", lambda: (_x().long(), 16, 16), TypeError, r"x must be float32, float16 or bfloat16, got torch\.int64"),
    ("x-float64", lambda: (_x().double(), 16, 16), TypeError, r"x must be float32.*got torch\.float64"),
    ("x-wrong-device", lambda: (_x().to(WRONG_DEVICE), 16, 16), ValueError, r"x is on meta"),
    ("BLOCK_1-24", lambda: (_x(), 24, 16), ValueError, r"BLOCK_1 must be a power of two between 1 and 1024, got 24"),
    ("BLOCK_1-0", lambda: (_x(), 0, 16), ValueError, r"BLOCK_1 must be a power of two .* got 0"),
    ("BLOCK_1-2048", lambda: (_x(), 2048, 16), ValueError, r"BLOCK_1 must be a power of two .* got 2048"),
    ("BLOCK_2-8192", lambda: (_x(), 16, 8192), ValueError, r"BLOCK_2 must be a power of two between 1 and 4096, got 8192"),
    ("BLOCK_2-float", lambda: (_x(), 16, 16.0), TypeError, r"BLOCK_2 must be an int, got float"),
    ("BLOCK_1-bool", lambda: (_x(), True, 16), TypeError, r"BLOCK_1 must be an int, got bool"),
    # Each size is allowed alone, but the tile is 4 Mi elements, past Triton's largest block.
    ("tile-1024x4096", lambda: (_x(), 1024, 4096), ValueError,
     r"BLOCK_1 \* BLOCK_2 must be at most 1048576 elements \(Triton's largest block\), got 1024 \* 4096 = 4194304"),
]


@pytest.mark.parametrize("impl", ["online_softmax", "OnlineSoftmax.apply"])
@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*c[1:], id=c[0]) for c in ONLINE_BAD_INPUTS])
def test_online_softmax_bad_input(impl, make_args, error, pattern):
    fn = online_softmax if impl == "online_softmax" else OnlineSoftmax.apply
    with pytest.raises(error, match=pattern):
        fn(*make_args())


BACKWARD_BAD_INPUTS = [
    # (id, (y, dy, BLOCK_1, BLOCK_2) builder, exception, message pattern)
    ("y-not-tensor", lambda: (1.0, _x(), 16, 16), TypeError, r"y must be a torch\.Tensor, got float"),
    ("dy-2d", lambda: (_x(), _x((3, 5)), 16, 16), ValueError, r"dy must have the shape of y \(2, 3, 5\), got \(3, 5\)"),
    ("dy-sparse", lambda: (_x(), _x().to_sparse(), 16, 16), TypeError, r"dy must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    ("tile-1024x4096", lambda: (_x(), _x(), 1024, 4096), ValueError, r"BLOCK_1 \* BLOCK_2 must be at most 1048576"),
    ("dy-other-dtype", lambda: (_x(), _x().half(), 16, 16), TypeError,
     r"dy has dtype torch\.float16 but y has torch\.float32"),
    ("dy-other-shape", lambda: (_x(), _x((2, 3, 6)), 16, 16), ValueError, r"dy must have the shape of y \(2, 3, 5\)"),
    ("BLOCK_2-24", lambda: (_x(), _x(), 16, 24), ValueError, r"BLOCK_2 must be a power of two .* got 24"),
]


@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*c[1:], id=c[0]) for c in BACKWARD_BAD_INPUTS])
def test_online_softmax_backward_bad_input(make_args, error, pattern):
    with pytest.raises(error, match=pattern):
        online_softmax_backward(*make_args())


ROW_BAD_INPUTS = [
    # (id, (x, BLOCK_SIZE) builder, exception, message pattern)
    ("x-not-tensor", lambda: ((1.0, 2.0), None), TypeError, r"x must be a torch\.Tensor, got tuple"),
    ("x-0d", lambda: (_x(()), None), ValueError, r"x must have at least 1 dimensions, got shape \(\)"),
    ("x-sparse", lambda: (_x((4, 5)).to_sparse(), None), TypeError, r"x must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    ("x-int", lambda: (_x().int(), None), TypeError, r"x must be float32, float16 or bfloat16, got torch\.int32"),
    ("x-wrong-device", lambda: (_x().to(WRONG_DEVICE), None), ValueError, r"x is on meta"),
    ("BLOCK_SIZE-24", lambda: (_x(), 24), ValueError, r"BLOCK_SIZE must be a power of two between 8 and 131072, got 24"),
    ("BLOCK_SIZE-4", lambda: (_x(), 4), ValueError, r"BLOCK_SIZE must be a power of two .* got 4"),
    ("BLOCK_SIZE-2^18", lambda: (_x(), 1 << 18), ValueError, r"BLOCK_SIZE must be a power of two .* got 262144"),
    ("BLOCK_SIZE-float", lambda: (_x(), 16.0), TypeError, r"BLOCK_SIZE must be an int, got float"),
]


@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*c[1:], id=c[0]) for c in ROW_BAD_INPUTS])
def test_row_softmax_bad_input(make_args, error, pattern):
    with pytest.raises(error, match=pattern):
        row_softmax(*make_args())


@needs_gpu
@pytest.mark.parametrize("impl", ["online_softmax", "row_softmax"])
def test_cpu_tensor_refused_on_gpu(impl):
    """Compiled kernels read device memory: a CPU tensor is refused by name before any launch."""
    fn = online_softmax if impl == "online_softmax" else row_softmax
    with pytest.raises(ValueError, match=r"x is on cpu, but compiled Triton kernels need a CUDA tensor"):
        fn(_x().cpu())



def test_host_integer_helpers_match_triton():
    """The wrappers' integer cdiv and next_power_of_2 give triton's answers (they replace its
    constexpr functions on the host's hot path)."""
    from online_softmax import cdiv, next_power_of_2

    for n in range(0, 2100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 1000):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
