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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from online_softmax import INTERPRET, KernelCapacityError, check_block, check_same, check_tensor, row_softmax


@torch.compiler.assume_constant_result
def _float32_matmul_precision() -> str:
    # torch.compile cannot put a string-valued torch call in its graph; it takes the setting as a
    # constant of the compiled code instead (as Inductor does for its own matmuls).
    return torch.get_float32_matmul_precision()


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision that matches PyTorch's float32 matmul setting."""
    if dtype != torch.float32:
        return "ieee"  # not used for 16-bit operands; tl.dot multiplies them exactly
    return "tf32x3" if _float32_matmul_precision() == "highest" else "tf32"


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """In the interpreter, tl.dot on bfloat16 returns wrong values (triton issue 11584).

    There the kernels round their operands to bfloat16 as on a GPU and multiply them in float32:
    the products of two bfloat16 values are exact in float32, so this is the GPU's arithmetic.
    """
    return INTERPRET and dtype == torch.bfloat16


def round_to_tf32(dtype: torch.dtype) -> bool:
    """Round the softmax weights to TF32 in the kernel before a "tf32" product (compiled only).

    A TF32 tensor core reads the top 10 of a float32's 23 mantissa bits: it truncates, every
    error towards zero. On the weights that bias does not cancel, since the row sum l adds them
    untruncated: on an H100 (4 x 512 x 1024 x 96) softmax(x) @ V had 2.7 x the error of torch
    under 'high' (cuBLAS rounds). Rounded weights, summed as rounded, remove it. V's truncation
    bias is about one TF32 unit, within torch's own error; whether V is rounded too is a matter
    of speed (``_round_v``). The interpreter multiplies in float32 and needs no rounding.
    """
    return not INTERPRET and dtype == torch.float32 and dot_precision(dtype) == "tf32"


@triton.jit
def _tf32_rounded(t):
    """float32 t rounded to the nearest TF32 value (half away from zero); inf and NaN unchanged.

    Adding half a TF32 unit (bit 12) to the bits carries into the kept bits exactly when the
    dropped 13 bits are at least half a unit; clearing them then leaves the rounded magnitude.
    """
    bits = t.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(t) < float("inf"), rounded, t)


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
def _scale_rows(acc, alpha, TRANSPOSED: tl.constexpr):
    """acc with each row of x's tile scaled by alpha: rows are acc's columns when TRANSPOSED."""
    if TRANSPOSED:
        out = acc * alpha[None, :]
    else:  # (compiled Triton visits code after a constexpr-if's return, so no early return here)
        out = acc * alpha[:, None]
    return out


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b; UPCAST: in float32, for the interpreter's wrong 16-bit products."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def fused_softmax_kernel(
    x_ptr, v_ptr, o_ptr,
    d1, d2, d3,
    stride_xb, stride_x1, stride_x2,
    stride_vb, stride_v2, stride_v3,
    stride_ob, stride_o1, stride_o3,
    n_tiles_3,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, LAZY_RESCALE: tl.constexpr, TRANSPOSED: tl.constexpr,
    ROUND_TF32: tl.constexpr, ROUND_V: tl.constexpr,
):
    """One program: BLOCK_1 rows of x against BLOCK_3 columns of V, streaming d2 in BLOCK_2 steps.

    Programs that share rows of x differ only in their d3 tile and are numbered consecutively,
    so they run together and all but the first read x from L2.

    TRANSPOSED computes the same tile as out^T = V^T @ softmax(x)^T: the product's M dimension is
    then BLOCK_3 (64 to 512) instead of BLOCK_1, tall enough for Hopper's warpgroup MMA even when
    the user's BLOCK_1 is 16 or 32. Row statistics then run along axis 0 of the (BLOCK_2,
    BLOCK_1) tile of x^T, and the accumulator is (BLOCK_3, BLOCK_1).
    """
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    rows = (tile // n_tiles_3) * BLOCK_1 + tl.arange(0, BLOCK_1)
    cols = (tile % n_tiles_3) * BLOCK_3 + tl.arange(0, BLOCK_3)
    ks = tl.arange(0, BLOCK_2)
    row_ok = rows < d1
    col_ok = cols < d3
    x_base = x_ptr + batch * stride_xb
    v_base = v_ptr + batch * stride_vb
    if TRANSPOSED:
        x_ptrs = x_base + rows[None, :].to(tl.int64) * stride_x1 + ks[:, None] * stride_x2
        v_ptrs = v_base + ks[None, :].to(tl.int64) * stride_v2 + cols[:, None] * stride_v3
        acc = tl.zeros((BLOCK_3, BLOCK_1), tl.float32)
    else:
        x_ptrs = x_base + rows[:, None].to(tl.int64) * stride_x1 + ks[None, :] * stride_x2
        v_ptrs = v_base + ks[:, None].to(tl.int64) * stride_v2 + cols[None, :] * stride_v3
        acc = tl.zeros((BLOCK_1, BLOCK_3), tl.float32)

    m = tl.full((BLOCK_1,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_1,), tl.float32)
    for start in range(0, d2, BLOCK_2):
        k_ok = (start + ks) < d2
        if TRANSPOSED:
            x = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=float("-inf")).to(tl.float32)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(x, axis=0))
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=float("-inf")).to(tl.float32)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(x, axis=1))
        if LAZY_RESCALE:
            # Rescale acc and l only when some row's max grew by more than 8 (a factor e^8 ~ 3e3):
            # until then exp(x - m) against the stale m stays below e^8, far inside every
            # dtype's range, and the final division uses the same m, so the result is unchanged.
            # (x > -inf) = (-inf > -inf + 8) is false, so rows of only -inf keep m = -inf.
            if tl.max((m_new > m + 8.0).to(tl.int32), axis=0) > 0:
                # A row still at -inf keeps alpha = 1 (exp(-inf - -inf) would be NaN).
                alpha = tl.where(m_new > float("-inf"), tl.exp(m - m_new), 1.0)
                l = l * alpha
                acc = _scale_rows(acc, alpha, TRANSPOSED)
                m = m_new
        else:
            alpha = tl.where(m_new > float("-inf"), tl.exp(m - m_new), 1.0)
            l = l * alpha
            acc = _scale_rows(acc, alpha, TRANSPOSED)
            m = m_new
        # Until a row has seen a finite logit its m is -inf; exp(-inf - -inf) would be NaN.
        seen = m > float("-inf")
        if TRANSPOSED:
            p = tl.where(seen[None, :], tl.exp(x - m[None, :]), 0.0).to(v.dtype)
        else:
            p = tl.where(seen[:, None], tl.exp(x - m[:, None]), 0.0).to(v.dtype)
        if ROUND_TF32:
            p = _tf32_rounded(p)
        if ROUND_V:
            v = _tf32_rounded(v)
        # The weights are summed as rounded for the product, so they are normalised exactly as used.
        if TRANSPOSED:
            l += tl.sum(p.to(tl.float32), axis=0)
            acc = _dot_acc(v, p, acc, PRECISION, UPCAST)
        else:
            l += tl.sum(p.to(tl.float32), axis=1)
            acc = _dot_acc(p, v, acc, PRECISION, UPCAST)
        x_ptrs += BLOCK_2 * stride_x2
        v_ptrs += BLOCK_2 * stride_v2

    # A row of only -inf has l = 0 and acc = 0: 0 / 0 is NaN, torch's answer for that row.
    o_base = o_ptr + batch * stride_ob
    if TRANSPOSED:
        out = acc / l[None, :]
        o_ptrs = o_base + rows[None, :].to(tl.int64) * stride_o1 + cols[:, None] * stride_o3
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])
    else:
        out = acc / l[:, None]
        o_ptrs = o_base + rows[:, None].to(tl.int64) * stride_o1 + cols[None, :] * stride_o3
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


# The fastest (BLOCK_3, num_warps, num_stages, lazy rescale, transposed) per (dot input
# precision, BLOCK_1), from sweeps on an H100 at the spec shape (batch 16, d1 2048, d2 8192, d3
# 512, BLOCK_1 = BLOCK_2): BLOCK_3 in {128, 256, 512}, warps {4, 8}, stages {2, 3, 4}, lazy on/off,
# transposed on/off. Transposed (the product as V^T @ P^T, M = BLOCK_3) wins wherever BLOCK_1 is
# too short for the warpgroup MMA: 3.7x at tf32x3 B = 64 (15.6 -> 4.2 ms). Plain "tf32" on the
# warpgroup MMA needs V through registers (``_round_v``): so B = 64 transposed runs 3.0 ms; B = 16
# and 32 stay on the older MMA, reading V from shared memory (3.45 and 2.14 ms; transposed, with V
# through registers, 5.3 and 3.3 ms).
_FUSED_LAUNCHES = {
    ("tf32x3", 16): (512, 4, 3, False, False), ("tf32x3", 32): (128, 4, 3, False, True),
    ("tf32x3", 64): (128, 8, 3, False, True),
    ("tf32", 16): (512, 4, 3, True, False), ("tf32", 32): (512, 4, 2, True, False), ("tf32", 64): (128, 4, 2, True, True),
    ("16bit", 16): (512, 4, 3, False, False), ("16bit", 32): (512, 4, 3, False, True),
    ("16bit", 64): (512, 8, 3, False, True),
}
# Shared memory a launch may plan for: an H100 block can have 227 KiB (the swept launches use up
# to 221 KiB of staged tiles, e.g. bf16 B = 64: 3 x (64 x 64 + 64 x 512) x 2 B).
_SHARED_MEMORY_BUDGET = 227 * 1024


def fused_launch(d3: int, block_1: int, dtype: torch.dtype, block_2: int | None = None) -> tuple[int, int, int, bool, bool]:
    """(BLOCK_3, num_warps, num_stages, lazy rescale, transposed) for a launch: the wrapper's choices beyond BLOCK_1/BLOCK_2.

    BLOCK_3 splits d3 over programs; the fp32 accumulator (BLOCK_1 x BLOCK_3) lives in
    registers. Tile sizes BLOCK_1 of 128 and 256 were not swept: they get narrow d3 tiles. The
    number of pipeline stages is cut until the staged x and V tiles fit in shared memory.
    """
    block_2 = block_1 if block_2 is None else block_2
    kind = dot_precision(dtype) if dtype == torch.float32 else "16bit"
    block_3, warps, stages, lazy, transposed = _FUSED_LAUNCHES.get((kind, block_1), (64, 8, 2, False, False))
    block_3 = max(16, min(block_3, triton.next_power_of_2(d3)))  # tl.dot needs every dimension >= 16
    element_size = torch.empty((), dtype=dtype).element_size()
    per_stage = (block_1 * block_2 + block_2 * block_3) * element_size
    stages = max(1, min(stages, _SHARED_MEMORY_BUDGET // per_stage))
    if per_stage > _SHARED_MEMORY_BUDGET and not INTERPRET:
        raise KernelCapacityError(
            f"BLOCK_1 x BLOCK_2 = {block_1} x {block_2} tiles of {dtype} need {per_stage // 1024} KiB of shared "
            f"memory with one d2 step staged, more than the {_SHARED_MEMORY_BUDGET // 1024} KiB a program can have")
    return block_3, warps, stages, lazy, transposed


def _round_v(dtype: torch.dtype, block_1: int, transposed: bool) -> bool:
    """Pass V's tiles through registers, rounded to TF32, before a "tf32" product that runs
    as a Hopper warpgroup MMA (M = BLOCK_3 when transposed, else BLOCK_1 >= 64).

    That MMA wants fp32 operands in shared memory K-major; V's tiles arrive there d3-major, and
    fed as they are, softmax(x) @ V at the spec shape (d2 8192) took 6.7 ms at B = 64 on an H100.
    Through registers (where rounding is nearly free) it took 3.0 ms, and its error fell from
    1.6 x torch's to torch's. The smaller products (BLOCK_1 < 64, the older MMA) read V straight
    from shared memory: there the detour cost 1.5 x the time (B = 16 and 32).
    """
    return round_to_tf32(dtype) and (transposed or block_1 >= 64)


def fused_softmax(x: torch.Tensor, V: torch.Tensor, BLOCK_1: int = 16, BLOCK_2: int = 16, *,
                  launch: tuple[int, int, int, bool, bool] | None = None) -> torch.Tensor:
    """softmax(x, dim=-1) @ V without storing the softmax.

    x: (batch, d1, d2), V: (batch, d2, d3) -> (batch, d1, d3), in x's dtype, accumulated in fp32.
    BLOCK_1 rows of x and BLOCK_2 of its columns per step: powers of two from 16 (the least
    ``tl.dot`` takes) to 256. Strided and transposed inputs are read in place.
    ``launch`` overrides the wrapper's (BLOCK_3, num_warps, num_stages, lazy rescale, transposed)
    (see ``fused_launch``), for tuning.
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
    if launch is not None and len(launch) == 4:
        launch = (*launch, False)  # (BLOCK_3, warps, stages, lazy): the untransposed kernel
    block_3, warps, stages, lazy, transposed = launch or fused_launch(d3, BLOCK_1, x.dtype, BLOCK_2)
    n_tiles_3 = triton.cdiv(d3, block_3)
    grid = (triton.cdiv(d1, BLOCK_1) * n_tiles_3, batch)
    fused_softmax_kernel[grid](
        x, V, out, d1, d2, d3, *x.stride(), *V.stride(), *out.stride(), n_tiles_3,
        BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2, BLOCK_3=block_3,
        PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot_operands(x.dtype), LAZY_RESCALE=lazy,
        ROUND_TF32=round_to_tf32(x.dtype), ROUND_V=_round_v(x.dtype, BLOCK_1, transposed),
        TRANSPOSED=transposed, num_warps=warps, num_stages=stages,
    )
    return out


# ----------------------------------------------------------------------------------------------
# softmax(x @ W): the classifier / LM head
# ----------------------------------------------------------------------------------------------
# x: (B, K) activations, W: (K, C) class weights -> probabilities (B, C), softmax over classes.
#
# Where the time goes. The product costs 2BKC flops; the softmax a handful of flops per logit but
# a full pass over the (B, C) logits. With K = 4096 the product does 2K = 8192 flops per logit,
# about 4096 flops per byte of a bf16 logit: far past an H100's ridge (~790 TFLOP/s over
# ~3 TB/s, ~260 flops/byte). So at LM-head sizes the product dominates and every extra pass over
# the logits costs about 4 bytes / 3 TB/s against 8192 flops / 790 TFLOP/s per logit, ~13 %.
# At the small float32 sizes (B, C of 10 to 1024) nothing is big: the cost is kernel launches
# and latency. One launch instead of PyTorch's two (cuBLAS, then softmax) is one gain; the other
# is spreading a long K over more SMs than there are row blocks (``split_k_kernel``).
#
# Three Triton versions:
# * unfused: a Triton matmul writes the logits, ``row_softmax`` reads them and writes the
#   probabilities (3 passes over (B, C)): the baseline that isolates what fusion buys.
# * fused, simple (``matmul_softmax_simple_kernel``): one program owns a block of rows and all C
#   classes, so the softmax happens in registers and only the probabilities are written (1 pass).
#   It only works while a row block's C float32 logits fit on chip (``SIMPLE_MAX_CLASSES``).
# * fused, tiled (``matmul_softmax_tile_kernel`` + ``rescale_tiles_kernel``): programs own
#   (rows x class tile) tiles, so any C works. Each writes exp(logit - tile max) and its
#   (tile max, tile sum); a light pass merges the tiles' (max, sum) pairs per row by the online
#   softmax rule and rescales every tile by exp(tile max - row max) / row sum. When C fits one
#   class tile the first kernel normalises directly and the second is skipped.
#
# Why the tiled kernel writes then rescales (3 passes over (B, C), like unfused) rather than
# something cleverer: normalising needs every logit of a row, so the choices are (a) hold a whole
# row block's logits on chip: at C = 128256 that is 64 rows x 128256 x 4 B = 32 MB, the size of
# all of an H100's registers, and W (1 GB in bf16) would stream from memory once per row block;
# (b) recompute the product in a second pass: +2BKC flops, +100 % at K = 4096; (c) write and
# rescale: +2 passes of B x C x elt, +13 % at K = 4096 by the estimate above. (c) is cheapest
# wherever the product matters. The extra scratch is the per-(row, tile) statistics,
# B x C / BLOCK_C x 8 bytes (1/32 of a bf16 output with 128-wide tiles), not a (B, C) buffer.
# So at LM-head sizes fusion saves the softmax kernel's own exp/max work and the split-row
# machinery, not bytes; at small C the tiled kernel is one launch and writes once.


def matmul_softmax_ref(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Reference: cuBLAS product, logits written in x's dtype, then ``torch.softmax`` over classes.

    x: (B, K), W: (K, C) -> (B, C). Bytes: the product reads x and W and writes B x C logits; the
    softmax reads them and writes B x C probabilities.
    """
    return torch.softmax(x @ W, dim=-1)


def matmul_softmax_unfused_bytes(B: int, K: int, C: int, element_size: int) -> int:
    """Two kernels: x and W in, logits out, logits in, probabilities out (3 passes over B x C)."""
    return (B * K + K * C + 3 * B * C) * element_size


def matmul_softmax_fused_bytes(B: int, K: int, C: int, element_size: int) -> int:
    """One kernel that keeps the logits on chip: x and W in, probabilities out (1 pass)."""
    return (B * K + K * C + B * C) * element_size


def matmul_softmax_tiled_bytes(B: int, K: int, C: int, element_size: int, launch: MatmulLaunch) -> int:
    """What ``matmul_softmax_fused_tiled`` moves at least with ``launch``'s tiles.

    One class tile: the fused minimum, plus with K split the partials (``split_k_bytes``).
    Several: the unnormalised tiles are written, read and written again (3 passes, as unfused),
    plus the float32 (max, sum) pair per row and tile, written once and read once.
    """
    n_tiles = triton.cdiv(C, launch.block_c)
    if n_tiles == 1:
        return matmul_softmax_fused_bytes(B, K, C, element_size) + split_k_bytes(B, K, launch)
    return matmul_softmax_unfused_bytes(B, K, C, element_size) + 2 * (2 * B * n_tiles * 4)


def split_k_slices(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(slice length, number of slices) for K cut into at most split_k slices of whole block_k
    steps; fewer slices where K is short, at least one."""
    k_slice = max(block_k, triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k)
    return k_slice, max(1, triton.cdiv(K, k_slice))


def split_k_bytes(B: int, K: int, launch: MatmulLaunch) -> int:
    """The float32 partial tiles of ``split_k_kernel`` (one per slice and row block, rows padded
    to the block), written once and read once; 0 unsplit. At the small sizes where the wrappers
    split K they stay in L2."""
    if launch.split_k == 1:
        return 0
    n_splits = split_k_slices(K, launch.block_k, launch.split_k)[1]
    return 2 * n_splits * triton.cdiv(B, launch.block_b) * launch.block_b * launch.block_c * 4


def matmul_softmax_flops(B: int, K: int, C: int) -> int:
    """The product's 2BKC plus ~5 flops per logit for the softmax (max, subtract, exp, sum, divide)."""
    return 2 * B * K * C + 5 * B * C


@dataclass(frozen=True)
class MatmulLaunch:
    """Launch parameters of the matmul-shaped kernels; the wrappers choose them unless given.

    block_b rows by block_c classes per program, block_k of the K dimension per step (powers of
    two, at least 16: ``tl.dot``'s least); programs run in groups of group_b row blocks that walk
    the class tiles together, so their x rows and W columns are read from L2 (see ``tile_coords``).
    split_k > 1 (only when C fits one class tile) cuts K into that many slices, one program each,
    for shapes with too few row blocks to fill the GPU (see ``split_k_kernel``).
    """

    block_b: int
    block_c: int
    block_k: int
    group_b: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# ``tiled_launch`` splits K when C fits one class tile and K is at least SPLIT_K_LEAST_STEPS
# steps of block_k, into slices of at least SPLIT_K_SLICE_STEPS steps, with row blocks of at
# least SPLIT_K_ROWS. From a sweep on an H100 (float32, row blocks 16/32/64 x 1 to 32 slices):
# about one program per SM was fastest; 64 x 128 x 10 (4 K steps) ran fastest unsplit.
SPLIT_K_LEAST_STEPS = 16
SPLIT_K_SLICE_STEPS = 2
SPLIT_K_ROWS = 32

# The simple kernel keeps a block_b x next_power_of_2(C) float32 accumulator in registers. At
# 16 rows (tl.dot's least) x 1024 classes that is 64 KiB: 64 registers a thread over 8 warps,
# beside the operand tiles; twice that spills on an H100 (255 registers a thread at most).
SIMPLE_MAX_CLASSES = 1024


def check_matmul_softmax_inputs(x, W) -> None:
    """x: (B, K), W: (K, C), same dtype and device; ValueError/TypeError naming the argument."""
    check_tensor("x", x, 2)
    check_tensor("W", W, 2)
    check_same("x", x, "W", W)
    if W.shape[0] != x.shape[1]:
        raise ValueError(f"W must have K = {x.shape[1]} rows (x's last dimension), got W of shape {tuple(W.shape)}")


def check_launch(launch) -> None:
    if not isinstance(launch, MatmulLaunch):
        raise TypeError(f"launch must be a MatmulLaunch, got {type(launch).__name__}")
    check_block("launch.block_b", launch.block_b, 16, 256)
    check_block("launch.block_c", launch.block_c, 16, 4096)
    check_block("launch.block_k", launch.block_k, 16, 256)
    check_block("launch.group_b", launch.group_b, 1, 64)
    check_block("launch.num_warps", launch.num_warps, 1, 16)
    for name, most in (("num_stages", 8), ("split_k", 256)):
        value = getattr(launch, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ValueError(f"launch.{name} must be an int from 1 to {most}, got {value!r}")


def _sm_count(device: torch.device) -> int | None:
    """SMs of the device; None in the interpreter, where programs run one after another."""
    if INTERPRET:
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fill_sms(B: int, n_tiles_c: int, block_b: int, sms: int | None, least: int = 16) -> int:
    """Halve the row block (down to ``least``, at least tl.dot's 16) until there is about one
    program per SM.

    At B = 1024, C = 100 a 64-row block gives 16 programs: 16 of 132 SMs do all the flops.
    """
    while sms is not None and block_b > least and triton.cdiv(B, block_b) * n_tiles_c < sms:
        block_b //= 2
    return block_b


def tiled_launch(B: int, C: int, dtype: torch.dtype, device: torch.device, K: int | None = None) -> MatmulLaunch:
    """H100 choices for the Triton matmul and the tiled fused kernel (starting points to tune).

    16-bit: 128 x 256 x 64 tiles, 8 warps (two Hopper warpgroups, each issuing the 64-row wgmma),
    4 stages: a 128 KiB float32 accumulator (128 registers a thread) still leaves room for the
    softmax epilogue. Float32: 64 x 128 x 32, 4 warps: tf32x3 splits each operand into two TF32
    halves in registers, so the tile is smaller to keep the register budget; 3 stages of
    (64 + 128) x 32 x 4 B = 72 KiB. A class tile narrower than the default is used when C is smaller, so
    small C runs as one tile and one launch. Given K, a long K may be cut into slices (split_k).
    """
    if dtype == torch.float32:
        block_b, block_c, block_k, warps, stages = 64, 128, 32, 4, 3
    else:
        # Swept at the LM-head sizes (4096 x 4096 x 32768, 8192 x 4096 x 128256): 128 x 256 x 64
        # tiles on 8 warps with 4 stages (4 x (128 + 256) x 64 x 2 B = 192 KiB staged) beat the
        # 128 x 128 x 64, 3-stage start by 20 to 27 %, the best of ten launches tried.
        block_b, block_c, block_k, warps, stages = 128, 256, 64, 8, 4
    block_c = max(16, min(block_c, triton.next_power_of_2(C)))
    sms = _sm_count(device)
    # One class tile and a long K: K slices fill the SMs better than thinner row blocks (at
    # 1024 x 1024 x 100 on an H100, 32 rows x 4 slices: 18 us; 16 rows, unsplit: 33 us).
    use_split = sms is not None and K is not None and C <= block_c and K >= SPLIT_K_LEAST_STEPS * block_k
    block_b = _fill_sms(B, triton.cdiv(C, block_c), block_b, sms, least=SPLIT_K_ROWS if use_split else 16)
    if block_b * block_c <= 64 * 128:
        warps = 4  # one warpgroup covers a tile of <= 8192 accumulators at 64 a thread
    split = 1
    if use_split:
        # About one program per SM, each slice at least SPLIT_K_SLICE_STEPS steps of block_k.
        split = max(1, min(sms // triton.cdiv(B, block_b), K // (SPLIT_K_SLICE_STEPS * block_k)))
    return MatmulLaunch(block_b, block_c, block_k, group_b=8, num_warps=warps, num_stages=stages, split_k=split)


def simple_launch(B: int, C: int, dtype: torch.dtype, device: torch.device, K: int | None = None) -> MatmulLaunch:
    """H100 choices for the simple fused kernel: all C (padded to a power of two) in one tile.

    Rows: as many as keep the accumulator within 64 KiB (<= 64 registers a thread over 8 warps),
    at most 64, then fewer while that leaves SMs idle. block_k: what keeps one stage of operands
    near 32 KiB, so 3 stages fit shared memory even at 1024 classes. K is not used: the simple
    kernel does not split K.
    """
    block_c = max(16, triton.next_power_of_2(C))
    block_b = max(16, min(64, 16384 // block_c))
    block_b = _fill_sms(B, 1, block_b, _sm_count(device))
    k_in_32_kib = 32 * 1024 // ((block_b + block_c) * _element_size(dtype))
    block_k = max(16, min(64, 1 << (k_in_32_kib.bit_length() - 1)))
    warps = 4 if block_b * block_c <= 64 * 128 else 8
    return MatmulLaunch(block_b, block_c, block_k, group_b=1, num_warps=warps, num_stages=3)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@triton.jit
def tile_coords(pid, n_tiles_b, n_tiles_c, GROUP_B: tl.constexpr):
    """(row tile, class tile) of program pid, GROUP_B row tiles at a time sweeping the class tiles.

    Consecutive programs share a class tile (W columns) across GROUP_B row blocks, and a group
    reuses its GROUP_B row blocks of x across all class tiles: at the LM head (B = 8192, 128-row
    tiles) W is read from memory B / (128 x GROUP_B) = 8 times instead of 64.
    """
    per_group = GROUP_B * n_tiles_c
    first_b = (pid // per_group) * GROUP_B
    group_size = tl.minimum(n_tiles_b - first_b, GROUP_B)
    within = pid % per_group
    return first_b + within % group_size, within // group_size


@triton.jit
def logits_tile(
    x_ptr, w_ptr, rows, cols, B, C, k_start, k_end,
    stride_xb, stride_xk, stride_wk, stride_wc,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """x[rows, k_start:k_end] @ W[k_start:k_end, cols] as a float32 (BLOCK_B, BLOCK_C) tile;
    rows/cols past B/C give 0."""
    ks = k_start + tl.arange(0, BLOCK_K)
    row_ok = rows < B
    col_ok = cols < C
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xb + ks[None, :] * stride_xk
    w_ptrs = w_ptr + ks[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wc
    acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    for step in range(0, k_end - k_start, BLOCK_K):
        k_ok = (step + ks) < k_end
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def matmul_kernel(
    x_ptr, w_ptr, out_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    n_tiles_b, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """out = x @ W, one (BLOCK_B, BLOCK_C) tile per program, rounded to out's dtype."""
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, 0, K, stride_xb, stride_xk, stride_wk, stride_wc,
                      BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=False)


@triton.jit
def store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX: tl.constexpr):
    """Store a float32 tile of logits in out's dtype; with SOFTMAX (cols then hold every class)
    their softmax over the classes instead."""
    col_ok = cols < C
    if SOFTMAX:
        # Padding classes must weigh nothing: -inf, not the 0 the masked product left there.
        logits = tl.where(col_ok[None, :], acc, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        acc = p / tl.sum(p, axis=1)[:, None]
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ob + cols[None, :] * stride_oc
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < B)[:, None] & col_ok[None, :])


@triton.jit
def matmul_softmax_simple_kernel(
    x_ptr, w_ptr, out_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """softmax(x @ W) for BLOCK_B rows; BLOCK_C >= C, so each row's logits are all in registers."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_C)
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, 0, K, stride_xb, stride_xk, stride_wk, stride_wc,
                      BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=True)


@triton.jit
def split_k_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    n_splits, k_slice,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTMAX: tl.constexpr,
):
    """One K slice of a row block's logits, all C classes in one tile (BLOCK_C >= C).

    Each program writes its float32 partial tile to part (n_splits, row blocks x BLOCK_B,
    BLOCK_C) and bumps its row block's count; the program that brings the count to n_splits
    adds the partials in slice order, so the sum is the same whichever slice finishes last,
    and stores the logits, or with SOFTMAX their softmax. The count's atomic is acquire-release:
    a slice's partial is in memory before its count, and the last program reads all of them after.
    """
    tile_b = tl.program_id(0) // n_splits
    part = tl.program_id(0) % n_splits
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_C)
    k_start = part * k_slice
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, k_start, tl.minimum(k_start + k_slice, K),
                      stride_xb, stride_xk, stride_wk, stride_wc, BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    tile_offsets = rows[:, None].to(tl.int64) * BLOCK_C + cols[None, :]
    slice_size = (tl.num_programs(0) // n_splits).to(tl.int64) * (BLOCK_B * BLOCK_C)
    tl.store(part_ptr + part * slice_size + tile_offsets, acc)
    # One thread bumps the count; the barrier first has every thread's stores of the partial
    # done, so the count's release covers them all (CUTLASS's semaphore does the same).
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + tile_b, 1) == n_splits - 1:
        total = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
        for other in range(0, n_splits):
            # .cg: from L2, where the other programs' stores are, never a stale L1 line.
            total += tl.load(part_ptr + other * slice_size + tile_offsets, cache_modifier=".cg")
        store_tile(total, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=SOFTMAX)


@triton.jit
def matmul_softmax_tile_kernel(
    x_ptr, w_ptr, out_ptr, stats_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    n_tiles_b, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One (rows, class tile) of exp(logit - tile max), and per row the tile's (max, sum).

    stats: (2, B, n_tiles_c) float32, [0] the maxima, [1] the sums of exp(logit - max) taken in
    float32 before the output is rounded. ``rescale_tiles_kernel`` finishes the softmax.
    """
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < B
    col_ok = cols < C
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, 0, K, stride_xb, stride_xk, stride_wk, stride_wc,
                      BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    logits = tl.where(col_ok[None, :], acc, float("-inf"))
    tile_max = tl.max(logits, axis=1)
    p = tl.exp(logits - tile_max[:, None])
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ob + cols[None, :] * stride_oc
    tl.store(o_ptrs, p.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    stat_ptrs = stats_ptr + rows.to(tl.int64) * n_tiles_c + tile_c
    tl.store(stat_ptrs, tile_max, mask=row_ok)
    tl.store(stat_ptrs + B * n_tiles_c, tl.sum(p, axis=1), mask=row_ok)


@triton.jit
def rescale_tiles_kernel(
    out_ptr, stats_ptr, B, C, n_tiles_c, stride_ob, stride_oc,
    BLOCK_C: tl.constexpr, TILES: tl.constexpr,
):
    """Finish one row: merge its tiles' (max, sum) online, then scale each tile to probabilities.

    A step covers TILES whole class tiles as a (TILES, BLOCK_C) block, so each tile's factor
    exp(tile max - row max) / row sum costs one exp per tile, not one per element.
    """
    row = tl.program_id(0).to(tl.int64)
    ts = tl.arange(0, TILES)
    max_row = stats_ptr + row * n_tiles_c
    sum_row = max_row + B * n_tiles_c
    row_max = tl.max(tl.full((TILES,), float("-inf"), tl.float32), axis=0)
    row_sum = tl.sum(tl.zeros((TILES,), tl.float32), axis=0)
    for start in range(0, n_tiles_c, TILES):
        t_ok = start + ts < n_tiles_c
        tile_max = tl.load(max_row + start + ts, mask=t_ok, other=float("-inf"))
        tile_sum = tl.load(sum_row + start + ts, mask=t_ok, other=0.0)
        new_max = tl.maximum(row_max, tl.max(tile_max, axis=0))
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tile_sum * tl.exp(tile_max - new_max), axis=0)
        row_max = new_max

    inv_sum = 1.0 / row_sum
    js = tl.arange(0, BLOCK_C)
    for start in range(0, n_tiles_c, TILES):
        tiles = start + ts
        t_ok = tiles < n_tiles_c
        scale = tl.exp(tl.load(max_row + tiles, mask=t_ok, other=0.0) - row_max) * inv_sum
        cols = tiles[:, None] * BLOCK_C + js[None, :]
        mask = t_ok[:, None] & (cols < C)
        ptrs = out_ptr + row * stride_ob + cols.to(tl.int64) * stride_oc
        p = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (p * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _matmul_args(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor) -> tuple:
    B, K = x.shape
    return (B, K, W.shape[1], *x.stride(), *W.stride(), *out.stride())


def _precision_args(dtype: torch.dtype) -> dict:
    return dict(PRECISION=dot_precision(dtype), UPCAST=upcast_dot_operands(dtype))


def _grouped_grid(B: int, C: int, launch: MatmulLaunch) -> tuple[int, int, tuple[int]]:
    n_tiles_b, n_tiles_c = triton.cdiv(B, launch.block_b), triton.cdiv(C, launch.block_c)
    return n_tiles_b, n_tiles_c, (n_tiles_b * n_tiles_c,)


def _launch_kwargs(launch: MatmulLaunch, grouped: bool = True) -> dict:
    kwargs = dict(BLOCK_B=launch.block_b, BLOCK_C=launch.block_c, BLOCK_K=launch.block_k,
                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    if grouped:
        kwargs["GROUP_B"] = launch.group_b
    return kwargs


def _prepare(x, W, launch, choose) -> tuple[torch.Tensor, MatmulLaunch | None]:
    """Check inputs and launch, allocate the (B, C) output; launch None means nothing to compute."""
    check_matmul_softmax_inputs(x, W)
    if launch is not None:
        check_launch(launch)
    B, C = x.shape[0], W.shape[1]
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, None
    launch = launch or choose(B, C, x.dtype, x.device, K=x.shape[1])
    if launch.split_k > 1 and C > launch.block_c:
        raise ValueError(f"launch.split_k = {launch.split_k} needs all C = {C} classes in one tile, "
                         f"got launch.block_c = {launch.block_c}")
    return out, launch


def _launch_split_k(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor, launch: MatmulLaunch, softmax: bool) -> None:
    """``split_k_kernel`` over launch.split_k slices of K (fewer where K is short): float32
    partials of split x B x block_c (rows padded to the row block), a zeroed count per row block."""
    B, K = x.shape
    n_tiles_b = triton.cdiv(B, launch.block_b)
    k_slice, n_splits = split_k_slices(K, launch.block_k, launch.split_k)
    parts = torch.empty((n_splits, n_tiles_b * launch.block_b, launch.block_c), dtype=torch.float32, device=x.device)
    counts = torch.zeros((n_tiles_b,), dtype=torch.int32, device=x.device)
    split_k_kernel[(n_tiles_b * n_splits,)](x, W, out, parts, counts, *_matmul_args(x, W, out), n_splits, k_slice,
                                            **_launch_kwargs(launch, grouped=False), **_precision_args(x.dtype),
                                            SOFTMAX=softmax)


def matmul(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """x @ W in Triton: x (B, K), W (K, C) -> (B, C) in x's dtype, accumulated in float32.

    ``launch`` overrides the wrapper's tiles (``tiled_launch``).
    """
    out, launch = _prepare(x, W, launch, tiled_launch)
    if launch is None:
        return out
    if launch.split_k > 1:
        _launch_split_k(x, W, out, launch, softmax=False)
        return out
    n_tiles_b, n_tiles_c, grid = _grouped_grid(*out.shape, launch)
    matmul_kernel[grid](x, W, out, *_matmul_args(x, W, out), n_tiles_b, n_tiles_c,
                        **_launch_kwargs(launch), **_precision_args(x.dtype))
    return out


def matmul_softmax_unfused(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """softmax(x @ W) as two Triton kernels: ``matmul`` writes the logits, ``row_softmax`` reads them."""
    return row_softmax(matmul(x, W, launch))


def matmul_softmax_fused_simple(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """softmax(x @ W) in one kernel with all C classes of a row block in registers.

    x: (B, K), W: (K, C) -> (B, C) in x's dtype. C may be at most ``SIMPLE_MAX_CLASSES``
    (ValueError otherwise, before anything is allocated or launched); a given ``launch`` must
    have block_c >= C.
    """
    check_matmul_softmax_inputs(x, W)
    C = W.shape[1]
    if C > SIMPLE_MAX_CLASSES:
        raise KernelCapacityError(f"C = {C} classes is more than matmul_softmax_fused_simple keeps on chip "
                                  f"(at most {SIMPLE_MAX_CLASSES}); use matmul_softmax_fused_tiled")
    if isinstance(launch, MatmulLaunch):
        if launch.block_c < C:
            raise ValueError(f"launch.block_c = {launch.block_c} must cover all C = {C} classes in the simple kernel")
        if launch.split_k != 1:
            raise ValueError(f"launch.split_k must be 1 in the simple kernel (one program per row block), got {launch.split_k}")
    out, launch = _prepare(x, W, launch, simple_launch)
    if launch is None:
        return out
    grid = (triton.cdiv(x.shape[0], launch.block_b),)
    matmul_softmax_simple_kernel[grid](x, W, out, *_matmul_args(x, W, out),
                                       **_launch_kwargs(launch, grouped=False), **_precision_args(x.dtype))
    return out


def matmul_softmax_fused_tiled(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """softmax(x @ W) for any C, with no (B, C) buffer but the output.

    x: (B, K), W: (K, C) -> (B, C) in x's dtype. One class tile (C <= launch.block_c): one kernel
    that normalises in registers, or with K split (``split_k_kernel``) the last slice of each row
    block does. Several: unnormalised tiles plus a (2, B, tiles) float32 table
    of tile maxima and sums, then ``rescale_tiles_kernel`` (see the section notes for why).
    """
    out, launch = _prepare(x, W, launch, tiled_launch)
    if launch is None:
        return out
    if launch.split_k > 1:
        _launch_split_k(x, W, out, launch, softmax=True)
        return out
    B, C = out.shape
    n_tiles_b, n_tiles_c, grid = _grouped_grid(B, C, launch)
    if n_tiles_c == 1:
        matmul_softmax_simple_kernel[(n_tiles_b,)](x, W, out, *_matmul_args(x, W, out),
                                                    **_launch_kwargs(launch, grouped=False), **_precision_args(x.dtype))
        return out
    stats = torch.empty((2, B, n_tiles_c), dtype=torch.float32, device=x.device)
    matmul_softmax_tile_kernel[grid](x, W, out, stats, *_matmul_args(x, W, out), n_tiles_b, n_tiles_c,
                                     **_launch_kwargs(launch), **_precision_args(x.dtype))
    # About 4096 elements a step: 32 a thread over 4 warps, enough loads in flight per program.
    tiles = min(triton.next_power_of_2(n_tiles_c), max(1, 4096 // launch.block_c))
    rescale_tiles_kernel[(B,)](out, stats, B, C, n_tiles_c, *out.stride(), BLOCK_C=launch.block_c,
                               TILES=tiles, num_warps=4)
    return out


# Each version of softmax(x @ W) under the name the tests and the benchmark give it.
MATMUL_SOFTMAX_IMPLS = {
    "torch": matmul_softmax_ref,
    "triton_unfused": matmul_softmax_unfused,
    "triton_fused_simple": matmul_softmax_fused_simple,
    "triton_fused_tiled": matmul_softmax_fused_tiled,
}


def matmul_softmax_impl_bytes(impl: str, B: int, K: int, C: int, dtype: torch.dtype, device) -> int:
    """The least traffic of each version (its bytes_model): PyTorch, torch.compile (cuBLAS or an
    extern mm, then a softmax kernel) and Triton unfused write and re-read the logits; the simple
    kernel writes once; the tiled one as ``matmul_softmax_tiled_bytes`` with the tiles its
    wrapper picks. Where the wrapper splits K, the Triton versions also move their partials."""
    elt = _element_size(dtype)
    if impl == "triton_fused_simple":
        return matmul_softmax_fused_bytes(B, K, C, elt)
    launch = tiled_launch(B, C, dtype, torch.device(device), K=K)
    if impl == "triton_fused_tiled":
        return matmul_softmax_tiled_bytes(B, K, C, elt, launch)
    partials = split_k_bytes(B, K, launch) if impl == "triton_unfused" else 0
    return matmul_softmax_unfused_bytes(B, K, C, elt) + partials


# ==============================================================================================
# Attention
# ==============================================================================================
# softmax(Q K^T / sqrt(d)) V: the softmax-matmul above with its logits computed on the fly from
# Q and K. Materialised, it writes and reads an (n_queries, n_keys) matrix several times per
# batch element, so its memory grows with the square of the sequence. FlashAttention-2 keeps one
# tile of those logits on chip at a time: the forward saves only the output O and the row
# log-sum-exp L, and the backward recomputes each tile of the softmax from L.
#
# Causal masking is top-left aligned (query i sees keys j <= i), as in
# ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``: with more queries than
# keys, the queries past the last key see every key.

# Imported here, not at the top, so that this section merges beside others appended to the file.
from dataclasses import dataclass  # noqa: E402

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the GPU's native instruction

# Head dimensions the Triton kernels take: powers of two (tl.arange) from 16 (the least tl.dot
# takes) to 128 (above that one program's Q, K and V tiles no longer fit in shared memory).
FLASH_HEAD_DIMS = (16, 32, 64, 128)


def attention_reference(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Materialised attention in Q's dtype (float64 included): the answer every kernel must give.

    Q: (batch, n_queries, d), K and V: (batch, n_keys, d) -> (batch, n_queries, d).
    Per batch element, in elements: S = Q K^T reads (nq + nk) d and writes nq nk; the softmax
    reads S and writes P (2 nq nk, more for its steps); P V reads nq nk + nk d and writes nq d.
    """
    S = attention_logits(Q, K, is_causal)
    return torch.softmax(S, dim=-1) @ V


def attention_logits(Q: torch.Tensor, K: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """S = Q K^T / sqrt(d), with -inf where a causal query may not see a key: (batch, nq, nk)."""
    S = (Q @ K.transpose(-2, -1)) * Q.shape[-1] ** -0.5
    if is_causal:
        S = S.masked_fill(causal_mask(Q.shape[-2], K.shape[-2], Q.device), float("-inf"))
    return S


def attention_logsumexp(Q: torch.Tensor, K: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """L = logsumexp over keys of S, (batch, n_queries): what the flash forwards save."""
    return torch.logsumexp(attention_logits(Q, K, is_causal), dim=-1)


def causal_mask(n_queries: int, n_keys: int, device, query_start: int = 0, key_start: int = 0) -> torch.Tensor:
    """True where query i may NOT see key j (j > i), for the block starting at (query_start, key_start)."""
    queries = torch.arange(query_start, query_start + n_queries, device=device)
    keys = torch.arange(key_start, key_start + n_keys, device=device)
    return keys[None, :] > queries[:, None]


def attention_flops(batch: int, n_queries: int, n_keys: int, d: int, is_causal: bool, mode: str = "fwd") -> int:
    """Matmul flops: Q K^T and P V are 2 nq nk d each; causal does half of them.

    The backward does five such products (S again, dV, dP, dQ, dK): 2.5x the forward.
    ``mode`` is "fwd" or "fwd_bwd" (forward then backward: 3.5x the forward).
    """
    forward = 4 * batch * n_queries * n_keys * d // (2 if is_causal else 1)
    return {"fwd": forward, "fwd_bwd": forward + 5 * forward // 2}[mode]


def flash_attention_bytes(batch: int, n_queries: int, n_keys: int, d: int, element_size: int, mode: str = "fwd") -> int:
    """The least a fused attention moves: no (nq, nk) tensor, each operand once.

    Forward: Q, K, V in, O out, L (float32) out. Backward: Q, K, V, O, dO, L in, D = rowsum(dO O)
    out and back in (float32), dQ, dK, dV out.
    """
    q, kv, rows = batch * n_queries * d, batch * n_keys * d, batch * n_queries
    forward = (2 * q + 2 * kv) * element_size + 4 * rows
    backward = (3 * q + 2 * kv + 2 * kv + q) * element_size + 3 * 4 * rows
    return {"fwd": forward, "fwd_bwd": forward + backward}[mode]


def check_attention_inputs(Q, K, V, is_causal) -> None:
    """The checks both flash attentions make before any work (ValueError/TypeError naming the argument)."""
    check_tensor("Q", Q, 3)
    check_tensor("K", K, 3)
    check_tensor("V", V, 3)
    check_same("Q", Q, "K", K)
    check_same("Q", Q, "V", V)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if K.shape[0] != Q.shape[0] or K.shape[2] != Q.shape[2]:
        raise ValueError(f"K must be (batch, n_keys, d) with Q's batch {Q.shape[0]} and d {Q.shape[2]}, "
                         f"got K of shape {tuple(K.shape)}")
    if V.shape != K.shape:
        raise ValueError(f"V must have K's shape {tuple(K.shape)}, got {tuple(V.shape)}")
    if K.shape[1] == 0:
        raise ValueError("K has no keys (n_keys = 0): a softmax over no keys is undefined")
    if Q.shape[2] == 0:
        raise ValueError("Q has d = 0: the scale 1/sqrt(d) is undefined")


# ----------------------------------------------------------------------------------------------
# FlashAttention-2 in plain PyTorch
# ----------------------------------------------------------------------------------------------
# Key tiles of 128: each tile costs about a dozen PyTorch launches, so small tiles are slow;
# the live (n_queries, 128) logits stay linear in the sequence length. Query tiles only decide
# which queries a causal key tile can skip: 64 keeps that skipping fine-grained.
FLASH_PYTORCH_KEY_TILE = 128
FLASH_PYTORCH_QUERY_TILE = 64


def _causal_first_query(key_start: int, query_tile: int) -> int:
    """The start of the first query tile that sees a key at or after key_start (earlier ones see none)."""
    return key_start // query_tile * query_tile


def _key_tiles(n_queries: int, n_keys: int, is_causal: bool, key_tile: int, query_tile: int):
    """(key start, key end, first query) of every key tile that some query sees."""
    for start in range(0, n_keys, key_tile):
        first_query = _causal_first_query(start, query_tile) if is_causal else 0
        if first_query < n_queries:
            yield start, min(start + key_tile, n_keys), first_query


class FlashAttentionPytorch(torch.autograd.Function):
    """``FlashAttentionPytorch.apply(Q, K, V, is_causal)``: FlashAttention-2 tiling in PyTorch.

    Q: (batch, n_queries, d), K and V: (batch, n_keys, d) -> O: (batch, n_queries, d).
    The outer loop of FlashAttention-2 runs one program per query tile, each streaming the key
    tiles with an online softmax. Those programs are independent, so here they run in lock-step:
    each step takes one key tile against every query tile that sees it. Saves Q, K, V, O and
    L: (batch, n_queries); 16-bit inputs are computed in float32.
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        check_attention_inputs(Q, K, V, is_causal)
        work = torch.float32
        batch, n_queries, d = Q.shape
        n_keys = K.shape[1]
        scale = d ** -0.5
        q, k, v = Q.to(work), K.to(work), V.to(work)
        m = torch.full((batch, n_queries), float("-inf"), dtype=work, device=Q.device)
        l = torch.zeros((batch, n_queries), dtype=work, device=Q.device)
        acc = torch.zeros((batch, n_queries, d), dtype=work, device=Q.device)
        for ks, ke, q0 in _key_tiles(n_queries, n_keys, is_causal, FLASH_PYTORCH_KEY_TILE, FLASH_PYTORCH_QUERY_TILE):
            s = (q[:, q0:] @ k[:, ks:ke].transpose(1, 2)) * scale
            if is_causal:
                s.masked_fill_(causal_mask(n_queries - q0, ke - ks, Q.device, q0, ks), float("-inf"))
            m_old = m[:, q0:]
            m_new = torch.maximum(m_old, s.amax(dim=-1))
            # Every query of a tile taken here sees the tile's first key or an earlier one, so
            # m_new is finite and exp(-inf - m_new) = 0 clears the empty start.
            alpha = torch.exp(m_old - m_new)
            p = torch.exp(s - m_new[..., None])
            l[:, q0:] = l[:, q0:] * alpha + p.sum(dim=-1)
            acc[:, q0:] = acc[:, q0:] * alpha[..., None] + p @ v[:, ks:ke]
            m[:, q0:] = m_new
        O = (acc / l[..., None]).to(Q.dtype)
        L = (m + torch.log(l)).to(torch.float32)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        is_causal = ctx.is_causal
        work = torch.float32
        batch, n_queries, d = Q.shape
        n_keys = K.shape[1]
        scale = d ** -0.5
        q, k, v, do = Q.to(work), K.to(work), V.to(work), dO.to(work)
        lse = L.to(work)
        D = (do * O.to(work)).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP), the softmax's Jacobian term
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        # FlashAttention-2's backward: each key tile owns its dK, dV and streams the query tiles.
        for ks, ke, q0 in _key_tiles(n_queries, n_keys, is_causal, FLASH_PYTORCH_KEY_TILE, FLASH_PYTORCH_QUERY_TILE):
            s = (q[:, q0:] @ k[:, ks:ke].transpose(1, 2)) * scale
            if is_causal:
                s.masked_fill_(causal_mask(n_queries - q0, ke - ks, Q.device, q0, ks), float("-inf"))
            p = torch.exp(s - lse[:, q0:, None])
            dv[:, ks:ke] = p.transpose(1, 2) @ do[:, q0:]
            dp = do[:, q0:] @ v[:, ks:ke].transpose(1, 2)
            ds = p * (dp - D[:, q0:, None]) * scale
            dq[:, q0:] += ds @ k[:, ks:ke]
            dk[:, ks:ke] = ds.transpose(1, 2) @ q[:, q0:]
        return dq.to(Q.dtype), dk.to(K.dtype), dv.to(V.dtype), None


# ----------------------------------------------------------------------------------------------
# FlashAttention-2 in Triton
# ----------------------------------------------------------------------------------------------
# Every kernel splits its stream of tiles in two: tiles that need no mask (all keys exist and,
# when causal, every query of the program sees every key of the tile), then the few that do
# (the causal diagonal and the ragged end). The mask costs a compare and a select per logit, so
# keeping it off the bulk of the tiles matters on a GPU. Rows past the end of the queries are
# harmless without a mask: they load zeros (and L = +inf in the backward, so their P is 0) and
# are never stored. Logits are kept in base-2 units (scaled by log2(e)) so that each exponential
# is one exp2.
@triton.jit
def _flash_tile_ptrs(ptr, batch, rows, dims, stride_b, stride_row, stride_dim):
    """Pointers to a (rows x head dims) tile of one batch element of a (batch, n, d) tensor."""
    return ptr + batch * stride_b + rows[:, None] * stride_row + dims[None, :] * stride_dim


@triton.jit
def _flash_heavy_first(IS_CAUSAL: tl.constexpr):
    """This program's query tile. Grids are (batch, tiles) and launch in order with batch
    fastest; under causal masking the last query tiles see the most keys, so they go first and
    the short ones fill in the tail instead of the long ones running alone at the end."""
    tile = tl.program_id(1)
    if IS_CAUSAL:
        tile = tl.num_programs(1) - 1 - tile
    return tile


@triton.jit
def _flash_key_range(query_start, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """(full_end, key_end) for the query tile at query_start: key tiles before full_end need no
    mask, those from there to key_end do (the causal diagonal, the ragged last tile)."""
    if IS_CAUSAL:
        # Keys before query_start are seen by every query of the tile; the diagonal ends the stream.
        full_end = tl.minimum(query_start, n_keys) // BLOCK_N * BLOCK_N
        key_end = tl.minimum(n_keys, query_start + BLOCK_M)
    else:
        full_end = n_keys // BLOCK_N * BLOCK_N
        key_end = n_keys
    return full_end, key_end


@triton.jit
def _flash_load_key_tile(k_ptrs, v_ptrs, start, stride_kn, stride_vn, keys, n_keys, MASKED: tl.constexpr):
    """The K and V rows of one key tile; keys past the end read as 0 where a mask is needed."""
    if MASKED:
        key_ok = keys < n_keys
        k = tl.load(k_ptrs + start * stride_kn, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs + start * stride_vn, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start * stride_kn)
        v = tl.load(v_ptrs + start * stride_vn)
    return k, v


@triton.jit
def _flash_visible(rows, keys, n_keys, IS_CAUSAL: tl.constexpr):
    """(queries x keys) True where the query sees the key: the key exists and, if causal, j <= i."""
    visible = (keys < n_keys)[None, :]
    if IS_CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
    return visible


@triton.jit
def _flash_forward_tiles(
    acc, m, l, q, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, key_start, key_end, n_keys, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """The online softmax over key tiles [key_start, key_end) for one query tile."""
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k, v = _flash_load_key_tile(k_ptrs, v_ptrs, start, stride_kn, stride_vn, keys, n_keys, MASKED)
        s = _dot_acc(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), tl.float32), PRECISION, UPCAST)
        # Each row's first tile holds a key it sees (key 0, or for causal a key <= its own
        # index), so m_new is finite from the first tile on and exp2(-inf - m_new) = 0.
        if MASKED:
            s = tl.where(_flash_visible(rows, keys, n_keys, IS_CAUSAL), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # Scaling the row maxima rather than the tile saves a pass over the logits: the
            # scale rides in the one multiply-add before exp2 (rounding is monotone, so the
            # scaled maximum is the maximum of the scaled logits).
            m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m = m_new
    return acc, m, l


@triton.jit
def flash_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    n_queries, n_keys, qk_scale,
    stride_qb, stride_qm, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_ob, stride_om, stride_od,
    stride_lb, stride_lm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: BLOCK_M queries of one batch element against all the keys they see (grid: batch x query tiles)."""
    batch = tl.program_id(0).to(tl.int64)
    query_start = _flash_heavy_first(IS_CAUSAL) * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(_flash_tile_ptrs(q_ptr, batch, rows, dims, stride_qb, stride_qm, stride_qd),
                mask=row_ok[:, None], other=0.0)
    tile_keys = tl.arange(0, BLOCK_N)
    k_ptrs = _flash_tile_ptrs(k_ptr, batch, tile_keys, dims, stride_kb, stride_kn, stride_kd)
    v_ptrs = _flash_tile_ptrs(v_ptr, batch, tile_keys, dims, stride_vb, stride_vn, stride_vd)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    full_end, key_end = _flash_key_range(query_start, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m, l = _flash_forward_tiles(acc, m, l, q, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_end,
                                     n_keys, qk_scale, BLOCK_N, False, IS_CAUSAL, PRECISION, UPCAST)
    acc, m, l = _flash_forward_tiles(acc, m, l, q, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, full_end, key_end,
                                     n_keys, qk_scale, BLOCK_N, True, IS_CAUSAL, PRECISION, UPCAST)

    out = acc / l[:, None]
    tl.store(_flash_tile_ptrs(o_ptr, batch, rows, dims, stride_ob, stride_om, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    # Back from base 2: L = ln(sum exp(S)) = (m + log2(l)) * ln(2).
    tl.store(lse_ptr + batch * stride_lb + rows * stride_lm, (m + tl.math.log2(l)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def flash_attention_backward_rowdot_kernel(
    o_ptr, do_ptr, delta_ptr, n_queries,
    stride_ob, stride_om, stride_od,
    stride_gb, stride_gm, stride_gd,
    stride_db, stride_dm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """D = rowsum(dO * O) for BLOCK_M queries (grid: batch x query tiles): the softmax Jacobian's row term."""
    batch = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims = tl.arange(0, HEAD_DIM)
    o = tl.load(_flash_tile_ptrs(o_ptr, batch, rows, dims, stride_ob, stride_om, stride_od),
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(_flash_tile_ptrs(do_ptr, batch, rows, dims, stride_gb, stride_gm, stride_gd),
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + batch * stride_db + rows * stride_dm, tl.sum(o * do, axis=1), mask=row_ok)


@triton.jit
def _flash_dkdv_tiles(
    dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_gm, stride_lm, stride_dm,
    query_start, query_end, n_queries, qk_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dK and dV of one key tile from query tiles [query_start, query_end), in key-major layout.

    With S^T = K Q^T (keys x queries) every product takes its operands as loaded:
    dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - D), dK += dS^T Q (scaled by the caller).
    """
    for start in range(query_start, query_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_queries
        q = tl.load(q_ptrs + start * stride_qm, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs + start * stride_gm, mask=row_ok[:, None], other=0.0)
        # L = +inf past the last query makes those columns of P exactly 0.
        lse = tl.load(lse_ptrs + rows * stride_lm, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_ptrs + rows * stride_dm, mask=row_ok, other=0.0)
        sT = _dot_acc(k, tl.trans(q), tl.zeros((k.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        if MASKED:
            pT = tl.where(keys[:, None] <= rows[None, :], pT, 0.0)
        dv = _dot_acc(pT.to(do.dtype), do, dv, PRECISION, UPCAST)
        dpT = _dot_acc(v, tl.trans(do), tl.zeros((k.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        dsT = pT * (dpT - delta[None, :])
        dk = _dot_acc(dsT.to(q.dtype), q, dk, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def flash_attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    n_queries, n_keys, sm_scale, qk_scale,
    stride_qb, stride_qm, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_gb, stride_gm, stride_gd,
    stride_lb, stride_lm,
    stride_db, stride_dm,
    stride_dkb, stride_dkn, stride_dkd,
    stride_dvb, stride_dvn, stride_dvd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program owns BLOCK_N keys and their dK, dV, streaming the queries that see them.

    Each key's gradient is summed by one program only, so no atomics (grid: batch x key tiles).
    """
    # Under causal masking the first key tiles are seen by the most queries: the natural order
    # already launches the longest programs first.
    batch = tl.program_id(0).to(tl.int64)
    key_start = tl.program_id(1) * BLOCK_N
    keys = key_start + tl.arange(0, BLOCK_N)
    key_ok = keys < n_keys
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(_flash_tile_ptrs(k_ptr, batch, keys, dims, stride_kb, stride_kn, stride_kd),
                mask=key_ok[:, None], other=0.0)
    v = tl.load(_flash_tile_ptrs(v_ptr, batch, keys, dims, stride_vb, stride_vn, stride_vd),
                mask=key_ok[:, None], other=0.0)
    tile_rows = tl.arange(0, BLOCK_M)
    q_ptrs = _flash_tile_ptrs(q_ptr, batch, tile_rows, dims, stride_qb, stride_qm, stride_qd)
    do_ptrs = _flash_tile_ptrs(do_ptr, batch, tile_rows, dims, stride_gb, stride_gm, stride_gd)
    lse_ptrs = lse_ptr + batch * stride_lb
    delta_ptrs = delta_ptr + batch * stride_db

    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    if IS_CAUSAL:
        # Queries before key_start see none of these keys; from the tile holding query
        # key_start + BLOCK_N - 1 on, every query sees all of them.
        diagonal_start = key_start // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(key_start + BLOCK_N, BLOCK_M) * BLOCK_M
        dk, dv = _flash_dkdv_tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs,
                                   stride_qm, stride_gm, stride_lm, stride_dm,
                                   diagonal_start, tl.minimum(full_start, n_queries), n_queries, qk_scale,
                                   BLOCK_M, True, PRECISION, UPCAST)
    else:
        full_start = 0
    dk, dv = _flash_dkdv_tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs,
                               stride_qm, stride_gm, stride_lm, stride_dm,
                               full_start, n_queries, n_queries, qk_scale,
                               BLOCK_M, False, PRECISION, UPCAST)
    # S = scale * Q K^T, so dK picks up the scale; the logits' log2(e) lives only inside exp2.
    dk = dk * sm_scale
    tl.store(_flash_tile_ptrs(dk_ptr, batch, keys, dims, stride_dkb, stride_dkn, stride_dkd),
             dk.to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(_flash_tile_ptrs(dv_ptr, batch, keys, dims, stride_dvb, stride_dvn, stride_dvd),
             dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _flash_dq_tiles(
    dq, q, do, lse, delta, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, key_start, key_end, n_keys, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dQ of one query tile from key tiles [key_start, key_end): dQ += dS K (scaled by the caller)."""
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k, v = _flash_load_key_tile(k_ptrs, v_ptrs, start, stride_kn, stride_vn, keys, n_keys, MASKED)
        s = _dot_acc(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), tl.float32), PRECISION, UPCAST)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_flash_visible(rows, keys, n_keys, IS_CAUSAL), p, 0.0)
        dp = _dot_acc(do, tl.trans(v), tl.zeros((q.shape[0], BLOCK_N), tl.float32), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _dot_acc(ds.to(k.dtype), k, dq, PRECISION, UPCAST)
    return dq


@triton.jit
def flash_attention_backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    n_queries, n_keys, sm_scale, qk_scale,
    stride_qb, stride_qm, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_gb, stride_gm, stride_gd,
    stride_lb, stride_lm,
    stride_db, stride_dm,
    stride_dqb, stride_dqm, stride_dqd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program owns BLOCK_M queries and their dQ, streaming the keys they see like the forward.

    It recomputes S and dP that the dK/dV kernel also computed: two more products than one fused
    kernel, bought back by needing no atomic adds into dQ (grid: batch x query tiles).
    """
    batch = tl.program_id(0).to(tl.int64)
    query_start = _flash_heavy_first(IS_CAUSAL) * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(_flash_tile_ptrs(q_ptr, batch, rows, dims, stride_qb, stride_qm, stride_qd),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(_flash_tile_ptrs(do_ptr, batch, rows, dims, stride_gb, stride_gm, stride_gd),
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + batch * stride_lb + rows * stride_lm, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + batch * stride_db + rows * stride_dm, mask=row_ok, other=0.0)
    tile_keys = tl.arange(0, BLOCK_N)
    k_ptrs = _flash_tile_ptrs(k_ptr, batch, tile_keys, dims, stride_kb, stride_kn, stride_kd)
    v_ptrs = _flash_tile_ptrs(v_ptr, batch, tile_keys, dims, stride_vb, stride_vn, stride_vd)

    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    full_end, key_end = _flash_key_range(query_start, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _flash_dq_tiles(dq, q, do, lse, delta, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_end,
                         n_keys, qk_scale, BLOCK_N, False, IS_CAUSAL, PRECISION, UPCAST)
    dq = _flash_dq_tiles(dq, q, do, lse, delta, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, full_end, key_end,
                         n_keys, qk_scale, BLOCK_N, True, IS_CAUSAL, PRECISION, UPCAST)
    dq = dq * sm_scale
    tl.store(_flash_tile_ptrs(dq_ptr, batch, rows, dims, stride_dqb, stride_dqm, stride_dqd),
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@dataclass(frozen=True)
class FlashLaunch:
    """One kernel's launch: queries per tile (block_m), keys per tile (block_n), warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def check(self, kernel: str) -> None:
        check_block(f"{kernel}.block_m", self.block_m, 16, 256)
        check_block(f"{kernel}.block_n", self.block_n, 16, 256)
        check_block(f"{kernel}.num_warps", self.num_warps, 1, 16)
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"{kernel}.num_stages must be an int from 1 to 8, got {self.num_stages!r}")


FLASH_KERNELS = ("forward", "dkdv", "dq")


def flash_launches(d: int, dtype: torch.dtype) -> dict[str, FlashLaunch]:
    """The wrapper's launch for each kernel on an H100, by head dimension and dtype.

    Untuned first choices, argued from the hardware (tune them: see ``FlashAttentionTriton``).
    * 16-bit forward: 128 queries per program and 8 warps, two Hopper warpgroups of 64 rows, the
      height of one wgmma; 128 queries also halve the K/V re-reads against 64. Key tiles of 128
      while K and V are narrow (d <= 32), 64 from d = 64 on, so the fp32 logits (128 x 64 = 32
      registers a thread) and the fp32 accumulator fit beside each other without spilling.
      Three stages: K and V tiles of 64 x 128 x 2 bytes each, times three, sit well inside the
      228 KB of shared memory.
    * float32 forward: tf32x3 runs three products from split operands, and each operand tile is
      twice the bytes: 64 queries (one warpgroup, 4 warps) and key tiles of 64, 32 at d = 128.
    * dK/dV: a program holds K, V and two fp32 accumulators of block_n x d, and streams narrow
      query tiles (32) so the transposed logits and dP beside them stay small.
    * dQ: like the forward, but with dQ, Q, dO in registers the streamed key tile stays at 32.
    """
    if d not in FLASH_HEAD_DIMS:
        raise ValueError(f"d (the last dimension of Q, K, V) must be one of {FLASH_HEAD_DIMS}, got {d}")
    if dtype == torch.float32:
        if d <= 64:
            return {"forward": FlashLaunch(64, 64, 4, 3), "dkdv": FlashLaunch(32, 64, 4, 2),
                    "dq": FlashLaunch(64, 32, 4, 2)}
        return {"forward": FlashLaunch(64, 32, 4, 2), "dkdv": FlashLaunch(16, 32, 4, 2),
                "dq": FlashLaunch(32, 16, 4, 2)}
    if d <= 32:
        return {"forward": FlashLaunch(128, 128, 8, 3), "dkdv": FlashLaunch(32, 128, 8, 3),
                "dq": FlashLaunch(128, 32, 8, 3)}
    if d == 64:
        # Swept on an H100 at (16, 8192, 64) bf16 causal, one kernel's launch varied at a time:
        # dK/dV 64 x 128 on one warpgroup took forward+backward from 1.75 to 1.48 ms, dQ 64 x 64
        # saved 0.04 ms more; the forward's choice was within 1 % of the best tried.
        return {"forward": FlashLaunch(128, 64, 8, 3), "dkdv": FlashLaunch(64, 128, 4, 3),
                "dq": FlashLaunch(64, 64, 4, 3)}
    return {"forward": FlashLaunch(128, 64, 8, 2), "dkdv": FlashLaunch(32, 64, 8, 2),
            "dq": FlashLaunch(64, 32, 4, 2)}


def resolve_flash_launches(d: int, dtype: torch.dtype, launches: dict | None) -> dict[str, FlashLaunch]:
    """``flash_launches`` with any kernel's launch replaced by ``launches[kernel]`` (for tuning)."""
    chosen = flash_launches(d, dtype)
    if launches is None:
        return chosen
    if not isinstance(launches, dict):
        raise TypeError(f"launches must be a dict of kernel name -> FlashLaunch, got {type(launches).__name__}")
    for kernel, launch in launches.items():
        if kernel not in FLASH_KERNELS:
            raise ValueError(f"launches has unknown kernel {kernel!r}: the kernels are {FLASH_KERNELS}")
        if not isinstance(launch, FlashLaunch):
            raise TypeError(f"launches[{kernel!r}] must be a FlashLaunch, got {type(launch).__name__}")
        launch.check(f"launches[{kernel!r}]")
        chosen[kernel] = launch
    return chosen


# The rowsum kernel only streams O and dO: 64 rows of up to 128 values, 4 warps, many programs.
ROWDOT_BLOCK_M = 64


def flash_attention_forward(Q, K, V, is_causal: bool, launch: FlashLaunch):
    """O: (batch, n_queries, d) in Q's dtype and L: (batch, n_queries) float32, by the Triton kernel."""
    batch, n_queries, d = Q.shape
    n_keys = K.shape[1]
    O = torch.empty((batch, n_queries, d), dtype=Q.dtype, device=Q.device)
    L = torch.empty((batch, n_queries), dtype=torch.float32, device=Q.device)
    if O.numel() == 0:
        return O, L
    grid = (batch, triton.cdiv(n_queries, launch.block_m))
    flash_attention_forward_kernel[grid](
        Q, K, V, O, L, n_queries, n_keys, d ** -0.5 * LOG2_E,
        *Q.stride(), *K.stride(), *V.stride(), *O.stride(), *L.stride(),
        HEAD_DIM=d, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, IS_CAUSAL=is_causal,
        PRECISION=dot_precision(Q.dtype), UPCAST=upcast_dot_operands(Q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return O, L


def flash_attention_backward(Q, K, V, O, L, dO, is_causal: bool, launches: dict[str, FlashLaunch]):
    """dQ, dK, dV in the inputs' dtype: the rowsum kernel, then dK/dV over key tiles, then dQ over query tiles."""
    batch, n_queries, d = Q.shape
    n_keys = K.shape[1]
    dQ, dK, dV = torch.empty_like(Q), torch.empty_like(K), torch.empty_like(V)
    if dO.dtype != Q.dtype:
        dO = dO.to(Q.dtype)  # an upstream gradient of another dtype: the products need one operand type
    if batch == 0 or n_queries == 0:
        return dQ.zero_(), dK.zero_(), dV.zero_()
    delta = torch.empty((batch, n_queries), dtype=torch.float32, device=Q.device)
    flash_attention_backward_rowdot_kernel[(batch, triton.cdiv(n_queries, ROWDOT_BLOCK_M))](
        O, dO, delta, n_queries, *O.stride(), *dO.stride(), *delta.stride(),
        HEAD_DIM=d, BLOCK_M=ROWDOT_BLOCK_M, num_warps=4,
    )
    common = dict(HEAD_DIM=d, IS_CAUSAL=is_causal, PRECISION=dot_precision(Q.dtype), UPCAST=upcast_dot_operands(Q.dtype))
    scales = (d ** -0.5, d ** -0.5 * LOG2_E)
    inputs = (*Q.stride(), *K.stride(), *V.stride(), *dO.stride(), *L.stride(), *delta.stride())
    kv = launches["dkdv"]
    flash_attention_backward_dkdv_kernel[(batch, triton.cdiv(n_keys, kv.block_n))](
        Q, K, V, dO, L, delta, dK, dV, n_queries, n_keys, *scales, *inputs, *dK.stride(), *dV.stride(),
        BLOCK_M=kv.block_m, BLOCK_N=kv.block_n, num_warps=kv.num_warps, num_stages=kv.num_stages, **common,
    )
    qd = launches["dq"]
    flash_attention_backward_dq_kernel[(batch, triton.cdiv(n_queries, qd.block_m))](
        Q, K, V, dO, L, delta, dQ, n_queries, n_keys, *scales, *inputs, *dQ.stride(),
        BLOCK_M=qd.block_m, BLOCK_N=qd.block_n, num_warps=qd.num_warps, num_stages=qd.num_stages, **common,
    )
    return dQ, dK, dV


class FlashAttentionTriton(torch.autograd.Function):
    """``FlashAttentionTriton.apply(Q, K, V, is_causal[, launches])``: FlashAttention-2 in Triton.

    Q: (batch, n_queries, d), K and V: (batch, n_keys, d), d in ``FLASH_HEAD_DIMS`` -> O, in Q's
    dtype. Saves Q, K, V, O and L: (batch, n_queries) float32; the backward is three Triton kernels.
    ``launches`` maps any of "forward", "dkdv", "dq" to a ``FlashLaunch`` replacing the wrapper's
    choice (``flash_launches``), for tuning on a GPU.
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, launches=None):
        check_attention_inputs(Q, K, V, is_causal)
        chosen = resolve_flash_launches(Q.shape[2], Q.dtype, launches)
        O, L = flash_attention_forward(Q, K, V, is_causal, chosen["forward"])
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        ctx.launches = chosen
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        dQ, dK, dV = flash_attention_backward(Q, K, V, O, L, dO, ctx.is_causal, ctx.launches)
        return dQ, dK, dV, None, None


# ----------------------------------------------------------------------------------------------
# softmax(x) @ V on Hopper in Gluon
# ----------------------------------------------------------------------------------------------
# Why a second kernel for the same product: on an H100 triton 3.6 compiles ``fused_softmax_kernel``
# so that each warpgroup MMA is waited for right after it is issued (its A operand, the softmax
# weights, is computed in the loop), and a program alternates between the softmax of a tile and
# its product; the tensor pipe is 31.5 % busy at the spec shape (outputs/README.md). Gluon, the
# lower-level language inside triton, states the layouts, the shared-memory buffers, the barriers
# and the warp partitions itself, so the overlap can be written down instead of hoped for:
#
# * One program owns BLOCK_M rows of x and BLOCK_D3 columns of V in one batch element.
# * A loader partition (one warp) streams x tiles (BLOCK_M x BLOCK_N) and V tiles (BLOCK_N x
#   BLOCK_D3) by TMA into a ring of STAGES slots. x and V have their own "ready" and "free"
#   mbarriers per slot, since an x tile is free as soon as it is in registers while a V tile is
#   only free once the product reading it has finished.
# * The default partition (one warpgroup) computes the online softmax of step i while the
#   asynchronous warpgroup MMA of step i - 1 runs; it waits for that product only when it must
#   rescale the accumulator and issue the next one. The weights go to the MMA from registers.
#
# Tiles. BLOCK_M = 64 is one warpgroup MMA's height over the warpgroup's 4 warps. Every register
# budget below is per thread of the 128: the float32 accumulator (64 x BLOCK_D3) costs BLOCK_D3 / 2
# and the float32 logits of a step (64 x BLOCK_N) BLOCK_N / 2, so BLOCK_D3 = BLOCK_N = 128 hold
# 128 registers of live tiles, with room for the weights and row statistics under the 255 limit.
# A wider d3 is split over programs (d3 = 512: four programs per row block, numbered together so
# that three of them read x from L2); each recomputes its rows' softmax, work that 256-wide d3
# tiles halve (``gluon_softmax_launch``).
# TMA needs 16-byte aligned base and strides and a contiguous last dimension (``gluon_softmax_applies``);
# its descriptors here are 3-D, (batch, rows, columns), so a tile past d1, d2 or d3 reads zeros
# from the hardware instead of the next batch element's data. Columns of x past d2 are then
# masked to -inf in registers (zeros are not neutral for a softmax), and V's zero rows past d2
# meet zero weights.
GLUON_BLOCK_M = 64
GLUON_STAGES = 3  # 3 x (64 x 128 + 128 x 128) x 2 B = 144 KiB of the 227 KiB a program may have
GLUON_LOADER_REGISTERS = 40  # the loader only computes TMA coordinates; setmaxnreg wants a multiple of 8

_GLUON_DTYPES = (torch.float16, torch.bfloat16)


def _import_gluon():
    """Gluon's modules, or the reason they are unusable here (None in the interpreter: Gluon kernels only compile)."""
    if INTERPRET:
        return None, "Gluon kernels do not run in the Triton interpreter"
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except Exception as error:  # an older or newer triton whose Gluon lacks these names
        return None, f"triton {triton.__version__} has no usable Gluon for Hopper ({error!r})"
    return (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
            TensorDescriptor), None


_GLUON, GLUON_UNAVAILABLE = _import_gluon()
if _GLUON is not None:
    (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
     GluonTensorDescriptor) = _GLUON
    # The TMA load was renamed after triton 3.6 (the old name now raises); same arguments.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def gluon_softmax_unsupported(x: torch.Tensor, V: torch.Tensor) -> str | None:
    """Why ``fused_softmax_gluon`` cannot take (x, V), or None when it can.

    It needs an sm_90 GPU with Gluon, float16 or bfloat16, non-empty inputs and what TMA needs:
    a contiguous last dimension, 16-byte aligned base addresses and other strides.
    """
    if GLUON_UNAVAILABLE is not None:
        return GLUON_UNAVAILABLE
    if not (isinstance(x, torch.Tensor) and isinstance(V, torch.Tensor)) or x.dim() != 3 or V.dim() != 3:
        return "x and V must be 3-D tensors"
    if x.device.type != "cuda" or V.device != x.device:
        return "x and V must be on one CUDA device"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) != (9, 0):
        return f"the kernel is written for sm_90 (Hopper), this GPU is sm_{major}{minor}"
    if x.dtype not in _GLUON_DTYPES or V.dtype != x.dtype:
        return f"x and V must both be float16 or bfloat16, got {x.dtype} and {V.dtype}"
    if x.shape[0] != V.shape[0] or x.shape[2] != V.shape[1]:
        return f"shapes {tuple(x.shape)} and {tuple(V.shape)} do not make softmax(x) @ V"
    if x.numel() == 0 or V.numel() == 0:
        return "empty inputs have no TMA descriptor (fused_softmax handles them)"
    if x.shape[0] > 65535:
        return f"a batch of {x.shape[0]} is past the 65535 programs a grid's second axis can have"
    for name, t in (("x", x), ("V", V)):
        if t.stride(2) != 1:
            return f"{name}'s last dimension must be contiguous for TMA, its strides are {t.stride()}"
        if t.data_ptr() % 16 or any(s <= 0 or s * t.element_size() % 16 for s in t.stride()[:2]):
            return (f"TMA needs {name}'s address and its first two strides in bytes to be positive multiples of "
                    f"16, got strides {t.stride()} of {t.element_size()}-byte elements")
    return None


def gluon_softmax_applies(x: torch.Tensor, V: torch.Tensor) -> bool:
    """Whether ``fused_softmax_gluon`` takes these inputs (the reason when not: ``gluon_softmax_unsupported``)."""
    return gluon_softmax_unsupported(x, V) is None


@dataclass(frozen=True)
class GluonSoftmaxLaunch:
    """Tiles of ``fused_softmax_gluon``: d2 per step (block_n), d3 per program (block_d3), ring slots.

    maxnreg caps the registers per thread at launch (the consumer warpgroup then raises its own
    share, the loader lowers its). 128 with 2 slots of 128-wide tiles fits two programs per SM
    (2 x 8 warps x 128 registers, 2 x 96 KiB), so one program's softmax can run under the other's
    MMA; it compiles without spilling. None leaves triton's default (one program per SM).
    """

    block_n: int
    block_d3: int
    stages: int = GLUON_STAGES
    maxnreg: int | None = None

    def check(self) -> None:
        check_block("block_n", self.block_n, 16, 256)
        check_block("block_d3", self.block_d3, 16, 256)  # 256: the widest warpgroup MMA and TMA box
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not 2 <= self.stages <= 4:
            raise ValueError(f"stages must be an int from 2 to 4, got {self.stages!r}")
        if self.maxnreg is not None and self.maxnreg not in range(64, 257, 8):
            raise ValueError(f"maxnreg must be None or a multiple of 8 from 64 to 256, got {self.maxnreg!r}")
        ring = self.stages * (GLUON_BLOCK_M * self.block_n + self.block_n * self.block_d3) * 2
        if ring > _SHARED_MEMORY_BUDGET:
            raise KernelCapacityError(
                f"{self.stages} slots of {GLUON_BLOCK_M} x {self.block_n} x tiles and {self.block_n} x {self.block_d3} "
                f"V tiles need {ring // 1024} KiB of shared memory, more than {_SHARED_MEMORY_BUDGET // 1024} KiB")


def gluon_softmax_launch(d2: int, d3: int) -> GluonSoftmaxLaunch:
    """128-wide tiles (the register budget above), narrower only where d2 or d3 is smaller.

    16 is the least: the MMA's K step for 16-bit operands, and 32 bytes of a TMA box row. Wider d3
    tiles (256, with 2 slots of 128-wide steps or 4 of 64) also compile without spilling and halve
    the softmax work repeated per d3 tile; which is faster is for an H100 to say
    (outputs/profiles/gluon_fused_check.py times them).
    """
    return GluonSoftmaxLaunch(block_n=max(16, min(128, triton.next_power_of_2(d2))),
                              block_d3=max(16, min(128, triton.next_power_of_2(d3))))


if _GLUON is not None:

    @gluon.jit
    def _gluon_softmax_loader(x_desc, v_desc, x_bufs, v_bufs, x_ready, x_free, v_ready, v_free,
                              batch, off_m, off_d3, n_steps):
        """The producer: one warp issuing the TMA copies of every step's x and V tiles into the ring."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[2]
        for i in range(n_steps):
            slot = i % STAGES
            # Each pass through the ring completes one phase of a slot's barriers. A fresh mbarrier
            # behaves as if the phase before phase 0 had completed, so on the first pass the
            # waits for "free" (phase ^ 1 = 1) return at once.
            phase = (i // STAGES) & 1
            mbarrier.wait(x_free.index(slot), phase ^ 1)
            mbarrier.expect(x_ready.index(slot), x_desc.block_type.nbytes)
            _tma_load(x_desc, [batch, off_m, i * BLOCK_N], x_ready.index(slot), x_bufs.index(slot))
            mbarrier.wait(v_free.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [batch, i * BLOCK_N, off_d3], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _gluon_softmax_consumer(x_bufs, v_bufs, x_ready, x_free, v_ready, v_free,
                                o_ptr, stride_ob, stride_o1, stride_o3, batch, off_m, off_d3, d1, d2, d3, n_steps,
                                s_layout: gl.constexpr, acc_layout: gl.constexpr, p_layout: gl.constexpr):
        """The default partition: online softmax of step i overlapping the MMA of step i - 1; then the output."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = x_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = x_bufs.type.shape[3]
        BLOCK_D3: gl.constexpr = v_bufs.type.shape[3]
        dtype: gl.constexpr = x_bufs.dtype
        LOG2E: gl.constexpr = 1.4426950408889634
        rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)

        m = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_l)
        l = gl.zeros([BLOCK_M], gl.float32, rows_l)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_D3], gl.float32, acc_layout))
        p = gl.zeros([BLOCK_M, BLOCK_N], dtype, p_layout)
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        for i in range(n_steps):
            slot = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(x_ready.index(slot), phase)
            s = x_bufs.index(slot).reshape([BLOCK_M, BLOCK_N]).load(s_layout).to(gl.float32)
            # The generic-proxy read of the slot must precede the TMA that refills it. (An arrive
            # is one thread's, after a barrier of the partition's warps: triton puts it there.)
            fence_async_shared()
            mbarrier.arrive(x_free.index(slot))

            # Columns past d2 came in as zeros: they must weigh nothing.
            s = gl.where(gl.expand_dims(i * BLOCK_N + cols < d2, 0), s, float("-inf"))
            m_new = gl.maximum(m, gl.max(s, axis=1))
            # A row that has seen only -inf keeps m = -inf: exp(-inf - -inf) would be NaN.
            live = m_new > float("-inf")
            alpha = gl.where(live, gl.exp2((m - m_new) * LOG2E), 1.0)
            w = gl.where(gl.expand_dims(live, 1), gl.exp2((s - gl.expand_dims(m_new, 1)) * LOG2E), 0.0).to(dtype)
            # The weights are summed as rounded for the product, so they are normalised as used.
            l = l * alpha + gl.sum(w.to(gl.float32), axis=1)
            m = m_new

            # Step i - 1's product must be done before acc is rescaled and its V slot refilled;
            # its A operand p lives in registers and must not be overwritten until then either.
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_free.index((i + STAGES - 1) % STAGES), pred=i > 0)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout)), 1)
            p = gl.convert_layout(w, p_layout)
            mbarrier.wait(v_ready.index(slot), phase)
            acc = warpgroup_mma(p, v_bufs.index(slot).reshape([BLOCK_N, BLOCK_D3]), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))

        # A row of only -inf has l = 0 and acc = 0: 0 / 0 is NaN, torch's answer for that row.
        out = acc / gl.expand_dims(gl.convert_layout(l, gl.SliceLayout(1, acc_layout)), 1)
        rows = off_m + gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
        out_cols = off_d3 + gl.arange(0, BLOCK_D3, gl.SliceLayout(0, acc_layout))
        o_ptrs = (o_ptr + batch.to(gl.int64) * stride_ob + gl.expand_dims(rows.to(gl.int64) * stride_o1, 1)
                  + gl.expand_dims(out_cols * stride_o3, 0))
        mask = gl.expand_dims(rows < d1, 1) & gl.expand_dims(out_cols < d3, 0)
        gl.store(o_ptrs, out.to(dtype), mask=mask)

    @gluon.jit
    def fused_softmax_gluon_kernel(x_desc, v_desc, o_ptr, stride_ob, stride_o1, stride_o3, d1, d2, d3, n_tiles_d3,
                                   STAGES: gl.constexpr, LOADER_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        """softmax(x) @ V for one (BLOCK_M rows, BLOCK_D3 columns) tile of one batch element's output."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[2]
        BLOCK_D3: gl.constexpr = v_desc.block_type.shape[2]
        dtype: gl.constexpr = x_desc.dtype
        gl.static_assert(num_warps == 4, "one consumer warpgroup")
        gl.static_assert(BLOCK_M == 16 * num_warps, "BLOCK_M is one warpgroup MMA's height")

        tile = gl.program_id(0)
        batch = gl.program_id(1)
        off_m = (tile // n_tiles_d3) * BLOCK_M
        off_d3 = (tile % n_tiles_d3) * BLOCK_D3
        n_steps = gl.cdiv(d2, BLOCK_N)

        # The accumulator's layout fixes the MMA: 16 rows per warp, BLOCK_D3 columns per
        # instruction, K of 16 (16-bit operands). The logits use the same row distribution
        # (N = BLOCK_N), so their row statistics line up with the accumulator's rows, and the
        # weights move from it to the MMA's register operand layout.
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_D3, 16])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

        x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        x_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(slot), count=1)
            mbarrier.init(x_free.index(slot), count=1)
            mbarrier.init(v_ready.index(slot), count=1)
            mbarrier.init(v_free.index(slot), count=1)

        gl.warp_specialize([
            (_gluon_softmax_consumer, (x_bufs, v_bufs, x_ready, x_free, v_ready, v_free,
                                       o_ptr, stride_ob, stride_o1, stride_o3, batch, off_m, off_d3, d1, d2, d3,
                                       n_steps, s_layout, acc_layout, p_layout)),
            (_gluon_softmax_loader, (x_desc, v_desc, x_bufs, v_bufs, x_ready, x_free, v_ready, v_free,
                                     batch, off_m, off_d3, n_steps)),
        ], [1], [LOADER_REGISTERS])


def fused_softmax_gluon(x: torch.Tensor, V: torch.Tensor, *, launch: GluonSoftmaxLaunch | None = None) -> torch.Tensor:
    """softmax(x, dim=-1) @ V by the warp-specialised Hopper kernel; what ``fused_softmax`` computes.

    x: (batch, d1, d2), V: (batch, d2, d3), float16 or bfloat16 -> (batch, d1, d3) in x's dtype,
    accumulated in float32. Only where ``gluon_softmax_applies(x, V)``; otherwise a ValueError
    says why. ``launch`` overrides ``gluon_softmax_launch``'s tiles, for tuning.
    """
    check_softmax_matmul_inputs(x, V)
    reason = gluon_softmax_unsupported(x, V)
    if reason is not None:
        raise ValueError(f"fused_softmax_gluon cannot take these inputs: {reason}")
    batch, d1, d2 = x.shape
    d3 = V.shape[2]
    launch = launch or gluon_softmax_launch(d2, d3)
    launch.check()
    gl_dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_block = [1, GLUON_BLOCK_M, launch.block_n]
    v_block = [1, launch.block_n, launch.block_d3]
    x_desc = GluonTensorDescriptor(x, list(x.shape), list(x.stride()), x_block,
                                   gl.NVMMASharedLayout.get_default_for(x_block, gl_dtype))
    v_desc = GluonTensorDescriptor(V, list(V.shape), list(V.stride()), v_block,
                                   gl.NVMMASharedLayout.get_default_for(v_block, gl_dtype))
    out = torch.empty((batch, d1, d3), dtype=x.dtype, device=x.device)
    n_tiles_d3 = triton.cdiv(d3, launch.block_d3)
    grid = (triton.cdiv(d1, GLUON_BLOCK_M) * n_tiles_d3, batch)
    fused_softmax_gluon_kernel[grid](
        x_desc, v_desc, out, *out.stride(), d1, d2, d3, n_tiles_d3,
        STAGES=launch.stages, LOADER_REGISTERS=GLUON_LOADER_REGISTERS, num_warps=GLUON_BLOCK_M // 16,
        **({} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}),
    )
    return out
