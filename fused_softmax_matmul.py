"""Fused softmax-matmul kernels in Triton, each beside the PyTorch code it replaces.

``softmax(x) @ V`` is the inner loop of attention. PyTorch computes it in two kernels and writes
the (d1, d2) softmax to memory in between; the fused kernel keeps each block of the softmax in
registers and folds it straight into the product, so the softmax never exists in memory.

Float32 matrix products follow PyTorch's own switch, ``torch.get_float32_matmul_precision()``:
under 'highest' (PyTorch's default) the tensor-core product is split into three TF32 products
(``input_precision="tf32x3"``), which is as accurate as a float32 product; under 'high' or
'medium' a single TF32 product is used, as PyTorch then does for its own matmuls. Float16 and
bfloat16 inputs multiply in their own precision and accumulate in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from online_softmax import INTERPRET, check_block, check_same, check_tensor


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision that matches PyTorch's float32 matmul setting."""
    if dtype != torch.float32:
        return "ieee"  # not used for 16-bit operands; tl.dot multiplies them exactly
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """In the interpreter, tl.dot on bfloat16 returns wrong values (triton issue 11584).

    There the kernels round their operands to bfloat16 as on a GPU and multiply them in float32:
    the products of two bfloat16 values are exact in float32, so this is the GPU's arithmetic.
    """
    return INTERPRET and dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# softmax(x) @ V
# ----------------------------------------------------------------------------------------------
def softmax_mult(x: torch.Tensor, V: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reference: the softmax of x, written to memory, then multiplied by V.

    x: (batch, d1, d2), V: (batch, d2, d3) -> (batch, d1, d3).
    Bytes: the softmax reads x and writes P (2 * d1 * d2 per batch element); the product reads P
    and V and writes the output.
    """
    return F.softmax(x, dim=dim) @ V


def softmax_mult_bytes(batch: int, d1: int, d2: int, d3: int, element_size: int) -> int:
    """What ``softmax_mult`` moves at least: x in, P out, P and V in, output out."""
    return (3 * d1 * d2 + d2 * d3 + d1 * d3) * batch * element_size


def fused_softmax_bytes(batch: int, d1: int, d2: int, d3: int, element_size: int) -> int:
    """What a fused kernel must move: x and V in, the output out."""
    return (d1 * d2 + d2 * d3 + d1 * d3) * batch * element_size


def softmax_matmul_flops(batch: int, d1: int, d2: int, d3: int) -> int:
    """The product dominates: 2 * d1 * d2 * d3 per batch element (the softmax adds ~5 * d1 * d2)."""
    return batch * (2 * d1 * d2 * d3 + 5 * d1 * d2)


@triton.jit
def fused_softmax_kernel(
    x_ptr, v_ptr, o_ptr,
    d1, d2, d3,
    stride_xb, stride_x1, stride_x2,
    stride_vb, stride_v2, stride_v3,
    stride_ob, stride_o1, stride_o3,
    n_tiles_3,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):
    """One program: BLOCK_1 rows of x against BLOCK_3 columns of V, streaming d2 in BLOCK_2 steps.

    Programs that share rows of x differ only in their d3 tile and are numbered consecutively,
    so they run together and all but the first read x from L2.
    """
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    rows = (tile // n_tiles_3) * BLOCK_1 + tl.arange(0, BLOCK_1)
    cols = (tile % n_tiles_3) * BLOCK_3 + tl.arange(0, BLOCK_3)
    ks = tl.arange(0, BLOCK_2)
    row_ok = rows < d1
    col_ok = cols < d3
    x_ptrs = x_ptr + batch * stride_xb + rows[:, None].to(tl.int64) * stride_x1 + ks[None, :] * stride_x2
    v_ptrs = v_ptr + batch * stride_vb + ks[:, None].to(tl.int64) * stride_v2 + cols[None, :] * stride_v3

    m = tl.full((BLOCK_1,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_1,), tl.float32)
    acc = tl.zeros((BLOCK_1, BLOCK_3), tl.float32)
    for start in range(0, d2, BLOCK_2):
        k_ok = (start + ks) < d2
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=float("-inf")).to(tl.float32)
        v = tl.load(v_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        if LAZY_RESCALE:
            # Rescale acc and l only when some row's max grew by more than 8 (a factor e^8 ~ 3e3):
            # until then exp(x - m) against the stale m stays below e^8, far inside every
            # dtype's range, and the final division uses the same m, so the result is unchanged.
            # (x > -inf) = (-inf > -inf + 8) is false, so rows of only -inf keep m = -inf.
            if tl.max((m_new > m + 8.0).to(tl.int32), axis=0) > 0:
                alpha = tl.exp(m - m_new)
                l = l * alpha
                acc = acc * alpha[:, None]
                m = m_new
        else:
            seen = m_new > float("-inf")
            alpha = tl.where(seen, tl.exp(m - m_new), 1.0)
            l = l * alpha
            acc = acc * alpha[:, None]
            m = m_new
        # Until a row has seen a finite logit its m is -inf; exp(-inf - -inf) would be NaN.
        p = tl.where((m > float("-inf"))[:, None], tl.exp(x - m[:, None]), 0.0).to(v.dtype)
        # Sum the weights as rounded for the product, so they are normalised exactly as used.
        l += tl.sum(p.to(tl.float32), axis=1)
        if UPCAST:
            acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc)
        else:
            acc = tl.dot(p, v, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_2 * stride_x2
        v_ptrs += BLOCK_2 * stride_v2

    # A row of only -inf has l = 0 and acc = 0: 0 / 0 is NaN, torch's answer for that row.
    out = acc / l[:, None]
    o_ptrs = o_ptr + batch * stride_ob + rows[:, None].to(tl.int64) * stride_o1 + cols[None, :] * stride_o3
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def check_softmax_matmul_inputs(x, V) -> None:
    """The checks ``fused_softmax`` makes before any launch (ValueError/TypeError naming the argument)."""
    check_tensor("x", x, 3)
    check_tensor("V", V, 3)
    check_same("x", x, "V", V)
    if x.shape[0] != V.shape[0]:
        raise ValueError(f"V must have x's batch size {x.shape[0]}, got V of shape {tuple(V.shape)}")
    if x.shape[2] != V.shape[1]:
        raise ValueError(f"V must have d2 = {x.shape[2]} rows (x's last dimension), got V of shape {tuple(V.shape)}")


def fused_launch(d3: int, block_1: int, element_size: int) -> tuple[int, int, int, bool]:
    """(BLOCK_3, num_warps, num_stages, lazy rescale) for a launch: the wrapper's choices beyond BLOCK_1/BLOCK_2.

    BLOCK_3 splits d3 over programs: the fp32 accumulator (BLOCK_1 x BLOCK_3) lives in
    registers, so wider tiles fit only with fewer rows. Four warps are one Hopper warpgroup,
    which issues the 64-row tensor-core instruction.
    """
    block_3 = min(triton.next_power_of_2(d3), 128 if block_1 >= 64 else 256)
    block_3 = max(block_3, 16)  # tl.dot needs every dimension >= 16
    warps = 4 if block_1 * block_3 <= 64 * 128 else 8
    stages = 3 if element_size == 4 else 4
    return block_3, warps, stages, True


def fused_softmax(x: torch.Tensor, V: torch.Tensor, BLOCK_1: int = 16, BLOCK_2: int = 16, *,
                  launch: tuple[int, int, int, bool] | None = None) -> torch.Tensor:
    """softmax(x, dim=-1) @ V without storing the softmax.

    x: (batch, d1, d2), V: (batch, d2, d3) -> (batch, d1, d3), in x's dtype, accumulated in fp32.
    BLOCK_1 rows of x and BLOCK_2 of its columns per step: powers of two from 16 (the least
    ``tl.dot`` takes) to 256. Strided and transposed inputs are read in place.
    ``launch`` overrides the wrapper's (BLOCK_3, num_warps, num_stages, lazy rescale), for tuning.
    """
    check_softmax_matmul_inputs(x, V)
    check_block("BLOCK_1", BLOCK_1, 16, 256)
    check_block("BLOCK_2", BLOCK_2, 16, 256)
    batch, d1, d2 = x.shape
    d3 = V.shape[2]
    out = torch.empty((batch, d1, d3), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if d2 == 0:
        return out.zero_()  # an empty softmax times an empty V: torch gives zeros
    block_3, warps, stages, lazy = launch or fused_launch(d3, BLOCK_1, x.element_size())
    n_tiles_3 = triton.cdiv(d3, block_3)
    grid = (triton.cdiv(d1, BLOCK_1) * n_tiles_3, batch)
    fused_softmax_kernel[grid](
        x, V, out, d1, d2, d3, *x.stride(), *V.stride(), *out.stride(), n_tiles_3,
        BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2, BLOCK_3=block_3,
        PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot_operands(x.dtype), LAZY_RESCALE=lazy,
        num_warps=warps, num_stages=stages,
    )
    return out
