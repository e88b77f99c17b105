"""A kernel module as a user would bring it: one online softmax done right, two subtly wrong.

    pytest --candidate example=tests/candidate_example.py tests/test_candidates.py

``online_softmax(x)`` keeps a running maximum and a running sum over tiles of each row and
rescales the sum by exp(old max - new max) whenever the maximum grows. ``OnlineSoftmax`` runs the
same kernel without that rescale: on rows of one tile it is exact; on longer rows whose maximum
grows after the first tile its sum counts the early tiles at too large a weight, so its rows sum
to less than 1. ``row_softmax(x)`` (x: (rows, columns)) rescales, but subtracts a running maximum
that is still -inf after a tile of only -inf logits: -inf - -inf makes its row NaN. The first two
take x: (batch, d1, d2); all compute in float32 and return x's dtype, with the gradient
y * (dy - sum(dy * y)) in PyTorch. tests/test_candidates.py checks that the suite passes the first
and names what each of the others gets wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def example_online_softmax_kernel(x_ptr, y_ptr, d1, d2, stride_b, stride_r, stride_c, RESCALE: tl.constexpr,
                                  GUARD: tl.constexpr, BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr):
    batch, row_tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows = row_tile * BLOCK_1 + tl.arange(0, BLOCK_1)
    row_ok = rows < d1
    rows = rows.to(tl.int64)  # offsets past 2^31 elements (16384 rows of 131072)
    x_rows = x_ptr + batch * stride_b + rows[:, None] * stride_r
    m = tl.full((BLOCK_1,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_1,), tl.float32)
    for start in range(0, d2, BLOCK_2):
        cols = start + tl.arange(0, BLOCK_2)
        ok = row_ok[:, None] & (cols[None, :] < d2)
        x = tl.load(x_rows + cols[None, :] * stride_c, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # A row with no finite logit yet keeps max -inf: subtract 0 instead, so that -inf - -inf
        # never makes a NaN and the tile's terms stay exp(-inf) = 0.
        if GUARD:
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            shift = m_new
        if RESCALE:
            s = s * tl.exp(m - shift)
        s += tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
    y_rows = y_ptr + batch * d1 * d2 + rows[:, None] * d2
    for start in range(0, d2, BLOCK_2):
        cols = start + tl.arange(0, BLOCK_2)
        ok = row_ok[:, None] & (cols[None, :] < d2)
        x = tl.load(x_rows + cols[None, :] * stride_c, mask=ok, other=float("-inf")).to(tl.float32)
        # An all -inf row: exp(-inf - -inf) / 0 is NaN, as torch.softmax gives.
        y = tl.exp(x - m[:, None]) / s[:, None]
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def _softmax_forward(x: torch.Tensor, rescale: bool, BLOCK_1: int, BLOCK_2: int, guard: bool = True) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, d1, d2), got shape {tuple(x.shape)}")
    batch, d1, d2 = x.shape
    y = torch.empty((batch, d1, d2), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid = (batch, triton.cdiv(d1, BLOCK_1))
    example_online_softmax_kernel[grid](x, y, d1, d2, *x.stride(), RESCALE=rescale, GUARD=guard, BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2)
    return y


def _softmax_backward(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    y32, dy32 = y.float(), dy.float()
    return (y32 * (dy32 - (dy32 * y32).sum(-1, keepdim=True))).to(y.dtype)


class _RescaledSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, BLOCK_1, BLOCK_2, guard):
        y = _softmax_forward(x, True, BLOCK_1, BLOCK_2, guard)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _softmax_backward(y, dy), None, None, None


def online_softmax(x: torch.Tensor, BLOCK_1: int = 8, BLOCK_2: int = 1024) -> torch.Tensor:
    """Softmax over the last dimension of x: (batch, d1, d2), BLOCK_1 rows by BLOCK_2 columns a step.

    Wide column tiles keep the running sum short: with 32 columns a 65537-column row adds 2048
    partial sums one after another, and its float32 error (7.2e-7 on an H200) was 8.6x
    torch.softmax's, which the battery's shape cases fail; with 1024 it adds 65."""
    return _RescaledSoftmax.apply(x, BLOCK_1, BLOCK_2, True)


def row_softmax(x: torch.Tensor, BLOCK_SIZE: int | None = None) -> torch.Tensor:
    """Softmax of each row of x: (rows, columns), without the guard for a tile of only -inf.
    BLOCK_SIZE None: half the row rounded up to a power of two, 16 to 1024 columns."""
    if BLOCK_SIZE is None:
        BLOCK_SIZE = min(1024, max(16, triton.next_power_of_2(triton.cdiv(x.shape[-1], 2))))
    return _RescaledSoftmax.apply(x[None], 8, BLOCK_SIZE, False)[0]


class OnlineSoftmax(torch.autograd.Function):
    """``OnlineSoftmax.apply(x)``: the same tiles without rescaling the running sum (the bug)."""

    @staticmethod
    def forward(ctx, x, BLOCK_1=16, BLOCK_2=32):
        y = _softmax_forward(x, False, BLOCK_1, BLOCK_2)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _softmax_backward(y, dy), None, None
