"""Fused softmax-matmul kernels in Triton, each beside the PyTorch code it replaces.

``softmax(x) @ V`` is the inner loop of attention. PyTorch computes it in two kernels and writes
the (d1, d2) softmax to memory in between; the fused kernel keeps each block of the softmax in
registers and folds it straight into the product, so the softmax never exists in memory.

Float32 products follow ``torch.get_float32_matmul_precision()``: under 'highest' (the default)
three TF32 products (``input_precision="tf32x3"``), as accurate as float32 (on Hopper, large
softmax(x @ W) and ``matmul`` products split their operands once, beforehand:
``matmul_presplit_kernel``); under 'high' or 'medium' one TF32 product, as PyTorch's own matmuls.
Float16 and bfloat16 inputs multiply in their own precision and accumulate in float32.

Sections, each workload in the same order (header, reference, bytes and flops models, launch
type and chooser, jit helpers, kernels, wrappers, autograd):

* Shared: float32 matmul precision, ``_dot_acc``, constants, integer checks, grid and launch helpers.
* softmax(x) @ V: ``softmax_mult``, ``fused_softmax`` (the course's names).
* softmax(x @ W): ``matmul_softmax_ref`` and three Triton versions.
* Attention: ``attention_reference``, ``FlashAttentionPytorch``, ``FlashAttentionTriton``.
* Attention as models call it: ``flash_attention`` (SDPA's layout and options, grouped-query
  attention, head dims to 256, window, softcap, log-sum-exp) and ``flash_attention_reference``.
* Linear cross-entropy: ``linear_cross_entropy_ref``, ``linear_cross_entropy``.
* Gluon on Hopper (compiled GPUs only), one section of kernels: ``fused_softmax_gluon`` (16-bit,
  and float32 as TF32 or tf32x3 products) and ``flash_attention_gluon`` with its backward's dQ and
  dK/dV kernels. Each op's plan (``fused_softmax_plan``, ``flash_plan``) names its Gluon path
  beside its Triton ones where the Gluon kernel measured faster.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:  # host-side TMA descriptors (triton 3.4 on): the K-major matmul path; without them it is off
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

try:  # numpy's bool is accepted for is_causal; numpy itself is optional
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

from online_softmax import (
    ANY_RANK, INTERPRET, KernelCapacityError, jit_kernel, check_block, check_dense, check_flag, check_int, check_same,
    check_tensor, cdiv, ReplayChain, Replays, fresh_counters, kernel_op, launch_and_keep, needs_op, no_cached_buffers,
    next_power_of_2, one_axis_grid, replay_key, row_softmax, vector_align, vector_strides, row_forward,
    backward_through_op, batch_first, eager_autograd, softmax_tangent, transformed,
    launch_kept, on_input_device, other_device, no_double_backward, refuse_second_derivative, empty_like_contiguous,
    AutogradSpec, register_autograd,
)
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    # softmax(x) @ V
    "softmax_mult", "fused_softmax", "fused_softmax_gluon", "FusedLaunch", "GluonSoftmaxLaunch",
    "softmax_mult_bytes", "fused_softmax_bytes", "softmax_matmul_flops",
    # softmax(x @ W) and the plain product
    "matmul_softmax_ref", "matmul", "matmul_softmax_unfused", "matmul_softmax_fused_simple",
    "matmul_softmax_fused_tiled", "MatmulLaunch", "matmul_softmax_unfused_bytes", "matmul_softmax_fused_bytes",
    "matmul_softmax_tiled_bytes", "matmul_softmax_flops",
    # attention: the course's classes, and the op as models call it
    "attention_reference", "FlashAttentionPytorch", "FlashAttentionTriton", "FlashLaunch", "attention_flops",
    "flash_attention_bytes", "flash_attention_reference", "flash_attention", "AttentionPlan", "attention_plan", "flash_attention_gluon",
    "flash_attention_flops", "flash_attention_io_bytes",
    # linear cross-entropy
    "linear_cross_entropy_ref", "linear_cross_entropy", "vocab_parallel_linear_cross_entropy",
    "LinearCrossEntropyLaunch", "linear_cross_entropy_flops",
]


# ----------------------------------------------------------------------------------------------
# Shared: precision helpers, constants, checks and launch helpers of every workload
# ----------------------------------------------------------------------------------------------
@torch.compiler.assume_constant_result
def _float32_matmul_precision() -> str:
    # torch.compile cannot graph a string-valued call; it takes the setting as a constant, as Inductor does.
    return torch.get_float32_matmul_precision()


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision that matches PyTorch's float32 matmul setting."""
    if dtype != torch.float32:
        return "ieee"  # not used for 16-bit operands; tl.dot multiplies them exactly
    return "tf32x3" if _float32_matmul_precision() == "highest" else "tf32"


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """Multiply bfloat16 operands in float32 (exact for their products): the interpreter's bfloat16
    tl.dot returns wrong values (triton issue 11584)."""
    return INTERPRET and dtype == torch.bfloat16


def round_to_tf32(dtype: torch.dtype) -> bool:
    """Round the softmax weights to TF32 in the kernel before a "tf32" product (compiled only).

    A TF32 tensor core truncates float32 to 10 mantissa bits, every error towards zero; the row
    sum l adds the weights untruncated, so the bias would not cancel (cuBLAS rounds). Weights
    rounded, and summed as rounded, remove it. V's bias is within torch's error: rounding V is a
    matter of speed (``_round_v``). The interpreter multiplies in float32.
    """
    return not INTERPRET and dtype == torch.float32 and dot_precision(dtype) == "tf32"


@triton.jit
def _tf32_rounded(t):
    """float32 t rounded to the nearest TF32 value (half away from zero); inf and NaN unchanged.
    Adding half a unit (bit 12) carries into the kept bits exactly when the dropped 13 bits reach it."""
    bits = t.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(t) < float("inf"), rounded, t)


# exp(x) = exp2(x * log2(e)) and ln(y) = log2(y) * ln(2): exp2 and log2 are the GPU's native
# instructions. Kernels read these constexprs; host code reads ``.value``.
LOG2_E = tl.constexpr(1.4426950408889634)
LN_2 = tl.constexpr(0.6931471805599453)
# The kernels hold scalar options in float32: these bound what an option may give there.
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny


# Gluon (Hopper kernels written warp by warp): its modules, or why they are unusable. Its kernels close the module.
_GLUON_DTYPES = (torch.float16, torch.bfloat16)
# float32 softmax(x) @ V runs as one TF32 product, or as three (tf32x3) under 'highest'.
_GLUON_SOFTMAX_DTYPES = _GLUON_DTYPES + (torch.float32,)


def _import_gluon():
    """Gluon's modules, or the reason they are unusable here (None in the interpreter: Gluon kernels only compile)."""
    if INTERPRET:
        return None, "Gluon kernels do not run in the Triton interpreter"
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except Exception as error:  # an older or newer triton whose Gluon lacks these names
        return None, f"triton {triton.__version__} has no usable Gluon for Hopper ({error!r})"
    return (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, TensorDescriptor), None


_GLUON, GLUON_UNAVAILABLE = _import_gluon()
GLUON_BLOCK_M = 64  # a consumer warpgroup's rows of x or queries: one warpgroup MMA's height


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b; UPCAST: in float32, for the interpreter's wrong 16-bit products."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


def check_operands(x, name: str, other, ndim: int) -> None:
    """x and the other operand: ndim-dimensional tensors of one supported dtype on one device."""
    check_tensor("x", x, ndim)
    check_tensor(name, other, ndim)
    check_same("x", x, name, other)


def _empty_rows_on_16_bytes(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """An empty tensor of ``shape`` whose rows start on 16 bytes (the row stride rounded up), as TMA
    and cuBLAS's tensor-core products need."""
    *lead, n = shape
    per_16_bytes = 16 // dtype.itemsize
    padded = torch.empty((*lead, cdiv(n, per_16_bytes) * per_16_bytes), dtype=dtype, device=device)
    if padded.device.type == "cpu":
        # torch's CPU bfloat16 mm reads a row's pad (times a zero): a NaN left there by the allocator reaches the product.
        padded[..., n:].zero_()
    return padded[..., :n]


def _backward_fake(x, W, *rest):
    """Meta of a backward op: (x's gradient, the second input's), empty where not needed."""
    need_x, need_W = rest[-2:]
    return x.new_empty(x.shape if need_x else (0,)), W.new_empty(W.shape if need_W else (0,))


# ----------------------------------------------------------------------------------------------
# softmax(x) @ V
# ----------------------------------------------------------------------------------------------
# ``fused_softmax_kernel`` streams x and V once (running max and sum per row); the backward recomputes
# the softmax from x and the saved log-sum-exp. A call: checks, ``fused_softmax_plan``, ``_run_fused_softmax``.
def softmax_mult(x: torch.Tensor, V: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reference: the softmax of x, written to memory, then multiplied by V (``softmax_mult_bytes``).
    x: (batch, d1, d2), V: (batch, d2, d3) -> (batch, d1, d3)."""
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


def check_softmax_matmul_inputs(x, V) -> None:
    """The checks ``fused_softmax`` makes before any launch (ValueError/TypeError naming the argument)."""
    check_operands(x, "V", V, 3)
    if x.shape[0] != V.shape[0]:
        raise ValueError(f"V must have x's batch size {x.shape[0]}, got V of shape {tuple(V.shape)}")
    if x.shape[2] != V.shape[1]:
        raise ValueError(f"V must have d2 = {x.shape[2]} rows (x's last dimension), got V of shape {tuple(V.shape)}")


@dataclass(frozen=True)
class FusedLaunch:
    """Launch parameters of ``fused_softmax_kernel`` beyond BLOCK_1 and BLOCK_2: block_3 columns of V
    a program (a power of two, 16 to 512); lazy_rescale: rescale the accumulator only when a row's
    max grew by more than 8; transposed: compute out^T = V^T @ P^T, the product's tall side block_3."""

    block_3: int
    num_warps: int = 4
    num_stages: int = 2
    lazy_rescale: bool = False
    transposed: bool = False

    def check(self) -> None:
        check_block("launch.block_3", self.block_3, 16, 512)
        check_block("launch.num_warps", self.num_warps, 1, 16)
        check_int("launch.num_stages", self.num_stages, 1, 8)
        check_flag("launch.lazy_rescale", self.lazy_rescale)
        check_flag("launch.transposed", self.transposed)


# The fastest launch per (tl.dot precision, "ieee" for 16-bit operands; BLOCK_1) at the spec
# shape on an H100 (see outputs/README.md, design notes: fused launches).
_FUSED_LAUNCHES = {
    ("tf32x3", 16): FusedLaunch(512, 4, 3), ("tf32x3", 32): FusedLaunch(128, 4, 3, transposed=True),
    ("tf32x3", 64): FusedLaunch(128, 8, 3, transposed=True),
    ("tf32", 16): FusedLaunch(512, 4, 3, lazy_rescale=True), ("tf32", 32): FusedLaunch(512, 4, 2, lazy_rescale=True),
    ("tf32", 64): FusedLaunch(128, 4, 2, lazy_rescale=True, transposed=True),
    ("ieee", 16): FusedLaunch(512, 4, 3), ("ieee", 32): FusedLaunch(512, 4, 3, transposed=True),
    ("ieee", 64): FusedLaunch(512, 8, 3, transposed=True),
}
# Shared memory a launch may plan for: an H100 block can have 227 KiB.
_SHARED_MEMORY_BUDGET = 227 * 1024
# Past FUSED_MAX_D3 columns of V (TF32: 64, with under TF32_FUSED_MIN_PROGRAMS_PER_SM programs a SM) the
# products dominate and the materialised softmax is faster (outputs/README.md, design notes: materialized path).
FUSED_MAX_D3 = 128
TF32_FUSED_MIN_PROGRAMS_PER_SM = 3
# Where the Gluon kernel is faster on an H100: (tl.dot precision, d3 from, d3 to, least d2, least programs a SM),
# a program 128 rows of x and a d3 tile; other d3 unmeasured (outputs/README.md, design notes: Gluon route).
GLUON_FUSED_WINS = (
    ("ieee", 1, 128, 512, 0.7), ("ieee", 129, 256, 1024, 0.7), ("ieee", 384, 512, 3000, 0.96),
    ("tf32x3", 1, 512, 1024, 0.7), ("tf32", 1, 512, 1024, 0.7), ("tf32", 1, 512, 2048, 0.48),
)


def fused_blocks(d2: int, d3: int, dtype: torch.dtype, aligned: bool = True, precision: str | None = None) -> int:
    """The wrapper's BLOCK_1 = BLOCK_2 for x of (.., d2) against V of (.., d2, d3), x's batch and
    row strides ``aligned`` to 16 bytes, under tl.dot's ``precision`` (``dot_precision``'s): the
    fastest on an H100 (see outputs/README.md, design notes: fused blocks)."""
    if d2 < 256:
        return 32
    if not aligned:
        return 16 if dtype == torch.float32 else 32
    if dtype != torch.float32:
        return 64
    return 64 if (d3 <= 64) == ((precision or dot_precision(dtype)) == "tf32") else 32


def _fused_launch(d3: int, block_1: int, block_2: int, dtype: torch.dtype, precision: str) -> FusedLaunch:
    """The wrapper's ``FusedLaunch``: the swept one for BLOCK_1, block_3 cut to d3 (at least 16,
    tl.dot's least), and its stages cut until the staged x and V tiles fit in shared memory."""
    launch = _FUSED_LAUNCHES.get((precision, block_1), FusedLaunch(64, 8, 2))
    block_3 = max(16, min(launch.block_3, next_power_of_2(d3)))
    per_stage = (block_1 * block_2 + block_2 * block_3) * dtype.itemsize
    if per_stage > _SHARED_MEMORY_BUDGET and not INTERPRET:
        raise KernelCapacityError(
            f"BLOCK_1 x BLOCK_2 = {block_1} x {block_2} tiles of {dtype} need {per_stage // 1024} KiB of shared "
            f"memory with one d2 step staged, more than the {_SHARED_MEMORY_BUDGET // 1024} KiB a program can have")
    return replace(launch, block_3=block_3, num_stages=max(1, min(launch.num_stages, _SHARED_MEMORY_BUDGET // per_stage)))


def _round_v(rounded: bool, block_1: int, transposed: bool) -> bool:
    """V's tiles through registers, rounded, before a rounded TF32 product on Hopper's warpgroup
    MMA (M = block_3 transposed, else BLOCK_1 >= 64): faster than from shared memory (see
    outputs/README.md, design notes: V through registers)."""
    return rounded and (transposed or block_1 >= 64)


@functools.lru_cache(maxsize=4096)
def _fused_constants(dtype: torch.dtype, precision: str, BLOCK_1: int, BLOCK_2: int, BLOCK_3: int, num_warps: int,
                     num_stages: int, lazy_rescale: bool, transposed: bool) -> dict:
    """``fused_softmax_kernel``'s constexpr keywords for these tiles and launch (not to be mutated)."""
    rounded = not INTERPRET and precision == "tf32"  # round_to_tf32 under this precision
    return dict(BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2, BLOCK_3=BLOCK_3, PRECISION=precision, UPCAST=upcast_dot_operands(dtype),
                LAZY_RESCALE=lazy_rescale, TRANSPOSED=transposed, ROUND_TF32=rounded,
                ROUND_V=_round_v(rounded, BLOCK_1, transposed), num_warps=num_warps, num_stages=num_stages)


def _backward_blocks(BLOCK_1: int, BLOCK_2: int, d3: int) -> tuple[int, int, int]:
    """Tiles of the backward kernels: the forward's rows and d2 step up to 64, d3 in 16 to 64
    columns. Each backward product holds three such tiles (operands and accumulator): at 64 x 64
    float32 that is 48 KiB, which leaves room for two pipeline stages on any GPU Triton targets."""
    return min(BLOCK_1, 64), min(BLOCK_2, 64), max(16, min(64, next_power_of_2(d3)))


@dataclass(frozen=True)
class FusedSoftmaxPlan:
    """A ``fused_softmax`` call's path ("gluon", "fused": Triton, "materialized": ``row_softmax`` then bmm),
    call ("eager": direct launches, "autograd": ``_FUSED_AUTOGRAD``, "op": the custom op), Triton tiles
    (the backward's too), forward launch and tl.dot precision."""

    path: str
    call: str = "eager"
    BLOCK_1: int = 0
    BLOCK_2: int = 0
    launch: FusedLaunch | GluonSoftmaxLaunch | None = None
    precision: str = "ieee"

    @property
    def op_args(self) -> tuple:
        """The custom op's arguments after x and V."""
        launch = self.launch
        return (self.BLOCK_1, self.BLOCK_2, launch.block_3, launch.num_warps, launch.num_stages, launch.lazy_rescale,
                launch.transposed)


def fused_softmax_plan(batch: int, d1: int, d2: int, d3: int, dtype: torch.dtype, *, x_aligned: bool = True,
                       tma: str | None = None, sms: int | None = None, capability: tuple[int, int] | None = None,
                       setting: str = "highest", BLOCK_1=None, BLOCK_2=None, launch=None, materialize=None,
                       call: str = "eager") -> FusedSoftmaxPlan:
    """``fused_softmax``'s plan for x (batch, d1, d2) and V (batch, d2, d3) of ``dtype``. Facts: x's batch
    and row strides on 16 bytes (``x_aligned``), why TMA cannot read x and V (``tma``), the GPU's ``sms``
    and ``capability`` (None where no Gluon kernel compiles), torch's float32 matmul ``setting``;
    options: fused_softmax's and ``call``. A GluonSoftmaxLaunch asks for "gluon", ``materialize`` or
    Triton parameters for a Triton path; else the fastest measured (GLUON_FUSED_WINS in eager calls,
    FUSED_MAX_D3), else "fused". Raises TypeError or ValueError naming a bad option,
    KernelCapacityError past shared memory."""
    gluon_launch = isinstance(launch, GluonSoftmaxLaunch)
    if not (launch is None or gluon_launch or isinstance(launch, FusedLaunch)):
        raise TypeError(f"launch must be a FusedLaunch or a GluonSoftmaxLaunch, got {type(launch).__name__}")
    if materialize is not None and not isinstance(materialize, bool):
        raise TypeError(f"materialize must be None, True or False, got {type(materialize).__qualname__}")
    tuned = BLOCK_1 is not None or BLOCK_2 is not None or launch is not None
    if materialize and tuned:
        raise ValueError("BLOCK_1, BLOCK_2 and launch are parameters of the fused kernels, which "
                         "materialize=True does not run: give one or the other")
    if materialize is False and gluon_launch:
        raise ValueError("materialize=False asks for the Triton kernel and launch is a GluonSoftmaxLaunch: "
                         "give one or the other")
    precision = "ieee" if dtype != torch.float32 else "tf32x3" if setting == "highest" else "tf32"
    block = fused_blocks(d2, d3, dtype, x_aligned, precision)
    unfit = _gluon_unfit(batch, d1, d2, d3, tma, capability)
    if gluon_launch:
        if call == "op":
            raise ValueError("a GluonSoftmaxLaunch runs in eager calls only: under torch.compile, or on a tensor "
                             "subclass, fused_softmax takes the Triton kernel (leave launch out, or give a FusedLaunch)")
        if unfit is not None:
            raise ValueError(f"launch is a GluonSoftmaxLaunch, but the Gluon kernel cannot take these inputs: {unfit}")
        path = "gluon"
    elif materialize is not None or tuned:
        path = "materialized" if materialize else "fused"
    elif call == "eager" and unfit is None and sms is not None and _gluon_wins(batch, d1, d2, d3, dtype, precision, sms):
        path = "gluon"
    elif precision != "tf32x3" and (d3 > FUSED_MAX_D3 or precision == "tf32" and d3 > 64 and sms is not None
                                    and batch * cdiv(d1, block) < TF32_FUSED_MIN_PROGRAMS_PER_SM * sms):
        path = "materialized"
    else:
        path = "fused"
    if path == "materialized":
        return FusedSoftmaxPlan(path, call)
    BLOCK_1 = block if BLOCK_1 is None else BLOCK_1
    BLOCK_2 = block if BLOCK_2 is None else BLOCK_2
    check_block("BLOCK_1", BLOCK_1, 16, 256)
    check_block("BLOCK_2", BLOCK_2, 16, 256)
    if path == "gluon":
        launch = launch or gluon_softmax_launch(d2, d3, dtype, precision)
        launch.check(dtype, precision)
        return FusedSoftmaxPlan(path, call, BLOCK_1, BLOCK_2, launch, precision)
    if launch is None:
        launch = _fused_launch(d3, BLOCK_1, BLOCK_2, dtype, precision)
    launch.check()
    return FusedSoftmaxPlan(path, call, BLOCK_1, BLOCK_2, launch, precision)


# typed: 16, 16.0 and True differ; launches are not cached (FusedLaunch(lazy_rescale=1) equals its valid form).
_cached_plan = functools.lru_cache(maxsize=4096, typed=True)(fused_softmax_plan)


def _gluon_unfit(batch: int, d1: int, d2: int, d3: int, tma: str | None, capability) -> str | None:
    """Why the Gluon kernel cannot take inputs of this shape, which TMA reads unless ``tma`` says
    why not, on a GPU of ``capability`` (None: no Gluon kernel compiles here); None where it can."""
    if capability is None:
        return GLUON_UNAVAILABLE or "x and V must be on one CUDA device"
    if tuple(capability) != (9, 0):
        return f"the kernel is written for sm_90 (Hopper), this GPU is sm_{capability[0]}{capability[1]}"
    if min(batch, d1, d2, d3) == 0:
        return "empty inputs have no TMA descriptor (fused_softmax handles them)"
    if batch > 65535:
        return f"a batch of {batch} is past the 65535 programs a grid's second axis can have"
    return tma


def _gluon_wins(batch: int, d1: int, d2: int, d3: int, dtype: torch.dtype, precision: str, sms: int) -> bool:
    """Whether the Gluon kernel is the faster softmax(x) @ V at this shape on ``sms`` SMs (GLUON_FUSED_WINS)."""
    programs = batch * cdiv(d1, GLUON_SOFTMAX_ROWS) * cdiv(d3, gluon_softmax_launch(d2, d3, dtype, precision).block_d3)
    return any(kind == precision and low <= d3 <= high and d2 >= min_d2 and programs >= share * sms
               for kind, low, high, min_d2, share in GLUON_FUSED_WINS)


GLUON_SOFTMAX_CONSUMERS = 2
GLUON_SOFTMAX_ROWS = GLUON_SOFTMAX_CONSUMERS * GLUON_BLOCK_M  # a program's rows of x
# Under tf32x3 a consumer holds two float32 accumulators (the running one and a step's products):
# 2 x 64 x 128 is 128 of its registers; 256 columns spill.
GLUON_TF32X3_MAX_D3 = 128


def gluon_softmax_unsupported(x: torch.Tensor, V: torch.Tensor) -> str | None:
    """Why ``fused_softmax_gluon`` cannot take (x, V), or None when it can: an sm_90 GPU with
    Gluon, float16, bfloat16 or float32, non-empty inputs and what TMA needs (``_tma_reason``)."""
    if GLUON_UNAVAILABLE is not None:
        return GLUON_UNAVAILABLE
    if not (isinstance(x, torch.Tensor) and isinstance(V, torch.Tensor)) or x.dim() != 3 or V.dim() != 3:
        return "x and V must be 3-D tensors"
    if x.device.type != "cuda" or V.device != x.device:
        return "x and V must be on one CUDA device"
    if x.dtype not in _GLUON_SOFTMAX_DTYPES or V.dtype != x.dtype:
        return f"x and V must both be float16, bfloat16 or float32, got {x.dtype} and {V.dtype}"
    if x.shape[0] != V.shape[0] or x.shape[2] != V.shape[1]:
        return f"shapes {tuple(x.shape)} and {tuple(V.shape)} do not make softmax(x) @ V"
    return _gluon_unfit(*x.shape, V.shape[2], _tma_reason(x, V), _device_capability(_device_index(x.device)))


def _tma_reason(x: torch.Tensor, V: torch.Tensor) -> str | None:
    """Why TMA cannot read x and V (x alone in float32, whose V is copied into its TF32 parts
    first: ``gluon_softmax_v_operand``), or None where it can (``tma_unreadable``)."""
    try:
        return tma_unreadable("x", x) or (None if x.dtype == torch.float32 else tma_unreadable("V", V))
    except RuntimeError:  # no storage to read (a torch.func transform's tensor)
        return "x and V hold no storage TMA can read"


@dataclass(frozen=True)
class GluonSoftmaxLaunch:
    """Tiles of ``fused_softmax_gluon``: d2 a step (block_n), d3 a program (block_d3), ring slots
    (stages), whether the two consumer warpgroups take turns to issue their products (pingpong),
    whether a consumer rescales only when a row's max grew by more than 8 (lazy_rescale), whether
    16-bit weights reach the products through shared memory (p_smem: 64 x block_n a consumer)
    rather than as the register operand. A slot holds GLUON_SOFTMAX_ROWS x block_n of x and
    block_n x block_d3 of V (two under tf32x3: V's TF32 value and the rest), in the inputs' dtype."""

    block_n: int
    block_d3: int
    stages: int = 2
    pingpong: bool = False
    lazy_rescale: bool = True
    p_smem: bool = False

    def check(self, dtype: torch.dtype = torch.bfloat16, precision: str | None = None) -> None:
        """The fields, the ring's shared memory and the accumulators' registers for ``dtype`` under ``precision``."""
        check_block("block_n", self.block_n, 16, 256)
        check_block("block_d3", self.block_d3, 16, 256)  # 256: the widest warpgroup MMA and TMA box
        check_int("stages", self.stages, 2, 8)
        check_flag("pingpong", self.pingpong)
        check_flag("lazy_rescale", self.lazy_rescale)
        check_flag("p_smem", self.p_smem)
        if self.p_smem and dtype == torch.float32:
            raise ValueError("p_smem is for 16-bit inputs: float32's TF32 weights stay in registers")
        parts = _gluon_v_parts(dtype, precision)
        if parts == 2 and self.block_d3 > GLUON_TF32X3_MAX_D3:
            raise KernelCapacityError(
                f"block_d3 must be at most {GLUON_TF32X3_MAX_D3} under tf32x3 (float32 under 'highest'), got "
                f"{self.block_d3}: 2 x {self.block_n} x {self.block_d3} V tiles of {dtype} a slot are two float32 "
                f"accumulators of 64 x {self.block_d3} a consumer, past its registers")
        # Each slot's x and V tiles and its barriers (32 bytes); p_smem: the consumers' weights.
        weights = GLUON_SOFTMAX_ROWS * self.block_n * dtype.itemsize if self.p_smem else 0
        ring = self.stages * ((GLUON_SOFTMAX_ROWS + parts * self.block_d3) * self.block_n * dtype.itemsize + 32) + weights
        if ring > _SHARED_MEMORY_BUDGET:
            weights = f" and the weights' {GLUON_SOFTMAX_ROWS} x {self.block_n}" if self.p_smem else ""
            raise KernelCapacityError(
                f"{self.stages} slots of {GLUON_SOFTMAX_ROWS} x {self.block_n} x tiles and "
                f"{parts} x {self.block_n} x {self.block_d3} V tiles of {dtype}{weights} need "
                f"{ring // 1024} KiB of shared memory, more than {_SHARED_MEMORY_BUDGET // 1024} KiB")


def _gluon_v_parts(dtype: torch.dtype, precision: str | None = None) -> int:
    """V's tiles a ring slot holds: 2 for float32 under tf32x3 (V's TF32 value and the rest), else 1."""
    return 2 if dtype == torch.float32 and (precision or dot_precision(dtype)) == "tf32x3" else 1


def gluon_softmax_launch(d2: int, d3: int, dtype: torch.dtype = torch.bfloat16,
                         precision: str | None = None) -> GluonSoftmaxLaunch:
    """The default tiles for d2 and d3 in ``dtype`` under ``precision``: d3 tiles of up to 256 (the widest
    MMA; GLUON_TF32X3_MAX_D3 under tf32x3), d2 steps of up to 128 (64 in float32: 256 bytes), 2 slots, at
    least 16 (the 16-bit MMA's K step); bfloat16 weights through shared memory where one d3 tile of 65 to
    256 covers d3, as the register operand they take more byte permutes than float16's (outputs/README.md,
    design notes: Gluon tiles)."""
    if dtype == torch.float32:
        widest_d3 = GLUON_TF32X3_MAX_D3 if _gluon_v_parts(dtype, precision) == 2 else 256
        return GluonSoftmaxLaunch(block_n=max(16, min(64, next_power_of_2(d2))),
                                  block_d3=max(16, min(widest_d3, next_power_of_2(d3))), stages=2)
    return GluonSoftmaxLaunch(block_n=max(16, min(128, next_power_of_2(d2))),
                              block_d3=max(16, min(256, next_power_of_2(d3))), stages=2,
                              p_smem=dtype == torch.bfloat16 and 64 < d3 <= 256)


@triton.jit
def _scale_rows(acc, alpha, TRANSPOSED: tl.constexpr):
    """acc with each row of x's tile scaled by alpha: rows are acc's columns when TRANSPOSED."""
    if TRANSPOSED:
        out = acc * alpha[None, :]
    else:  # (compiled Triton visits code after a constexpr-if's return, so no early return here)
        out = acc * alpha[:, None]
    return out


@triton.jit
def fused_softmax_kernel(
    x_ptr, v_ptr, o_ptr, lse_ptr,
    d1, d2, d3,
    stride_xb, stride_x1, stride_x2,
    stride_vb, stride_v2, stride_v3,
    stride_ob, stride_o1, stride_o3,
    n_tiles, n_tiles_3,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, LAZY_RESCALE: tl.constexpr, TRANSPOSED: tl.constexpr,
    ROUND_TF32: tl.constexpr, ROUND_V: tl.constexpr, STORE_LSE: tl.constexpr,
    X_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, K_ALIGN: tl.constexpr,
):
    """One program: BLOCK_1 rows of x against BLOCK_3 columns of V, streaming d2 in BLOCK_2 steps.

    One grid axis of batch x n_tiles (the others take only 65535); the programs sharing rows of x
    are numbered consecutively, so all but the first read x from L2. TRANSPOSED computes
    out^T = V^T @ softmax(x)^T, M = BLOCK_3: tall enough for Hopper's warpgroup MMA when BLOCK_1 is
    16 or 32; the accumulator is (BLOCK_3, BLOCK_1). STORE_LSE: the first d3 tile of each row block
    writes the rows' log-sum-exp, (batch, d1) float32. x's and V's batch and row strides come
    divided by X_ALIGN and V_ALIGN, d2 by K_ALIGN (``vector_strides``): masks on d2 hold over whole vectors.
    """
    d2 = d2 * K_ALIGN
    stride_xb = stride_xb * X_ALIGN
    stride_x1 = stride_x1 * X_ALIGN
    stride_vb = stride_vb * V_ALIGN
    stride_v2 = stride_v2 * V_ALIGN
    pid = tl.program_id(0)
    batch = (pid // n_tiles).to(tl.int64)
    tile = pid % n_tiles
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
            # Until a row's max grew by more than 8, exp(x - m) against the stale m stays below e^8, inside
            # every dtype's range, and the final division uses the same m. -inf > -inf + 8 is false.
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
        # l sums the weights as rounded, so they are normalised exactly as the product uses them.
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
    if STORE_LSE:
        # A row of only -inf gets -inf (log 0 + m = -inf): its backward is NaN, as torch's is.
        if tile % n_tiles_3 == 0:
            tl.store(lse_ptr + batch * d1 + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _dp_tile(g_rows, v_base, k, ks, k_ok, cs, row_ok, d3, stride_g3, stride_v2, stride_v3,
             BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr,
             PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_TF32: tl.constexpr):
    """The (BLOCK_1, BLOCK_2) tile of dP = dO @ V^T at d2 offset k, over d3 in BLOCK_3 steps."""
    dp = tl.zeros((BLOCK_1, BLOCK_2), tl.float32)
    for c in range(0, d3, BLOCK_3):
        c_ok = (c + cs) < d3
        g = tl.load(g_rows + (c + cs)[None, :] * stride_g3, mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        v_t = tl.load(v_base + (c + cs)[:, None] * stride_v3 + (k + ks)[None, :].to(tl.int64) * stride_v2,
                      mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        if ROUND_TF32:  # as in the forward: a TF32 product of truncated operands is biased
            g = _tf32_rounded(g)
            v_t = _tf32_rounded(v_t)
        dp = _dot_acc(g, v_t, dp, PRECISION, UPCAST)
    return dp


@triton.jit
def fused_softmax_backward_dx_kernel(
    x_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dx_ptr,
    d1, d2, d3,
    stride_xb, stride_x1, stride_x2,
    stride_vb, stride_v2, stride_v3,
    stride_ob, stride_o1, stride_o3,
    stride_gb, stride_g1, stride_g3,
    stride_db, stride_d1, stride_d2,
    n_tiles_1,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_TF32: tl.constexpr, DELTA_FROM_DP: tl.constexpr,
    X_ALIGN: tl.constexpr, D_ALIGN: tl.constexpr, K_ALIGN: tl.constexpr,
):
    """dx = P * (dP - delta) for BLOCK_1 rows, P = exp(x - lse) recomputed, dP = dO @ V^T.

    delta = rowsum(P * dP) = rowsum(dO * O), since O = P @ V: one pass over d3, not two over d2.
    A row of only -inf has lse = -inf, so P and dx are NaN there, as torch's are.
    DELTA_FROM_DP (TF32 products): delta from this kernel's own dP, in a first pass over d2. A TF32
    dP errs by 2^-11, and where the softmax is nearly one-hot dx_j = P_j (dP_j - delta) with
    delta ~ dP_j: only a delta of the same dP cancels that error; rowsum(dO * O) has O's own.
    x's and dx's batch and row strides come divided by X_ALIGN and D_ALIGN, d2 by K_ALIGN.
    """
    d2 = d2 * K_ALIGN
    stride_xb = stride_xb * X_ALIGN
    stride_x1 = stride_x1 * X_ALIGN
    stride_db = stride_db * D_ALIGN
    stride_d1 = stride_d1 * D_ALIGN
    pid = tl.program_id(0)
    batch = (pid // n_tiles_1).to(tl.int64)
    rows = (pid % n_tiles_1) * BLOCK_1 + tl.arange(0, BLOCK_1)
    row_ok = rows < d1
    cs = tl.arange(0, BLOCK_3)
    ks = tl.arange(0, BLOCK_2)
    o_rows = o_ptr + batch * stride_ob + rows[:, None].to(tl.int64) * stride_o1
    g_rows = do_ptr + batch * stride_gb + rows[:, None].to(tl.int64) * stride_g1
    # Rows past d1 read lse 0 and x -inf: P = 0 there, never NaN.
    lse = tl.load(lse_ptr + batch * d1 + rows, mask=row_ok, other=0.0)
    x_rows = x_ptr + batch * stride_xb + rows[:, None].to(tl.int64) * stride_x1
    d_rows = dx_ptr + batch * stride_db + rows[:, None].to(tl.int64) * stride_d1
    v_base = v_ptr + batch * stride_vb
    delta = tl.zeros((BLOCK_1,), tl.float32)
    if DELTA_FROM_DP:
        for k in range(0, d2, BLOCK_2):
            k_ok = (k + ks) < d2
            x = tl.load(x_rows + (k + ks)[None, :] * stride_x2, mask=row_ok[:, None] & k_ok[None, :],
                        other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse[:, None])
            dp = _dp_tile(g_rows, v_base, k, ks, k_ok, cs, row_ok, d3, stride_g3, stride_v2, stride_v3,
                          BLOCK_1, BLOCK_2, BLOCK_3, PRECISION, UPCAST, ROUND_TF32)
            delta += tl.sum(p * dp, axis=1)
    else:
        for c in range(0, d3, BLOCK_3):
            mask = row_ok[:, None] & ((c + cs) < d3)[None, :]
            o = tl.load(o_rows + (c + cs)[None, :] * stride_o3, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_rows + (c + cs)[None, :] * stride_g3, mask=mask, other=0.0).to(tl.float32)
            delta += tl.sum(o * g, axis=1)
    for k in range(0, d2, BLOCK_2):
        k_ok = (k + ks) < d2
        mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + (k + ks)[None, :] * stride_x2, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        dp = _dp_tile(g_rows, v_base, k, ks, k_ok, cs, row_ok, d3, stride_g3, stride_v2, stride_v3,
                      BLOCK_1, BLOCK_2, BLOCK_3, PRECISION, UPCAST, ROUND_TF32)
        dx = p * (dp - delta[:, None])
        tl.store(d_rows + (k + ks)[None, :] * stride_d2, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fused_softmax_backward_dv_kernel(
    x_ptr, do_ptr, lse_ptr, dv_ptr,
    d1, d2, d3,
    stride_xb, stride_x1, stride_x2,
    stride_gb, stride_g1, stride_g3,
    stride_db, stride_d2, stride_d3,
    n_tiles, n_tiles_3,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_TF32: tl.constexpr, X_ALIGN: tl.constexpr,
    K_ALIGN: tl.constexpr,
):
    """dV = P^T @ dO for a (BLOCK_2, BLOCK_3) tile, P^T recomputed a (BLOCK_2, BLOCK_1) block at a time;
    x's batch and row strides come divided by X_ALIGN, d2 by K_ALIGN."""
    d2 = d2 * K_ALIGN
    stride_xb = stride_xb * X_ALIGN
    stride_x1 = stride_x1 * X_ALIGN
    pid = tl.program_id(0)
    batch = (pid // n_tiles).to(tl.int64)
    tile = pid % n_tiles
    ks = (tile // n_tiles_3) * BLOCK_2 + tl.arange(0, BLOCK_2)
    cols = (tile % n_tiles_3) * BLOCK_3 + tl.arange(0, BLOCK_3)
    k_ok = ks < d2
    c_ok = cols < d3
    rs = tl.arange(0, BLOCK_1)
    x_base = x_ptr + batch * stride_xb + ks[:, None].to(tl.int64) * stride_x2
    g_base = do_ptr + batch * stride_gb + cols[None, :] * stride_g3
    acc = tl.zeros((BLOCK_2, BLOCK_3), tl.float32)
    for r in range(0, d1, BLOCK_1):
        r_ok = (r + rs) < d1
        lse = tl.load(lse_ptr + batch * d1 + r + rs, mask=r_ok, other=0.0)
        x_t = tl.load(x_base + (r + rs)[None, :].to(tl.int64) * stride_x1, mask=k_ok[:, None] & r_ok[None, :],
                      other=float("-inf")).to(tl.float32)
        g = tl.load(g_base + (r + rs)[:, None].to(tl.int64) * stride_g1, mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        p_t = tl.exp(x_t - lse[None, :]).to(g.dtype)  # torch multiplies P in the inputs' dtype too
        if ROUND_TF32:
            p_t = _tf32_rounded(p_t)
            g = _tf32_rounded(g)
        acc = _dot_acc(p_t, g, acc, PRECISION, UPCAST)
    d_ptrs = dv_ptr + batch * stride_db + ks[:, None].to(tl.int64) * stride_d2 + cols[None, :] * stride_d3
    tl.store(d_ptrs, acc.to(dv_ptr.dtype.element_ty), mask=k_ok[:, None] & c_ok[None, :])


def _fused_output(x: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """softmax(x) @ V's output: (batch, d1, d3) in x's dtype, contiguous."""
    return x.new_empty((x.shape[0], x.shape[1], V.shape[2]))  # less host time: empty_like_contiguous


def _fused_lse(x: torch.Tensor) -> torch.Tensor:
    """The rows' log-sum-exp a forward saves for the backward: (batch, d1) float32."""
    return torch.empty(tuple(x.shape[:2]), dtype=torch.float32, device=x.device)


def _fused_softmax_forward(x: torch.Tensor, V: torch.Tensor, constants: dict, store_lse: bool, wrap: bool,
                           keep=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax(x) @ V, its rows' log-sum-exp if store_lse else None) by ``fused_softmax_kernel``;
    ``keep`` receives the launch as a Replay of (x, V, out, lse or out)."""
    batch, d1, d2 = x.shape
    d3 = V.shape[2]
    out = _fused_output(x, V)
    lse = _fused_lse(x) if store_lse else None
    if out.numel() == 0 and (lse is None or lse.numel() == 0):
        return out, lse
    if d2 == 0:
        # An empty softmax times an empty V: torch gives zeros; every row's log-sum-exp is log 0.
        return out.zero_(), None if lse is None else lse.fill_(float("-inf"))
    n_tiles_3 = cdiv(max(d3, 1), constants["BLOCK_3"])
    n_tiles = cdiv(d1, constants["BLOCK_1"]) * n_tiles_3
    x_strides, x_align = vector_strides(x)
    v_strides, v_align = vector_strides(V)
    k_align = vector_align((d2,), x.element_size())
    launch_and_keep(jit_kernel(fused_softmax_kernel, wrap), one_axis_grid(batch * n_tiles, fused_softmax_kernel.__name__),
                    (x, V, out, out if lse is None else lse, d1, d2 // k_align, d3, *x_strides, *v_strides,
                     *out.stride(), n_tiles, n_tiles_3),
                    dict(constants, STORE_LSE=store_lse, X_ALIGN=x_align, V_ALIGN=v_align, K_ALIGN=k_align),
                    keep, 4)
    return out, lse


def _fused_softmax_backward(x, V, out, lse, dout, BLOCK_1: int, BLOCK_2: int, need_x: bool, need_V: bool,
                            wrap: bool):
    """(dx, dV) from the forward's output and log-sum-exp; one not needed is empty, its kernel not launched."""
    batch, d1, d2 = x.shape
    d3 = V.shape[2]
    # An expanded gradient (y.sum()'s, stride 0) would cost every tile its vector loads; a copy costs one pass.
    dout = dout.contiguous()
    dx = torch.empty((batch, d1, d2) if need_x else (0,), dtype=x.dtype, device=x.device)
    dV = torch.empty((batch, d2, d3) if need_V else (0,), dtype=V.dtype, device=V.device)
    if dx.numel() == 0 and dV.numel() == 0:
        return dx, dV
    if d1 == 0 or d3 == 0:
        # No output element depends on the other input: its gradient is zero (torch's too).
        return dx.zero_(), dV.zero_()
    b1, b2, b3 = _backward_blocks(BLOCK_1, BLOCK_2, int(d3))
    precision = dict(PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot_operands(x.dtype),
                     ROUND_TF32=round_to_tf32(x.dtype))
    # Only a TF32 dP (2^-11) needs the delta made of itself (fused_softmax_backward_dx_kernel).
    delta_from_dp = x.dtype == torch.float32 and dot_precision(x.dtype) == "tf32"
    x_strides, x_align = vector_strides(x)
    k_align = vector_align((d2,), x.element_size())
    if dx.numel():
        n_tiles_1 = cdiv(d1, b1)
        dx_strides, dx_align = vector_strides(dx)
        jit_kernel(fused_softmax_backward_dx_kernel, wrap)[one_axis_grid(batch * n_tiles_1, fused_softmax_backward_dx_kernel.__name__)](
            x, V, out, dout, lse, dx, d1, d2 // k_align, d3, *x_strides, *V.stride(), *out.stride(),
            *dout.stride(), *dx_strides, n_tiles_1, BLOCK_1=b1, BLOCK_2=b2, BLOCK_3=b3, **precision,
            DELTA_FROM_DP=delta_from_dp, X_ALIGN=x_align, D_ALIGN=dx_align, K_ALIGN=k_align, num_warps=4, num_stages=2)
    if dV.numel():
        n_tiles_3 = cdiv(d3, b3)
        n_tiles = cdiv(d2, b2) * n_tiles_3
        jit_kernel(fused_softmax_backward_dv_kernel, wrap)[one_axis_grid(batch * n_tiles, fused_softmax_backward_dv_kernel.__name__)](
            x, dout, lse, dV, d1, d2 // k_align, d3, *x_strides, *dout.stride(), *dV.stride(), n_tiles, n_tiles_3,
            BLOCK_1=b1, BLOCK_2=b2, BLOCK_3=b3, **precision, X_ALIGN=x_align, K_ALIGN=k_align, num_warps=4, num_stages=2)
    return dx, dV


def _launch_fields(launch) -> list[int]:
    """A launch dataclass as the op's list of ints (an op takes no dataclass); [] for None."""
    return [] if launch is None else [int(getattr(launch, f.name)) for f in fields(launch)]


@kernel_op("fused_softmax", lambda x, V, *plan: (
    x.new_empty((x.shape[0], x.shape[1], V.shape[2])), x.new_empty((x.shape[0], x.shape[1]), dtype=torch.float32)))
def _fused_softmax_op(x: torch.Tensor, V: torch.Tensor, BLOCK_1: int, BLOCK_2: int, block_3: int, num_warps: int,
                      num_stages: int, lazy_rescale: bool, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    constants = _fused_constants(x.dtype, dot_precision(x.dtype), BLOCK_1, BLOCK_2, block_3, num_warps, num_stages,
                                 lazy_rescale, transposed)
    return _fused_softmax_forward(x, V, constants, store_lse=True, wrap=True)


@kernel_op("fused_softmax_backward", _backward_fake)
def _fused_softmax_backward_op(x: torch.Tensor, V: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                               BLOCK_1: int, BLOCK_2: int, need_x: bool, need_V: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_softmax_backward(x, V, out, lse, dout, BLOCK_1, BLOCK_2, need_x, need_V, wrap=True)


refuse_second_derivative(_fused_softmax_backward_op, "fused_softmax")  # raises, instead of a silent zero


def _fused_softmax_save(ctx, x, V, output, BLOCK_1: int, BLOCK_2: int) -> None:
    ctx.save_for_backward(x, V, *output)
    ctx.mark_non_differentiable(output[1])
    ctx.blocks = (BLOCK_1, BLOCK_2)


def _fused_softmax_grad(ctx, dout, need: tuple, through_op: bool) -> tuple:
    """(dx, dV), None where not ``need``ed, from the saved (x, V, out, lse). ``through_op`` (the
    op's own autograd) or where ``backward_through_op``: the backward op; a transform's gradient or
    one with a tangent: torch's ops in float32, which the transforms see through; else the backward
    kernels launched directly."""
    x, V, out, lse = ctx.saved_tensors
    need_x, need_V = need
    if not through_op and transformed(x, V, dout):
        P = torch.softmax(x.float(), dim=-1)
        dx = softmax_tangent(P, dout.float() @ V.float().transpose(-1, -2)).to(x.dtype)
        dV = (P.transpose(-1, -2) @ dout.float()).to(V.dtype)
    elif through_op or backward_through_op(dout):
        dx, dV = _fused_softmax_backward_op(x, V, out, lse, dout, *ctx.blocks, need_x, need_V)
    else:
        dx, dV = _fused_softmax_backward(x, V, out, lse, dout, *ctx.blocks, need_x, need_V, wrap=False)
    return (dx if need_x else None), (dV if need_V else None)


register_autograd(
    _fused_softmax_op,
    lambda ctx, dout, _dlse: (*_fused_softmax_grad(ctx, dout, ctx.needs_input_grad[:2], True), *[None] * 7),
    setup_context=lambda ctx, inputs, output: _fused_softmax_save(ctx, *inputs[:2], output, *inputs[2:4]))


# ``fused_softmax`` under eager autograd or a torch.func transform: (out, the rows' log-sum-exp) by the
# plan's kernel launched directly (its launch kept beside the plain calls'), the backward likewise where it may.
def _fused_autograd_forward(x, V, plan):
    key = replay_key((x, V), ((plan, "lse"),))
    replay = None if key is None else _FUSED_REPLAYS.get(key)
    if replay is not None:
        out, lse = _fused_output(x, V), _fused_lse(x)
        if replay(x, V, out, lse):
            return out, lse
    return _launch_fused_softmax(x, V, plan, True, None if key is None else _FUSED_REPLAYS.keeper(key))


def _fused_autograd_setup(ctx, inputs, output):
    x, V, plan = inputs
    _fused_softmax_save(ctx, x, V, output, plan.BLOCK_1, plan.BLOCK_2)
    ctx.save_for_forward(x, V)


def _fused_jvp(ctx, dx, dV, _):
    x, V = ctx.saved_tensors
    P = torch.softmax(x.float(), dim=-1)
    tangent = 0
    if dx is not None:
        tangent = softmax_tangent(P, dx) @ V.float()
    if dV is not None:
        tangent = tangent + P @ dV.float()
    return tangent.to(x.dtype), None


def _fused_vmap(info, in_dims, x, V, plan):
    x_dim, v_dim = in_dims[:2]
    if v_dim is None:  # one V for the batch: x's batch joins its rows (d1), V is not copied
        x = x.movedim(x_dim, 1)
        out, lse = _FUSED_AUTOGRAD.apply(x.flatten(1, 2), V, plan)
        return (out.unflatten(1, x.shape[1:3]), lse.unflatten(1, x.shape[1:3])), (1, 1)
    # Else the batch folds into the kernel's batch (an unbatched x repeated for it).
    x = batch_first(x, x_dim, info.batch_size)
    V = batch_first(V, v_dim)
    out, lse = _FUSED_AUTOGRAD.apply(x.flatten(0, 1), V.flatten(0, 1), plan)
    return (out.unflatten(0, x.shape[:2]), lse.unflatten(0, x.shape[:2])), (0, 0)


def _fused_reference(x, V, plan):
    x32 = x.float()
    return (torch.softmax(x32, dim=-1) @ V.float()).to(x.dtype), torch.logsumexp(x32, dim=-1)


_FUSED_AUTOGRAD = AutogradSpec(
    "fused_softmax", forward=_fused_autograd_forward, setup=_fused_autograd_setup,
    backward=lambda ctx, dout, _dlse: (*_fused_softmax_grad(ctx, dout, ctx.needs_input_grad[1:3], False), None),
    jvp=_fused_jvp, vmap=_fused_vmap, reference=_fused_reference)


def _launch_fused_softmax(x: torch.Tensor, V: torch.Tensor, plan: FusedSoftmaxPlan, store_lse: bool,
                          keep=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A kernel path's forward launched directly: (out, the rows' log-sum-exp if store_lse); ``keep`` as above."""
    if plan.path == "fused":
        constants = _fused_constants(x.dtype, plan.precision, *plan.op_args)
        return _fused_softmax_forward(x, V, constants, store_lse, wrap=False, keep=keep)
    out, lse = _fused_output(x, V), _fused_lse(x) if store_lse else None
    _gluon_fused_forward(x, V, out, lse, plan.launch, keep)
    return out, lse


def _run_fused_softmax(x: torch.Tensor, V: torch.Tensor, plan: FusedSoftmaxPlan, keep=None) -> torch.Tensor:
    """softmax(x) @ V as ``plan`` says: materialised, launched directly, through autograd or the custom op."""
    if plan.path == "materialized":
        if not torch.compiler.is_compiling() and _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
            return torch.bmm(row_softmax(x), V)
        # fused_softmax does not autocast (the kernel paths cannot): torch.bmm would, in autocast's dtype.
        with torch.autocast(x.device.type, enabled=False):
            return torch.bmm(row_softmax(x), V)
    if plan.call == "eager":
        return _launch_fused_softmax(x, V, plan, False, keep)[0]
    if plan.call == "autograd":
        return _FUSED_AUTOGRAD.run(x, V, plan)[0]
    return _fused_softmax_op(x, V, *plan.op_args)[0]


def _plan_call(x, V, BLOCK_1, BLOCK_2, launch, materialize) -> FusedSoftmaxPlan:
    """Checks (x, V), then ``fused_softmax_plan`` for facts read from them (TMA's only where Gluon may run)."""
    check_softmax_matmul_inputs(x, V)
    call = "eager" if not needs_op(x, V) else "autograd" if eager_autograd(x, V) else "op"
    capability = None
    if x.is_cuda and call != "op" and GLUON_UNAVAILABLE is None:
        capability = _device_capability(_device_index(x.device))
    gluon = capability is not None and (call == "eager" or isinstance(launch, GluonSoftmaxLaunch))
    facts = (int(x.shape[0]), int(x.shape[1]), int(x.shape[2]), int(V.shape[2]), x.dtype)
    options = dict(x_aligned=not any(s * x.element_size() % 16 for s in x.stride()[:2]),
                   tma=_tma_reason(x, V) if gluon else None, sms=_sm_count(x.device),
                   capability=capability, setting=_float32_matmul_precision(), BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2,
                   launch=launch, materialize=materialize, call=call)
    if launch is None and not torch.compiler.is_compiling():  # a trace plans once, in its own cache
        try:
            return _cached_plan(*facts, **options)
        except TypeError:  # an option that cannot be a key: the plan names it
            pass
    return fused_softmax_plan(*facts, **options)


def fused_softmax_path(x: torch.Tensor, V: torch.Tensor, BLOCK_1: int | None = None, BLOCK_2: int | None = None, *,
                       launch=None, materialize: bool | None = None) -> str:
    """What ``fused_softmax(x, V, ...)`` runs here and now: "gluon", "fused" or "materialized"."""
    return _plan_call(x, V, BLOCK_1, BLOCK_2, launch, materialize).path


@on_input_device
def fused_softmax(x: torch.Tensor, V: torch.Tensor, BLOCK_1: int | None = None, BLOCK_2: int | None = None, *,
                  launch: FusedLaunch | GluonSoftmaxLaunch | None = None, materialize: bool | None = None) -> torch.Tensor:
    """softmax(x, dim=-1) @ V, with no softmax in memory where a fused kernel runs; differentiable in x and V.

    x: (batch, d1, d2), V: (batch, d2, d3) -> (batch, d1, d3), in x's dtype, accumulated in fp32;
    float16, bfloat16 or float32 (products as torch's float32 matmul setting says); strided inputs
    read in place. ``fused_softmax_path`` says what runs: the Gluon kernel on Hopper where faster
    (plain eager calls), the softmax materialised (``row_softmax``, then ``torch.bmm``) where the
    products dominate, else the Triton kernel. BLOCK_1 and BLOCK_2 (powers of two, 16 to 256) or a
    ``FusedLaunch`` ask for the Triton kernel, a ``GluonSoftmaxLaunch`` for the Gluon one;
    ``materialize`` True or False for either Triton path. The kernels' backward recomputes the
    softmax from x and the log-sum-exp and has no second derivative (it raises); the materialised
    path's has. Raises TypeError/ValueError naming a bad argument. Range: the kernels divide by the
    row's sum last, as FlashAttention does, so an output overflows to inf once |V| nears float32's
    largest / d2 (/ (d2 x e^8) with ``FusedLaunch.lazy_rescale``) where torch's is finite.
    """
    key = replay_key((x, V), (BLOCK_1, BLOCK_2, launch, materialize, _float32_matmul_precision()))
    if key is not None:
        replay = _FUSED_REPLAYS.get(key)
        if replay is not None:
            out = _fused_output(x, V)
            if replay(x, V, out, out):
                return out
    plan = _plan_call(x, V, BLOCK_1, BLOCK_2, launch, materialize)
    return _run_fused_softmax(x, V, plan, None if key is None else _FUSED_REPLAYS.keeper(key))


# Eager calls' kept launches, by ``replay_key`` of the inputs and options (of the plan where the lse is stored).
_FUSED_REPLAYS = Replays("fused_softmax")


# ----------------------------------------------------------------------------------------------
# softmax(x @ W): the classifier / LM head
# ----------------------------------------------------------------------------------------------
# x: (B, K) @ W: (K, C) -> softmax over the C classes. Unfused (``matmul``, then ``row_softmax``), simple (a
# program owns a row block and all C classes), tiled (tiles write exp(logit - tile max), a light pass rescales).
# A call: ``check_matmul_call``, ``matmul_softmax_plan``, ``_family_forward``; the backward:
# ``softmax_grad_kernel``, then ``matmul``. Thresholds' figures: outputs/README.md, "Design notes".


def matmul_softmax_ref(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Reference: cuBLAS product, logits in x's dtype, then ``torch.softmax``. x: (B, K), W: (K, C) -> (B, C)."""
    return torch.softmax(x @ W, dim=-1)


def matmul_softmax_unfused_bytes(B: int, K: int, C: int, element_size: int) -> int:
    """Two kernels: x and W in, logits out, logits in, probabilities out (3 passes over B x C)."""
    return (B * K + K * C + 3 * B * C) * element_size


def matmul_softmax_fused_bytes(B: int, K: int, C: int, element_size: int) -> int:
    """One kernel that keeps the logits on chip: x and W in, probabilities out (1 pass)."""
    return (B * K + K * C + B * C) * element_size


def matmul_softmax_tiled_bytes(B: int, K: int, C: int, element_size: int, launch: MatmulLaunch) -> int:
    """One class tile: the fused minimum; several: the unfused passes plus a float32 (max, sum) a row
    and tile written and read; with K split, the partials too."""
    n_tiles = cdiv(C, launch.block_c)
    if n_tiles == 1:
        return matmul_softmax_fused_bytes(B, K, C, element_size) + split_k_bytes(B, K, launch)
    return (matmul_softmax_unfused_bytes(B, K, C, element_size) + 2 * (2 * B * n_tiles * 4)
            + split_k_bytes(B, K, launch, C))


def split_k_slices(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(slice length, slices): K in at most split_k slices of whole block_k steps, at least one."""
    k_slice = max(block_k, cdiv(cdiv(K, split_k), block_k) * block_k)
    return k_slice, max(1, cdiv(K, k_slice))


def split_k_bytes(B: int, K: int, launch: MatmulLaunch, C: int | None = None) -> int:
    """``split_k_kernel``'s padded float32 partials written and read (C None: one class tile); 0 unsplit."""
    if launch.split_k == 1:
        return 0
    n_splits = split_k_slices(K, launch.block_k, launch.split_k)[1]
    n_tiles_c = 1 if C is None else cdiv(C, launch.block_c)
    return 2 * n_splits * cdiv(B, launch.block_b) * launch.block_b * n_tiles_c * launch.block_c * 4


def presplit_bytes(B: int, K: int, C: int) -> int:
    """The presplit path's extra traffic: each float32 operand read, written as two parts, read back."""
    return 16 * K * (B + C)


def matmul_softmax_flops(B: int, K: int, C: int) -> int:
    """The product's 2BKC plus ~5 flops per logit for the softmax (max, subtract, exp, sum, divide)."""
    return 2 * B * K * C + 5 * B * C


@dataclass(frozen=True)
class MatmulLaunch:
    """Launch of the matmul-shaped kernels (the plan's unless given): block_b rows by block_c classes
    a program, block_k of K a step (powers of two, at least tl.dot's 16); group_b row blocks walk
    the class tiles together; split_k > 1 cuts K into slices; presplit: float32 'highest' from TF32
    parts split beforehand (unsplit K; the simple kernel ignores it)."""

    block_b: int
    block_c: int
    block_k: int
    group_b: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    presplit: bool = False

    def check(self) -> None:
        check_block("launch.block_b", self.block_b, 16, 256)
        check_block("launch.block_c", self.block_c, 16, 4096)
        check_block("launch.block_k", self.block_k, 16, 256)
        check_block("launch.group_b", self.group_b, 1, 64)
        check_block("launch.num_warps", self.num_warps, 1, 16)
        check_int("launch.num_stages", self.num_stages, 1, 8)
        check_int("launch.split_k", self.split_k, 1, 256)
        check_flag("launch.presplit", self.presplit)
        if self.presplit and self.split_k != 1:
            raise ValueError(f"launch.presplit takes an unsplit K: split_k must be 1, got {self.split_k}")


# K splits from SPLIT_K_LEAST_STEPS steps of block_k, in slices of SPLIT_K_SLICE_STEPS or more, rows no thinner than
# SPLIT_K_ROWS (one class tile) or SPLIT_K_ROWS_16BIT (the warpgroup MMA's height). Design notes: split-K.
SPLIT_K_LEAST_STEPS = 16
SPLIT_K_SLICE_STEPS = 2
SPLIT_K_ROWS = 32
SPLIT_K_ROWS_16BIT = 64
SPLIT_K_MAX_SLICES = 16
# 16-bit class tiles narrow to this before rows thin below 64 or K is split. Design notes: narrow tiles.
NARROW_CLASS_TILE = 64
# Float32 class tiles of at most this many classes take K steps of 128. Design notes: narrow tiles.
NARROW_FLOAT32_CLASSES = 32
# A 16-bit W within 4/5 of L2, K-major or in rows of no whole 32-byte sectors, is bound by L2 reads: its
# products take the tile that reads least (``_l2_bound_tile``). Design notes: L2 tiles.
L2_RESIDENT_W_BYTES = 40 << 20
L2_BOUND_TILES_16BIT = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
# 16 rows x 1024 classes of float32 accumulator: 64 registers a thread over 8 warps; twice spills.
SIMPLE_MAX_CLASSES = 1024
# TMA on sm_90 from these rows (W K-major) or B x K x C: below, descriptors cost more host time than TMA saves.
TMA_LEAST_KMAJOR_ROWS = 256
TMA_LEAST_PRODUCT = 1 << 32
_TMA_DTYPES = (torch.float16, torch.bfloat16)
# Measured rates of ``presplit_pays``; W split PRESPLIT_CHUNK_BYTES of parts at a time. Design notes: presplit.
TF32X3_FLOPS = 48e12
TF32X3_KMAJOR_FLOPS = 44e12
PRESPLIT_MARGIN = 1.2
PRESPLIT_FLOPS = 95e12
SPLIT_BYTES_PER_S = 2.5e12
SPLIT_FIXED_S = 12e-6
PRESPLIT_CHUNK_BYTES = 256 << 20
PARTS_BLOCK = 64
# The rescale's step (32 values a thread, 4 warps), programs an SM, tiles merged a step. Design notes: rescale.
RESCALE_VALUES = 4096
RESCALE_PROGRAMS_PER_SM = 2
RESCALE_MERGE = 1024


def _sm_count(device: torch.device) -> int | None:
    """SMs of the device; None off CUDA and in the interpreter, where programs run one after another."""
    if INTERPRET or device.type != "cuda":
        return None
    return _device_sms(_device_index(device))


def _device_index(device: torch.device) -> int:
    """The CUDA device's index ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _device_sms_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Dynamo takes the count as a constant in the flash Function's forward (it would trace an lru_cache).
@torch.compiler.assume_constant_result
def _device_sms(index: int) -> int:
    return _device_sms_cached(index)


def _l2_bound_tile(B: int, C: int, sms: int) -> tuple[int, int] | None:
    """The L2_BOUND_TILES_16BIT tile (rows, classes) reading the fewest values over whole waves of
    programs (the taller on a tie), no taller than B; None where each leaves half the SMs idle."""
    costs = [(cdiv(cdiv(B, bb) * cdiv(C, bc), sms) * (bb + bc), -bb, bb, bc) for bb, bc in L2_BOUND_TILES_16BIT
             if bb <= B and cdiv(B, bb) * cdiv(C, bc) >= sms // 2]
    return min(costs)[2:] if costs else None


def _fill_sms(B: int, n_tiles_c: int, block_b: int, sms: int | None, least: int = 16) -> int:
    """The row block halved (down to ``least``) until there is about one program an SM."""
    while sms is not None and block_b > least and cdiv(B, block_b) * n_tiles_c < sms:
        block_b //= 2
    return block_b


def tiled_launch(B: int, C: int, dtype: torch.dtype, device: torch.device, K: int | None = None,
                 w_kmajor: bool = False) -> MatmulLaunch:
    """``_tiled_launch`` for the device's SMs (``w_kmajor``: ``_w_kmajor``)."""
    return _tiled_launch(B, C, dtype, _sm_count(device), K, w_kmajor)


@functools.lru_cache(maxsize=4096)
def _tiled_launch(B: int, C: int, dtype: torch.dtype, sms: int | None, K: int | None,
                  w_kmajor: bool = False) -> MatmulLaunch:
    """``matmul``'s and the tiled version's: 16-bit 128 x 256 x 64 tiles, float32 32 x 128 x 32; rows thinned,
    16-bit class tiles narrowed and a long K split where SMs idle. Design notes: matmul tiles."""
    if dtype == torch.float32:
        block_b, block_c, block_k, warps, stages = 32, 128, 32, 4, 3
    else:
        if (sms is not None and K is not None and C > 256 and K * C * dtype.itemsize <= L2_RESIDENT_W_BYTES
                and (w_kmajor or C % 16)):
            tile = _l2_bound_tile(B, C, sms)  # see L2_RESIDENT_W_BYTES
            if tile is not None:
                return MatmulLaunch(*tile, 64, group_b=1, num_warps=8 if tile[0] * tile[1] > 64 * 128 else 4,
                                    num_stages=4)
        block_b, block_c, block_k, warps, stages = 128, 256, 64, 8, 4
        if w_kmajor and B >= 256 and C > 256:
            block_b, block_c = 256, 128  # a K-major W from DRAM, read by TMA (design notes: TMA)
    block_c = max(16, min(block_c, next_power_of_2(C)))
    block_b = min(block_b, max(16, next_power_of_2(B)))  # at B = 32 a 64-row block is half padding
    # A long K: slices fill SMs better than thinner rows over one class tile, or than thin rows that leave SMs idle.
    n_tiles_c = cdiv(C, block_c)
    long_k = sms is not None and K is not None and K >= SPLIT_K_LEAST_STEPS * block_k
    one_tile = long_k and n_tiles_c == 1
    fill = sms // 2 if sms is not None and not one_tile else sms
    least = SPLIT_K_ROWS if one_tile else 16
    if dtype != torch.float32 and n_tiles_c > 1:
        # 16-bit, several class tiles: rows to the MMA's height, class tiles to NARROW_CLASS_TILE, then thin or split.
        block_b = _fill_sms(B, n_tiles_c, block_b, fill, least=min(block_b, SPLIT_K_ROWS_16BIT))
        while fill is not None and block_c > NARROW_CLASS_TILE and cdiv(B, block_b) * n_tiles_c < fill:
            block_c //= 2
            n_tiles_c = cdiv(C, block_c)
        if long_k and block_b >= SPLIT_K_ROWS_16BIT:
            least = SPLIT_K_ROWS_16BIT
    block_b = _fill_sms(B, n_tiles_c, block_b, fill, least=least)
    if block_b * block_c <= 64 * 128:
        warps = 4  # one warpgroup covers a tile of <= 8192 accumulators at 64 a thread
    tiles = cdiv(B, block_b) * n_tiles_c
    split = 1
    if one_tile:
        # About one program per SM, each slice at least SPLIT_K_SLICE_STEPS steps of block_k.
        split = max(1, min(sms // tiles, K // (SPLIT_K_SLICE_STEPS * block_k)))
    elif long_k and tiles < sms // 2:
        split = max(1, min(sms // tiles, K // (SPLIT_K_SLICE_STEPS * block_k), SPLIT_K_MAX_SLICES))
    if dtype == torch.float32 and block_c <= NARROW_FLOAT32_CLASSES and split == 1:
        block_k, stages = 128, 4  # a step's bytes are mostly x's: four stages of 32 x 128 in flight
    return MatmulLaunch(block_b, block_c, block_k, group_b=8, num_warps=warps, num_stages=stages, split_k=split)


@functools.lru_cache(maxsize=4096)
def _simple_launch(B: int, C: int, dtype: torch.dtype, sms: int | None) -> MatmulLaunch:
    """The simple kernel's: all C classes in one tile, rows keeping the accumulator within 64 KiB
    (fewer while SMs idle), K steps keeping a stage near 32 KiB (3 fit shared memory)."""
    block_c = max(16, next_power_of_2(C))
    block_b = max(16, min(64, 16384 // block_c))
    block_b = _fill_sms(B, 1, block_b, sms)
    k_in_32_kib = 32 * 1024 // ((block_b + block_c) * dtype.itemsize)
    block_k = max(16, min(64, 1 << (k_in_32_kib.bit_length() - 1)))
    warps = 4 if block_b * block_c <= 64 * 128 else 8
    return MatmulLaunch(block_b, block_c, block_k, group_b=1, num_warps=warps, num_stages=3)


def presplit_pays(B: int, K: int, C: int, w_kmajor: bool) -> bool:
    """Whether presplit saves PRESPLIT_MARGIN times its split pass (12 bytes a value, launches) at measured rates."""
    pointer = TF32X3_KMAJOR_FLOPS if w_kmajor else TF32X3_FLOPS
    saved = 2 * B * K * C * (1 / pointer - 1 / PRESPLIT_FLOPS)
    return saved >= PRESPLIT_MARGIN * (12 * K * (B + C) / SPLIT_BYTES_PER_S + SPLIT_FIXED_S)


def _presplit_wanted(B: int, K: int, C: int, dtype: torch.dtype, w_kmajor: bool, setting: str) -> bool:
    """Whether a plan with no launch takes presplit on sm_90: float32 'highest' where ``presplit_pays``."""
    return dtype == torch.float32 and setting == "highest" and K > 0 and presplit_pays(B, K, C, w_kmajor)


@functools.lru_cache(maxsize=4096)
def presplit_launch(B: int, C: int, sms: int) -> MatmulLaunch:
    """128 x 128 x 32 tiles, 8 warps, 3 stages; halved to 64 x 64 (4 warps, 4 stages) while tiles < SMs."""
    block_b = block_c = 128
    while block_b * block_c > 64 * 64 and cdiv(B, block_b) * cdiv(C, block_c) < sms:
        if block_b >= block_c:
            block_b //= 2
        else:
            block_c //= 2
    big = block_b * block_c > 64 * 128
    return MatmulLaunch(block_b, block_c, 32, group_b=8, num_warps=8 if big else 4, num_stages=3 if big else 4,
                        presplit=True)


def presplit_chunk(K: int, C: int, block_c: int) -> int:
    """Classes of W split at a time: whole class tiles (at least one) whose parts fit PRESPLIT_CHUNK_BYTES."""
    tiles = max(1, PRESPLIT_CHUNK_BYTES // (8 * max(K, 1) * block_c))
    return min(tiles, cdiv(C, block_c)) * block_c


@functools.lru_cache(maxsize=4096)
def rescale_split(B: int, n_tiles_c: int, block_c: int, sms: int | None) -> tuple[int, int]:
    """(tiles a step, tiles a program) of ``rescale_tiles_kernel``: a row a program, or the fewest whole
    steps that give RESCALE_PROGRAMS_PER_SM programs an SM."""
    tiles = min(next_power_of_2(n_tiles_c), max(1, RESCALE_VALUES // block_c))
    if sms is None or B >= RESCALE_PROGRAMS_PER_SM * sms:
        return tiles, n_tiles_c
    wanted = cdiv(RESCALE_PROGRAMS_PER_SM * sms, B)
    while tiles > 1 and cdiv(n_tiles_c, tiles) < wanted:
        tiles //= 2
    steps = cdiv(n_tiles_c, tiles)
    return tiles, cdiv(steps, min(steps, wanted)) * tiles


@dataclass(frozen=True, eq=False)
class MatmulPlan:
    """What one call of a matmul-family op runs (``matmul_softmax_plan``)."""

    path: str  # "pointer", "tma" (16-bit operands by TMA), "split_k" or "presplit" (float32 from TF32 parts)
    kernel: object  # the product's, launched on grid with constants (presplit: a grid a chunk of W)
    launch: MatmulLaunch
    normalise: str  # "none" (x @ W), "rows" (then row_softmax), "kernel" (one class tile) or "rescale"
    grid: tuple
    tiles: tuple[int, int]  # row blocks, class tiles
    constants: dict
    buffers: tuple = ()  # (kind, shape) of each workspace: "float32", "int32" (zeroed) or "counts" (split-K's)
    split: tuple = ()  # split_k: (slice length, slices); presplit: (first class, classes) of each chunk
    rescale: tuple | None = None  # (grid, tiles a program, constants) of rescale_tiles_kernel over buffers[0]

    @property
    def slots(self) -> tuple[int | None, int]:
        """Slots in (x, W, out, *buffers) of the (max, sum) table (None without one) and the path's first buffer."""
        return (3, 4) if self.rescale is not None else (None, 3)


def matmul_softmax_plan(name: str, B: int, K: int, C: int, dtype: torch.dtype, w_kmajor: bool = False,
                        tma_readable: bool = False, sms: int | None = None, capability: tuple | None = None,
                        setting: str = "highest", launch: MatmulLaunch | None = None) -> MatmulPlan:
    """Op ``name``'s plan for x (B, K) @ W (K, C) in ``dtype``: W K-major, operands TMA-readable (never traced),
    ``sms`` (None: the interpreter), ``capability`` where sm_90 routes apply, float32 ``setting``, ``launch``."""
    simple = name == "matmul_softmax_fused_simple"
    precision = "ieee" if dtype != torch.float32 else "tf32x3" if setting == "highest" else "tf32"
    if launch is None:
        if simple:
            launch = _simple_launch(B, C, dtype, sms)
        elif sms is not None and capability == (9, 0) and _presplit_wanted(B, K, C, dtype, w_kmajor, setting):
            launch = presplit_launch(B, C, sms)
        else:
            launch = _tiled_launch(B, C, dtype, sms, K, w_kmajor)
    n_b, n_c = cdiv(B, launch.block_b), cdiv(C, launch.block_c)
    if name in ("matmul", "matmul_softmax_unfused"):
        normalise = "none" if name == "matmul" else "rows"
    else:
        normalise = "kernel" if simple or n_c <= 1 else "rescale"
    tiled, upcast = normalise == "rescale", upcast_dot_operands(dtype)
    shape = dict(BLOCK_B=launch.block_b, BLOCK_C=launch.block_c, BLOCK_K=launch.block_k,
                 num_warps=launch.num_warps, num_stages=launch.num_stages)
    plan = functools.partial(MatmulPlan, launch=launch, normalise=normalise, tiles=(n_b, n_c),
                             rescale=_rescale_plan(B, C, n_c, launch.block_c, dtype, sms) if tiled else None)
    stats = (("float32", (2, B, n_c)),) if tiled else ()
    if launch.presplit and not simple and precision == "tf32x3" and K:
        chunk = presplit_chunk(K, C, launch.block_c)
        parts = (("float32", (B, K)),) * 2 + (("float32", (chunk, K)),) * 2 + (("int32", (B + C,)),)
        return plan("presplit", matmul_presplit_kernel, grid=(), buffers=stats + parts,
                    split=tuple((first, min(chunk, C - first)) for first in range(0, C, chunk)),
                    constants=dict(shape, GROUP_B=launch.group_b, SOFTMAX=normalise == "kernel", TILED=tiled))
    dot = dict(shape, PRECISION=precision, UPCAST=upcast)
    if launch.split_k > 1:
        k_slice, n_splits = split_k_slices(K, launch.block_k, launch.split_k)
        parts = (("float32", (n_splits, n_b * launch.block_b, n_c * launch.block_c)), ("counts", (n_b * n_c,)))
        return plan("split_k", split_k_kernel, grid=(n_b * n_c * n_splits,), buffers=stats + parts,
                    split=(k_slice, n_splits), constants=dict(dot, SOFTMAX=normalise in ("kernel", "rescale"),
                                                                TILED=tiled))
    if normalise == "kernel":
        return plan("pointer", matmul_softmax_simple_kernel, grid=(n_b,), constants=dot)
    # TMA: sizes past the thresholds above on sm_90, any size in the interpreter (CI runs the path).
    if (tma_readable and dtype in _TMA_DTYPES and launch.block_c <= 256 and K
            and (sms is None or capability == (9, 0)
                 and (B >= TMA_LEAST_KMAJOR_ROWS if w_kmajor else B * K * C >= TMA_LEAST_PRODUCT))):
        return plan("tma", matmul_softmax_tma_tile_kernel if tiled else matmul_tma_kernel, grid=(n_b * n_c,),
                    buffers=stats, constants=dict(shape, GROUP_B=launch.group_b, W_KMAJOR=w_kmajor, UPCAST=upcast,
                                                  VEC=vector_align((C, C), dtype.itemsize)))
    return plan("pointer", matmul_softmax_tile_kernel if tiled else matmul_kernel, grid=(n_b * n_c,), buffers=stats,
                constants=dict(dot, GROUP_B=launch.group_b))


def _rescale_plan(B: int, C: int, n_tiles_c: int, block_c: int, dtype: torch.dtype, sms: int | None) -> tuple:
    """(grid, tiles a program, constants) of ``rescale_tiles_kernel`` over a contiguous (B, C) output."""
    tiles, per_program = rescale_split(B, n_tiles_c, block_c, sms)
    vector = 16 // dtype.itemsize
    shift = vector if C % vector else 1  # rows off 16-byte boundaries: blocks laid from them
    return ((B, cdiv(n_tiles_c, per_program)), per_program,
            dict(BLOCK_C=block_c, TILES=tiles, MERGE=min(next_power_of_2(n_tiles_c), RESCALE_MERGE),
                 VEC=1 if shift > 1 else vector_align((C, C), dtype.itemsize), SHIFT=shift, num_warps=4))


def _plan_of(name: str, x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None, traced: bool) -> MatmulPlan:
    """``matmul_softmax_plan`` for a call (the capability asked only where an sm_90 route may apply)."""
    (B, K), C = _concrete(*x.shape), int(W.shape[1])
    kmajor, setting = _w_kmajor(W), _float32_matmul_precision()
    tma = (not traced and TensorDescriptor is not None and x.dtype in _TMA_DTYPES
           and not tma_2d_unreadable(x) and not tma_2d_unreadable(W.t() if kmajor else W))
    sm90_route = tma or launch is None and _presplit_wanted(B, K, C, x.dtype, kmajor, setting)
    sms, capability = _device_facts(x.device, sm90_route)
    return matmul_softmax_plan(name, B, K, C, x.dtype, kmajor, tma, sms, capability, setting, launch)


@triton.jit
def tile_coords(pid, n_tiles_b, n_tiles_c, GROUP_B: tl.constexpr):
    """(row tile, class tile) of pid: GROUP_B row blocks sweep the class tiles together, sharing L2."""
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
    """x[rows, k_start:k_end] @ W[k_start:k_end, cols], float32; rows/cols past B/C give 0."""
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
def undivided_strides(stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, VEC: tl.constexpr,
                      W_KMAJOR: tl.constexpr, X_TRANSPOSED: tl.constexpr):
    """The strides ``_matmul_args`` divided by VEC, multiplied back: out's row stride, W's K
    stride (its class stride where W_KMAJOR) and x's row stride (its K stride where X_TRANSPOSED)."""
    stride_xb = stride_xb if X_TRANSPOSED else stride_xb * VEC
    stride_xk = stride_xk * VEC if X_TRANSPOSED else stride_xk
    stride_wk = stride_wk if W_KMAJOR else stride_wk * VEC
    stride_wc = stride_wc * VEC if W_KMAJOR else stride_wc
    return stride_xb, stride_xk, stride_wk, stride_wc, stride_ob * VEC


@triton.jit
def matmul_kernel(
    x_ptr, w_ptr, out_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    n_tiles_b, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, VEC: tl.constexpr,
    W_KMAJOR: tl.constexpr = False, X_TRANSPOSED: tl.constexpr = False,
):
    """out = x @ W, one (BLOCK_B, BLOCK_C) tile a program. K, C and the row strides (W_KMAJOR: W's
    class stride, X_TRANSPOSED: x's K stride) come divided by VEC (``_matmul_args``)."""
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob = undivided_strides(
        stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, VEC, W_KMAJOR, X_TRANSPOSED)
    K, C = K * VEC, C * VEC
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, 0, K, stride_xb, stride_xk, stride_wk, stride_wc,
                      BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=False)


@triton.jit
def store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX: tl.constexpr):
    """Store a float32 tile of logits in out's dtype; SOFTMAX (cols hold every class): their softmax."""
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
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, VEC: tl.constexpr,
    W_KMAJOR: tl.constexpr = False, X_TRANSPOSED: tl.constexpr = False,
):
    """softmax(x @ W) for BLOCK_B rows; BLOCK_C >= C, so each row's logits are all in registers.
    K, C and the row strides divided by VEC, as ``matmul_kernel``'s."""
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob = undivided_strides(
        stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, VEC, W_KMAJOR, X_TRANSPOSED)
    K, C = K * VEC, C * VEC
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_C)
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, 0, K, stride_xb, stride_xk, stride_wk, stride_wc,
                      BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=True)


@triton.jit
def split_k_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, stats_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    n_splits, k_slice, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTMAX: tl.constexpr, TILED: tl.constexpr, VEC: tl.constexpr,
    W_KMAJOR: tl.constexpr = False, X_TRANSPOSED: tl.constexpr = False,
):
    """One K slice of one (row block, class tile): its float32 partial to part, then the tile's count
    bumped (acquire-release); the program completing the count adds the partials in slice order and
    stores the logits, their softmax (SOFTMAX) or the tile's part and (max, sum) (TILED)."""
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob = undivided_strides(
        stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, VEC, W_KMAJOR, X_TRANSPOSED)
    K, C = K * VEC, C * VEC
    tile = tl.program_id(0) // n_splits
    part = tl.program_id(0) % n_splits
    tile_b = tile // n_tiles_c
    tile_c = tile % n_tiles_c
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    k_start = part * k_slice
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, k_start, tl.minimum(k_start + k_slice, K),
                      stride_xb, stride_xk, stride_wk, stride_wc, BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    tile_offsets = rows[:, None].to(tl.int64) * (n_tiles_c * BLOCK_C) + cols[None, :]
    slice_size = (tl.num_programs(0) // n_splits).to(tl.int64) * (BLOCK_B * BLOCK_C)
    # Rows past B are left out of the partials (at B = 1, 15 of a 16-row block's).
    live = (rows < B)[:, None]
    tl.store(part_ptr + part * slice_size + tile_offsets, acc, mask=live)
    # One thread bumps the count: the barrier first has every thread's partial stored, so the release covers them.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + tile, 1) == n_splits - 1:
        # Back to 0 for the next launch: one counts buffer serves calls and CUDA-graph replays (``_split_k_counts``).
        tl.atomic_xchg(count_ptr + tile, 0)
        total = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
        # Unrolled: four partials' loads in flight, not one L2 round trip after another.
        for other in tl.range(0, n_splits, loop_unroll_factor=4):
            # .cg: from L2, where the other programs' stores are, never a stale L1 line.
            total += tl.load(part_ptr + other * slice_size + tile_offsets, mask=live, other=0.0, cache_modifier=".cg")
        if TILED:
            store_tile_part(total, rows, cols, B, C, out_ptr, stats_ptr, tile_c, n_tiles_c, stride_ob, stride_oc)
        else:
            store_tile(total, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=SOFTMAX)


@triton.jit
def matmul_softmax_tile_kernel(
    x_ptr, w_ptr, out_ptr, stats_ptr, B, K, C,
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, stride_oc,
    n_tiles_b, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, VEC: tl.constexpr,
    W_KMAJOR: tl.constexpr = False, X_TRANSPOSED: tl.constexpr = False,
):
    """exp(logit - tile max) of one tile, and per row its (max, sum) in stats (2, B, n_tiles_c)."""
    stride_xb, stride_xk, stride_wk, stride_wc, stride_ob = undivided_strides(
        stride_xb, stride_xk, stride_wk, stride_wc, stride_ob, VEC, W_KMAJOR, X_TRANSPOSED)
    K, C = K * VEC, C * VEC
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = logits_tile(x_ptr, w_ptr, rows, cols, B, C, 0, K, stride_xb, stride_xk, stride_wk, stride_wc,
                      BLOCK_B, BLOCK_C, BLOCK_K, PRECISION, UPCAST)
    store_tile_part(acc, rows, cols, B, C, out_ptr, stats_ptr, tile_c, n_tiles_c, stride_ob, stride_oc)


@triton.jit
def store_tile_part(acc, rows, cols, B, C, out_ptr, stats_ptr, tile_c, n_tiles_c, stride_ob, stride_oc):
    """Store logits as exp(logit - tile max) in out's dtype, and each row's tile max and sum in stats."""
    row_ok = rows < B
    col_ok = cols < C
    logits = tl.where(col_ok[None, :], acc, float("-inf"))
    tile_max = tl.max(logits, axis=1)
    # A row all -inf here: weights and sum 0, not NaN; its tile max stays -inf, which the rescale weighs as nothing.
    p = tl.exp(logits - tl.where(tile_max > float("-inf"), tile_max, 0.0)[:, None])
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ob + cols[None, :] * stride_oc
    tl.store(o_ptrs, p.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    stat_ptrs = stats_ptr + rows.to(tl.int64) * n_tiles_c + tile_c
    tl.store(stat_ptrs, tile_max, mask=row_ok)
    tl.store(stat_ptrs + B * n_tiles_c, tl.sum(p, axis=1), mask=row_ok)


@triton.jit
def tma_logits_tile(x_desc, w_desc, tile_b, tile_c, K, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_K: tl.constexpr, W_KMAJOR: tl.constexpr, UPCAST: tl.constexpr):
    """x @ W over one tile in float32 by TMA (zeros past B, C and K); W_KMAJOR: w_desc is over W^T (C, K)."""
    acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([tile_b * BLOCK_B, k])
        if W_KMAJOR:
            w = w_desc.load([tile_c * BLOCK_C, k]).T
        else:
            w = w_desc.load([k, tile_c * BLOCK_C])
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def matmul_tma_kernel(
    x_desc, w_desc, out_ptr, B, K, C, stride_ob, stride_oc, n_tiles_b, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    VEC: tl.constexpr, W_KMAJOR: tl.constexpr, UPCAST: tl.constexpr,
):
    """``matmul_kernel`` by TMA; C and out's row stride come divided by VEC."""
    C, stride_ob = C * VEC, stride_ob * VEC
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    acc = tma_logits_tile(x_desc, w_desc, tile_b, tile_c, K, BLOCK_B, BLOCK_C, BLOCK_K, W_KMAJOR, UPCAST)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=False)


@triton.jit
def matmul_softmax_tma_tile_kernel(
    x_desc, w_desc, out_ptr, stats_ptr, B, K, C, stride_ob, stride_oc, n_tiles_b, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    VEC: tl.constexpr, W_KMAJOR: tl.constexpr, UPCAST: tl.constexpr,
):
    """``matmul_softmax_tile_kernel`` by TMA; C and out's row stride come divided by VEC."""
    C, stride_ob = C * VEC, stride_ob * VEC
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    acc = tma_logits_tile(x_desc, w_desc, tile_b, tile_c, K, BLOCK_B, BLOCK_C, BLOCK_K, W_KMAJOR, UPCAST)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    store_tile_part(acc, rows, cols, B, C, out_ptr, stats_ptr, tile_c, n_tiles_c, stride_ob, stride_oc)


@triton.jit
def _tf32_parts(t):
    """float32 t as hi + lo: hi rounded to TF32, lo = t - hi (0 where t or hi is not finite: hi carries it)."""
    hi = _tf32_rounded(t)
    # A finite t that rounds to inf is truncated instead, so lo and t's products stay as finite as torch's.
    overflow = (tl.abs(hi) == float("inf")) & (tl.abs(t) < float("inf"))
    hi = tl.where(overflow, (t.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True), hi)
    lo = t - hi
    return hi, tl.where(tl.abs(lo) < float("inf"), lo, 0.0)


@triton.jit
def tf32_parts_kernel(src_ptr, hi_ptr, lo_ptr, flags_ptr, start, flag_start, R, K, stride_r, stride_k,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [start, start + R) of a float32 matrix as contiguous TF32 parts hi and lo (R, K); a row
    holding inf or NaN sets flags_ptr[flag_start + row - start]. One grid axis, K's blocks fastest."""
    k_blocks = tl.cdiv(K, BLOCK_K)
    rows = (tl.program_id(0) // k_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = (tl.program_id(0) % k_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (ks < K)[None, :]
    t = tl.load(src_ptr + (start + rows)[:, None].to(tl.int64) * stride_r + ks[None, :].to(tl.int64) * stride_k,
                mask=mask, other=0.0)
    hi, lo = _tf32_parts(t)
    offsets = rows[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(hi_ptr + offsets, hi, mask=mask)
    tl.store(lo_ptr + offsets, lo, mask=mask)
    bad = tl.max(tl.where(tl.abs(t) < float("inf"), 0, 1), axis=1)
    tl.atomic_max(flags_ptr + flag_start + rows, bad, mask=(rows < R) & (bad > 0))


@triton.jit
def tf32_transposed_parts_kernel(v_ptr, out_ptr, d2, d3, stride_vb, stride_v2, stride_v3, stride_ob, stride_op,
                                 stride_o3, PARTS: tl.constexpr, BLOCK_2: tl.constexpr, BLOCK_3: tl.constexpr):
    """float32 V (batch, d2, d3), any strides, as out (batch, PARTS, d3, d2), d2 contiguous: part 0 V rounded
    to TF32, part 1 (PARTS = 2) the rest. One program a (BLOCK_2, BLOCK_3) block."""
    blocks_3 = tl.cdiv(d3, BLOCK_3)
    ks = (tl.program_id(0) // blocks_3) * BLOCK_2 + tl.arange(0, BLOCK_2)
    cs = (tl.program_id(0) % blocks_3) * BLOCK_3 + tl.arange(0, BLOCK_3)
    batch = tl.program_id(1).to(tl.int64)
    mask = (ks < d2)[:, None] & (cs < d3)[None, :]
    t = tl.load(v_ptr + batch * stride_vb + ks[:, None].to(tl.int64) * stride_v2 + cs[None, :].to(tl.int64) * stride_v3,
                mask=mask, other=0.0)
    hi, lo = _tf32_parts(t)
    offsets = batch * stride_ob + cs[None, :].to(tl.int64) * stride_o3 + ks[:, None]
    tl.store(out_ptr + offsets, hi, mask=mask)
    if PARTS == 2:
        tl.store(out_ptr + stride_op + offsets, lo, mask=mask)


@triton.jit
def presplit_logits_tile(x_ptr, xl_ptr, w_ptr, wl_ptr, rows, w_rows, row_ok, col_ok, K,
                         BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                         GUARD: tl.constexpr):
    """x @ W over one tile as three TF32 products of presplit parts (x's at rows, W^T's at w_rows); each step's
    products are summed from 0, small first, then added in float32 (in the MMA's sum the tile loses low
    bits). GUARD: non-finite small products dropped; the hi product carries inf and NaN. Design notes: presplit."""
    ks = tl.arange(0, BLOCK_K)
    x_off = rows[:, None].to(tl.int64) * K + ks[None, :]
    w_off = w_rows[None, :].to(tl.int64) * K + ks[:, None]
    acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        x_mask = row_ok[:, None] & k_ok[None, :]
        w_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(x_ptr + x_off, mask=x_mask, other=0.0)
        b = tl.load(w_ptr + w_off, mask=w_mask, other=0.0)
        a_lo = tl.load(xl_ptr + x_off, mask=x_mask, other=0.0)
        b_lo = tl.load(wl_ptr + w_off, mask=w_mask, other=0.0)
        small = tl.dot(a_lo, b, input_precision="tf32")
        small = tl.dot(a, b_lo, small, input_precision="tf32")
        if GUARD:
            small = tl.where(tl.abs(small) < float("inf"), small, 0.0)
        acc += tl.dot(a, b, small, input_precision="tf32")
        x_off += BLOCK_K
        w_off += BLOCK_K
    return acc


@triton.jit
def matmul_presplit_kernel(
    x_ptr, xl_ptr, w_ptr, wl_ptr, out_ptr, stats_ptr, flags_ptr, B, K, C, stride_ob, stride_oc,
    n_tiles_b, chunk_tiles, first_tile, n_tiles_c,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
    SOFTMAX: tl.constexpr, TILED: tl.constexpr, GUARD: tl.constexpr,
):
    """``presplit_logits_tile`` for chunk_tiles class tiles from first_tile, stored as the other kernels store.
    GUARD: a second launch over only tiles whose x rows or W classes hold inf or NaN (flags (B + C,)):
    one kernel with both loops would need shared memory for both pipelines."""
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, chunk_tiles, GROUP_B)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    w_rows = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    tile_c += first_tile
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < B, cols < C
    bad = 1  # a Python int without GUARD: the test below is decided at compile time
    if GUARD:
        bad = (tl.max(tl.load(flags_ptr + rows, mask=row_ok, other=0), axis=0)
               + tl.max(tl.load(flags_ptr + B + cols, mask=col_ok, other=0), axis=0))
    if bad > 0:
        acc = presplit_logits_tile(x_ptr, xl_ptr, w_ptr, wl_ptr, rows, w_rows, row_ok, col_ok, K,
                                   BLOCK_B, BLOCK_C, BLOCK_K, GUARD)
        if TILED:
            store_tile_part(acc, rows, cols, B, C, out_ptr, stats_ptr, tile_c, n_tiles_c, stride_ob, stride_oc)
        else:
            store_tile(acc, rows, cols, B, C, out_ptr, stride_ob, stride_oc, SOFTMAX=SOFTMAX)


@triton.jit
def rescale_tiles_kernel(
    out_ptr, stats_ptr, B, C, n_tiles_c, tiles_per_program, stride_ob, stride_oc,
    BLOCK_C: tl.constexpr, TILES: tl.constexpr, MERGE: tl.constexpr, VEC: tl.constexpr, SHIFT: tl.constexpr,
):
    """Program (row, q): merge the row's tiles' (max, sum), MERGE a step, then scale class tiles from
    q x tiles_per_program, TILES a block. C and the row stride come divided by VEC. SHIFT > 1 (rows off
    16 bytes): blocks laid from the boundary before the row, whole vectors; the edges are program 0's."""
    stride_ob, C = stride_ob * VEC, C * VEC
    row = tl.program_id(0).to(tl.int64)
    ms = tl.arange(0, MERGE)
    max_row = stats_ptr + row * n_tiles_c
    sum_row = max_row + B * n_tiles_c
    row_max = tl.max(tl.full((MERGE,), float("-inf"), tl.float32), axis=0)
    row_sum = tl.sum(tl.zeros((MERGE,), tl.float32), axis=0)
    for start in range(0, n_tiles_c, MERGE):
        t_ok = start + ms < n_tiles_c
        tile_max = tl.load(max_row + start + ms, mask=t_ok, other=float("-inf"))
        tile_sum = tl.load(sum_row + start + ms, mask=t_ok, other=0.0)
        new_max = tl.maximum(row_max, tl.max(tile_max, axis=0))
        # While every tile so far is all -inf the sums are 0: shift by 0, not by -inf (NaN).
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tile_sum * tl.exp(tile_max - shift), axis=0)
        row_max = new_max
    # A row of only -inf ends with row_max -inf and row_sum 0: its scale is NaN, torch's answer.
    inv_sum = 1.0 / row_sum
    ts = tl.arange(0, TILES)
    js = tl.arange(0, BLOCK_C)
    out_row = out_ptr + row * stride_ob
    first = tl.program_id(1) * tiles_per_program
    end = tl.minimum(first + tiles_per_program, n_tiles_c)
    if SHIFT > 1:
        lead = (row * stride_ob % SHIFT).to(tl.int32)
        out_row = out_ptr + tl.multiple_of(row * stride_ob - lead, SHIFT)
        last = (C + lead) // SHIFT * SHIFT  # the row's whole vectors: [SHIFT, last) of the frame
        # The frame runs lead values past the row's last tile: one more tile where they cross it.
        end = tl.where(end == n_tiles_c, n_tiles_c + 1, end)
    for start in range(first, end, TILES):
        tiles = start + ts
        t_ok = tiles < n_tiles_c
        scale = tl.exp(tl.load(max_row + tiles, mask=t_ok, other=0.0) - row_max) * inv_sum
        cols = tiles[:, None] * BLOCK_C + js[None, :]
        if SHIFT > 1:
            before = tl.exp(tl.load(max_row + tiles - 1, mask=(tiles >= 1) & (tiles <= n_tiles_c), other=0.0)
                            - row_max) * inv_sum
            scale = tl.where(js[None, :] < lead, before[:, None], scale[:, None])
            mask = (cols >= SHIFT) & (cols < last)
            ptrs = out_row + cols.to(tl.int64)
        else:
            scale = scale[:, None]
            mask = t_ok[:, None] & (cols < C)
            ptrs = out_row + cols.to(tl.int64) * stride_oc
        p = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (p * scale).to(out_ptr.dtype.element_ty), mask=mask)
    if SHIFT > 1:
        # The row's partial vectors: frame [lead, SHIFT) and [last, C + lead), by program 0.
        lanes = tl.arange(0, 2 * SHIFT)
        frame = tl.where(lanes < SHIFT, lanes, last + lanes - SHIFT)
        edge_ok = (((lanes < SHIFT) & (lanes >= lead)) | ((lanes >= SHIFT) & (frame >= SHIFT))) & (frame < C + lead)
        edge_ok = edge_ok & (tl.full((2 * SHIFT,), tl.program_id(1), tl.int32) == 0)
        tile = (frame - lead) // BLOCK_C
        scale = tl.exp(tl.load(max_row + tile, mask=edge_ok, other=0.0) - row_max) * inv_sum
        p = tl.load(out_row + frame, mask=edge_ok, other=0.0).to(tl.float32)
        tl.store(out_row + frame, (p * scale).to(out_ptr.dtype.element_ty), mask=edge_ok)


@triton.jit
def softmax_grad_kernel(
    y_ptr, dy_ptr, dz_ptr, C,
    stride_yb, stride_yc, stride_gb, stride_gc, stride_zb, stride_zc,
    BLOCK_C: tl.constexpr,
):
    """One row of dz = y * (dy - sum(y * dy)): the logits' gradient from the softmax's output y."""
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, BLOCK_C)
    dot = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, C, BLOCK_C):
        mask = start + cs < C
        y = tl.load(y_ptr + row * stride_yb + (start + cs) * stride_yc, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row * stride_gb + (start + cs) * stride_gc, mask=mask, other=0.0).to(tl.float32)
        dot += y * g
    total = tl.sum(dot, axis=0)
    for start in range(0, C, BLOCK_C):
        mask = start + cs < C
        y = tl.load(y_ptr + row * stride_yb + (start + cs) * stride_yc, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row * stride_gb + (start + cs) * stride_gc, mask=mask, other=0.0).to(tl.float32)
        tl.store(dz_ptr + row * stride_zb + (start + cs) * stride_zc, (y * (g - total)).to(dz_ptr.dtype.element_ty),
                 mask=mask)


def _w_kmajor(W: torch.Tensor) -> bool:
    """W (K, C) K-major (nn.Linear's weight transposed), as a plain bool whether strides are symbolic or not."""
    wk, wc = W.stride()
    return bool(wk == 1 and wc != 1)


def tma_2d_unreadable(t: torch.Tensor) -> bool:
    """Whether TMA cannot read t: its rows must be contiguous, its address and row bytes multiples of 16."""
    rows, cols = t.stride()
    return cols != 1 or rows <= 0 or (rows * t.element_size()) % 16 != 0 or t.data_ptr() % 16 != 0


def _device_facts(device: torch.device, sm90_route: bool = True) -> tuple[int | None, tuple | None]:
    """(SMs, capability) for ``matmul_softmax_plan``; (None, None) in the interpreter; capability None unless
    ``sm90_route``."""
    sms = _sm_count(device)
    return sms, None if sms is None or not sm90_route else _device_capability(_device_index(device))


def check_launch(launch) -> None:
    if not isinstance(launch, MatmulLaunch):
        raise TypeError(f"launch must be a MatmulLaunch, got {type(launch).__name__}")
    launch.check()


def check_matmul_call(name: str, x, W, launch) -> None:
    """Checks x (B, K), W (K, C) and launch: TypeError or ValueError naming the argument, KernelCapacityError
    where the simple kernel cannot hold C."""
    check_operands(x, "W", W, 2)
    if W.shape[0] != x.shape[1]:
        raise ValueError(f"W must have K = {x.shape[1]} rows (x's last dimension), got W of shape {tuple(W.shape)}")
    if launch is not None:
        check_launch(launch)
    C = W.shape[1]
    if name != "matmul_softmax_fused_simple":
        return
    if C > SIMPLE_MAX_CLASSES:
        raise KernelCapacityError(f"C = {C} classes is more than matmul_softmax_fused_simple keeps on chip "
                                  f"(at most {SIMPLE_MAX_CLASSES}); use matmul_softmax_fused_tiled")
    if launch is not None and launch.block_c < C:
        raise ValueError(f"launch.block_c = {launch.block_c} must cover all C = {C} classes in the simple kernel")
    if launch is not None and launch.split_k != 1:
        raise ValueError(f"launch.split_k must be 1 in the simple kernel (one program per row block), got {launch.split_k}")


def _matmul_args(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor) -> tuple[tuple, dict]:
    """The pointer kernels' (B, K, C, strides) and (VEC, W_KMAJOR, X_TRANSPOSED): K, C and the row strides
    divided by VEC, multiplied back in the kernels, so masks cover whole vectors. Design notes: vector strides."""
    (B, K), C = x.shape, W.shape[1]
    (xb, xk), (wk, wc), (ob, oc) = (tuple(t.stride()) for t in (x, W, out))  # no int(): see vector_strides
    kmajor, transposed = _w_kmajor(W), bool(xb == 1 and xk != 1)
    vec = vector_align((xk if transposed else xb, wc if kmajor else wk, ob, K, C), x.element_size())
    x_strides = (xb, xk // vec) if transposed else (xb // vec, xk)
    w_strides = (wk, wc // vec) if kmajor else (wk // vec, wc)
    return ((B, K // vec, C // vec, *x_strides, *w_strides, ob // vec, oc),
            dict(VEC=vec, W_KMAJOR=kmajor, X_TRANSPOSED=transposed))


def _concrete(*sizes) -> tuple[int, ...]:
    """Sizes as ints: a launch chosen for a size specialises a compiled graph on it anyway."""
    return tuple(int(n) for n in sizes)


def _output(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], W.shape[1]))  # less host time: empty_like_contiguous


@functools.lru_cache(maxsize=None)
def _split_k_counts(device: torch.device, stream: int, size: int) -> torch.Tensor:
    """split_k_kernel's counts, one kept buffer a device, stream and size: the kernel leaves them 0."""
    return torch.zeros((size,), dtype=torch.int32, device=device)


def _split_k_counts_for(x: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """split_k_kernel's counts for a call on x: fresh where a cached buffer must not serve (``fresh_counters``)."""
    if fresh_counters(x):
        return torch.zeros((n_tiles,), dtype=torch.int32, device=x.device)
    stream = torch._C._cuda_getCurrentRawStream(x.device.index) if x.is_cuda else 0
    return _split_k_counts(x.device, stream, next_power_of_2(n_tiles))


def _workspace(kind: str, shape: tuple, device: torch.device):
    """A function of a call's (x, W, out) making one of its plan's buffers (``MatmulPlan.buffers``)."""
    if kind == "counts":
        return lambda x, W, out: _split_k_counts_for(x, shape[0])
    if kind == "int32":
        return lambda x, W, out: torch.zeros(shape, dtype=torch.int32, device=device)
    return lambda x, W, out: torch.empty(shape, dtype=torch.float32, device=device)


def _launch(kernel, grid, args: tuple, options: dict, wrap: bool, kept: list | None, slots: tuple,
            descriptors: tuple = ()) -> None:
    """kernel[grid](*args, **options); ``kept`` gets (its Replay of the first len(slots) arguments or None, slots)."""
    replay = launch_kept(jit_kernel(kernel, wrap), grid, args, options, len(slots), descriptors, kept is not None)
    if kept is not None:
        kept.append((replay, slots))


def _family_forward(name: str, x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None, wrap: bool,
                    keep=None) -> torch.Tensor:
    """Op ``name`` on checked x and W by its plan (``wrap``: a traced op body); ``keep`` gets its launches as
    one replay of (x, W, out)."""
    if name == "matmul_softmax_unfused":
        return _unfused_forward(x, W, launch, wrap, keep)
    out = _output(x, W)
    if out.numel() == 0:
        return out
    plan = _plan_of(name, x, W, launch, wrap)
    makers = tuple(_workspace(kind, shape, x.device) for kind, shape in plan.buffers)
    slots = (x, W, out, *(make(x, W, out) for make in makers))
    kept = None if keep is None else []
    if plan.path == "presplit":
        _presplit_forward(plan, slots, wrap, kept)
    elif plan.path == "split_k":
        x_args, vectors = _matmul_args(x, W, out)
        table, t = plan.slots
        indices = (0, 1, 2, t, t + 1, t if table is None else table)  # x, W, out, partials, counts, table
        _launch(split_k_kernel, plan.grid, (*(slots[i] for i in indices), *x_args, plan.split[1], plan.split[0],
                                            plan.tiles[1]), dict(plan.constants, **vectors), wrap, kept, indices)
    elif plan.path == "tma":
        descriptors = _tma_descriptors(x, W, plan)
        vec, (ob, oc), n = plan.constants["VEC"], out.stride(), len(slots)
        _launch(plan.kernel, plan.grid, (*descriptors, *slots[2:], *x.shape, out.shape[1] // vec, ob // vec, oc,
                                         *plan.tiles), plan.constants, wrap, kept, tuple(range(n)), descriptors)
    else:
        x_args, vectors = _matmul_args(x, W, out)
        tiles = () if plan.normalise == "kernel" else plan.tiles  # the simple kernel takes none
        _launch(plan.kernel, plan.grid, (*slots, *x_args, *tiles), dict(plan.constants, **vectors), wrap, kept,
                tuple(range(len(slots))))
    if plan.rescale is not None:
        (grid, per_program, constants), table = plan.rescale, plan.slots[0]
        (B, C), (ob, oc), vec = out.shape, out.stride(), constants["VEC"]
        _launch(rescale_tiles_kernel, grid, (out, slots[table], B, C // vec, plan.tiles[1], per_program, ob // vec, oc),
                constants, wrap, kept, (2, table))
    if kept and all(replay is not None for replay, _ in kept):
        keep(kept[0][0] if len(kept) == 1 and not makers else ReplayChain(makers, tuple(kept)))
    return out


def _tma_descriptors(x: torch.Tensor, W: torch.Tensor, plan: MatmulPlan) -> tuple:
    """TMA descriptors of x and of W (W^T where K-major; a kept launch reads only the address)."""
    launch, kmajor = plan.launch, plan.constants["W_KMAJOR"]
    w = W.t() if kmajor else W
    block = [launch.block_c, launch.block_k] if kmajor else [launch.block_k, launch.block_c]
    return (TensorDescriptor(x, list(x.shape), list(x.stride()), [launch.block_b, launch.block_k]),
            TensorDescriptor(w, list(w.shape), list(w.stride()), block))


def _presplit_forward(plan: MatmulPlan, slots: tuple, wrap: bool, kept: list | None) -> None:
    """x's TF32 parts, then chunk by chunk W's parts and the products, over (x, W, out[, table], parts, flags)."""
    x, W, out = slots[:3]
    (B, K), C = x.shape, out.shape[1]
    (table, t), n_b, block_c = plan.slots, plan.tiles[0], plan.launch.block_c
    flags = t + 4
    parts = dict(BLOCK_R=PARTS_BLOCK, BLOCK_K=PARTS_BLOCK, num_warps=4)
    indices = (0, t, t + 1, flags)
    _launch(tf32_parts_kernel, (cdiv(B, PARTS_BLOCK) * cdiv(K, PARTS_BLOCK),),
            (*(slots[i] for i in indices), 0, 0, B, K, *x.stride()), parts, wrap, kept, indices)
    products = (t, t + 1, t + 2, t + 3, 2, 2 if table is None else table, flags)  # out for the table without one
    for first, width in plan.split:
        indices = (1, t + 2, t + 3, flags)
        _launch(tf32_parts_kernel, (cdiv(width, PARTS_BLOCK) * cdiv(K, PARTS_BLOCK),),
                (*(slots[i] for i in indices), first, B + first, width, K, W.stride(1), W.stride(0)), parts, wrap,
                kept, indices)
        chunk_tiles = cdiv(width, block_c)
        for guard in (False, True):  # every tile, then those of infinite or NaN operands again
            _launch(matmul_presplit_kernel, (n_b * chunk_tiles,),
                    (*(slots[i] for i in products), B, K, C, *out.stride(), n_b, chunk_tiles, first // block_c,
                     plan.tiles[1]), dict(plan.constants, GUARD=guard), wrap, kept, products)


def _unfused_forward(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None, wrap: bool,
                     keep=None) -> torch.Tensor:
    """``matmul``'s logits, then ``row_softmax``; ``keep`` gets both as one chain making the logits."""
    if keep is None:
        return row_softmax(_family_forward("matmul", x, W, launch, wrap))
    kept = []
    logits = _family_forward("matmul", x, W, launch, wrap, keep=kept.append)
    out = row_forward(logits, 0, traced=False, keep=kept.append)
    if len(kept) == 2:
        shape, dtype, device = logits.shape, logits.dtype, logits.device
        keep(ReplayChain((lambda x, W, out: torch.empty(shape, dtype=dtype, device=device),),
                         ((kept[0], (0, 1, 3)), (kept[1], (3, 2)))))
    return out


def _softmax_grad(y: torch.Tensor, dy: torch.Tensor, wrap: bool) -> torch.Tensor:
    """dz = y * (dy - rowsum(y * dy)), (B, C) in y's dtype (as torch's softmax backward gives it)."""
    dz = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if dz.numel():
        # 1024 columns a step: 8 per thread over 4 warps, loads wide enough for any C.
        jit_kernel(softmax_grad_kernel, wrap)[(y.shape[0],)](
            y, dy, dz, y.shape[1], *y.stride(), *dy.stride(), *dz.stride(),
            BLOCK_C=min(1024, next_power_of_2(int(y.shape[1]))), num_warps=4)
    return dz


def _matmul_backward(x: torch.Tensor, W: torch.Tensor, dz: torch.Tensor, need_x: bool, need_W: bool,
                     wrap: bool, product=None) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = dz @ W^T and dW = x^T @ dz by ``matmul``'s plan or ``product``; one not needed is empty."""
    product = product or (lambda a, b: _family_forward("matmul", a, b, None, wrap))
    dz = dz.contiguous()  # an expanded (stride-0) upstream gradient would lose the vector loads
    dx = product(dz, W.t()) if need_x else x.new_empty((0,))
    dW = product(x.t(), dz) if need_W else W.new_empty((0,))
    return dx, dW


@kernel_op("matmul_softmax_backward", _backward_fake)
def _matmul_softmax_backward_op(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor | None, dout: torch.Tensor,
                                need_x: bool, need_W: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of x @ W (out None) or of out = softmax(x @ W), for the gradient dout of the output."""
    dz = dout if out is None else _softmax_grad(out, dout, wrap=True)
    return _matmul_backward(x, W, dz, need_x, need_W, wrap=True)


# The backward op raises a second derivative (with where to get one), instead of giving a silent zero.
refuse_second_derivative(_matmul_softmax_backward_op, "matmul / softmax(x @ W)")


def _matmul_grads(ctx, dout: torch.Tensor, need: tuple, eager: bool) -> tuple:
    """(dx, dW), None where not ``need``ed, from the saved (x, W[, out]): by the backward op (the custom op's,
    or where ``backward_through_op``), torch's ops under a transform, else kept launches."""
    x, W, *out = ctx.saved_tensors
    y, (need_x, need_W) = (out[0] if out else None), need
    if eager and transformed(x, W, *out, dout):
        dz = dout if y is None else softmax_tangent(y, dout)
        dx, dW = dz @ W.t(), x.t() @ dz
    elif not eager or backward_through_op(dout):
        dx, dW = _matmul_softmax_backward_op(x, W, y, dout, need_x, need_W)
    else:
        dz = dout if y is None else _softmax_grad(y, dout, wrap=False)
        dx, dW = _matmul_backward(x, W, dz, need_x, need_W, wrap=False, product=_kept_product)
    return (dx if need_x else None), (dW if need_W else None)


def _family_op(name: str):
    """Custom op ``softmax_kernels::name`` with its backward; the unfused one is opaque (``row_softmax``
    does not launch through wrap_triton)."""
    opaque = name == "matmul_softmax_unfused"
    def body(x: torch.Tensor, W: torch.Tensor, launch: list[int]) -> torch.Tensor:
        with no_cached_buffers() if opaque else contextlib.nullcontext():
            return _family_forward(name, x, W, MatmulLaunch(*launch[:-1], bool(launch[-1])) if launch else None,
                                   wrap=not opaque)
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:2], *((output,) if name != "matmul" else ()))
    op = kernel_op(name, lambda x, W, launch: x.new_empty((x.shape[0], W.shape[1])), opaque=opaque)(body)
    register_autograd(
        op, lambda ctx, dout: (*_matmul_grads(ctx, dout, ctx.needs_input_grad[:2], eager=False), None),
        setup_context=setup)
    return op


_MATMUL_OPS = {name: _family_op(name) for name in ("matmul", "matmul_softmax_unfused", "matmul_softmax_fused_simple",
                                                   "matmul_softmax_fused_tiled")}
_MATMUL_REPLAYS = Replays("matmul")


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_operands(x, W) -> tuple:
    """x and W as torch's matmul takes them: under autocast, non-float64 floats cast to its dtype."""
    if not torch.compiler.is_compiling() and _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return x, W  # the common case, in 0.1 us (a trace asks by device type below, which it can follow)
    if not isinstance(x, torch.Tensor):
        return x, W  # the checks name it
    kind = "cuda" if x.is_cuda else x.device.type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return x, W  # the kernels' devices only: torch has no autocast state for "meta", say
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (x, W))


def _matmul_family(name: str, x, W, launch: MatmulLaunch | None, checked: bool = True) -> torch.Tensor:
    """Op ``name``: the kept launches for the call's key, else checks, then the Function (autograd or a
    transform), the custom op (a trace, a subclass) or a run that keeps its launches."""
    key = replay_key((x, W), (name, launch, _float32_matmul_precision()))
    if key is not None:
        replay = _MATMUL_REPLAYS.get(key)
        if replay is not None:
            out = _output(x, W)
            if replay(x, W, out):
                return out
    if checked:
        check_matmul_call(name, x, W, launch)
    if needs_op(x, W):
        if eager_autograd(x, W):
            return _MATMUL_AUTOGRAD.run(x, W, name, launch)
        return _MATMUL_OPS[name](x, W, _launch_fields(launch))
    return _family_forward(name, x, W, launch, wrap=False, keep=None if key is None else _MATMUL_REPLAYS.keeper(key))


def _kept_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for an eager backward: ``matmul``'s kept launch, no checks (the inputs were checked)."""
    return _matmul_family("matmul", a, b, None, checked=False)


# A matmul-family call under eager autograd (design notes: eager autograd) or torch.func; a backward that
# records a graph, is traced or is given a batch of gradients takes the backward op.
def _matmul_autograd_setup(ctx, inputs, output):
    x, W, name = inputs[:3]
    ctx.softmax = name != "matmul"
    saved = (x, W, output) if ctx.softmax else (x, W)
    ctx.save_for_backward(*saved)
    ctx.save_for_forward(*saved)


def _matmul_jvp(ctx, dx, dW, *_):
    x, W, *out = ctx.saved_tensors
    dz = 0
    if dx is not None:
        dz = dx @ W
    if dW is not None:
        dz = dz + x @ dW
    return softmax_tangent(out[0], dz) if ctx.softmax else dz


def _matmul_vmap(info, in_dims, x, W, name, launch):
    (x_dim, w_dim), n = in_dims[:2], info.batch_size
    if w_dim is None:  # one W for the batch: its rows join x's
        x = batch_first(x, x_dim)
        out = _MATMUL_AUTOGRAD.apply(x.flatten(0, 1), W, name, launch)
        return out.unflatten(0, x.shape[:2]), 0
    xs = batch_first(x, x_dim, n)
    return torch.stack([_MATMUL_AUTOGRAD.apply(a, b, name, launch) for a, b in zip(xs, batch_first(W, w_dim))]), 0


def _matmul_reference(x, W, name, launch):
    z = x.float() @ W.float()
    return (z if name == "matmul" else torch.softmax(z, dim=-1)).to(x.dtype)


_MATMUL_AUTOGRAD = AutogradSpec(
    "matmul / softmax(x @ W)", forward=lambda x, W, name, launch: _matmul_family(name, x, W, launch, checked=False),
    setup=_matmul_autograd_setup, jvp=_matmul_jvp, vmap=_matmul_vmap, reference=_matmul_reference,
    backward=lambda ctx, dout: (*_matmul_grads(ctx, dout, ctx.needs_input_grad[1:3], eager=True), None, None))


@on_input_device
def matmul(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """x @ W in Triton: x (B, K), W (K, C) -> (B, C) in x's dtype, accumulated in float32. ``launch``
    overrides the plan's. Differentiable in x and W; autocast casts the operands as for torch's matmul.
    """
    x, W = autocast_operands(x, W)
    return _matmul_family("matmul", x, W, launch)


@on_input_device
def matmul_softmax_unfused(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """softmax(x @ W) as two Triton kernels: ``matmul`` writes the logits, ``row_softmax`` reads them."""
    x, W = autocast_operands(x, W)
    return _matmul_family("matmul_softmax_unfused", x, W, launch)


@on_input_device
def matmul_softmax_fused_simple(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """softmax(x @ W) in one kernel, all C classes of a row block in registers. x: (B, K), W: (K, C) ->
    (B, C) in x's dtype. C at most ``SIMPLE_MAX_CLASSES`` (else KernelCapacityError, before allocating);
    a given ``launch`` must have block_c >= C and split_k 1. The logits stay in float32: a float16
    logit past 65504, inf or NaN in torch's float16 product, still counts at its value.
    """
    x, W = autocast_operands(x, W)
    return _matmul_family("matmul_softmax_fused_simple", x, W, launch)


@on_input_device
def matmul_softmax_fused_tiled(x: torch.Tensor, W: torch.Tensor, launch: MatmulLaunch | None = None) -> torch.Tensor:
    """softmax(x @ W) for any C, with no (B, C) buffer but the output. x: (B, K), W: (K, C) -> (B, C) in
    x's dtype. One class tile: one kernel; several: exp tiles and a (2, B, tiles) float32 table, then
    ``rescale_tiles_kernel``. Workspace: with K split, float32 partials; presplit (float32 'highest' on
    sm_90), TF32 parts of x (twice its size) and of W (up to ``PRESPLIT_CHUNK_BYTES``). Logits in
    float32, as ``matmul_softmax_fused_simple``'s.
    """
    x, W = autocast_operands(x, W)
    return _matmul_family("matmul_softmax_fused_tiled", x, W, launch)


# ==============================================================================================
# Attention
# ==============================================================================================
# softmax(Q K^T / sqrt(d)) V with the logits computed on the fly. FlashAttention-2 keeps one tile of the
# (n_queries, n_keys) matrix on chip at a time: the forward saves O and the rows' log-sum-exp L, the
# backward recomputes each tile of the softmax from L. Causal is top-left aligned (query i sees keys
# j <= i), as SDPA's is_causal. A row whose visible logits are all -inf gets 0 and L = -inf; NaN or +inf
# make the row NaN. Hidden keys never reach a row, except 0 x NaN from a non-finite V row in a partly
# seen tile (SDPA's backends differ there too).

# Powers of two from 16 (tl.dot's least) to 128 (past it Q, K and V tiles overflow shared memory).
FLASH_HEAD_DIMS = (16, 32, 64, 128)


def attention_reference(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Materialised attention in Q's dtype (float64 included): the answer every kernel must give.
    Q: (batch, n_queries, d), K and V: (batch, n_keys, d) -> (batch, n_queries, d). A row of only -inf
    logits gives NaN here (SDPA and the flash versions give 0).
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
    """Matmul flops: Q K^T and P V are 2 nq nk d each, causal half of them; the backward's five
    products (S again, dV, dP, dQ, dK) are 2.5x the forward. ``mode``: "fwd" or "fwd_bwd"."""
    forward = 4 * batch * n_queries * n_keys * d // (2 if is_causal else 1)
    return {"fwd": forward, "fwd_bwd": forward + 5 * forward // 2}[mode]


def flash_attention_bytes(batch: int, n_queries: int, n_keys: int, d: int, element_size: int, mode: str = "fwd") -> int:
    """The least a fused attention moves (no (nq, nk) tensor): ``flash_attention_io_bytes`` of one head."""
    return flash_attention_io_bytes(batch, 1, 1, n_queries, n_keys, d, d, element_size, mode)


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _python_number(name: str, value, kind: type, expected: str) -> float | int:
    """value as a Python float (kind numbers.Real) or int (numbers.Integral): Python's numbers and
    numpy's scalars; TypeError naming the argument otherwise. Under torch.compile numpy scalars are
    traced as arrays: the error says to pass a Python number."""
    if np is not None and isinstance(value, np.ndarray) and torch.compiler.is_compiling():
        raise TypeError(f"{name} must be a Python number under torch.compile, which traces numpy values as "
                        f"arrays: pass {'int' if kind is numbers.Integral else 'float'}({name})")
    if isinstance(value, (bool, np.bool_) if np is not None else bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {expected}, got {_type_name(value)}")
    try:
        return int(value) if kind is numbers.Integral else float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite float, got an int past float's range") from None


def causal_flag(is_causal) -> bool:
    """is_causal as a Python bool: a bool or a numpy bool (what comparisons of numpy values give)."""
    if isinstance(is_causal, bool):
        return is_causal
    if np is not None and isinstance(is_causal, np.bool_):
        return bool(is_causal)
    if np is not None and isinstance(is_causal, np.ndarray) and torch.compiler.is_compiling():
        raise TypeError("is_causal must be a Python bool under torch.compile, which traces numpy values (a "
                        "numpy.bool_ too) as tensors: pass bool(is_causal)")
    raise TypeError(f"is_causal must be a bool (or numpy.bool_), got {_type_name(is_causal)}")


# The plain-PyTorch version computes in float32 (float64 for float64 inputs) on any device.
FLASH_PYTORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_any_device(name: str, t) -> None:
    """FlashAttentionPytorch's rule for one input: a dense 3-d floating tensor on any device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
    check_dense(name, t)
    if t.dim() != 3:
        raise ValueError(f"{name} must have 3 dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in FLASH_PYTORCH_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def check_attention_inputs(Q, K, V, is_causal, kernels: bool = True) -> bool:
    """Both flash attentions' checks, returning is_causal as a bool; ``kernels``: for the Triton kernels ((batch,
    n, d) or (batch, heads, n, d)), else (batch, n, d) on any device. TypeError/ValueError naming the argument."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if kernels:
            check_tensor(name, t, (3, 4) if name == "Q" else Q.dim())
        else:
            _check_any_device(name, t)
    check_same("Q", Q, "K", K)
    check_same("Q", Q, "V", V)
    is_causal = causal_flag(is_causal)
    batch, d = tuple(Q.shape[:-2]), Q.shape[-1]
    k_shape = tuple(K.shape)
    if k_shape[:-2] != batch or k_shape[-1] != d:
        what = ("(batch, n_keys, d) with Q's batch" if Q.dim() == 3
                else "(batch, heads, n_keys, d) with Q's (batch, heads)")
        raise ValueError(f"K must be {what} {batch[0] if Q.dim() == 3 else batch} and d {d}, got K of shape {k_shape}")
    if tuple(V.shape) != k_shape:
        raise ValueError(f"V must have K's shape {k_shape}, got {tuple(V.shape)}")
    if k_shape[-2] == 0:
        raise ValueError("K has no keys (n_keys = 0): a softmax over no keys is undefined")
    if d == 0:
        raise ValueError("Q has d = 0: the scale 1/sqrt(d) is undefined")
    return is_causal


def _differentiates_twice() -> bool:
    """Inside a backward: whether autograd records it (create_graph=True); a compiled backward never does."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


# ----------------------------------------------------------------------------------------------
# FlashAttention-2 in plain PyTorch
# ----------------------------------------------------------------------------------------------
# Key tiles of 128: a tile costs about a dozen launches, and the live logits stay linear in the length.
# Query tiles only decide which queries a causal key tile skips.
FLASH_PYTORCH_KEY_TILE = 128
FLASH_PYTORCH_QUERY_TILE = 64


def _key_tiles(n_queries: int, n_keys: int, is_causal: bool, key_tile: int, query_tile: int):
    """(key start, key end, first query) of every key tile that some query sees."""
    for start in range(0, n_keys, key_tile):
        first_query = start // query_tile * query_tile if is_causal else 0
        if first_query < n_queries:
            yield start, min(start + key_tile, n_keys), first_query


def _flash_work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def flash_pytorch_forward(q, k, v, is_causal: bool):
    """O and L of FlashAttention-2's tiling, in q's dtype. q: (batch, nq, d), k, v: (batch, nk, d). The
    independent query-tile programs run in lock-step: a step takes one key tile against every query tile
    that sees it. Differentiable where autograd records (the second-derivative path)."""
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    scale = d ** -0.5
    m = torch.full((batch, n_queries), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros((batch, n_queries), dtype=q.dtype, device=q.device)
    acc = torch.zeros((batch, n_queries, d), dtype=q.dtype, device=q.device)
    for ks, ke, q0 in _key_tiles(n_queries, n_keys, is_causal, FLASH_PYTORCH_KEY_TILE, FLASH_PYTORCH_QUERY_TILE):
        s = (q[:, q0:] @ k[:, ks:ke].transpose(1, 2)) * scale
        if is_causal:
            s.masked_fill_(causal_mask(n_queries - q0, ke - ks, q.device, q0, ks), float("-inf"))
        m_old = m[:, q0:]
        # The running max only keeps exp() in range (O and L do not depend on it): detached, no in-place hazard.
        m_new = torch.maximum(m_old, s.detach().amax(dim=-1))
        # A row of only -inf logits so far subtracts 0: exp(-inf - 0) = 0, not NaN.
        m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(m_old - m_sub)
        p = torch.exp(s - m_sub[..., None])
        l[:, q0:] = l[:, q0:] * alpha + p.sum(dim=-1)
        acc[:, q0:] = acc[:, q0:] * alpha[..., None] + p @ v[:, ks:ke]
        m[:, q0:] = m_new
    # A row with no finite logit has l = 0 and acc = 0: its output is 0 and L = -inf, as SDPA.
    O = acc / l.masked_fill(l == 0, 1.0)[..., None]
    L = m + torch.log(l)
    return O, L


def flash_pytorch_backward(q, k, v, O, L, do, is_causal: bool):
    """dQ, dK, dV of FlashAttention-2's backward, in q's dtype, from the forward's O and L."""
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    scale = d ** -0.5
    D = (do * O).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP), the softmax's Jacobian term
    # Rows with no finite logit have L = -inf; +inf makes their P = exp(S - L) exactly 0.
    lse = L.masked_fill(L == float("-inf"), float("inf"))
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    # Each key tile owns its dK, dV and streams the query tiles that see it.
    for ks, ke, q0 in _key_tiles(n_queries, n_keys, is_causal, FLASH_PYTORCH_KEY_TILE, FLASH_PYTORCH_QUERY_TILE):
        s = (q[:, q0:] @ k[:, ks:ke].transpose(1, 2)) * scale
        if is_causal:
            s.masked_fill_(causal_mask(n_queries - q0, ke - ks, q.device, q0, ks), float("-inf"))
        p = torch.exp(s - lse[:, q0:, None])
        dv[:, ks:ke] = p.transpose(1, 2) @ do[:, q0:]
        dp = do[:, q0:] @ v[:, ks:ke].transpose(1, 2)
        ds = p * (dp - D[:, q0:, None]) * scale
        dq[:, q0:] += ds @ k[:, ks:ke]
        dk[:, ks:ke] = ds.transpose(1, 2) @ q[:, q0:]
    return dq, dk, dv


def flash_pytorch_gradients_twice_differentiable(Q, K, V, dO, is_causal: bool):
    """dQ, dK, dV with right derivatives (create_graph=True): O and L recomputed with history, then the backward."""
    work = _flash_work_dtype(Q.dtype)
    q, k, v, do = Q.to(work), K.to(work), V.to(work), dO.to(work)
    O, L = flash_pytorch_forward(q, k, v, is_causal)
    dq, dk, dv = flash_pytorch_backward(q, k, v, O, L, do, is_causal)
    return dq.to(Q.dtype), dk.to(K.dtype), dv.to(V.dtype)


class FlashAttentionPytorch(torch.autograd.Function):
    """``FlashAttentionPytorch.apply(Q, K, V, is_causal)``: FlashAttention-2 tiling in PyTorch.
    Q: (batch, n_queries, d), K and V: (batch, n_keys, d) -> O: (batch, n_queries, d), on any one device,
    float32, float16, bfloat16 or float64 (computed in float32, float64 in float64). Saves Q, K, V, O and
    L: (batch, n_queries). Twice differentiable.
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        is_causal = check_attention_inputs(Q, K, V, is_causal, kernels=False)
        work = _flash_work_dtype(Q.dtype)
        O, L = flash_pytorch_forward(Q.to(work), K.to(work), V.to(work), is_causal)
        O = O.to(Q.dtype)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        if _differentiates_twice():
            dQ, dK, dV = flash_pytorch_gradients_twice_differentiable(Q, K, V, dO, ctx.is_causal)
            return dQ, dK, dV, None
        work = L.dtype
        q, k, v, do = Q.to(work), K.to(work), V.to(work), dO.to(work)
        dq, dk, dv = flash_pytorch_backward(q, k, v, O.to(work), L, do, ctx.is_causal)
        return dq.to(Q.dtype), dk.to(K.dtype), dv.to(V.dtype), None


# ----------------------------------------------------------------------------------------------
# FlashAttention-2 in Triton
# ----------------------------------------------------------------------------------------------
# Each kernel streams unmasked tiles, then the few masked ones (causal diagonal, ragged end), keeping the
# per-logit select off the bulk. Rows past the last query are never stored (the forward and dQ compute them
# on zeros); dK/dV sums over queries, so it masks them. Logits are in base 2: one exp2 each. Float scalars
# are cast to float32: Inductor re-launches user kernels with fp64 floats (an fp64 tl.dot accumulator).
def flash_grid(batch: int, n_rows: int, block: int) -> tuple[int]:
    """One grid axis of batch x tiles programs (CUDA caps axes 1 and 2 at 65535, axis 0 at 2^31 - 1)."""
    tiles = cdiv(n_rows, block)
    return one_axis_grid(batch * tiles, f"batch {batch} x {tiles} tiles of {block} rows (split the batch)")


# Offsets within one batch element are 32-bit (Triton types sizes and strides below 2^31 as int32).
FLASH_MAX_OFFSET = 2**31 - 1


def check_flash_offsets(**tensors) -> None:
    """ValueError naming a tensor one of whose (batch, head) elements spans past FLASH_MAX_OFFSET."""
    for name, t in tensors.items():
        n, d = t.shape[-2:]
        stride_row, stride_dim = t.stride()[-2:]
        span = (n - 1) * stride_row + (d - 1) * stride_dim
        if span > FLASH_MAX_OFFSET:
            raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()} spans {span} elements in one "
                             f"batch element, past the kernels' 32-bit offsets ({FLASH_MAX_OFFSET}): split the sequence")


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
        check_int(f"{kernel}.num_stages", self.num_stages, 1, 8)


FLASH_KERNELS = ("forward", "dkdv", "dq")


def flash_launches(d: int, dtype: torch.dtype, few_tiles: bool = False, causal: bool = False) -> dict[str, FlashLaunch]:
    """Each Triton kernel's launch on an H100 by head dim, dtype, few query tiles (``flash_plan``) and
    causal masking; float32 operands take half the tiles (outputs/README.md, design notes: attention launches)."""
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
        # Causal dK/dV runs three loops: 128 keys on 4 warps spill there (3x slower than 64).
        causal_dkdv = FlashLaunch(64, 64, 4, 3)
        if few_tiles:
            return {"forward": FlashLaunch(64, 128, 4, 3), "dkdv": causal_dkdv if causal else FlashLaunch(32, 128, 4, 2),
                    "dq": FlashLaunch(64, 32, 4, 3)}
        return {"forward": FlashLaunch(128, 64, 8, 3), "dkdv": causal_dkdv if causal else FlashLaunch(64, 128, 4, 3),
                "dq": FlashLaunch(64, 64, 4, 3)}
    return {"forward": FlashLaunch(128, 64, 8, 3), "dkdv": FlashLaunch(64, 128, 8, 2),
            "dq": FlashLaunch(64, 64, 4, 2)}


# Below this many 128-query tiles an SM the last wave dominates: 64-query tiles (design notes: few query tiles).
FEW_TILES_PER_SM = 4
# Where each Gluon kernel is faster than its Triton peer (``_gluon_faster``; outputs/README.md, design notes:
# Gluon attention routes).
GLUON_FLASH_D64_MIN_WAVES = 1.5
GLUON_DQ_D64_MIN_QUERIES = 2048
GLUON_DKDV_D64_MIN_QUERIES = 2048


@dataclass(frozen=True)
class FlashPlan:
    """Each kernel's Triton launch, and the kernels ("forward", "dq", "dkdv") that run in Gluon instead."""

    forward: FlashLaunch
    dq: FlashLaunch
    dkdv: FlashLaunch
    gluon: tuple[str, ...] = ()

    def path(self, kernel: str) -> str:
        return "gluon" if kernel in self.gluon else "triton"


def flash_plan(batch: int, n_queries: int, n_keys: int, d: int, dtype: torch.dtype, is_causal: bool, *,
               sms: int | None = None, capability: tuple[int, int] | None = None, tma: bool = False,
               launches: dict | None = None) -> FlashPlan:
    """FlashAttentionTriton's kernels for this problem. ``sms``: SMs (None: unknown); ``capability``: (major,
    minor) where Gluon may run (None: no GPU, no Gluon, a trace); ``tma``: TMA can read the inputs;
    ``launches``: kernel name -> FlashLaunch (that kernel then runs in Triton). TypeError/ValueError on a
    head dim the kernels lack or a bad launch."""
    launches = {} if launches is None else launches
    if not isinstance(launches, dict):
        raise TypeError(f"launches must be a dict of kernel name -> FlashLaunch, got {type(launches).__name__}")
    for kernel, launch in launches.items():
        if kernel not in FLASH_KERNELS:
            raise ValueError(f"launches has unknown kernel {kernel!r}: the kernels are {FLASH_KERNELS}")
        if not isinstance(launch, FlashLaunch):
            raise TypeError(f"launches[{kernel!r}] must be a FlashLaunch, got {type(launch).__name__}")
        launch.check(f"launches[{kernel!r}]")
    few = sms is not None and batch * cdiv(n_queries, 128) < FEW_TILES_PER_SM * sms
    chosen = {**flash_launches(d, dtype, few, is_causal), **launches}
    unfit = gluon_flash_unfit(dtype, d, capability, None if tma else "TMA cannot read the inputs",
                              empty=batch * n_queries * n_keys <= 0)
    if unfit is not None or not sms:
        return FlashPlan(**chosen)
    faster = _gluon_faster(batch, n_queries, d, is_causal, sms)
    return FlashPlan(**chosen, gluon=tuple(kernel for kernel in faster if kernel not in launches))


def _gluon_faster(batch: int, n_queries: int, d: int, is_causal: bool, sms: int) -> tuple[str, ...]:
    """The kernels whose Gluon version measured faster than the Triton one at this shape (d 64 or 128)."""
    waves = batch * cdiv(n_queries, GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M) / sms
    wins = {"forward": d == 128 or waves > GLUON_FLASH_D64_MIN_WAVES,
            "dq": d == 128 or n_queries >= GLUON_DQ_D64_MIN_QUERIES,
            "dkdv": d == 128 or (not is_causal and n_queries >= GLUON_DKDV_D64_MIN_QUERIES)}
    return tuple(kernel for kernel in FLASH_KERNELS if wins[kernel])


# Two consumers share the K and V ring: twice the products in flight a program.
GLUON_FLASH_CONSUMERS = 2
# Persistent (a program an SM, the next tile's loads under the last one's products) for full attention up to
# this many keys; causal tiles balance better as one-tile programs (design notes: Gluon persistent forward).
GLUON_FLASH_PERSISTENT_MAX_KEYS = 4096


def gluon_flash_persistent(n_keys: int, is_causal: bool) -> bool:
    """Whether the Gluon attention forward runs a persistent grid for this shape (see above)."""
    return not is_causal and n_keys <= GLUON_FLASH_PERSISTENT_MAX_KEYS


GLUON_FLASH_HEAD_DIMS = (64, 128)  # the Gluon attention kernels' head dims
# The Gluon dQ kernel steps 128 keys at d = 64, and at d = 128 from this many keys (design notes: Gluon dQ key step).
GLUON_DQ_WIDE_MIN_KEYS = 8192


def gluon_dq_block_n(d: int, n_keys: int) -> int:
    """Keys a step of the Gluon dQ kernel at head dimension d over n_keys keys (see above)."""
    return 128 if d == 64 or n_keys >= GLUON_DQ_WIDE_MIN_KEYS else 64


def gluon_flash_unfit(dtype: torch.dtype, d: int, capability: tuple[int, int] | None, tma: str | None = None,
                      empty: bool = False) -> str | None:
    """Why the Gluon attention kernels cannot take inputs of this dtype, head dim d, ``capability`` (None: no
    Gluon), emptiness and TMA reason ``tma``; None where they can. The plan, the compiled route and
    ``gluon_flash_unsupported`` share it; TMA comes last, as a caller may read it only past the rest."""
    if capability is None:
        return GLUON_UNAVAILABLE or "Q, K and V must be CUDA tensors"
    if capability != (9, 0):
        return f"the kernel is written for sm_90 (Hopper), this GPU is sm_{capability[0]}{capability[1]}"
    if dtype not in _GLUON_DTYPES:
        return f"Q, K and V must be float16 or bfloat16, got {dtype}"
    if d not in GLUON_FLASH_HEAD_DIMS:
        return f"d must be one of {GLUON_FLASH_HEAD_DIMS}, got {d}"
    if empty:
        return "empty inputs have no TMA descriptor (FlashAttentionTriton handles them)"
    return tma


def gluon_flash_unsupported(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> str | None:
    """Why the Gluon attention kernels cannot take (Q, K, V) (``gluon_flash_unfit``), or None when they can."""
    unfit = gluon_flash_unfit(Q.dtype, Q.shape[-1], _gluon_capability(Q.device), empty=Q.numel() == 0 or K.numel() == 0)
    return unfit or _flash_tma_reason(Q=Q, K=K, V=V)


def _flash_tma_reason(**tensors) -> str | None:
    """Why TMA cannot read the first named tensor it cannot read (None ones left out), or None."""
    return next(filter(None, (tma_unreadable(name, t) for name, t in tensors.items() if t is not None)), None)


def tma_unreadable(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot read t (it needs a contiguous last dimension, a 16-byte address, other strides positive
    multiples of 16 bytes), or None."""
    if t.stride(-1) != 1:
        return f"{name}'s last dimension must be contiguous for TMA, its strides are {t.stride()}"
    if t.data_ptr() % 16 or any(s <= 0 or s * t.element_size() % 16 for s in t.stride()[:-1]):
        return (f"TMA needs {name}'s address and its strides but the last in bytes to be positive multiples of "
                f"16, got strides {t.stride()} of {t.element_size()}-byte elements")
    return None


def dkdv_full_tile_masks(d: int, is_causal: bool, n_queries: int) -> bool:
    """Whether dK/dV loads whole query tiles with (unneeded) row masks: at d = 128, causal or whole lengths, it
    spills less with them (design notes: dK/dV row masks)."""
    return d > 64 and (is_causal or n_queries % 16 == 0)


def _flash_kernel_args(dtype: torch.dtype) -> dict:
    """The constexprs every flash kernel takes from the dtype: tl.dot's precision and the interpreter's upcast."""
    return dict(PRECISION=dot_precision(dtype), UPCAST=upcast_dot_operands(dtype))


@triton.jit
def _flash_program(n_batch, n_rows, BLOCK: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """(batch element, tile) of this program, the batch index int64. Programs launch by id, batch fastest;
    HEAVY_FIRST (causal query tiles): the last tiles, which see the most keys, go first, so short ones
    fill the tail."""
    pid = tl.program_id(0)
    batch = pid % n_batch
    tile = pid // n_batch
    if HEAVY_FIRST:
        tile = tl.cdiv(n_rows, BLOCK) - 1 - tile
    return batch.to(tl.int64), tile


@triton.jit
def _flash_head(ptr, batch, n_heads, stride_b, stride_h):
    """ptr at flat batch element ``batch``: batch // n_heads, head batch % n_heads."""
    return ptr + (batch // n_heads) * stride_b + (batch % n_heads) * stride_h


@triton.jit
def _flash_tile_ptrs(ptr, batch, n_heads, rows, dims, stride_b, stride_h, stride_row, stride_dim):
    """Pointers to a (rows x head dims) tile of one flat batch element (``_flash_head``)."""
    base = _flash_head(ptr, batch, n_heads, stride_b, stride_h)
    return base + rows[:, None] * stride_row + dims[None, :] * stride_dim


@triton.jit
def _flash_key_range(query_start, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """(full_end, key_end): key tiles before full_end need no mask, those up to key_end do."""
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
def _flash_lse_base2(lse):
    """L in base 2, +inf where L = -inf (no finite logit), so that P = exp2(S - L) is 0 there, not NaN."""
    lse = lse * LOG2_E
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _flash_load_lse(lse_ptrs, offsets, row_ok):
    """``_flash_lse_base2`` of these rows' L, +inf for rows past the end too (P = 0 there)."""
    return _flash_lse_base2(tl.load(lse_ptrs + offsets, mask=row_ok, other=float("inf")))


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
        if MASKED:
            s = tl.where(_flash_visible(rows, keys, n_keys, IS_CAUSAL), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
        else:
            # Scale the row maxima, not the tile: the scale rides in the multiply-add before exp2 (monotone).
            m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
        # -inf inputs can leave a row's logits all -inf so far: it subtracts 0 (exp2(-inf - -inf) is NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        if MASKED:
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m - m_sub)
        l = l * alpha + tl.sum(p, axis=1)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m = m_new
    return acc, m, l


@triton.jit
def flash_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    n_batch, n_heads, n_queries, n_keys, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: BLOCK_M queries of one batch element against the keys they see; n_batch counts (batch, head)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    batch, tile = _flash_program(n_batch, n_queries, BLOCK_M, IS_CAUSAL)
    query_start = tile * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(_flash_tile_ptrs(q_ptr, batch, n_heads, rows, dims, stride_qb, stride_qh, stride_qm, stride_qd),
                mask=row_ok[:, None], other=0.0)
    tile_keys = tl.arange(0, BLOCK_N)
    k_ptrs = _flash_tile_ptrs(k_ptr, batch, n_heads, tile_keys, dims, stride_kb, stride_kh, stride_kn, stride_kd)
    v_ptrs = _flash_tile_ptrs(v_ptr, batch, n_heads, tile_keys, dims, stride_vb, stride_vh, stride_vn, stride_vd)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    full_end, key_end = _flash_key_range(query_start, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m, l = _flash_forward_tiles(acc, m, l, q, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_end,
                                     n_keys, qk_scale, BLOCK_N, False, IS_CAUSAL, PRECISION, UPCAST)
    acc, m, l = _flash_forward_tiles(acc, m, l, q, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, full_end, key_end,
                                     n_keys, qk_scale, BLOCK_N, True, IS_CAUSAL, PRECISION, UPCAST)
    # A row with no finite logit has l = 0 (and acc = 0): output 0 and L = -inf, as SDPA gives.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(_flash_tile_ptrs(o_ptr, batch, n_heads, rows, dims, stride_ob, stride_oh, stride_om, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    # Back from base 2: L = ln(sum exp(S)) = (m + log2(l)) * ln(2).
    tl.store(lse_ptr + batch * stride_lb + rows * stride_lm, (m + tl.math.log2(l)) * LN_2, mask=row_ok)


@triton.jit
def _flash_dkdv_tiles(
    dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_gm, stride_lm, stride_dm,
    query_start, query_end, n_queries, qk_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROW_MASKS: tl.constexpr,
):
    """dK and dV of one key tile from query tiles [query_start, query_end), key-major: with S^T = K Q^T every
    product takes its operands as loaded: dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - D), dK += dS^T Q.
    MASKED tiles zero P^T and dS^T where a query does not see the key or does not exist (a padding query's
    zeros times an infinite key are NaN). ROW_MASKS: mask rows past n_queries (``dkdv_full_tile_masks``).
    """
    for start in range(query_start, query_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_queries
        if ROW_MASKS:
            q = tl.load(q_ptrs + start * stride_qm, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs + start * stride_gm, mask=row_ok[:, None], other=0.0)
            lse = _flash_load_lse(lse_ptrs, rows * stride_lm, row_ok)
            delta = tl.load(delta_ptrs + rows * stride_dm, mask=row_ok, other=0.0)
        else:  # every row exists
            q = tl.load(q_ptrs + start * stride_qm)
            do = tl.load(do_ptrs + start * stride_gm)
            lse = _flash_lse_base2(tl.load(lse_ptrs + rows * stride_lm))
            delta = tl.load(delta_ptrs + rows * stride_dm)
        sT = _dot_acc(k, tl.trans(q), tl.zeros((k.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        if MASKED:
            keep = row_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (keys[:, None] <= rows[None, :])
            pT = tl.where(keep, pT, 0.0)
        dv = _dot_acc(pT.to(do.dtype), do, dv, PRECISION, UPCAST)
        dpT = _dot_acc(v, tl.trans(do), tl.zeros((k.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        dsT = pT * (dpT - delta[None, :])
        if MASKED:
            dsT = tl.where(keep, dsT, 0.0)
        dk = _dot_acc(dsT.to(q.dtype), q, dk, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def flash_attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    n_batch, n_heads, n_queries, n_keys, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lm,
    stride_db, stride_dm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, FULL_TILE_MASKS: tl.constexpr,
):
    """One program owns BLOCK_N keys and their dK, dV (no atomics), streaming the queries that see them.
    FULL_TILE_MASKS: load whole query tiles with row masks too (``dkdv_full_tile_masks``).
    """
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    # Causal: the first key tiles see the most queries, so the natural order launches the longest first.
    batch, tile = _flash_program(n_batch, n_keys, BLOCK_N, False)
    key_start = tile * BLOCK_N
    keys = key_start + tl.arange(0, BLOCK_N)
    key_ok = keys < n_keys
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(_flash_tile_ptrs(k_ptr, batch, n_heads, keys, dims, stride_kb, stride_kh, stride_kn, stride_kd),
                mask=key_ok[:, None], other=0.0)
    v = tl.load(_flash_tile_ptrs(v_ptr, batch, n_heads, keys, dims, stride_vb, stride_vh, stride_vn, stride_vd),
                mask=key_ok[:, None], other=0.0)
    tile_rows = tl.arange(0, BLOCK_M)
    q_ptrs = _flash_tile_ptrs(q_ptr, batch, n_heads, tile_rows, dims, stride_qb, stride_qh, stride_qm, stride_qd)
    do_ptrs = _flash_tile_ptrs(do_ptr, batch, n_heads, tile_rows, dims, stride_gb, stride_gh, stride_gm, stride_gd)
    lse_ptrs = lse_ptr + batch * stride_lb
    delta_ptrs = delta_ptr + batch * stride_db
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    if IS_CAUSAL:
        # Queries before key_start see none of these keys; from query key_start + BLOCK_N - 1 on, all see all.
        diagonal_start = key_start // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(key_start + BLOCK_N, BLOCK_M) * BLOCK_M
        dk, dv = _flash_dkdv_tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs,
                                   stride_qm, stride_gm, stride_lm, stride_dm,
                                   diagonal_start, tl.minimum(full_start, n_queries), n_queries, qk_scale,
                                   BLOCK_M, True, True, PRECISION, UPCAST, True)
    # The ragged last query tile, unless the diagonal took it, masks its missing queries.
    ragged_start = n_queries // BLOCK_M * BLOCK_M
    if IS_CAUSAL:
        ragged_from = tl.maximum(full_start, ragged_start)
    else:
        full_start = 0
        ragged_from = ragged_start
    dk, dv = _flash_dkdv_tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs,
                               stride_qm, stride_gm, stride_lm, stride_dm,
                               full_start, ragged_start, n_queries, qk_scale,
                               BLOCK_M, False, False, PRECISION, UPCAST, FULL_TILE_MASKS)
    dk, dv = _flash_dkdv_tiles(dk, dv, k, v, keys, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs,
                               stride_qm, stride_gm, stride_lm, stride_dm,
                               ragged_from, n_queries, n_queries, qk_scale,
                               BLOCK_M, True, False, PRECISION, UPCAST, True)
    # S = scale * Q K^T, so dK picks up the scale; the logits' log2(e) lives only inside exp2.
    dk = dk * sm_scale
    tl.store(_flash_tile_ptrs(dk_ptr, batch, n_heads, keys, dims, stride_dkb, stride_dkh, stride_dkn, stride_dkd),
             dk.to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(_flash_tile_ptrs(dv_ptr, batch, n_heads, keys, dims, stride_dvb, stride_dvh, stride_dvn, stride_dvd),
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
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, o_ptr,
    n_batch, n_heads, n_queries, n_keys, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lm,
    stride_db, stride_dm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_ob, stride_oh, stride_om, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program owns BLOCK_M queries and their dQ, streaming the keys they see like the forward.
    Recomputing S and dP (as dK/dV does) avoids atomic adds into dQ. It runs first and writes
    D = rowsum(dO * O), the softmax Jacobian's row term, which the dK/dV kernel reads.
    """
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    batch, tile = _flash_program(n_batch, n_queries, BLOCK_M, IS_CAUSAL)
    query_start = tile * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(_flash_tile_ptrs(q_ptr, batch, n_heads, rows, dims, stride_qb, stride_qh, stride_qm, stride_qd),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(_flash_tile_ptrs(do_ptr, batch, n_heads, rows, dims, stride_gb, stride_gh, stride_gm, stride_gd),
                 mask=row_ok[:, None], other=0.0)
    lse = _flash_load_lse(lse_ptr + batch * stride_lb, rows * stride_lm, row_ok)
    o = tl.load(_flash_tile_ptrs(o_ptr, batch, n_heads, rows, dims, stride_ob, stride_oh, stride_om, stride_od),
                mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + batch * stride_db + rows * stride_dm, delta, mask=row_ok)
    tile_keys = tl.arange(0, BLOCK_N)
    k_ptrs = _flash_tile_ptrs(k_ptr, batch, n_heads, tile_keys, dims, stride_kb, stride_kh, stride_kn, stride_kd)
    v_ptrs = _flash_tile_ptrs(v_ptr, batch, n_heads, tile_keys, dims, stride_vb, stride_vh, stride_vn, stride_vd)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    full_end, key_end = _flash_key_range(query_start, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _flash_dq_tiles(dq, q, do, lse, delta, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_end,
                         n_keys, qk_scale, BLOCK_N, False, IS_CAUSAL, PRECISION, UPCAST)
    dq = _flash_dq_tiles(dq, q, do, lse, delta, rows, k_ptrs, v_ptrs, stride_kn, stride_vn, full_end, key_end,
                         n_keys, qk_scale, BLOCK_N, True, IS_CAUSAL, PRECISION, UPCAST)
    dq = dq * sm_scale
    tl.store(_flash_tile_ptrs(dq_ptr, batch, n_heads, rows, dims, stride_dqb, stride_dqh, stride_dqm, stride_dqd),
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def _flash_kernel(kernel):
    """The kernel itself under torch.compile and in the interpreter, else its ``DirectLauncher`` (less host time)."""
    return kernel if torch.compiler.is_compiling() else jit_kernel(kernel, traced=False)


def _launch_flash(kernel, grid, args: tuple, options: dict, n_tensors: int, kept: list | None,
                  descriptors: tuple = ()) -> None:
    """``kernel[grid](*args, **options)``; ``kept`` gets a Replay of its first n_tensors arguments, or None."""
    replay = launch_kept(kernel, grid, args, options, n_tensors, descriptors, kept is not None)
    if kept is not None:
        kept.append(replay)


def flash_output_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like t for the flash kernels: where t's heads lie inside its rows (a fused qkv
    projection's), a view of (batch, n, heads, d), so the model's reshape back copies nothing; else
    contiguous (an expanded head too: rows heads x d apart would pass 32-bit offsets sooner)."""
    if t.dim() == 4 and 0 < t.stride(1) < t.stride(2):
        batch, heads, n, d = t.shape
        return t.new_empty((batch, n, heads, d)).transpose(1, 2)
    return empty_like_contiguous(t)


def flash_forward_outputs(Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) for the forward kernels to write: O as ``flash_output_like``, L Q's shape but d, float32."""
    return flash_output_like(Q), Q.new_empty(Q.shape[:-1], dtype=torch.float32)


def flash_dims(Q: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch x heads, heads, n, d) of a (batch, n, d) tensor (one head) or a (batch, heads, n, d) one."""
    if Q.dim() == 3:
        return Q.shape[0], 1, Q.shape[1], Q.shape[2]
    batch, heads, n, d = Q.shape
    return batch * heads, heads, n, d


def flash_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, head, row, dim) strides of a (batch, n, d) tensor (head stride 0) or a 4-d one."""
    stride = t.stride()
    return (stride[0], 0, stride[1], stride[2]) if t.dim() == 3 else stride


def _triton_flash_forward(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor, L: torch.Tensor,
                          is_causal: bool, launch: FlashLaunch, kept: list | None = None) -> None:
    """The Triton forward into O and L; kept as a Replay of (Q, K, V, O, L)."""
    batch, heads, n_queries, d = flash_dims(Q)
    args = (Q, K, V, O, L, batch, heads, n_queries, K.shape[-2], d ** -0.5 * LOG2_E.value,
            *flash_strides(Q), *flash_strides(K), *flash_strides(V), *flash_strides(O), L.stride(-2), L.stride(-1))
    options = dict(HEAD_DIM=d, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, IS_CAUSAL=is_causal,
                   num_warps=launch.num_warps, num_stages=launch.num_stages, **_flash_kernel_args(Q.dtype))
    _launch_flash(_flash_kernel(flash_attention_forward_kernel), flash_grid(batch, n_queries, launch.block_m), args,
                  options, 5, kept)


def _triton_flash_backward(which: str, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor,
                           L: torch.Tensor, dO: torch.Tensor, delta: torch.Tensor, outputs: tuple, is_causal: bool,
                           launch: FlashLaunch, kept: list | None = None) -> None:
    """Kernel "dq" (outputs (dQ,), writes D) or "dkdv" (outputs (dK, dV), reads D); kept as a Replay of 8 tensors."""
    batch, heads, n_queries, d = flash_dims(Q)
    n_keys = K.shape[-2]
    head = (Q, K, V, dO, L, delta)
    tail = (batch, heads, n_queries, n_keys, d ** -0.5, d ** -0.5 * LOG2_E.value, *flash_strides(Q),
            *flash_strides(K), *flash_strides(V), *flash_strides(dO), L.stride(-2), L.stride(-1), *delta.stride())
    options = dict(HEAD_DIM=d, IS_CAUSAL=is_causal, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                   num_warps=launch.num_warps, num_stages=launch.num_stages, **_flash_kernel_args(Q.dtype))
    if which == "dq":
        (dQ,) = outputs
        _launch_flash(_flash_kernel(flash_attention_backward_dq_kernel), flash_grid(batch, n_queries, launch.block_m),
                      (*head, dQ, O, *tail, *flash_strides(dQ), *flash_strides(O)), options, 8, kept)
        return
    dK, dV = outputs
    options["FULL_TILE_MASKS"] = dkdv_full_tile_masks(d, is_causal, n_queries)
    _launch_flash(_flash_kernel(flash_attention_backward_dkdv_kernel), flash_grid(batch, n_keys, launch.block_n),
                  (*head, dK, dV, *tail, *flash_strides(dK), *flash_strides(dV)), options, 8, kept)


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    """(major, minor) of CUDA device ``index``, asked once (the Gluon paths check it on every call)."""
    return torch.cuda.get_device_capability(index)


# Traced in the flash Function: Dynamo takes the answer as a constant (see _device_sms). An int,
# not a tuple: torch 2.11's Dynamo cannot guard a tuple made constant so when it is compared.
@torch.compiler.assume_constant_result
def _traced_capability_code(index: int) -> int:
    major, minor = _device_capability(index)
    return 10 * major + minor


def _traced_capability(index: int) -> tuple[int, int]:
    """``_device_capability`` inside a trace, where it is a constant."""
    return divmod(_traced_capability_code(index), 10)


def _exporting() -> bool:
    """Whether torch.export is tracing (torch 2.11's is_exporting() is True in torch.compile's traces too)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


# Compiled Gluon kernels run in opaque ops, whose host cost only a large call hides: from this much work,
# batch x heads x n_queries x n_keys x d, halved when causal (design notes: compiled attention route).
GLUON_COMPILED_MIN_WORK = 2**35


def compiled_gluon_route(Q: torch.Tensor, K: torch.Tensor, is_causal: bool) -> bool:
    """Whether a compiled FlashAttentionTriton call runs in the opaque ops ``flash_forward_by_path`` /
    ``flash_backward_by_path``, which plan when they run (a trace cannot know TMA's alignment): under
    torch.compile, not torch.export, where ``gluon_flash_unfit`` takes the GPU, dtype and head dim and the
    work reaches ``GLUON_COMPILED_MIN_WORK``; elsewhere the trace holds the Triton launches."""
    if not (torch.compiler.is_compiling() and not _exporting() and GLUON_UNAVAILABLE is None
            and Q.device.type == "cuda"
            and gluon_flash_unfit(Q.dtype, Q.shape[-1], _traced_capability(_device_index(Q.device))) is None):
        return False
    batch, _, n_queries, d = flash_dims(Q)
    return bool(batch * n_queries * K.shape[-2] * d // (2 if is_causal else 1) >= GLUON_COMPILED_MIN_WORK)


def _through_ops(Q: torch.Tensor, K: torch.Tensor, is_causal: bool, launches: dict | None) -> bool:
    """Whether to use the opaque ops: ``compiled_gluon_route`` (no override), or FakeTensors outside a trace."""
    return (launches is None and compiled_gluon_route(Q, K, is_causal)
            or (not torch.compiler.is_compiling() and is_fake(Q)))


def _gluon_capability(device: torch.device) -> tuple[int, int] | None:
    """The (major, minor) of the device where Gluon kernels may run there, else None."""
    if GLUON_UNAVAILABLE is not None or device.type != "cuda":
        return None
    return _device_capability(_device_index(device))


def flash_plan_of(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool, launches: dict | None = None,
                  dO: torch.Tensor | None = None) -> FlashPlan:
    """``flash_plan`` for these tensors (Gluon only in eager calls where TMA reads Q, K, V and dO, which a
    contiguous but unaligned slice may not)."""
    batch, _, n_queries, d = flash_dims(Q)
    capability = None if torch.compiler.is_compiling() or is_fake(Q) else _gluon_capability(Q.device)
    tma = capability is not None and _flash_tma_reason(Q=Q, K=K, V=V, dO=dO) is None
    return flash_plan(batch, n_queries, K.shape[-2], d, Q.dtype, is_causal, sms=_sm_count(Q.device),
                      capability=capability, tma=tma, launches=launches)


# Eager calls' kept launches (forwards as (Replay, is_causal), backwards as ReplayChains): less host time
# for small calls (design notes: kept attention launches).
_FLASH_REPLAYS = Replays("flash_attention")


def _flash_forward(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal,
                   launches: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(O, L, is_causal as a bool): an earlier call's kept launch, else checks, plan and launch (kept)."""
    key = None if launches is not None else replay_key((Q, K, V), (is_causal, _float32_matmul_precision()))
    kept = _FLASH_REPLAYS.get(key) if key is not None else None
    if kept is not None:
        O, L = flash_forward_outputs(Q)
        if kept[0](Q, K, V, O, L):
            return O, L, kept[1]
    is_causal = check_attention_inputs(Q, K, V, is_causal)
    # Every check before the hand-off: the ops' fakes check nothing (the plan checks d and launches).
    plan = flash_plan_of(Q, K, V, is_causal, launches)
    O = flash_output_like(Q)
    check_flash_offsets(Q=Q, K=K, V=V, O=O)  # O stands for dQ too; dK and dV are checked in the backward
    if _through_ops(Q, K, is_causal, launches):
        return (*flash_forward_by_path(Q, K, V, is_causal), is_causal)
    L = Q.new_empty(Q.shape[:-1], dtype=torch.float32)
    steps = [] if key is not None else None
    if O.numel() and plan.path("forward") == "gluon":
        _gluon_flash_forward(Q, K, V, is_causal, O, L, kept=steps)
    elif O.numel():
        _triton_flash_forward(Q, K, V, O, L, is_causal, plan.forward, steps)
    if steps and steps[0] is not None:
        _FLASH_REPLAYS.keeper(key)((steps[0], is_causal))
    return O, L, is_causal


def _flash_backward(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor, L: torch.Tensor,
                    dO: torch.Tensor, is_causal: bool, launches: dict | None = None,
                    keyed: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) from O, L and a dense dO in Q's dtype: the chain kept under (Q, K, V, dO, *keyed), else
    the plan's two kernels (kept as one chain)."""
    if Q.numel() == 0:  # in the layouts of the op's fake
        return tuple(flash_output_like(t).zero_() for t in (Q, K, V))
    if _through_ops(Q, K, is_causal, launches):
        return flash_backward_by_path(Q, K, V, O, L, dO, is_causal)
    dQ, dK, dV = flash_output_like(Q), flash_output_like(K), flash_output_like(V)
    key = None if launches is not None else replay_key((Q, K, V, dO, *keyed), (is_causal, _float32_matmul_precision()))
    chain = _FLASH_REPLAYS.get(key) if key is not None else None
    if chain is not None and chain(Q, K, V, O, L, dO, dQ, dK, dV):
        return dQ, dK, dV
    check_flash_offsets(dO=dO, dK=dK, dV=dV)
    plan = flash_plan_of(Q, K, V, is_causal, launches, dO)
    (batch, _, n_queries, _), device = flash_dims(Q), Q.device
    delta = torch.empty((batch, n_queries), dtype=torch.float32, device=device)
    steps = [] if key is not None else None
    # dQ first: it writes D (delta), which the dK/dV kernel reads.
    if plan.path("dq") == "gluon":
        _gluon_flash_dq(Q, K, V, O, dO, L, delta, dQ, is_causal, kept=steps)
    else:
        _triton_flash_backward("dq", Q, K, V, O, L, dO, delta, (dQ,), is_causal, plan.dq, steps)
    if plan.path("dkdv") == "gluon":
        _gluon_flash_dkdv(Q, K, V, dO, L, delta, dK, dV, is_causal, kept=steps)
    else:
        _triton_flash_backward("dkdv", Q, K, V, O, L, dO, delta, (dK, dV), is_causal, plan.dkdv, steps)
    if steps and all(step is not None for step in steps):  # slots: Q K V O L dO dQ dK dV, then delta
        _FLASH_REPLAYS.keeper(key)(ReplayChain(
            (lambda *tensors: torch.empty((batch, n_queries), dtype=torch.float32, device=device),),
            ((steps[0], (0, 1, 2, 5, 4, 9, 6, 3)), (steps[1], (0, 1, 2, 5, 4, 9, 7, 8)))))
    return dQ, dK, dV


@kernel_op("flash_forward_by_path", lambda Q, K, V, is_causal: flash_forward_outputs(Q), opaque=True)
def flash_forward_by_path(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                          is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) as one opaque op, planned when it runs (``compiled_gluon_route``)."""
    return _flash_forward(Q, K, V, is_causal)[:2]


@kernel_op("flash_backward_by_path", lambda Q, K, V, O, L, dO, is_causal: (
    flash_output_like(Q), flash_output_like(K), flash_output_like(V)), opaque=True)
def flash_backward_by_path(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor, L: torch.Tensor,
                           dO: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) as one opaque op (dO dense in Q's dtype, unchecked). O and L are in the key: a direct
    call's need not be fresh or contiguous (L's rows are read flat, as a view or a copy)."""
    L = L.flatten(0, -2)
    return _flash_backward(Q, K, V, O, L, dO, is_causal, keyed=(O, L))


class FlashAttentionTriton(torch.autograd.Function):
    """``FlashAttentionTriton.apply(Q, K, V, is_causal[, launches])``: FlashAttention-2 in Triton.

    Q: (batch, n_queries, d), K and V: (batch, n_keys, d), d in ``FLASH_HEAD_DIMS``, float32, float16 or
    bfloat16 -> O in Q's dtype; or SDPA's (batch, heads, n, d), any strides (a fused qkv projection's views
    read in place, O then a view: ``flash_output_like``). Saves Q, K, V, O and L (Q's shape but d, float32);
    the backward runs dQ's kernel (which makes D = rowsum(dO * O)), then dK and dV's. ``flash_plan`` picks
    each kernel (Gluon on Hopper where faster) and launch; ``launches`` maps "forward", "dkdv" or "dq" to a
    ``FlashLaunch`` of its Triton kernel. No host synchronisation: torch.compile(fullgraph=True) traces it
    and CUDA graphs capture it (Gluon through ``compiled_gluon_route``'s opaque ops). An eager call with an
    earlier call's key (``replay_key``) replays its kept launches. A backward under create_graph=True runs
    the recorded PyTorch tiling (twice differentiable).
    """

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, launches=None):
        device = other_device(Q)
        if device is not None:  # Q's device current for the launches, as torch's ops run
            with torch.cuda.device(device):
                return FlashAttentionTriton.forward(ctx, Q, K, V, is_causal, launches)
        O, L, ctx.is_causal = _flash_forward(Q, K, V, is_causal, launches)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.launches = launches  # a call with an override keeps no launch, backward included
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        if _differentiates_twice():
            grads = flash_pytorch_gradients_twice_differentiable(*(t.flatten(0, -3) for t in (Q, K, V, dO)),
                                                                 ctx.is_causal)
            return (*(g.view(t.shape) for g, t in zip(grads, (Q, K, V))), None, None)
        # One dtype and dense rows: a stride-0 dO (y.sum()'s) would be read an element at a time in every tile.
        dO = dO.to(Q.dtype)
        if dO.stride(-1) != 1 or 0 in dO.stride():
            dO = dO.contiguous()
        return (*_flash_backward(Q, K, V, O, L, dO, ctx.is_causal, ctx.launches), None, None)


# ==============================================================================================
# Attention as models call it: flash_attention (SDPA's layout, GQA, head dims to 256, window,
# softcap, log-sum-exp)
# ==============================================================================================
# The general kernels: four strides a tensor, a head-group index for GQA, d and dv padded to a power of two,
# and a mask as bounds on j - i: query i sees key j when lo <= j - i <= hi. Causal is hi = offset, a window
# (left, right) lo = offset - left, hi = offset + right; offset 0 top-left (SDPA's) or n_keys - n_queries
# bottom-right. A query that sees no key gets 0, lse -inf and zero gradients, as SDPA gives a row its mask
# hides. Key tiles hidden from a whole query tile are skipped (``_attention_span``); whole ones run
# unmasked. Softcap: s becomes softcap * tanh(s / softcap), whose derivative 1 - tanh^2 multiplies dS.


ATTENTION_MAX_HEAD_DIM = 256
# Head dims step by 8: 16-bit rows of 8 elements are 16-byte vectors, what every model's head has.
ATTENTION_HEAD_DIM_STEP = 8
CAUSAL_ALIGNS = ("top_left", "bottom_right")
# Window sides are capped at 2^30 (every key of any sequence 32-bit offsets allow), so a bound plus a row fits int32.
ATTENTION_MAX_WINDOW = 2**30
# 16-bit inputs take a one-exp2 tanh, which errs by softcap x 6e-8 a logit (float32's unit in
# 1 - 2 / (e^2x + 1)): to 1e4 that is under a 16-bit logit's rounding; past it, no cap or float32.
ATTENTION_MAX_SOFTCAP_16BIT = 1e4
# 2 log2(e): tanh(x) = 1 - 2 / (exp2(x * TANH_EXP2) + 1).
TANH_EXP2 = tl.constexpr(2.8853900817779268)


def attention_mask_bounds(n_queries: int, n_keys: int, is_causal: bool = False, causal_align: str = "top_left",
                          window: tuple | None = None) -> tuple[int | None, int | None]:
    """(lo, hi): query i sees key j when lo <= j - i <= hi (None: no bound on that side)."""
    offset = n_keys - n_queries if causal_align == "bottom_right" else 0
    left, right = ((None, None) if window is None else
                   (None if n is None else min(n, ATTENTION_MAX_WINDOW) for n in window))
    lo = None if left is None else offset - left
    his = ([offset] if is_causal else []) + ([offset + right] if right is not None else [])
    return lo, (min(his) if his else None)


def attention_visible(n_queries: int, n_keys: int, lo: int | None, hi: int | None, device=None) -> torch.Tensor:
    """(n_queries, n_keys) bool, True where the query sees the key under the bounds (lo, hi)."""
    gap = torch.arange(n_keys, device=device)[None, :] - torch.arange(n_queries, device=device)[:, None]
    visible = torch.ones((n_queries, n_keys), dtype=torch.bool, device=device)
    if lo is not None:
        visible &= gap >= lo
    if hi is not None:
        visible &= gap <= hi
    return visible


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                              scale: float | None = None, causal_align: str = "top_left", window: tuple | None = None,
                              softcap: float | None = None,
                              bounds: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of materialised attention with every option of ``flash_attention``, in q's dtype (the
    tests' judge in float64). Key/value heads are repeated over their query heads (as SDPA's enable_gqa);
    a query that sees no key gets 0 and lse -inf, with zero gradients. ``bounds``: the mask's (lo, hi)
    instead of the options' (for the first queries of a longer problem, whose alignment would differ)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bounds is None:
        bounds = attention_mask_bounds(n_queries, n_keys, is_causal, causal_align, window)
    visible = attention_visible(n_queries, n_keys, *bounds, device=q.device)
    dead = ~visible.any(dim=-1)[:, None]  # queries that see no key
    s = s.masked_fill(~visible, float("-inf")).masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(dead[:, 0], float("-inf"))
    out = (torch.softmax(s, dim=-1) @ v).masked_fill(dead, 0.0)
    return out, lse


def attention_visible_pairs(n_queries: int, n_keys: int, lo: int | None, hi: int | None) -> int:
    """How many (query, key) pairs the bounds show: each costs 2 (d + dv) flops forward."""
    i = torch.arange(n_queries, dtype=torch.int64)
    first = (i + lo).clamp_min(0) if lo is not None else torch.zeros_like(i)
    last = (i + hi).clamp_max(n_keys - 1) if hi is not None else torch.full_like(i, n_keys - 1)
    return int((last - first + 1).clamp_min(0).sum())


def flash_attention_flops(batch: int, heads: int, n_queries: int, n_keys: int, d: int, dv: int,
                          lo: int | None = None, hi: int | None = None, mode: str = "fwd") -> int:
    """Matmul flops on the visible pairs: S = Q K^T (2 d a pair) and P V (2 dv); the backward
    recomputes S and adds dV, dP, dQ, dK: 2.5x the forward, as ``attention_flops`` counts."""
    forward = 2 * (d + dv) * batch * heads * attention_visible_pairs(n_queries, n_keys, lo, hi)
    return {"fwd": forward, "fwd_bwd": forward + 5 * forward // 2}[mode]


def flash_attention_io_bytes(batch: int, heads: int, kv_heads: int, n_queries: int, n_keys: int, d: int, dv: int,
                             element_size: int, mode: str = "fwd") -> int:
    """The least a fused attention moves: q, k, v in, out and lse (float32) out; the backward reads
    q, k, v, out, dout, lse, writes and reads D (float32), writes dq, dk, dv."""
    q, o = batch * heads * n_queries * d, batch * heads * n_queries * dv
    kv = batch * kv_heads * n_keys * (d + dv)
    rows = batch * heads * n_queries
    forward = (q + kv + o) * element_size + 4 * rows
    backward = (2 * q + 2 * kv + 2 * o) * element_size + 3 * 4 * rows
    return {"fwd": forward, "fwd_bwd": forward + backward}[mode]


def _real_number(name: str, value, positive: bool) -> float:
    value = _python_number(name, value, numbers.Real, "None or a float")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite float, got {value}")
    return value


def _check_attention_scalars(scale: float, softcap: float | None, dtype: torch.dtype) -> None:
    """ValueError where the kernels could not hold a given scale and softcap as they should."""
    if softcap is not None and dtype in (torch.float16, torch.bfloat16) and softcap > ATTENTION_MAX_SOFTCAP_16BIT:
        raise ValueError(f"softcap must be at most {ATTENTION_MAX_SOFTCAP_16BIT:g} with {dtype} inputs, whose "
                         f"kernels' tanh errs by softcap x 6e-8 a logit, got {softcap}: pass None for no cap, or "
                         "float32 inputs")
    # The kernels hold these factors in float32 (``_attention_scalars``): each must be a normal float32.
    for value, what in zip(_attention_scalars(scale, softcap or 0.0), ("scale / softcap" if softcap else
                                                                        "scale x log2(e)", "softcap x log2(e)")):
        if value and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
            raise ValueError(f"{'scale and softcap give' if softcap else 'scale gives'} the kernels' factor {what} = "
                             f"{value:g}, outside float32's normal range [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}]")


def _check_window(window) -> tuple | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of key counts, got {window!r}")
    sides = tuple(None if n is None else _python_number(f"window's {side}", n, numbers.Integral,
                                                         "None (unlimited) or an int >= 0")
                  for side, n in zip(("left", "right"), window))
    for side, n in zip(("left", "right"), sides):
        if n is not None and n < 0:
            raise ValueError(f"window's {side} must be None (unlimited) or an int >= 0, got {n}")
    return sides


def check_flash_attention_inputs(q, k, v, is_causal, scale, enable_gqa, causal_align, window, softcap) -> dict:
    """``flash_attention``'s checks; returns the options normalised (is_causal a bool, scale a float, window a
    tuple or None, softcap a float or None). TypeError/ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4)
    check_same("q", q, "k", k)
    check_same("q", q, "v", v)
    is_causal = causal_flag(is_causal)
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {_type_name(enable_gqa)}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    batch, heads, _, d = q.shape
    kb, kv_heads, n_keys, kd = k.shape
    if kb != batch or kd != d:
        raise ValueError(f"k must be (batch, kv_heads, n_keys, d) with q's batch {batch} and d {d}, got k of shape "
                         f"{tuple(k.shape)}")
    if tuple(v.shape[:3]) != (batch, kv_heads, n_keys):
        raise ValueError(f"v must be (batch, kv_heads, n_keys, dv) with k's {(batch, kv_heads, n_keys)}, got v of "
                         f"shape {tuple(v.shape)}")
    if heads % kv_heads if kv_heads else heads:  # no heads at all: empty, as SDPA gives
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's and v's heads ({kv_heads})")
    if heads != kv_heads and not enable_gqa:
        raise ValueError(f"q has {heads} heads and k, v have {kv_heads}: grouped-query attention needs enable_gqa=True "
                         "(as in F.scaled_dot_product_attention)")
    for name, n in (("d (the last dimension of q and k)", d), ("dv (the last dimension of v)", v.shape[-1])):
        if n % ATTENTION_HEAD_DIM_STEP or not 0 < n <= ATTENTION_MAX_HEAD_DIM:
            raise ValueError(f"{name} must be a multiple of {ATTENTION_HEAD_DIM_STEP} from {ATTENTION_HEAD_DIM_STEP} "
                             f"to {ATTENTION_MAX_HEAD_DIM}, got {n}")
    for name, t in (("q", q), ("k", k), ("v", v)):  # one head's offsets are 32-bit in the kernels
        span = sum((n - 1) * abs(st) for n, st in zip(t.shape[2:], t.stride()[2:]) if n > 0)
        if span > FLASH_MAX_OFFSET:
            raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()} spans {span} elements in one "
                             f"head, past the kernels' 32-bit offsets ({FLASH_MAX_OFFSET}): split the sequence")
    given = scale is not None or softcap is not None
    scale = d ** -0.5 if scale is None else _real_number("scale", scale, positive=False)
    softcap = None if softcap is None else _real_number("softcap", softcap, positive=True)
    if given:
        _check_attention_scalars(scale, softcap, q.dtype)
    return dict(is_causal=is_causal, scale=scale, causal_align=causal_align, window=_check_window(window),
                softcap=softcap)


@dataclass(frozen=True)
class AttentionPlan:
    """What ``flash_attention`` launches: ``path`` "course" (FlashAttentionTriton's kernels) or "general"; for
    the general kernels the head dims padded to powers of two (at least 16), the mask bounds (lo, hi) on
    j - i (None: unbounded), each kernel's tiles and the forward's key splits, and whether the forward runs as
    the Hopper Gluon kernel where the GPU and TMA allow (else the general Triton kernel at these tiles). A plan
    given to flash_attention runs the general kernels."""

    head_dim: int
    head_dim_v: int
    lo: int | None
    hi: int | None
    forward: FlashLaunch
    dq: FlashLaunch
    dkdv: FlashLaunch
    splits: int = 1  # the forward's key range in this many parts (``attention_splits``)
    path: str = "general"
    heads_in_tile: int = 1  # query heads of one group sharing a forward tile (``attention_heads_in_tile``)
    gluon_forward: bool = False  # where ``_attention_gluon_unfit`` gives None

    def check(self) -> None:
        for kernel in FLASH_KERNELS:
            getattr(self, kernel).check(f"plan.{kernel}")
        check_int("plan.splits", self.splits, 1, 1024)
        # At most block_m (a power of two): then the heads padded to a power of two fit it too.
        check_int("plan.heads_in_tile", self.heads_in_tile, 1, self.forward.block_m)
        check_flag("plan.gluon_forward", self.gluon_forward)


def _attention_tiles(head_dim: int, dtype: torch.dtype, tail: bool) -> dict[str, FlashLaunch]:
    """Tiles by the widest padded head dim: 16-bit 64 and 128 their own, else the course's up to 128; at 256
    on 4 warps, by whether the head dim has a tail (d 160, 192; design notes: tiles at 256), float32 smaller
    (tests/compile_flash_kernels.py checks each for sm_90)."""
    if head_dim == 64 and dtype != torch.float32:
        # 64 x 64 on 4 warps each: the course's 64 x 128 dK/dV spills in these kernels' three loops (design
        # notes: general attention tiles).
        return dict.fromkeys(FLASH_KERNELS, FlashLaunch(64, 64, 4, 3))
    if head_dim == 128 and dtype != torch.float32:
        # Faster for the general kernels (outputs/README.md, design notes: general attention tiles).
        return {**flash_launches(128, dtype), "forward": FlashLaunch(64, 64, 4, 3), "dkdv": FlashLaunch(32, 64, 4, 3)}
    if head_dim <= 128:
        return flash_launches(head_dim, dtype)
    if dtype == torch.float32:
        return {"forward": FlashLaunch(32, 32, 4, 1), "dq": FlashLaunch(32, 16, 4, 1), "dkdv": FlashLaunch(16, 32, 4, 1)}
    if tail:
        return {"forward": FlashLaunch(64, 32, 4, 3), "dq": FlashLaunch(64, 32, 4, 3), "dkdv": FlashLaunch(32, 64, 4, 2)}
    return {"forward": FlashLaunch(64, 64, 4, 3), "dq": FlashLaunch(64, 32, 4, 3), "dkdv": FlashLaunch(64, 32, 4, 2)}


# Few query tiles over many keys (decode, a chunk of a prefill) leave SMs idle: the forward splits the keys in a
# power of two of parts (even parts of a power-of-two length), up to two waves of 132 programs and 512 keys a part
# (design notes: split keys).
ATTENTION_SPLIT_PROGRAMS = 2 * 132
ATTENTION_SPLIT_MIN_KEYS = 512


def attention_splits(batch_heads: int, n_queries: int, n_keys: int, block_m: int) -> int:
    """How many parts the forward splits the keys into (``ATTENTION_SPLIT_PROGRAMS``)."""
    programs = batch_heads * cdiv(n_queries, block_m)
    splits = 1
    while (0 < 2 * splits * programs <= ATTENTION_SPLIT_PROGRAMS
           and n_keys // (2 * splits) >= ATTENTION_SPLIT_MIN_KEYS):
        splits *= 2
    return splits


def attention_heads_in_tile(group: int, n_queries: int, block_m: int) -> int:
    """Query heads of a group sharing a forward tile of block_m rows, so that they read each key and value tile
    once: the most dividing the group whose queries fit the tile (a head's queries and the heads each padded
    to a power of two); 1 where one head's queries fill it (design notes: grouped tiles)."""
    rows = next_power_of_2(max(1, n_queries))
    return max(h for h in range(1, group + 1) if group % h == 0 and (h == 1 or next_power_of_2(h) * rows <= block_m))


def _tile_queries(block_m: int, heads: int) -> int:
    """A head's rows in a forward tile of block_m rows holding heads of a group (their count padded to a power of
    two): the kernel's QUERIES, which the plan's splits and the launch's grid count in."""
    return block_m // next_power_of_2(heads)


def attention_plan(d: int, dv: int, dtype: torch.dtype, n_queries: int, n_keys: int, *, is_causal: bool = False,
                   causal_align: str = "top_left", window: tuple | None = None, batch_heads: int = 1,
                   grouped: bool | int = False, scale: float | None = None, softcap: float | None = None,
                   return_lse: bool = False) -> AttentionPlan:
    """``flash_attention``'s launch for these head dims, dtype, lengths, mask, batch x query heads and
    options. Path "course" where FlashAttentionTriton takes the call as it is (no GQA, d = dv in
    FLASH_HEAD_DIMS, SDPA's scale, causal top-left or square, no window, softcap or lse; design notes:
    flash_attention routes). Tiles: ``_attention_tiles``'s, shrunk to the least power of two >= 16 that
    covers a short sequence (the forward's: its heads' queries). ``grouped``: the group's size (query heads a
    key/value head serves), for ``attention_heads_in_tile``; True: grouped, one head a tile."""
    head_dim, head_dim_v = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))
    queries, keys = max(16, next_power_of_2(n_queries)), max(16, next_power_of_2(n_keys))
    width = max(head_dim, head_dim_v)
    # A tail where each head dim padded to the widest tile splits into a whole tile and a tail (160 = 128 + 32).
    tail = all(_head_dim_tiles(n)[1] for n, padded in ((d, head_dim), (dv, head_dim_v)) if padded == width)
    tiles = _attention_tiles(width, dtype, tail)
    heads = attention_heads_in_tile(int(grouped), n_queries, tiles["forward"].block_m) if grouped else 1
    rows = dict(forward=max(16, next_power_of_2(heads) * next_power_of_2(max(1, n_queries))), dq=queries,
                dkdv=queries)
    tiles = {name: replace(launch, block_m=min(launch.block_m, rows[name]), block_n=min(launch.block_n, keys))
             for name, launch in tiles.items()}
    lo, hi = attention_mask_bounds(n_queries, n_keys, is_causal, causal_align, window)
    block_m = tiles["forward"].block_m
    splits = attention_splits(batch_heads // heads, n_queries, n_keys, _tile_queries(block_m, heads))
    course = (not (grouped or return_lse) and window is None and softcap is None and dv == d and d in FLASH_HEAD_DIMS
              and (scale is None or scale == d ** -0.5) and n_keys > 0
              and (not is_causal or causal_align == "top_left" or n_queries == n_keys))
    return AttentionPlan(head_dim, head_dim_v, lo, hi, **tiles, splits=splits, path="course" if course else "general",
                         heads_in_tile=heads,
                         gluon_forward=_attention_gluon_unfit(d, dv, dtype, n_queries, lo, hi, scale, softcap, splits,
                                                              heads) is None)


def _attention_gluon_unfit(d: int, dv: int, dtype: torch.dtype, n_queries: int, lo: int | None, hi: int | None,
                           scale: float | None, softcap: float | None, splits: int, heads_in_tile: int) -> str | None:
    """Why the Gluon forward does not take a general call of these head dims, dtype, lengths, bounds and options;
    None where it does (on Hopper, where TMA reads the inputs): FlashAttentionTriton's calls at d = 128 but for a
    scale, a log-sum-exp or grouped heads of their own (design notes: Gluon attention routes)."""
    if dtype not in _GLUON_DTYPES or d != dv or d != 128:
        return "it takes d = dv = 128 in float16 or bfloat16"
    if softcap is not None or lo is not None or hi not in (None, 0):
        return "it takes no softcap or window, and causal only top-left (or square)"
    if scale is not None and not scale > 0:
        # Its whole key tiles take the row maximum of the raw logits times the scale: the least one below 0.
        return f"it takes a scale above 0, got {scale}"
    if n_queries < GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M:
        return f"it takes at least its tile's {GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M} queries"
    if splits != 1 or heads_in_tile != 1:
        return "it takes one query head a tile and unsplit keys"
    return None


# Eager calls plan once per shape and options (a trace plans in its own cache).
_cached_attention_plan = functools.lru_cache(maxsize=4096, typed=True)(attention_plan)


@triton.jit
def _attention_span(own_start, n_own, n_other, lo, hi, OWN: tl.constexpr, OTHER: tl.constexpr,
                    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """(start, full_start, full_end, end) of the OTHER tiles the OWN rows from own_start see (keys in dK/dV,
    bounds negated and swapped): [start, end) holds every shown pair, [full_start, full_end) needs no mask."""
    own_last = tl.minimum(own_start + OWN, n_own) - 1
    start = 0
    full_start = 0
    end = n_other
    full_end = n_other // OTHER * OTHER
    if HAS_LO:
        start = tl.maximum(own_start + lo, 0) // OTHER * OTHER
        full_start = tl.cdiv(tl.maximum(own_last + lo, 0), OTHER) * OTHER
    if HAS_HI:
        end = tl.minimum(tl.maximum(own_last + hi + 1, 0), n_other)
        full_end = tl.minimum(tl.maximum(own_start + hi + 1, 0), n_other) // OTHER * OTHER
    return start, full_start, full_end, end


@triton.jit
def _attention_load(base, rows, n_rows, stride_row, dims, stride_dim, D: tl.constexpr, PADDED: tl.constexpr,
                    MASK_ROWS: tl.constexpr):
    """A (rows x PADDED) tile of one head, zeros past n_rows (MASK_ROWS) and past the head dim D."""
    ptrs = base + rows[:, None] * stride_row + dims[None, :] * stride_dim
    if MASK_ROWS:
        mask = (rows < n_rows)[:, None]
        if PADDED != D:
            mask = mask & (dims < D)[None, :]
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif PADDED != D:
        tile = tl.load(ptrs, mask=(dims < D)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _attention_tail(base, whole, rows, n_rows, stride_row, stride_dim, HEAD: tl.constexpr, D_TAIL: tl.constexpr,
                    TAIL: tl.constexpr, MASK_ROWS: tl.constexpr):
    """The tail (dims HEAD to HEAD + D_TAIL, in a TAIL tile) of a head whose first HEAD dims are ``whole``; without
    a TAIL, ``whole`` (which then holds every dim)."""
    tail = whole
    if TAIL > 0:
        tail = _attention_load(base + HEAD * stride_dim, rows, n_rows, stride_row, tl.arange(0, TAIL), stride_dim,
                               D_TAIL, TAIL, MASK_ROWS)
    return tail


@triton.jit
def _attention_store(base, tile, rows, n_rows, stride_row, dims, stride_dim, D: tl.constexpr):
    ptrs = base + rows[:, None] * stride_row + dims[None, :] * stride_dim
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(rows < n_rows)[:, None] & (dims < D)[None, :])


@triton.jit
def _attention_tanh(x):
    """tanh from one exp2: 1 - 2 / (e^2x + 1) is -1 and 1 at the ends (no inf / inf)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * TANH_EXP2) + 1.0)


@triton.jit
def _attention_logits(a, b, qk_scale, cap2, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      a_tail, b_tail, TAIL: tl.constexpr):
    """a b^T (plus a_tail b_tail^T where the head dim has a TAIL part) in base-2 units: times qk_scale =
    scale log2(e), or with SOFTCAP cap2 tanh(a b^T qk_scale), qk_scale = scale / softcap, cap2 = softcap log2(e)."""
    s = _dot_acc(a, tl.trans(b), tl.zeros((a.shape[0], b.shape[0]), tl.float32), PRECISION, UPCAST)
    if TAIL > 0:
        s = _dot_acc(a_tail, tl.trans(b_tail), s, PRECISION, UPCAST)
    s = s * qk_scale
    if SOFTCAP:
        # One exp2's tanh errs by float32's unit near 0 (softcap x 6e-8 a logit): 16-bit rounding hides it at
        # models' caps, float32's does not, so float32 takes _tanh's series.
        if a.dtype == tl.float32:
            s = _tanh(s) * cap2
        else:
            s = _attention_tanh(s) * cap2
    return s


@triton.jit
def _attention_shown(rows, cols, n_cols, lo, hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """True where the column exists and lo <= col - row <= hi (rows past their end are never stored)."""
    shown = (cols < n_cols)[None, :] & (rows >= 0)[:, None]
    # The bounds move with the row (a vector), not with each pair: one add a row, a compare a pair.
    if HAS_LO:
        shown = shown & (cols[None, :] >= (rows + lo)[:, None])
    if HAS_HI:
        shown = shown & (cols[None, :] <= (rows + hi)[:, None])
    return shown


@triton.jit
def _attention_key_tile(q, q_t, k_base, v_base, key_start, stride_kn, stride_kd, stride_vn, stride_vd, n_keys, qk_scale,
                        cap2, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                        D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr,
                        BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr):
    """The key tile at key_start: key indices, K and V rows and their tails (zeros past n_keys if MASKED; a part
    without a tail stands in for it), base-2 logits."""
    keys = key_start + tl.arange(0, BLOCK_N)
    k = _attention_load(k_base, keys, n_keys, stride_kn, tl.arange(0, HEAD_DIM), stride_kd, D, HEAD_DIM, MASKED)
    v = _attention_load(v_base, keys, n_keys, stride_vn, tl.arange(0, HEAD_DIM_V), stride_vd, DV, HEAD_DIM_V, MASKED)
    k_t = _attention_tail(k_base, k, keys, n_keys, stride_kn, stride_kd, HEAD_DIM, D_TAIL, TAIL, MASKED)
    v_t = _attention_tail(v_base, v, keys, n_keys, stride_vn, stride_vd, HEAD_DIM_V, DV_TAIL, TAIL_V, MASKED)
    return keys, k, k_t, v, v_t, _attention_logits(q, k, qk_scale, cap2, SOFTCAP, PRECISION, UPCAST, q_t, k_t, TAIL)


@triton.jit
def _attention_forward_tiles(
    acc, acc_t, m, l, q, q_t, rows, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start, end,
    n_queries, n_keys, qk_scale, cap2, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_TAIL: tl.constexpr,
    DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """The online softmax over the key tiles from start to end for one query tile (base 2). The head dims in
    two parts where ``attention_head_dims`` splits them: D of HEAD_DIM, then D_TAIL of TAIL (acc_t, q_t)."""
    for key_start in range(start, end, BLOCK_N):
        keys, k, k_t, v, v_t, s = _attention_key_tile(q, q_t, k_base, v_base, key_start, stride_kn, stride_kd,
                                                      stride_vn, stride_vd, n_keys, qk_scale, cap2, D, DV, HEAD_DIM,
                                                      HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_N, MASKED,
                                                      SOFTCAP, PRECISION, UPCAST)
        if MASKED:
            s = tl.where(_attention_shown(rows, keys, n_keys, lo, hi, HAS_LO, HAS_HI), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen only -inf so far subtracts 0: exp2(-inf - 0) = 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m - m_sub)
        l = l * alpha + tl.sum(p, axis=1)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        if TAIL_V > 0:
            acc_t = _dot_acc(p.to(v.dtype), v_t, acc_t * alpha[:, None], PRECISION, UPCAST)
        m = m_new
    return acc, acc_t, m, l


@triton.jit
def _row_strides(batch, head, row, ALIGN: tl.constexpr):
    """A tensor's batch, head and row strides as multiples of ALIGN, which the host found them to be, where the
    compiler can see it: Triton marks multiples of 16 only, and rows 72 or 88 wide then load an element at a
    time (design notes: row strides)."""
    if ALIGN > 1 and ALIGN < 16:
        batch, head, row = batch // ALIGN * ALIGN, head // ALIGN * ALIGN, row // ALIGN * ALIGN
    return batch, head, row


@triton.jit
def _attention_head(pid, pid_rows, n_rows, n_heads, BLOCK: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """(batch, head, tile) of pid, batch and head fastest and int64; HEAVY_FIRST: the last tiles first."""
    n_tiles = tl.cdiv(n_rows, BLOCK)
    tile = pid // pid_rows
    if HEAVY_FIRST:
        tile = n_tiles - 1 - tile
    head = (pid % pid_rows).to(tl.int64)
    return head // n_heads, head % n_heads, tile


@triton.jit
def attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    n_batch, n_heads, group, n_queries, n_keys, qk_scale, cap2, lo, hi, n_splits, split_keys,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_os, stride_ob, stride_oh, stride_om, stride_od,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, HEADS: tl.constexpr,
    QUERIES: tl.constexpr, D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """One program: BLOCK_M queries of one (batch, query head), or QUERIES of each of HEADS heads of a group
    (HEADS * QUERIES <= BLOCK_M, the rows past them masked), against the shown keys of their key/value head
    within its split of split_keys keys. out and lse: (splits, batch, heads, n_queries[, dv]), lse contiguous;
    each split's out is normalised by its own sum; the caller merges splits by their lse. Head dims as
    ``attention_head_dims`` gives them."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap2 = tl.cast(cap2, tl.float32)
    stride_qb, stride_qh, stride_qm = _row_strides(stride_qb, stride_qh, stride_qm, ROW_ALIGN)
    stride_kb, stride_kh, stride_kn = _row_strides(stride_kb, stride_kh, stride_kn, ROW_ALIGN)
    stride_vb, stride_vh, stride_vn = _row_strides(stride_vb, stride_vh, stride_vn, ROW_ALIGN)
    stride_ob, stride_oh, stride_om = _row_strides(stride_ob, stride_oh, stride_om, ROW_ALIGN)
    pid = tl.program_id(0)
    split = pid % n_splits  # 32-bit: the key bounds below stay 32-bit (a head's offsets are)
    # HEADS > 1: the rows are HEADS query heads of a group (h the first) x QUERIES queries, head-major; rows
    # past HEADS heads (the count padded to a power of two) take query n_queries: every access masked.
    if HEADS == 1:
        b, h, tile = _attention_head(pid // n_splits, n_batch * n_heads, n_queries, n_heads, BLOCK_M, HAS_HI)
        query_start = tile * BLOCK_M
        rows = query_start + tl.arange(0, BLOCK_M)
        q_base = q_ptr + b * stride_qb + h * stride_qh
    else:
        b, h, tile = _attention_head(pid // n_splits, n_batch * (n_heads // HEADS), n_queries, n_heads // HEADS,
                                     QUERIES, HAS_HI)
        h = h * HEADS
        query_start = tile * QUERIES
        rows = query_start + tl.arange(0, BLOCK_M) % QUERIES
        heads = h + tl.arange(0, BLOCK_M) // QUERIES
        if HEADS * QUERIES < BLOCK_M:
            rows = tl.where(heads < h + HEADS, rows, n_queries)
        q_base = q_ptr + b * stride_qb + (heads * stride_qh)[:, None]
        o_base = o_ptr + split.to(tl.int64) * stride_os + b * stride_ob + (heads * stride_oh)[:, None]
        lse_rows = ((split * n_batch + b) * n_heads + heads) * n_queries + rows
    hk = h // group
    dims, dims_v = tl.arange(0, HEAD_DIM), tl.arange(0, HEAD_DIM_V)
    q = _attention_load(q_base, rows, n_queries, stride_qm, dims, stride_qd, D, HEAD_DIM, True)
    q_t = _attention_tail(q_base, q, rows, n_queries, stride_qm, stride_qd, HEAD_DIM, D_TAIL, TAIL, True)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_V), tl.float32)
    acc_t = acc
    if TAIL_V > 0:
        acc_t = tl.zeros((BLOCK_M, TAIL_V), tl.float32)
    start, full_start, full_end, end = _attention_span(query_start, n_queries, n_keys, lo, hi, QUERIES, BLOCK_N,
                                                       HAS_LO, HAS_HI)
    # This split's keys only: the bounds stay tile-aligned, whole tiles stay whole.
    split_start = split * split_keys
    start, full_start = tl.maximum(start, split_start), tl.maximum(full_start, split_start)
    full_end, end = tl.minimum(full_end, split_start + split_keys), tl.minimum(end, split_start + split_keys)
    # Masked tiles before the whole ones (a window's left edge), the whole ones, masked after.
    acc, acc_t, m, l = _attention_forward_tiles(
        acc, acc_t, m, l, q, q_t, rows, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start,
        tl.minimum(full_start, end), n_queries, n_keys, qk_scale, cap2, lo, hi, D, DV, HEAD_DIM, HEAD_DIM_V, D_TAIL,
        DV_TAIL, TAIL, TAIL_V, BLOCK_N, True, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    acc, acc_t, m, l = _attention_forward_tiles(
        acc, acc_t, m, l, q, q_t, rows, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, full_start,
        full_end, n_queries, n_keys, qk_scale, cap2, lo, hi, D, DV, HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL,
        TAIL_V, BLOCK_N, False, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    acc, acc_t, m, l = _attention_forward_tiles(
        acc, acc_t, m, l, q, q_t, rows, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        tl.maximum(full_start, full_end), end, n_queries, n_keys, qk_scale, cap2, lo, hi, D, DV, HEAD_DIM, HEAD_DIM_V,
        D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_N, True, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    # A query that sees no key (or only -inf logits) has l = 0: output 0 and L = -inf.
    l_safe = tl.where(l == 0.0, 1.0, l)[:, None]
    if HEADS == 1:
        o_base = o_ptr + split.to(tl.int64) * stride_os + b * stride_ob + h * stride_oh
        lse_rows = ((split * n_batch + b) * n_heads + h) * n_queries + rows
    _attention_store(o_base, acc / l_safe, rows, n_queries, stride_om, dims_v, stride_od, DV)
    if TAIL_V > 0:
        _attention_store(o_base + HEAD_DIM_V * stride_od, acc_t / l_safe, rows, n_queries, stride_om,
                         tl.arange(0, TAIL_V), stride_od, DV_TAIL)
    tl.store(lse_ptr + lse_rows, (m + tl.math.log2(l)) * LN_2, mask=rows < n_queries)


@triton.jit
def attention_merge_kernel(parts_ptr, part_lse_ptr, out_ptr, lse_ptr, n_rows, n_splits, DV: tl.constexpr,
                           HEAD_DIM_V: tl.constexpr):
    """Row pid's out and lse from the splits' normalised float32 outs and lses: lse = logsumexp of theirs, out
    their sum weighted by exp(lse_split - lse). A row no split shows a key keeps 0 and lse -inf."""
    row = tl.program_id(0).to(tl.int64)
    m = float("-inf")
    for split in range(n_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + split * n_rows + row))
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    dims = tl.arange(0, HEAD_DIM_V)
    acc = tl.zeros((HEAD_DIM_V,), tl.float32)
    total = 0.0
    for split in range(n_splits):
        weight = tl.exp(tl.load(part_lse_ptr + split * n_rows + row) - m_sub)
        acc += weight * tl.load(parts_ptr + (split * n_rows + row) * DV + dims, mask=dims < DV, other=0.0)
        total += weight
    tl.store(out_ptr + row * DV + dims, (acc / tl.where(total == 0.0, 1.0, total)).to(out_ptr.dtype.element_ty),
             mask=dims < DV)
    tl.store(lse_ptr + row, tl.where(total == 0.0, float("-inf"), m_sub + tl.log(total)))


@triton.jit
def _attention_dq_tiles(
    dq, dq_t, q, q_t, do, do_t, lse, delta, rows, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, start,
    end, n_queries, n_keys, qk_scale, cap2, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_TAIL: tl.constexpr,
    DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dS K of one query tile over the key tiles from start to end (dS in softcap's input units); dq_t: the
    head dim's tail."""
    for key_start in range(start, end, BLOCK_N):
        keys, k, k_t, v, v_t, s = _attention_key_tile(q, q_t, k_base, v_base, key_start, stride_kn, stride_kd,
                                                      stride_vn, stride_vd, n_keys, qk_scale, cap2, D, DV, HEAD_DIM,
                                                      HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_N, MASKED,
                                                      SOFTCAP, PRECISION, UPCAST)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_attention_shown(rows, keys, n_keys, lo, hi, HAS_LO, HAS_HI), p, 0.0)
        dp = _dot_acc(do, tl.trans(v), tl.zeros((do.shape[0], BLOCK_N), tl.float32), PRECISION, UPCAST)
        if TAIL_V > 0:
            dp = _dot_acc(do_t, tl.trans(v_t), dp, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2, tanh = s / cap2
            t = s / cap2
            ds = ds * (1.0 - t * t)
        dq = _dot_acc(ds.to(k.dtype), k, dq, PRECISION, UPCAST)
        if TAIL > 0:
            dq_t = _dot_acc(ds.to(k.dtype), k_t, dq_t, PRECISION, UPCAST)
    return dq, dq_t


@triton.jit
def attention_backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_ptr,
    n_batch, n_heads, group, n_queries, n_keys, sm_scale, qk_scale, cap2, lo, hi,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_DLSE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """dQ of BLOCK_M queries of one (batch, query head). Runs first and writes D = rowsum(dO O) - dlse for
    dK/dV: lse's gradient (its derivative in S is P) joins the softmax's as dS = P (dP - D). Head dims as
    ``attention_head_dims`` gives them."""
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap2 = tl.cast(cap2, tl.float32)
    stride_qb, stride_qh, stride_qm = _row_strides(stride_qb, stride_qh, stride_qm, ROW_ALIGN)
    stride_kb, stride_kh, stride_kn = _row_strides(stride_kb, stride_kh, stride_kn, ROW_ALIGN)
    stride_vb, stride_vh, stride_vn = _row_strides(stride_vb, stride_vh, stride_vn, ROW_ALIGN)
    stride_ob, stride_oh, stride_om = _row_strides(stride_ob, stride_oh, stride_om, ROW_ALIGN)
    stride_gb, stride_gh, stride_gm = _row_strides(stride_gb, stride_gh, stride_gm, ROW_ALIGN)
    stride_dqb, stride_dqh, stride_dqm = _row_strides(stride_dqb, stride_dqh, stride_dqm, ROW_ALIGN)
    b, h, tile = _attention_head(tl.program_id(0), n_batch * n_heads, n_queries, n_heads, BLOCK_M, HAS_HI)
    hk = h // group
    query_start = tile * BLOCK_M
    rows = query_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n_queries
    dims, dims_v = tl.arange(0, HEAD_DIM), tl.arange(0, HEAD_DIM_V)
    q_base = q_ptr + b * stride_qb + h * stride_qh
    do_base = do_ptr + b * stride_gb + h * stride_gh
    o_base = o_ptr + b * stride_ob + h * stride_oh
    q = _attention_load(q_base, rows, n_queries, stride_qm, dims, stride_qd, D, HEAD_DIM, True)
    do = _attention_load(do_base, rows, n_queries, stride_gm, dims_v, stride_gd, DV, HEAD_DIM_V, True)
    o = _attention_load(o_base, rows, n_queries, stride_om, dims_v, stride_od, DV, HEAD_DIM_V, True)
    row_offsets = (b * n_heads + h) * n_queries + rows
    lse = _flash_load_lse(lse_ptr, row_offsets, row_ok)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    q_t = _attention_tail(q_base, q, rows, n_queries, stride_qm, stride_qd, HEAD_DIM, D_TAIL, TAIL, True)
    do_t = _attention_tail(do_base, do, rows, n_queries, stride_gm, stride_gd, HEAD_DIM_V, DV_TAIL, TAIL_V, True)
    if TAIL_V > 0:
        o_t = _attention_tail(o_base, o, rows, n_queries, stride_om, stride_od, HEAD_DIM_V, DV_TAIL, TAIL_V, True)
        delta += tl.sum(o_t.to(tl.float32) * do_t.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row_offsets, mask=row_ok, other=0.0)
    tl.store(delta_ptr + row_offsets, delta, mask=row_ok)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    dq_t = dq
    if TAIL > 0:
        dq_t = tl.zeros((BLOCK_M, TAIL), tl.float32)
    start, full_start, full_end, end = _attention_span(query_start, n_queries, n_keys, lo, hi, BLOCK_M, BLOCK_N,
                                                       HAS_LO, HAS_HI)
    dq, dq_t = _attention_dq_tiles(dq, dq_t, q, q_t, do, do_t, lse, delta, rows, k_base, v_base, stride_kn, stride_kd,
                                   stride_vn, stride_vd, start, tl.minimum(full_start, end), n_queries, n_keys,
                                   qk_scale, cap2, lo, hi, D, DV, HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V,
                                   BLOCK_N, True, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    dq, dq_t = _attention_dq_tiles(dq, dq_t, q, q_t, do, do_t, lse, delta, rows, k_base, v_base, stride_kn, stride_kd,
                                   stride_vn, stride_vd, full_start, full_end, n_queries, n_keys, qk_scale, cap2, lo,
                                   hi, D, DV, HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_N, False,
                                   HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    dq, dq_t = _attention_dq_tiles(dq, dq_t, q, q_t, do, do_t, lse, delta, rows, k_base, v_base, stride_kn, stride_kd,
                                   stride_vn, stride_vd, tl.maximum(full_start, full_end), end, n_queries, n_keys,
                                   qk_scale, cap2, lo, hi, D, DV, HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V,
                                   BLOCK_N, True, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    dq_base = dq_ptr + b * stride_dqb + h * stride_dqh
    _attention_store(dq_base, dq * sm_scale, rows, n_queries, stride_dqm, dims, stride_dqd, D)
    if TAIL > 0:
        _attention_store(dq_base + HEAD_DIM * stride_dqd, dq_t * sm_scale, rows, n_queries, stride_dqm,
                         tl.arange(0, TAIL), stride_dqd, D_TAIL)


@triton.jit
def _attention_dkdv_tiles(
    dk, dk_t, dv, dv_t, k, k_t, v, v_t, keys, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd, stride_gm,
    stride_gd, start, end, n_queries, qk_scale, cap2, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_TAIL: tl.constexpr,
    DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dK and dV of one key tile over query tiles [start, end) of one query head, key-major: dV += P^T dO,
    dS^T = P^T (V dO^T - D), dK += dS^T Q; masked tiles zero hidden or missing queries (0 x inf is NaN).
    *_t: the head dims' tails."""
    dims, dims_v = tl.arange(0, HEAD_DIM), tl.arange(0, HEAD_DIM_V)
    for query_start in range(start, end, BLOCK_M):
        rows = query_start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_queries
        q = _attention_load(q_base, rows, n_queries, stride_qm, dims, stride_qd, D, HEAD_DIM, MASKED)
        do = _attention_load(do_base, rows, n_queries, stride_gm, dims_v, stride_gd, DV, HEAD_DIM_V, MASKED)
        q_t = _attention_tail(q_base, q, rows, n_queries, stride_qm, stride_qd, HEAD_DIM, D_TAIL, TAIL, MASKED)
        do_t = _attention_tail(do_base, do, rows, n_queries, stride_gm, stride_gd, HEAD_DIM_V, DV_TAIL, TAIL_V, MASKED)
        if MASKED:
            lse = _flash_load_lse(lse_base, rows, row_ok)
            delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        else:
            lse = _flash_lse_base2(tl.load(lse_base + rows))
            delta = tl.load(delta_base + rows)
        sT = _attention_logits(k, q, qk_scale, cap2, SOFTCAP, PRECISION, UPCAST, k_t, q_t, TAIL)
        pT = tl.math.exp2(sT - lse[None, :])
        if MASKED:  # key j is seen by query i when -hi <= i - j <= -lo
            keep = _attention_shown(keys, rows, n_queries, -hi, -lo, HAS_HI, HAS_LO)
            pT = tl.where(keep, pT, 0.0)
        dv = _dot_acc(pT.to(do.dtype), do, dv, PRECISION, UPCAST)
        dpT = _dot_acc(v, tl.trans(do), tl.zeros((v.shape[0], BLOCK_M), tl.float32), PRECISION, UPCAST)
        if TAIL_V > 0:
            dv_t = _dot_acc(pT.to(do.dtype), do_t, dv_t, PRECISION, UPCAST)
            dpT = _dot_acc(v_t, tl.trans(do_t), dpT, PRECISION, UPCAST)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            t = sT / cap2
            dsT = dsT * (1.0 - t * t)
        if MASKED:
            dsT = tl.where(keep, dsT, 0.0)
        dk = _dot_acc(dsT.to(q.dtype), q, dk, PRECISION, UPCAST)
        if TAIL > 0:
            dk_t = _dot_acc(dsT.to(q.dtype), q_t, dk_t, PRECISION, UPCAST)
    return dk, dk_t, dv, dv_t


@triton.jit
def _attention_dkdv_head(
    dk, dk_t, dv, dv_t, k, k_t, v, v_t, keys, q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, n_heads,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_gb, stride_gh, stride_gm, stride_gd,
    start, full_start, full_end, end, n_queries, qk_scale, cap2, lo, hi,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_TAIL: tl.constexpr,
    DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One query head h's share of a key tile's dK and dV: masked query tiles, whole ones, masked ones."""
    q_base = q_ptr + b * stride_qb + h * stride_qh
    do_base = do_ptr + b * stride_gb + h * stride_gh
    lse_base = lse_ptr + (b * n_heads + h) * n_queries
    delta_base = delta_ptr + (b * n_heads + h) * n_queries
    dk, dk_t, dv, dv_t = _attention_dkdv_tiles(
        dk, dk_t, dv, dv_t, k, k_t, v, v_t, keys, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
        stride_gm, stride_gd, start, tl.minimum(full_start, end), n_queries, qk_scale, cap2, lo, hi, D, DV,
        HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_M, True, HAS_LO, HAS_HI, SOFTCAP, PRECISION,
        UPCAST)
    dk, dk_t, dv, dv_t = _attention_dkdv_tiles(
        dk, dk_t, dv, dv_t, k, k_t, v, v_t, keys, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
        stride_gm, stride_gd, full_start, full_end, n_queries, qk_scale, cap2, lo, hi, D, DV, HEAD_DIM,
        HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_M, False, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
    return _attention_dkdv_tiles(
        dk, dk_t, dv, dv_t, k, k_t, v, v_t, keys, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
        stride_gm, stride_gd, tl.maximum(full_start, full_end), end, n_queries, qk_scale, cap2, lo, hi, D, DV,
        HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V, BLOCK_M, True, HAS_LO, HAS_HI, SOFTCAP, PRECISION,
        UPCAST)


@triton.jit
def attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    n_batch, n_heads, group, n_queries, n_keys, sm_scale, qk_scale, cap2, lo, hi,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    D_TAIL: tl.constexpr, DV_TAIL: tl.constexpr, TAIL: tl.constexpr, TAIL_V: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """One program owns BLOCK_N keys of one (batch, key/value head) and their dK, dV over the group's heads.
    Head dims as ``attention_head_dims`` gives them."""
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap2 = tl.cast(cap2, tl.float32)
    stride_qb, stride_qh, stride_qm = _row_strides(stride_qb, stride_qh, stride_qm, ROW_ALIGN)
    stride_kb, stride_kh, stride_kn = _row_strides(stride_kb, stride_kh, stride_kn, ROW_ALIGN)
    stride_vb, stride_vh, stride_vn = _row_strides(stride_vb, stride_vh, stride_vn, ROW_ALIGN)
    stride_gb, stride_gh, stride_gm = _row_strides(stride_gb, stride_gh, stride_gm, ROW_ALIGN)
    stride_dkb, stride_dkh, stride_dkn = _row_strides(stride_dkb, stride_dkh, stride_dkn, ROW_ALIGN)
    stride_dvb, stride_dvh, stride_dvn = _row_strides(stride_dvb, stride_dvh, stride_dvn, ROW_ALIGN)
    n_kv_heads = n_heads // group
    b, hk, tile = _attention_head(tl.program_id(0), n_batch * n_kv_heads, n_keys, n_kv_heads, BLOCK_N, False)
    key_start = tile * BLOCK_N
    keys = key_start + tl.arange(0, BLOCK_N)
    dims, dims_v = tl.arange(0, HEAD_DIM), tl.arange(0, HEAD_DIM_V)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    k = _attention_load(k_base, keys, n_keys, stride_kn, dims, stride_kd, D, HEAD_DIM, True)
    v = _attention_load(v_base, keys, n_keys, stride_vn, dims_v, stride_vd, DV, HEAD_DIM_V, True)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM_V), tl.float32)
    k_t = _attention_tail(k_base, k, keys, n_keys, stride_kn, stride_kd, HEAD_DIM, D_TAIL, TAIL, True)
    v_t = _attention_tail(v_base, v, keys, n_keys, stride_vn, stride_vd, HEAD_DIM_V, DV_TAIL, TAIL_V, True)
    dk_t = dk
    dv_t = dv
    if TAIL > 0:
        dk_t = tl.zeros((BLOCK_N, TAIL), tl.float32)
    if TAIL_V > 0:
        dv_t = tl.zeros((BLOCK_N, TAIL_V), tl.float32)
    # Key j is seen by queries i with j - hi <= i <= j - lo: the span with the bounds swapped.
    start, full_start, full_end, end = _attention_span(key_start, n_keys, n_queries, -hi, -lo, BLOCK_N, BLOCK_M,
                                                       HAS_HI, HAS_LO)
    for g in range(0, group):
        dk, new_dk_t, dv, new_dv_t = _attention_dkdv_head(
            dk, dk_t, dv, dv_t, k, k_t, v, v_t, keys, q_ptr, do_ptr, lse_ptr, delta_ptr, b, hk * group + g, n_heads,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_gb, stride_gh, stride_gm, stride_gd, start, full_start,
            full_end, end, n_queries, qk_scale, cap2, lo, hi, D, DV, HEAD_DIM, HEAD_DIM_V, D_TAIL, DV_TAIL, TAIL, TAIL_V,
            BLOCK_M, HAS_LO, HAS_HI, SOFTCAP, PRECISION, UPCAST)
        # Only a tail is carried through the loop (an unused one costs registers: d 64's dK/dV spilled 76 bytes, not 12)
        if TAIL > 0:
            dk_t = new_dk_t
        if TAIL_V > 0:
            dv_t = new_dv_t
    dk_base = dk_ptr + b * stride_dkb + hk * stride_dkh
    dv_base = dv_ptr + b * stride_dvb + hk * stride_dvh
    _attention_store(dk_base, dk * sm_scale, keys, n_keys, stride_dkn, dims, stride_dkd, D)
    _attention_store(dv_base, dv, keys, n_keys, stride_dvn, dims_v, stride_dvd, DV)
    if TAIL > 0:
        _attention_store(dk_base + HEAD_DIM * stride_dkd, dk_t * sm_scale, keys, n_keys, stride_dkn,
                         tl.arange(0, TAIL), stride_dkd, D_TAIL)
    if TAIL_V > 0:
        _attention_store(dv_base + HEAD_DIM_V * stride_dvd, dv_t, keys, n_keys, stride_dvn, tl.arange(0, TAIL_V),
                         stride_dvd, DV_TAIL)


def _attention_scalars(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap2) of ``_attention_logits``; (scale, 1.0) passed as sm_scale where needed."""
    if softcap:
        return scale / softcap, softcap * LOG2_E.value
    return scale * LOG2_E.value, 1.0


def _attention_constants(q: torch.Tensor, dv: int, has_lo: bool, has_hi: bool, softcap: float,
                         launch: list[int], row_align: int) -> dict:
    """A general kernel's constexprs; ``row_align``: ``_row_align`` of the tensors it reads and writes."""
    return dict(BLOCK_M=launch[0], BLOCK_N=launch[1], HAS_LO=has_lo, HAS_HI=has_hi, SOFTCAP=bool(softcap),
                num_warps=launch[2], num_stages=launch[3], **attention_head_dims(q.shape[-1], dv),
                ROW_ALIGN=row_align, **_flash_kernel_args(q.dtype))


def _row_align(tensors: tuple) -> int:
    """The power of two up to 16 dividing every stride but the last of each tensor (``_row_strides``' ALIGN). A
    trace's symbolic strides are asked for their divisibility (a guard as Inductor's own), not their values."""
    strides = []
    for t in tensors:
        strides += t.stride()[:-1]
    if set(map(type, strides)) == {int}:
        return math.gcd(16, *strides)
    align = 16
    for s in strides:
        while align > 1 and s % align != 0:
            align //= 2
    return align


def attention_head_dims(d: int, dv: int) -> dict:
    """The general kernels' head dims: each of d and dv (multiples of 8) as one power-of-two tile of at least
    16 (HEAD_DIM, padded past D), or, where two smaller tiles cover it with less padding (96 = 64 + 32, 80 =
    64 + 16, 160 = 128 + 32), a whole first tile of HEAD_DIM = D and a TAIL tile holding the last D_TAIL
    (design notes: head dim tails)."""
    return dict(_head_dim_parts(d, "") + _head_dim_parts(dv, "_V"))


def _head_dim_tiles(n: int) -> tuple[int, int]:
    """(whole tile, tail tile) of head dim n as ``attention_head_dims`` splits it; tail 0 where one tile pads it."""
    whole = max(16, next_power_of_2(n))
    first = max(16, 1 << (n.bit_length() - 1))
    tail = max(16, next_power_of_2(n - first)) if n > first else 0
    return (first, tail) if tail and first + tail < whole else (whole, 0)


@functools.lru_cache(maxsize=None)
def _head_dim_parts(n: int, suffix: str) -> tuple:
    """``attention_head_dims``'s items for one head dim n: D / DV, D_TAIL / DV_TAIL, HEAD_DIM / HEAD_DIM_V, TAIL /
    TAIL_V."""
    first, tail = _head_dim_tiles(n)
    name = "D" if not suffix else "DV"
    return ((name, min(n, first)), (name + "_TAIL", n - min(n, first)), ("HEAD_DIM" + suffix, first),
            ("TAIL" + suffix, tail))


def _attention_args(scale: float, softcap: float | None, plan: AttentionPlan) -> tuple:
    """The custom ops' plain values for a plan: scale, the bounds as ints with flags, softcap (0.0: none),
    each kernel's [block_m, block_n, warps, stages] (forward, dq, dkdv), the key splits, heads a tile and 1 where
    the forward is Gluon's."""
    launches = [getattr(getattr(plan, kernel), field) for kernel in ("forward", "dq", "dkdv")
                for field in ("block_m", "block_n", "num_warps", "num_stages")]
    return (scale, plan.lo or 0, plan.hi or 0, plan.lo is not None, plan.hi is not None, softcap or 0.0,
            [*launches, plan.splits, plan.heads_in_tile, int(plan.gluon_forward)])


def _attention_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for the general forward to write: contiguous, out in q's dtype, lse float32."""
    batch, heads, n_queries, _ = q.shape
    return q.new_empty((batch, heads, n_queries, v.shape[-1])), q.new_empty((batch, heads, n_queries),
                                                                             dtype=torch.float32)


def _attention_forward_fake(q, k, v, scale, lo, hi, has_lo, has_hi, softcap, launches):
    return _attention_outputs(q, v)


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lo: int, hi: int,
                       has_lo: bool, has_hi: bool, softcap: float,
                       launches: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (batch, heads, n_queries, dv) contiguous in q's dtype, lse (batch, heads, n_queries)
    float32; the op's body, whose launch torch.compile can trace."""
    return _run_attention_forward(q, k, v, scale, lo, hi, has_lo, has_hi, softcap, launches, traced=True)


def _run_attention_forward(q, k, v, scale, lo, hi, has_lo, has_hi, softcap, launches, traced: bool, keep=None):
    """``_attention_forward``; ``traced`` False: launched directly, without ``wrap_triton``'s host time.
    ``keep``: called with the launches kept as one replay of (q, k, v, out, lse), where they could be."""
    launch = launches[:4]
    batch, heads, n_queries, _ = q.shape
    n_kv_heads, n_keys, dv = k.shape[1], k.shape[2], v.shape[-1]
    # Splits of whole key tiles; with several, each writes a float32 partial out and its lse.
    split_keys = max(1, cdiv(cdiv(n_keys, launches[12]), launch[1])) * launch[1]
    splits = max(1, cdiv(n_keys, split_keys))
    if splits == 1:
        out, lse = _attention_outputs(q, v)
    else:
        out = q.new_empty((splits, batch, heads, n_queries, dv), dtype=torch.float32)
        lse = q.new_empty((splits, batch, heads, n_queries), dtype=torch.float32)
    if out.numel() == 0:
        return (out, lse) if splits == 1 else _attention_outputs(q, v)
    steps = [] if keep is not None else None
    if launches[14] and not traced and gluon_flash_unsupported(q, k, v) is None:  # the plan's keys unsplit
        _gluon_flash_forward(q, k, v, has_hi, out, lse, kept=steps, scale=scale)
    else:
        qk_scale, cap2 = _attention_scalars(scale, softcap)
        tile_heads = launches[13]
        queries = _tile_queries(launch[0], tile_heads)
        grid = one_axis_grid(splits * batch * (heads // tile_heads) * cdiv(n_queries, queries),
                             "the attention forward")
        _launch_flash(jit_kernel(attention_forward_kernel, traced=traced), grid,
                      (q, k, v, out, lse, batch, heads, heads // n_kv_heads, n_queries, n_keys, qk_scale, cap2, lo,
                       hi, splits, split_keys, *q.stride(), *k.stride(), *v.stride(),
                       0 if splits == 1 else out.stride(0), *out.stride()[-4:]),
                      dict(HEADS=tile_heads, QUERIES=queries, **_attention_constants(
                          q, dv, has_lo, has_hi, softcap, launch, _row_align((q, k, v, out)))), 5, steps)
    if splits == 1:
        if steps and steps[0] is not None:
            keep(steps[0])
        return out, lse
    merged, total = _attention_outputs(q, v)
    rows = batch * heads * n_queries
    _launch_flash(jit_kernel(attention_merge_kernel, traced=traced),
                  one_axis_grid(rows, "the attention forward's merge"), (out, lse, merged, total, rows, splits),
                  dict(DV=dv, HEAD_DIM_V=max(16, next_power_of_2(dv)), num_warps=1), 4, steps)
    if steps and None not in steps:  # the partial outputs are the chain's buffers: slots 5 and 6
        parts, part_lse = out.shape, lse.shape
        keep(ReplayChain((lambda q, *_: q.new_empty(parts, dtype=torch.float32),
                          lambda q, *_: q.new_empty(part_lse, dtype=torch.float32)),
                         ((steps[0], (0, 1, 2, 5, 6)), (steps[1], (5, 6, 3, 4)))))
    return merged, total


# The op autograd and torch.compile see; eager calls that record no gradient launch directly.
attention_forward = kernel_op("attention_forward", _attention_forward_fake)(_attention_forward)


def _attention_backward_fake(q, k, v, out, lse, dout, dlse, scale, lo, hi, has_lo, has_hi, softcap, dq_launch,
                             dkdv_launch):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@kernel_op("attention_backward", _attention_backward_fake)
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       dout: torch.Tensor, dlse: torch.Tensor | None, scale: float, lo: int, hi: int, has_lo: bool,
                       has_hi: bool, softcap: float, dq_launch: list[int],
                       dkdv_launch: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, for dout and dlse (None: 0); dk and dv summed over each group's heads."""
    return _run_attention_backward(q, k, v, out, lse, dout, dlse, scale, lo, hi, has_lo, has_hi, softcap, dq_launch,
                                   dkdv_launch, traced=True)


def _run_attention_backward(q, k, v, out, lse, dout, dlse, scale, lo, hi, has_lo, has_hi, softcap, dq_launch,
                            dkdv_launch, traced: bool):
    """``attention_backward``; ``traced`` False for an eager backward, launched directly."""
    batch, heads, n_queries, _ = q.shape
    n_kv_heads, n_keys, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if dq.numel() == 0 or n_keys == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    qk_scale, cap2 = _attention_scalars(scale, softcap)
    group = heads // n_kv_heads
    delta = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q.device)
    head = (batch, heads, group, n_queries, n_keys, scale, qk_scale, cap2, lo, hi)
    # One alignment for both kernels: the gradients (rows d and dv wide, like out's) change neither's.
    row_align = _row_align((q, k, v, out, dout, dq, dk, dv))
    grid = one_axis_grid(batch * heads * cdiv(n_queries, dq_launch[0]), "the attention backward's dq")
    jit_kernel(attention_backward_dq_kernel, traced=traced)[grid](
        q, k, v, out, dout, lse, lse if dlse is None else dlse, delta, dq, *head,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *dout.stride(), *dq.stride(),
        HAS_DLSE=dlse is not None, **_attention_constants(q, dv_dim, has_lo, has_hi, softcap, dq_launch, row_align))
    grid = one_axis_grid(batch * n_kv_heads * cdiv(n_keys, dkdv_launch[1]), "the attention backward's dk, dv")
    jit_kernel(attention_backward_dkdv_kernel, traced=traced)[grid](
        q, k, v, dout, lse, delta, dk, dv, *head,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        **_attention_constants(q, dv_dim, has_lo, has_hi, softcap, dkdv_launch, row_align))
    return dq, dk, dv


def _attention_setup(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options
    ctx.set_materialize_grads(False)


def _attention_grad(ctx, dout, dlse, through_op: bool = True):
    """(dq, dk, dv) by the backward op (``through_op`` or ``backward_through_op``), else launched directly."""
    if torch.is_grad_enabled():
        if torch._C._are_functorch_transforms_active():  # torch.func's grad, vjp, jacrev: no first derivative either
            raise NotImplementedError("flash_attention's general kernels differentiate by backward only "
                                      "(out.backward(), torch.autograd.grad), not under torch.func's grad, vjp or "
                                      "jacrev; torch.func.vmap is supported")
        raise no_double_backward("flash_attention", "flash_attention_reference (materialised, in PyTorch): "
                                                    "torch.func's grad, jacrev and hessian do not run these kernels")
    q, k, v, out, lse = ctx.saved_tensors
    scale, lo, hi, has_lo, has_hi, softcap, launches = ctx.options
    if dout is None and dlse is None:
        return None, None, None
    dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype)
    if dlse is not None:  # the kernels index lse's gradient as lse: contiguous (lse.sum()'s is stride 0)
        dlse = dlse.float().contiguous()
    args = (q, k, v, out, lse, dout, dlse, scale, lo, hi, has_lo, has_hi, softcap, launches[4:8], launches[8:12])
    if through_op or backward_through_op(dout) or transformed(q, k, v, dout):
        return torch.ops.softmax_kernels.attention_backward(*args)
    return _run_attention_backward(*args, traced=False)


register_autograd(
    attention_forward, lambda ctx, dout, dlse: (*_attention_grad(ctx, dout, dlse), *([None] * 7)),
    setup_context=_attention_setup)

def _attention_vmap(info, in_dims, q, k, v, *options):
    """torch.func.vmap's rule: the mapped dimension joins the batch (an unmapped input repeated for it)."""
    folded = [batch_first(t, dim, info.batch_size).flatten(0, 1) for t, dim in zip((q, k, v), in_dims[:3])]
    out, lse = _ATTENTION_AUTOGRAD.apply(*folded, *options)
    return (out.unflatten(0, (info.batch_size, -1)), lse.unflatten(0, (info.batch_size, -1))), (0, 0)


# Eager autograd calls of the general kernels launch directly, sparing the custom op's dispatch.
_ATTENTION_AUTOGRAD = AutogradSpec(
    "flash_attention", forward=lambda *args: _run_attention_forward(*args, traced=False), setup=_attention_setup,
    backward=lambda ctx, dout, dlse: (*_attention_grad(ctx, dout, dlse, through_op=False), *([None] * 7)),
    vmap=_attention_vmap)


def _check_given_plan(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, options: dict) -> None:
    """A given plan must be a valid ``AttentionPlan`` of this call's bounds, its heads a tile dividing the
    group; errors name what differs."""
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {_type_name(plan)}")
    plan.check()
    bounds = attention_mask_bounds(q.shape[2], k.shape[2], options["is_causal"], options["causal_align"],
                                   options["window"])
    if (plan.lo, plan.hi) != bounds:
        raise ValueError(f"plan's mask bounds (lo, hi) = {(plan.lo, plan.hi)} are not this call's {bounds} (from "
                         "is_causal, causal_align, window and the lengths): plan with the same options")
    if group % plan.heads_in_tile:
        raise ValueError(f"plan.heads_in_tile ({plan.heads_in_tile}) must divide the group of query heads a "
                         f"key/value head serves ({group})")
    unfit = plan.gluon_forward and _attention_gluon_unfit(q.shape[-1], v.shape[-1], q.dtype, q.shape[2], plan.lo,
                                                          plan.hi, options["scale"], options["softcap"], plan.splits,
                                                          plan.heads_in_tile)
    if unfit:
        raise ValueError(f"plan.gluon_forward is True, but the Gluon forward cannot run this call: {unfit}")


# Eager calls that record no gradient, by replay_key and options: (the kept launches, a maker of their outputs),
# which a later call with the same key runs without checks or plan (design notes: kept attention launches).
_ATTENTION_REPLAYS = Replays("flash_attention_api")


def _attention_replay_key(q, k, v, is_causal, scale, enable_gqa, causal_align, window, softcap, return_lse):
    """``replay_key`` of a flash_attention call (each option keyed with its type, a window's sides too); None where
    an option is not a plain bool, int, float, str or None, or a tuple of them (the checked path takes the call)."""
    plain = (bool, int, float, str, type(None))
    if window is not None and not (type(window) is tuple and all(type(side) in plain for side in window)):
        return None
    options = (is_causal, scale, enable_gqa, causal_align, softcap, return_lse)
    if not all(type(option) in plain for option in options):
        return None
    return replay_key((q, k, v), (*options, window, _float32_matmul_precision()))


def _replay_attention(key, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(out, lse) by the launches kept under ``key``; None where none are, or where they could not launch."""
    kept = _ATTENTION_REPLAYS.get(key)
    if kept is None or not kept[0].ready():  # ready first: a profiler's hooks refuse every replay
        return None
    out, lse = kept[1](q, v)
    return (out, lse) if kept[0].launch(q, k, v, out, lse) else None


def _course_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, key) -> torch.Tensor:
    """FlashAttentionTriton's call, its kept forward launch kept under ``key`` too (None in a trace: Dynamo
    cannot read the shelves, a graph break)."""
    out = FlashAttentionTriton.apply(q, k, v, is_causal)
    course = None if key is None else _FLASH_REPLAYS.get(replay_key((q, k, v),
                                                                    (is_causal, _float32_matmul_precision())))
    if course is not None:
        _ATTENTION_REPLAYS.keeper(key)((course[0], lambda q, v: flash_forward_outputs(q)))
    return out


def _attention_plan_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict, return_lse: bool,
                       group: int) -> AttentionPlan:
    """``attention_plan`` for a checked call (cached outside a trace)."""
    planner = attention_plan if torch.compiler.is_compiling() else _cached_attention_plan
    return planner(q.shape[-1], v.shape[-1], q.dtype, q.shape[2], k.shape[2], return_lse=return_lse,
                   batch_heads=q.shape[0] * q.shape[1], grouped=group if group > 1 else q.shape[1] != k.shape[1],
                   **options)


@on_input_device
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False, causal_align: str = "top_left",
                    window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
                    return_lse: bool = False, plan: AttentionPlan | None = None):
    """Attention as ``F.scaled_dot_product_attention`` computes it, with what models add to it.

    q: (batch, heads, n_queries, d), k: (batch, kv_heads, n_keys, d), v: (batch, kv_heads,
    n_keys, dv), any strides; float32, float16 or bfloat16, one dtype and device; d and dv
    multiples of 8 up to 256. Returns out: (batch, heads, n_queries, dv) in q's dtype, and with
    ``return_lse`` also lse: (batch, heads, n_queries) float32, each query's natural log-sum-exp.

    * ``is_causal``, ``scale`` (default 1/sqrt(d)) and ``enable_gqa`` as in SDPA (query head h
      uses key/value head h // (heads // kv_heads)).
    * ``causal_align``: "top_left" (SDPA's: query i sees keys j <= i) or "bottom_right" (j <= i +
      n_keys - n_queries: decode, or new queries over a cache); windows align the same way.
    * ``window=(left, right)``: query i sees keys i - left <= j <= i + right (None: unbounded).
    * ``softcap``: the scaled logits s become softcap * tanh(s / softcap) (Gemma 2). With 16-bit
      inputs a logit errs by up to softcap x 6e-8, under their rounding: at most
      ATTENTION_MAX_SOFTCAP_16BIT (1e4) there (float32 inputs: as accurate as torch at any cap).
    * A query that sees no key gets output 0, lse -inf and zero gradients, as in SDPA.
    * ``plan``: an ``AttentionPlan`` replacing ``attention_plan``'s (tuning, tests): the general
      kernels at its tiles (``gluon_forward=False``: Triton's forward too). Without one, plain calls
      run FlashAttentionTriton (its Gluon kernels on Hopper; twice differentiable there); others
      the general kernels (no double backward; on Hopper the forward at d = dv = 128 in 16 bits,
      128 queries or more, a positive scale, no window or softcap, is Gluon's).

    Differentiable in q, k and v, through out and lse. The custom ops ``softmax_kernels::attention_forward``
    / ``attention_backward`` let torch.compile(fullgraph=True) trace the launches and CUDA graphs capture
    them. Errors name the argument. An eager call that records no gradient, with an earlier such call's
    shapes, strides, dtypes, device and options, replays that call's launches (no checks, no plan).
    """
    key = None if plan is not None else _attention_replay_key(q, k, v, is_causal, scale, enable_gqa, causal_align,
                                                              window, softcap, return_lse)
    replayed = None if key is None else _replay_attention(key, q, k, v)
    if replayed is not None:
        return replayed if return_lse else replayed[0]
    options = check_flash_attention_inputs(q, k, v, is_causal, scale, enable_gqa, causal_align, window, softcap)
    check_flag("return_lse", return_lse)
    group = q.shape[1] // max(k.shape[1], 1)
    if plan is not None:
        _check_given_plan(plan, q, k, v, group, options)
    else:
        plan = _attention_plan_of(q, k, v, options, return_lse, group)
        # torch.func's transforms take the general kernels' Function (its vmap rule, its refusals).
        if plan.path == "course" and not transformed(q, k, v):
            return _course_attention(q, k, v, options["is_causal"], key)
    args = (q, k, v, *_attention_args(options["scale"], options["softcap"], plan))
    if not needs_op(q, k, v):
        keep = None if key is None else lambda replay: _ATTENTION_REPLAYS.keeper(key)((replay, _attention_outputs))
        out, lse = _run_attention_forward(*args, traced=False, keep=keep)
    elif eager_autograd(q, k, v):
        out, lse = _ATTENTION_AUTOGRAD.run(*args)
    else:
        out, lse = torch.ops.softmax_kernels.attention_forward(*args)
    return (out, lse) if return_lse else out


# ==============================================================================================
# Linear cross-entropy: the language-model loss, cross_entropy(x @ W^T + bias, target), fused
# ==============================================================================================
# x: (BT, H), W: (V, H) as nn.Linear holds it, target: (BT,) int64. Chunks of rows share one (rows, V)
# buffer: cuBLAS logits, a Triton row kernel (log-sum-exp, loss, in place G = d loss / d logits times the
# row's factor), cuBLAS dx = G @ W and dW += G^T @ x. Options are constexpr switches that compile away.
# Design notes: Linear cross-entropy.

LCE_REDUCTIONS = ("mean", "sum", "none")
_INT64 = torch.iinfo(torch.int64)
# Rows a chunk: dW's update is compute bound from ~520 bf16 rows; the buffer is capped at a quarter of dW
# (rows <= H / 4); a narrow H takes up to LCE_MAX_FILL_ROWS so dx's product fills a wave of LCE_FILL_TILE
# tiles (design notes: Linear cross-entropy, SM fill).
LCE_MIN_ROWS = 512
LCE_MAX_ROWS = 1024
LCE_FILL_TILE = 128 * 128
LCE_MAX_FILL_ROWS = 4096
# cuBLAS's tiles are 64 to 256 rows: chunks are whole multiples of 128 rows where BT allows.
LCE_ROW_MULTIPLE = 128


def linear_cross_entropy_ref(x: torch.Tensor, W: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                             reduction: str = "mean", *, bias: torch.Tensor | None = None,
                             label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                             weight: torch.Tensor | None = None, logits_dtype: torch.dtype | None = None
                             ) -> torch.Tensor:
    """What ``linear_cross_entropy`` must equal: ``F.cross_entropy`` of the logits in float32 (float64 kept;
    or ``logits_dtype``), soft-capped first, plus ``z_loss * logsumexp(logits) ** 2`` on each row not
    ignored; "mean" divides by F.cross_entropy's denominator (rows not ignored, or their targets' weights)."""
    logits = F.linear(x, W, bias)
    wide = torch.promote_types(logits.dtype, torch.float32) if logits_dtype is None else logits_dtype
    logits = logits.to(wide).reshape(-1, W.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = target.reshape(-1)
    w = weight.to(logits.dtype) if weight is not None else None
    options = dict(weight=w, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if not z_loss:
        loss = F.cross_entropy(logits, flat, reduction=reduction, **options)
        return loss.reshape(target.shape) if reduction == "none" else loss
    kept = flat != ignore_index
    loss = F.cross_entropy(logits, flat, reduction="none", **options)
    loss = loss + torch.where(kept, z_loss * logits.logsumexp(-1) ** 2, 0.0)
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (w[flat[kept]].sum() if w is not None else kept.sum())


def linear_cross_entropy_flops(BT: int, H: int, V: int, mode: str = "fwd_bwd") -> int:
    """Flops of the products alone: the logits (forward), and dx and dW (backward)."""
    return (2 if mode == "fwd" else 6) * BT * H * V


@dataclass(frozen=True)
class LinearCrossEntropyLaunch:
    """Rows per chunk (the buffer is chunk_rows x V), the row kernel's vocabulary tile and warps."""

    chunk_rows: int
    block_v: int
    num_warps: int

    def check(self) -> None:
        check_int("launch.chunk_rows", self.chunk_rows, 1, _INT64.max)
        check_block("launch.block_v", self.block_v, 16, 16384)
        check_block("launch.num_warps", self.num_warps, 1, 16)


@dataclass(frozen=True)
class LinearCrossEntropyPlan:
    """What a call runs; its fields are the custom ops' arguments, in order. sharded: W holds classes
    class_offset ... class_offset + V - 1 of n_classes. target_apart: the target term is added in float32
    (``_add_target_term``). round_bf16: the kernel rounds bfloat16 stores (the interpreter's casts
    truncate). grad_*: the gradients wanted."""

    reduction: str
    chunk_rows: int
    block_v: int
    num_warps: int
    ignore_index: int
    label_smoothing: float
    softcap: float  # 0.0: none
    z_loss: float
    class_offset: int
    n_classes: int
    sharded: bool
    target_apart: bool
    round_bf16: bool
    grad_x: bool = False
    grad_W: bool = False
    grad_bias: bool = False

    @property
    def path(self) -> str:
        """The route: "scalar" ("mean" / "sum": gradients made in the forward, three products), "rows" ("none": the
        backward recomputes the logits, four products) or "sharded" (vocab_parallel, recomputing)."""
        return "sharded" if self.sharded else "rows" if self.reduction == "none" else "scalar"

    @property
    def launch(self) -> LinearCrossEntropyLaunch:
        return LinearCrossEntropyLaunch(self.chunk_rows, self.block_v, self.num_warps)

    def args(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__dataclass_fields__)


def _check_number(name: str, value, low: float, high: float = FLOAT32_MAX) -> float:
    """value as a Python float in [low, high] (the row kernel holds it in float32); TypeError / ValueError naming it."""
    value = _python_number(name, value, numbers.Real, "a float")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value:g}")
    return value


def linear_cross_entropy_plan(BT: int, H: int, V: int, dtype: torch.dtype, reduction: str = "mean", *,
                              ignore_index: int = -100, label_smoothing: float = 0.0, softcap: float | None = None,
                              z_loss: float = 0.0, launch: LinearCrossEntropyLaunch | None = None,
                              vocab_start: int | None = None, n_classes: int | None = None,
                              grads: tuple = (False, False, False), interpret: bool = INTERPRET,
                              sms: int | None = None) -> LinearCrossEntropyPlan:
    """The plan for x (BT, H) and W (V, H) of dtype: chunks of H / 4 rows within [LCE_MIN_ROWS, LCE_MAX_ROWS],
    or with ``sms`` the rows that fill the GPU with dx's product (at most LCE_MAX_FILL_ROWS), multiples of
    LCE_ROW_MULTIPLE, at most BT; 8 KiB tiles of a row. vocab_start, n_classes: W is that shard of the
    vocabulary; grads: whether x, W, bias want one. TypeError / ValueError naming a bad option or launch."""
    check_int("ignore_index", ignore_index, _INT64.min, _INT64.max)  # compared with int64 targets
    if reduction not in LCE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {LCE_REDUCTIONS}, got {reduction!r}")
    label_smoothing = _check_number("label_smoothing", label_smoothing, 0.0, 1.0)
    if softcap is not None:  # the kernel divides by it: a normal float32, and softcap * tanh stays finite
        softcap = _check_number("softcap", softcap, FLOAT32_TINY)
    z_loss = _check_number("z_loss", z_loss, 0.0)
    if vocab_start is not None:  # the shard's classes [vocab_start, vocab_start + V) within [0, n_classes)
        check_int("n_classes", n_classes, V, _INT64.max)
        check_int("vocab_start", vocab_start, 0, n_classes - V)
    if sms is not None:
        check_int("sms", sms, 1, 2**31 - 1)
    if launch is None:
        rows = min(LCE_MAX_ROWS, max(LCE_MIN_ROWS, H // 4 // LCE_ROW_MULTIPLE * LCE_ROW_MULTIPLE))
        if sms:
            fill = cdiv(cdiv(sms * LCE_FILL_TILE, max(H, 1)), LCE_ROW_MULTIPLE) * LCE_ROW_MULTIPLE
            rows = max(rows, min(fill, LCE_MAX_FILL_ROWS))
        block_v = min(next_power_of_2(V), 8192 // dtype.itemsize)
        launch = LinearCrossEntropyLaunch(max(1, min(BT, rows)), max(block_v, 16), 8 if block_v >= 2048 else 4)
    elif not isinstance(launch, LinearCrossEntropyLaunch):
        raise TypeError(f"launch must be a LinearCrossEntropyLaunch, got {type(launch).__name__}")
    else:
        launch.check()
    softcap = 0.0 if softcap is None else softcap
    return LinearCrossEntropyPlan(
        reduction, launch.chunk_rows, launch.block_v, launch.num_warps, ignore_index,
        label_smoothing, softcap, z_loss, vocab_start or 0, V if n_classes is None else n_classes,
        vocab_start is not None, label_smoothing > 0 and softcap == 0.0, interpret and dtype == torch.bfloat16,
        *grads)


def check_linear_cross_entropy_inputs(x, W, target, bias=None, weight=None, n_classes=None, w_name="W") -> tuple:
    """(x, W, bias, target) checked, autocast applied, x and target flattened to (BT, H) and (BT,). x (..., H),
    W (V, H), target x.shape[:-1] int64, bias (V,), weight (n_classes,) floating (n_classes: the vocabulary's
    when W is a shard, else V); no dual tensors nor torch.func transforms' tensors."""
    x, W = autocast_operands(x, W)
    if bias is not None:
        _, bias = autocast_operands(x, bias)
    check_tensor("x", x, ANY_RANK)
    check_tensor(w_name, W, 2)
    check_same("x", x, w_name, W)
    if W.shape[1] != x.shape[-1]:
        raise ValueError(f"{w_name} must be (V, H) as nn.Linear stores it, with H = x.shape[-1] = {x.shape[-1]}; "
                         f"got {w_name} of shape {tuple(W.shape)}")
    if W.shape[0] < 1:
        raise ValueError(f"{w_name} must have at least one row (class)")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    check_dense("target", target)
    if target.dtype != torch.int64:
        raise TypeError(f"target must hold int64 class indices, got {target.dtype}")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"target must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, one class per row of x; "
                         f"got {tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"target is on {target.device} but x is on {x.device}: they must be on one device")
    V = W.shape[0]
    if bias is not None:
        check_tensor("bias", bias, 1)
        check_same("x", x, "bias", bias)
        if bias.shape != (V,):
            raise ValueError(f"bias must have shape (V,) = ({V},), one entry per row of W; got {tuple(bias.shape)}")
    if weight is not None:
        classes = V if n_classes is None else n_classes
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight must be a floating-point torch.Tensor of class weights, got "
                            f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        check_dense("weight", weight)
        if weight.shape != (classes,):
            raise ValueError(f"weight must have shape ({classes},), one weight per class; got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device} but x is on {x.device}: they must be on one device")
        if weight.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("linear_cross_entropy is not differentiable in weight (nor is F.cross_entropy): "
                                      "pass weight.detach()")
    if transformed(x, W, bias):  # a custom op has no forward-mode formula nor torch.func rules
        raise NotImplementedError("linear_cross_entropy differentiates by backward only (loss.backward(), "
                                  "torch.autograd.grad): x, W and bias must not be dual tensors (forward-mode AD) "
                                  "nor torch.func transforms' tensors (grad, jvp, vmap)")
    return x.reshape(target.numel(), x.shape[-1]), W, bias, target.reshape(-1)


def check_targets(target: torch.Tensor, V: int, ignore_index: int) -> None:
    """A class index outside [0, V) that is not ignore_index: on the CPU a ValueError naming the first; on
    CUDA a device-side assertion, as F.cross_entropy's, with no host sync (design notes: target check).
    Skipped in a trace, a CUDA-graph capture or on a FakeTensor: the row's loss and gradient are NaN."""
    if (torch.compiler.is_compiling() or is_fake(target)
            or (target.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    ok = ((target >= 0) & (target < V)) | (target == ignore_index)
    if target.is_cuda:
        torch._assert_async(ok.all(), f"target holds a class index outside [0, {V}) that is not ignore_index")
        return
    if not bool(ok.all()):
        first = tuple(int(i) for i in (~ok).nonzero()[0])
        raise ValueError(f"target[{', '.join(map(str, first))}] = {int(target[first])} is not a class index in "
                         f"[0, {V}) (V = W.shape[0]) nor ignore_index = {ignore_index}")


@triton.jit
def _bf16_nearest_even(t):
    """float32 t rounded to the nearest bfloat16 (ties to even), as float32; inf and NaN kept. Adding 0x7FFF
    plus the lowest kept bit carries exactly when the dropped half is above half a unit, or at half with
    the kept part odd; a truncating cast keeps the result exactly."""
    bits = t.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(t) < float("inf"), rounded, t)


@triton.jit
def _tanh(u):
    """tanh of float32 u (libdevice's does not run in the interpreter): for |u| < 0.3, where 1 - e^(-2|u|)
    cancels, the odd series to u^11; else (1 - e) / (1 + e), e = e^(-2|u|). Within a few float32 ulp."""
    a = tl.abs(u)
    e = tl.math.exp2(a * (-2.0 * LOG2_E))
    far = (1.0 - e) / (1.0 + e)
    small = tl.where(a < 0.3, u, 0.0)  # the series only where it is used: no inf * 0 elsewhere
    s = small * small
    near = small * (1.0 + s * (-1.0 / 3 + s * (2.0 / 15 + s * (-17.0 / 315
                                                          + s * (62.0 / 2835 + s * (-1382.0 / 155925))))))
    return tl.where(a < 0.3, near, tl.where(u < 0, -far, far))


@triton.jit
def linear_cross_entropy_rows_kernel(
    logits_ptr, target_ptr, factor_ptr, loss_ptr, lse_ptr, weight_ptr, weight_sum_ptr,
    V, ignore_index, class_offset, n_classes, softcap, smoothing, z_loss, stride_lr, stride_t, stride_f,
    BLOCK_V: tl.constexpr, LSE_GIVEN: tl.constexpr, GRAD: tl.constexpr, ROUND_BF16: tl.constexpr,
    SOFTCAP: tl.constexpr, WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, Z_LOSS: tl.constexpr, SHARDED: tl.constexpr,
    TARGET_APART: tl.constexpr,
):
    """One program a row of the chunk's logits (rows, V). Without LSE_GIVEN: a pass stores the row's
    log-sum-exp and loss. GRAD: a second pass overwrites the logits with the gradient times factor[row].
    An ignored row has loss and gradient 0; a target outside [0, n_classes) gives NaN in both. SHARDED:
    the logits are classes class_offset ... class_offset + V - 1 of n_classes, and the loss slot gets
    this shard's linear terms alone. The other switches are the plan's options.
    """
    row = tl.program_id(0)
    row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_lr
    target = tl.load(target_ptr + row * stride_t)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < n_classes)
    # The target's column in this row of logits: outside [0, V) on another shard's rows.
    local = target
    if SHARDED:
        local = target - class_offset
    here = (local >= 0) & (local < V)
    cols = tl.arange(0, BLOCK_V)
    # Per row, loss = p_coef * lse - t_coef * z[target] - uniform * sum_c w_c z_c (+ z_loss lse^2),
    # and its gradient p_coef * softmax - t_coef * onehot - uniform * w (+ 2 z_loss lse softmax):
    # F.cross_entropy's (1 - eps) w_t nll_t + eps / n sum_c w_c nll_c, with w = 1 unweighted.
    w_target = 1.0
    if WEIGHT:
        w_target = tl.load(weight_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    t_coef = w_target
    p_coef = w_target
    uniform = 0.0
    if SMOOTH:
        uniform = smoothing / n_classes
        t_coef = w_target * (1.0 - smoothing)
        if WEIGHT:
            p_coef = t_coef + uniform * tl.load(weight_sum_ptr)
        else:
            p_coef = t_coef + smoothing
    if LSE_GIVEN:
        lse = tl.load(lse_ptr + row)
    else:
        row_max = tl.full([], float("-inf"), tl.float32)
        row_sum = tl.zeros([], tl.float32)
        smooth_sum = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK_V):
            inside = start + cols < V
            z = tl.load(row_ptr + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
            if SOFTCAP:
                z = tl.where(inside, softcap * _tanh(z / softcap), float("-inf"))
            new_max = tl.maximum(row_max, tl.max(z, 0))
            # The first tile holds a finite logit: new_max is finite, and the old -inf rescales an empty sum by 0.
            row_sum = row_sum * tl.math.exp2((row_max - new_max) * LOG2_E) \
                + tl.sum(tl.math.exp2((z - new_max) * LOG2_E), 0)
            row_max = new_max
            if SMOOTH:
                if WEIGHT:
                    w = tl.load(weight_ptr + class_offset + start + cols, mask=inside, other=0.0).to(tl.float32)
                    smooth_sum += tl.sum(w * tl.where(inside, z, 0.0), 0)  # masked: w = 0, z = -inf
                else:
                    smooth_sum += tl.sum(tl.where(inside, z, 0.0), 0)
        lse = row_max + tl.log(row_sum)
        tl.store(lse_ptr + row, lse)
        target_logit = tl.load(row_ptr + tl.where(here, local, 0)).to(tl.float32)
        if SOFTCAP:
            target_logit = softcap * _tanh(target_logit / softcap)
        if SHARDED:
            # This shard's linear terms; the caller sums the shards and adds p_coef * lse over the whole vocabulary.
            linear = tl.where(here, t_coef * target_logit, 0.0)
            if SMOOTH:
                linear += uniform * smooth_sum
            tl.store(loss_ptr + row, tl.where(ignored, 0.0, linear))
        else:
            if WEIGHT or SMOOTH:
                loss = p_coef * lse - t_coef * target_logit - uniform * smooth_sum
            else:
                loss = lse - target_logit
            if Z_LOSS:
                loss += z_loss * lse * lse
            loss = tl.where(in_range, loss, float("nan"))
            tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
    if GRAD:
        # The pass below overwrites the row every warp read the target's logit from: a warp ahead must wait.
        tl.debug_barrier()
        factor = tl.load(factor_ptr + row * stride_f).to(tl.float32)
        factor = tl.where(ignored, 0.0, tl.where(in_range, factor, float("nan")))
        if Z_LOSS:
            p_coef += 2.0 * z_loss * lse
        # Back to front: the last tiles read are the likeliest still in L2.
        n_tiles = tl.cdiv(V, BLOCK_V)
        for i in range(n_tiles):
            offs = (n_tiles - 1 - i) * BLOCK_V + cols
            inside = offs < V
            z = tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            if SOFTCAP:
                capped = _tanh(z / softcap)
                z = softcap * capped
            p = tl.math.exp2((z - lse) * LOG2_E)
            if TARGET_APART:
                g = p * p_coef  # the caller adds the target's term in float32
            elif WEIGHT or SMOOTH or Z_LOSS:
                g = p * p_coef - tl.where(offs == local, t_coef, 0.0)
            else:
                g = p - tl.where(offs == local, 1.0, 0.0)
            if SMOOTH:
                if WEIGHT:
                    g -= uniform * tl.load(weight_ptr + class_offset + offs, mask=inside, other=0.0).to(tl.float32)
                else:
                    g -= uniform
            g = g * factor
            if SOFTCAP:
                g = g * (1.0 - capped * capped)  # d softcap tanh(z / softcap) / dz
            if ROUND_BF16:
                g = _bf16_nearest_even(g)
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=inside)


def _lce_chunks(x, W, bias, target, weight, plan: LinearCrossEntropyPlan, lse, loss_rows, factor, dx, dW, db):
    """The chunk loop of the forward (loss_rows given) and of the recomputing backward (lse given). factor:
    the gradient's float32 factor a row (0-d: one for all; None: loss alone); dx, dW, db (float32): or None."""
    BT, V = x.shape[0], W.shape[0]
    if BT == 0:  # no rows: no chunk, no buffer; dW is a sum over none
        if dW is not None:
            dW.zero_()
        return
    # The row kernel reads the class weights with unit stride: a view (w[::2], an expand) is copied.
    weight32 = weight.float().contiguous() if weight is not None else None
    weight_sum = weight32.sum() if weight32 is not None and plan.label_smoothing else None
    apart = factor is not None and plan.target_apart
    slots = torch.empty((V,), dtype=torch.int64, device=x.device) if apart and dW is not None else None
    # Classes off 16 bytes take cuBLAS's slow kernels: an aligned head and a tail of under 8. With a bias, one
    # product into a contiguous buffer, where cuBLAS adds it before rounding, as F.linear (design notes:
    # vocabularies off 16 bytes).
    rows = min(plan.chunk_rows, BT)
    if bias is None:
        buffer = _empty_rows_on_16_bytes((rows, V), x.dtype, x.device)
        head = V - V % (16 // x.dtype.itemsize)
        parts = ((0, head), (head, V)) if 0 < head < V else ((0, V),)
    else:
        buffer = x.new_empty((rows, V))
        parts = ((0, V),)
    # Views made once a call, not once a chunk: each is host time.
    whole = len(parts) == 1
    W_parts = (W,) if whole else tuple(W[a:b] for a, b in parts)
    W_t = tuple(w.t() for w in W_parts)
    dW_parts = None if dW is None else (dW,) if whole else tuple(dW[a:b] for a, b in parts)
    per_row = factor is not None and factor.dim() == 1
    factor_stride = factor.stride(0) if per_row else 0

    def chunks(t):
        return t.split(plan.chunk_rows) if t is not None else (None,) * cdiv(BT, plan.chunk_rows)

    for i, (x_c, target_c, lse_c, loss_c, dx_c, factor_c) in enumerate(zip(
            *map(chunks, (x, target, lse, loss_rows, dx, factor if per_row else None)))):
        n = x_c.shape[0]
        logits = buffer if n == rows else buffer[:n]
        pieces = (logits,) if whole else tuple(logits[:, a:b] for a, b in parts)
        if bias is None:
            for w_t, piece in zip(W_t, pieces):
                torch.mm(x_c, w_t, out=piece)
        else:
            torch.addmm(bias, x_c, W_t[0], out=logits)
        # Unused pointers get target_c, which the kernel only reads: no written argument is passed twice.
        chunk_factor = target_c if factor is None else factor_c if per_row else factor
        jit_kernel(linear_cross_entropy_rows_kernel, traced=False)[(n,)](
            logits, target_c, chunk_factor, target_c if loss_c is None else loss_c, lse_c,
            target_c if weight32 is None else weight32, target_c if weight_sum is None else weight_sum,
            V, plan.ignore_index, plan.class_offset, plan.n_classes, plan.softcap, plan.label_smoothing,
            plan.z_loss, logits.stride(0), target.stride(0), factor_stride,
            BLOCK_V=plan.block_v, LSE_GIVEN=loss_rows is None, GRAD=factor is not None, ROUND_BF16=plan.round_bf16,
            SOFTCAP=plan.softcap > 0, WEIGHT=weight is not None, SMOOTH=plan.label_smoothing > 0,
            Z_LOSS=plan.z_loss > 0, SHARDED=plan.sharded, TARGET_APART=apart, num_warps=plan.num_warps,
        )
        if dx_c is not None:
            torch.mm(pieces[0], W_parts[0], out=dx_c)
            for piece, w in zip(pieces[1:], W_parts[1:]):
                dx_c.addmm_(piece, w)
        if dW_parts is not None:
            for piece, dW_part in zip(pieces, dW_parts):
                if i == 0:
                    torch.mm(piece.t(), x_c, out=dW_part)
                else:
                    dW_part.addmm_(piece.t(), x_c)
        if db is not None:
            db.add_(logits.sum(0, dtype=torch.float32))
        if apart:
            _add_target_term(x_c, W, target_c, chunk_factor, weight, plan, dx_c, dW, db, slots)


def _add_target_term(x_c, W, target_c, factor, weight, plan: LinearCrossEntropyPlan, dx_c, dW, db, slots) -> None:
    """Adds the target terms -c_r onehot(target_r), c_r = t_coef * factor, in float32: dx_r -= c_r W[target_r],
    dW[target_r] -= c_r x_r (summed in float32, each touched row rounded once), db[target_r] -= c_r. With
    label smoothing and no softcap the term is one constant: rounded in the 16-bit tile, its error would
    repeat in every row, a bias that does not average out (design notes: Label smoothing's target term).
    slots: a (V,) int64 scratch."""
    local = target_c - plan.class_offset
    here = (local >= 0) & (local < W.shape[0]) & (target_c != plan.ignore_index)
    t = torch.where(here, local, 0)
    coef = (plan.label_smoothing - 1.0) * factor
    if weight is not None:
        coef = coef * weight[torch.where(here, target_c, 0)].float()
    coef = torch.where(here, coef, 0.0)
    if dx_c is not None:
        dx_c.copy_(torch.addcmul(dx_c.float(), coef[:, None], W[t].float()))
    if dW is not None:
        n = t.shape[0]
        # Each row's slot: the first row of the chunk with its class, so equal classes sum in one float32 row.
        slot = slots.fill_(n).scatter_reduce_(0, t, torch.arange(n, device=t.device), "amin")[t]
        total = torch.zeros((n, x_c.shape[1]), dtype=torch.float32, device=x_c.device)
        total.index_add_(0, slot, coef[:, None] * x_c.float())
        dW[t] = (dW[t].float() + total[slot]).to(dW.dtype)  # a class's rows all write the same value
    if db is not None:
        db.index_add_(0, t, coef)


def _mean_denominator(target: torch.Tensor, weight: torch.Tensor | None, plan: LinearCrossEntropyPlan):
    """F.cross_entropy's "mean" denominator, float32 0-d: rows not ignored, or their targets' weights."""
    kept = target != plan.ignore_index
    if weight is None:
        return kept.sum().to(torch.float32)
    in_range = kept & (target >= 0) & (target < plan.n_classes)
    return torch.where(in_range, weight[torch.where(in_range, target, 0)].float(), 0.0).sum()


def _reduce_rows(loss_rows: torch.Tensor, reduction: str, denominator: torch.Tensor | None) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / denominator  # 0 / 0 = NaN when every target is ignored, as in PyTorch


def _lce_forward_fake(x, W, target, bias, weight, *plan_fields):
    plan = LinearCrossEntropyPlan(*plan_fields)
    scalar = plan.path == "scalar"
    return (x.new_empty(() if scalar else (x.shape[0],), dtype=torch.float32),
            x.new_empty((x.shape[0],), dtype=torch.float32),
            x.new_empty(tuple(x.shape) if scalar and plan.grad_x else (0,)),
            W.new_empty(tuple(W.shape) if scalar and plan.grad_W else (0,)),
            W.new_empty((W.shape[0],) if scalar and plan.grad_bias else (0,)))


def _lce_forward(
    x: torch.Tensor, W: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None,
    reduction: str, chunk_rows: int, block_v: int, num_warps: int, ignore_index: int,
    label_smoothing: float, softcap: float, z_loss: float, class_offset: int, n_classes: int, sharded: bool,
    target_apart: bool, round_bf16: bool, grad_x: bool, grad_W: bool, grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, dx, dW, db) of the plan given field by field: loss 0-d on "scalar", else (BT,) float32
    ("sharded": the linear terms); the rows' lse; on "scalar" the wanted gradients for an upstream 1."""
    plan = LinearCrossEntropyPlan(reduction, chunk_rows, block_v, num_warps, ignore_index, label_smoothing,
                                  softcap, z_loss, class_offset, n_classes, sharded, target_apart, round_bf16,
                                  grad_x, grad_W, grad_bias)
    BT, V = x.shape[0], W.shape[0]
    scalar = plan.path == "scalar"
    gx, gW, gb = scalar and grad_x, scalar and grad_W, scalar and grad_bias
    loss_rows = x.new_empty((BT,), dtype=torch.float32)
    lse = x.new_empty((BT,), dtype=torch.float32)
    denominator = _mean_denominator(target, weight, plan) if scalar and reduction == "mean" else None
    dx = x.new_empty((BT, x.shape[1]) if gx else (0,))
    dW = W.new_empty(tuple(W.shape) if gW else (0,))
    db = torch.zeros((V,), dtype=torch.float32, device=x.device) if gb else None
    factor = None
    if gx or gW or gb:
        # With every row ignored the mean's 1 / denominator is inf, but every row's factor is masked to 0.
        factor = denominator.reciprocal() if denominator is not None else x.new_ones((), dtype=torch.float32)
    _lce_chunks(x, W, bias, target, weight, plan, lse, loss_rows, factor, dx if gx else None, dW if gW else None, db)
    loss = _reduce_rows(loss_rows, reduction, denominator) if scalar else loss_rows
    return loss, lse, dx, dW, db.to(W.dtype) if gb else W.new_empty((0,))


# Opaque to torch.compile: traced, the chunk loop's writes into views of its reused buffer became
# copies and a model step crashed (design notes: linear_cross_entropy is opaque to torch.compile).
linear_cross_entropy_forward = kernel_op("linear_cross_entropy_forward", _lce_forward_fake, opaque=True)(_lce_forward)


def _lce_backward_fake(x, W, target, bias, weight, lse, dloss, *plan_fields):
    plan = LinearCrossEntropyPlan(*plan_fields)
    return (x.new_empty(tuple(x.shape) if plan.grad_x else (0,)), W.new_empty(tuple(W.shape) if plan.grad_W else (0,)),
            W.new_empty((W.shape[0],) if plan.grad_bias else (0,)))


def _lce_backward(
    x: torch.Tensor, W: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None,
    lse: torch.Tensor, dloss: torch.Tensor, reduction: str, chunk_rows: int, block_v: int, num_warps: int,
    ignore_index: int, label_smoothing: float, softcap: float, z_loss: float, class_offset: int,
    n_classes: int, sharded: bool, target_apart: bool, round_bf16: bool, grad_x: bool, grad_W: bool, grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db) for dloss ((BT,) any stride, or 0-d), the logits recomputed (empty where not wanted)."""
    plan = LinearCrossEntropyPlan(reduction, chunk_rows, block_v, num_warps, ignore_index, label_smoothing,
                                  softcap, z_loss, class_offset, n_classes, sharded, target_apart, round_bf16,
                                  grad_x, grad_W, grad_bias)
    dx = x.new_empty(tuple(x.shape) if grad_x else (0,))
    dW = W.new_empty(tuple(W.shape) if grad_W else (0,))
    db = torch.zeros((W.shape[0],), dtype=torch.float32, device=x.device) if grad_bias else None
    _lce_chunks(x, W, bias, target, weight, plan, lse, None, dloss.float(), dx if grad_x else None,
                dW if grad_W else None, db)
    return dx, dW, db.to(W.dtype) if grad_bias else W.new_empty((0,))


linear_cross_entropy_backward = kernel_op("linear_cross_entropy_backward", _lce_backward_fake,
                                          opaque=True)(_lce_backward)


def _lce_setup_context(ctx, inputs, output):
    x, W, target, bias, weight, *plan_fields = inputs
    loss, lse, dx, dW, db = output
    ctx.mark_non_differentiable(lse, dx, dW, db)
    # Materialised, each output above would get a zero-filled gradient: a dx and a dW more at the peak.
    ctx.set_materialize_grads(False)
    ctx.plan = LinearCrossEntropyPlan(*plan_fields)
    ctx.n_inputs = len(inputs)
    if ctx.plan.path == "rows":
        ctx.save_for_backward(x, W, target, bias, weight, lse)
    else:
        ctx.save_for_backward(dx, dW, db)


def _lce_autograd_backward(ctx, dloss, dlse, ddx, ddW, ddb, through_op: bool = True):
    """The gradients of x, W and bias; "rows": by the backward op where ``through_op`` or
    ``backward_through_op``, else launched directly."""
    if torch.is_grad_enabled():
        raise no_double_backward("linear_cross_entropy", "linear_cross_entropy_ref (the logits in memory): "
                                                         "torch.func's transforms do not run this op either")
    plan = ctx.plan
    if dloss is None:  # grads are not materialised: None stands for a zero upstream gradient
        return (None,) * ctx.n_inputs
    if plan.path == "rows":
        if transformed(dloss):
            raise NotImplementedError("linear_cross_entropy (reduction 'none') differentiates by backward only: "
                                      "its gradient of the losses must not be a dual tensor (forward-mode AD) nor "
                                      "a torch.func transform's tensor")
        backward = (torch.ops.softmax_kernels.linear_cross_entropy_backward
                    if through_op or backward_through_op(dloss) else _lce_backward)
        dx, dW, db = backward(*ctx.saved_tensors, dloss, *plan.args())
    elif backward_through_op(dloss):  # traced, or a batch of gradients (is_grads_batched): out of place
        dx, dW, db = (g * dloss for g in ctx.saved_tensors)
    else:
        # In place: dW is as large as W, and a copy would double the peak memory.
        if getattr(ctx, "gradients_returned", False):
            raise RuntimeError("linear_cross_entropy (reduction 'mean' / 'sum') computes its gradients in the "
                               "forward and hands them out once: a second backward through the same graph "
                               "(retain_graph=True) is not supported; call it again instead")
        ctx.gradients_returned = True
        dx, dW, db = (g.mul_(dloss) for g in ctx.saved_tensors)
    return (dx if plan.grad_x else None, dW if plan.grad_W else None, None, db if plan.grad_bias else None,
            *([None] * (ctx.n_inputs - 4)))


register_autograd(linear_cross_entropy_forward, _lce_autograd_backward, setup_context=_lce_setup_context)

# Where autograd records an eager call: the one Function, not the custom op's dispatch.
_LCE_AUTOGRAD = AutogradSpec(
    "linear_cross_entropy", forward=_lce_forward, setup=_lce_setup_context,
    backward=lambda ctx, *grads: _lce_autograd_backward(ctx, *grads, through_op=False))


@on_input_device
def linear_cross_entropy(x: torch.Tensor, W: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", *, bias: torch.Tensor | None = None, label_smoothing: float = 0.0,
                         softcap: float | None = None, z_loss: float = 0.0, weight: torch.Tensor | None = None,
                         return_lse: bool = False, launch: LinearCrossEntropyLaunch | None = None):
    """``F.cross_entropy(F.linear(x, W, bias), target, ...)`` without the (BT, V) logits.

    x: (..., H), W: (V, H) (nn.Linear's weight), bias: (V,) or None, one of float32 / float16 /
    bfloat16 (under autocast cast as F.linear casts them); target: x.shape[:-1] int64 (a causal
    LM shifts: ``linear_cross_entropy(h[:, :-1], W, tokens[:, 1:])``). Returns the float32 loss,
    0-d or target's shape for reduction "none", and with ``return_lse`` each row's float32
    log-sum-exp (detached). Differentiable in x, W and bias by backward (not forward-mode AD nor
    torch.func); "mean" and "sum" hand their gradients out once (no retain_graph).

    Options, off by default and then compiled away: ``weight`` (V,) and ``label_smoothing`` as
    F.cross_entropy defines them; ``softcap``: logits become softcap * tanh(logits / softcap)
    first, as Gemma 2 caps them; ``z_loss``: z_loss * lse ** 2 added to each row not ignored
    ("mean" divides it by the cross-entropy's denominator). ``launch`` overrides the plan's chunk
    and tile (``linear_cross_entropy_plan``).

    Raises TypeError / ValueError naming a bad argument. A target outside [0, V) that is not
    ignore_index: a ValueError naming it on the CPU; on CUDA, as F.cross_entropy, a device-side
    assertion (no host sync; the error surfaces at the next synchronisation); under
    torch.compile or CUDA-graph capture that row's loss and gradient are NaN instead. Precision
    and memory: outputs/README.md, design notes: Linear cross-entropy.
    """
    x2, W, bias, t = check_linear_cross_entropy_inputs(x, W, target, bias, weight)
    check_flag("return_lse", return_lse)
    grads = tuple(torch.is_grad_enabled() and a is not None and a.requires_grad for a in (x2, W, bias))
    plan = linear_cross_entropy_plan(*x2.shape, W.shape[0], x2.dtype, reduction, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss, launch=launch,
                                     grads=grads, sms=_sm_count(x2.device))
    check_targets(target, W.shape[0], ignore_index)
    args = (x2, W, t, bias, weight, *plan.args())
    if not needs_op(x2, W, bias):
        loss, lse = _lce_forward(*args)[:2]
    elif eager_autograd(x2, W, bias, t, weight):
        loss, lse = _LCE_AUTOGRAD.run(*args)[:2]
    else:
        loss, lse = torch.ops.softmax_kernels.linear_cross_entropy_forward(*args)[:2]
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return (loss, lse.reshape(target.shape)) if return_lse else loss


# Vocabulary-parallel: W sharded by classes over a process group. The gradient needs the merged log-sum-exp,
# known only after the forward's collectives, so the backward recomputes each shard's logits.
def _shard_bounds(V_local: int, group, vocab_start: int | None, n_classes: int | None, device) -> tuple:
    """(vocab_start, n_classes): as given, or from every rank's shard size in rank order (one
    all-gather of an integer, read back)."""
    import torch.distributed as dist
    if (vocab_start is None) != (n_classes is None):
        raise ValueError("vocab_start and n_classes go together: pass both (this shard's first class and the "
                         "vocabulary's size) or neither (shards in rank order, their sizes gathered)")
    if vocab_start is not None:
        return vocab_start, n_classes
    sizes = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(sizes, torch.full((1,), V_local, dtype=torch.int64, device=device), group=group)
    sizes = sizes.tolist()
    return sum(sizes[:dist.get_rank(group)]), sum(sizes)


def _group_logsumexp(lse_local: torch.Tensor, group) -> torch.Tensor:
    """log(sum over ranks of exp(lse_local)) per row: the maximum first, so no sum overflows."""
    import torch.distributed as dist
    top = lse_local.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a row of -inf or NaN keeps it through the sum
    total = torch.exp(lse_local - top)
    dist.all_reduce(total, group=group)
    return top + torch.log(total)


def _sharded_row_loss(lse, linear, target, weight, plan: LinearCrossEntropyPlan) -> torch.Tensor:
    """Each row's loss from the vocabulary's log-sum-exp and its summed linear terms: the row
    kernel's formula (p_coef lse - linear + z_loss lse^2), NaN for a bad class, 0 where ignored."""
    in_range = (target >= 0) & (target < plan.n_classes)
    p_coef = weight[torch.where(in_range, target, 0)].float() if weight is not None else torch.ones_like(lse)
    if plan.label_smoothing:
        total = weight.float().sum() if weight is not None else plan.n_classes
        p_coef = p_coef * (1.0 - plan.label_smoothing) + plan.label_smoothing / plan.n_classes * total
    loss = p_coef * lse - linear
    if plan.z_loss:
        loss = loss + plan.z_loss * lse * lse
    loss = torch.where(in_range, loss, float("nan"))
    return torch.where(target == plan.ignore_index, 0.0, loss)


# The op pair with the collectives between them (a custom op cannot take a process group). The forward hands
# the "mean" denominator (else a 0-d 1) to the backward as a third, non-differentiable output.
def _vocab_parallel_forward(x, W, bias, target, weight, group, plan: LinearCrossEntropyPlan):
    import torch.distributed as dist
    linear, lse_local = _lce_forward(x, W, target, bias, weight, *plan.args())[:2]
    lse = _group_logsumexp(lse_local, group)
    dist.all_reduce(linear, group=group)
    denominator = _mean_denominator(target, weight, plan) if plan.reduction == "mean" else None
    loss = _reduce_rows(_sharded_row_loss(lse, linear, target, weight, plan), plan.reduction, denominator)
    return loss, lse, lse.new_ones(()) if denominator is None else denominator


def _vocab_parallel_setup(ctx, inputs, output):
    x, W, bias, target, weight, ctx.group, ctx.plan = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, W, bias, target, weight, *output[1:])


def _vocab_parallel_backward(ctx, dloss, dlse, ddenominator):
    import torch.distributed as dist
    if dloss is None:
        return (None,) * 7
    x, W, bias, target, weight, lse, denominator = ctx.saved_tensors
    grad_x, grad_W, grad_bias = ctx.needs_input_grad[1:4]
    factor = dloss.float() / denominator if ctx.plan.reduction == "mean" else dloss.float()
    plan = replace(ctx.plan, grad_x=grad_x, grad_W=grad_W, grad_bias=grad_bias)
    dx, dW, db = _lce_backward(x, W, target, bias, weight, lse, factor, *plan.args())
    if grad_x:
        dist.all_reduce(dx, group=ctx.group)  # every shard's part of dx = G @ W, in x's dtype
    return dx if grad_x else None, dW if grad_W else None, db if grad_bias else None, None, None, None, None


_VOCAB_PARALLEL_AUTOGRAD = AutogradSpec("vocab_parallel_linear_cross_entropy", forward=_vocab_parallel_forward,
                                        setup=_vocab_parallel_setup, backward=_vocab_parallel_backward,
                                        non_differentiable=(1, 2))


@on_input_device
def vocab_parallel_linear_cross_entropy(x: torch.Tensor, W_shard: torch.Tensor, target: torch.Tensor, group=None,
                                        ignore_index: int = -100, reduction: str = "mean", *,
                                        vocab_start: int | None = None, n_classes: int | None = None,
                                        bias: torch.Tensor | None = None, label_smoothing: float = 0.0,
                                        softcap: float | None = None, z_loss: float = 0.0,
                                        weight: torch.Tensor | None = None, return_lse: bool = False,
                                        launch: LinearCrossEntropyLaunch | None = None):
    """``linear_cross_entropy`` with W sharded by rows over the process group ``group`` (None: the
    default group). Every rank passes the same x (..., H) and target, and its own W_shard (V_r, H)
    (and bias shard (V_r,)): the classes vocab_start ... vocab_start + V_r - 1 of n_classes, or
    without them the shards in rank order, sizes possibly uneven (gathered: a collective and a
    host sync per call). Every option applies (weight: all n_classes of it on every rank). The
    loss and lse are the group's, the same on every rank; dx is the group's, dW_shard and the
    bias shard's gradient this rank's. Four products instead of three, each 1 / world of the
    unsharded one's. Eager only: torch.compile(fullgraph=True) does not trace the collectives.
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs an initialised torch.distributed process "
                           "group (torch.distributed.init_process_group)")
    if isinstance(W_shard, torch.Tensor) and W_shard.dim() == 2 and isinstance(x, torch.Tensor):
        vocab_start, n_classes = _shard_bounds(W_shard.shape[0], group, vocab_start, n_classes, x.device)
    x2, W_shard, bias, t = check_linear_cross_entropy_inputs(x, W_shard, target, bias, weight, n_classes, "W_shard")
    check_flag("return_lse", return_lse)
    plan = linear_cross_entropy_plan(*x2.shape, W_shard.shape[0], x2.dtype, reduction, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss, launch=launch,
                                     vocab_start=vocab_start, n_classes=n_classes,
                                     sms=_sm_count(x2.device))
    check_targets(target, n_classes, ignore_index)
    loss, lse = _VOCAB_PARALLEL_AUTOGRAD.run(x2, W_shard, bias, t, weight, group, plan)[:2]
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return (loss, lse.reshape(target.shape)) if return_lse else loss


# ----------------------------------------------------------------------------------------------
# Gluon on Hopper: softmax(x) @ V and FlashAttention (forward, dK/dV, dQ), warp-specialised
# ----------------------------------------------------------------------------------------------
# softmax(x) @ V: compiled Triton waits for each warpgroup MMA right after issuing it; Gluon writes the overlap
# down. A program owns GLUON_SOFTMAX_ROWS rows of x and one d3 tile: a loader warp brings each step's x and V
# tiles into a TMA ring; each consumer warpgroup issues step i - 1's products, runs step i's online softmax
# of its 64 rows, then waits. The consumers share every V tile, one's softmax under the other's products.
# setmaxnreg: loader 24 registers, consumers 240 (24 x 128 + 2 x 240 x 128 of the SM's 64 K).
GLUON_LOADER_REGISTERS = 40  # the attention kernels' loaders
GLUON_SOFTMAX_LOADER_REGISTERS = 24
GLUON_SOFTMAX_CONSUMER_REGISTERS = 240

# Forward: a tile is GLUON_BLOCK_M queries for each consumer; a program runs one tile or, persistent, many.
# A loader warp brings each Q tile once, then K and V tiles into a TMA ring both consumers read (a slot is
# refilled once both released it). The step's overlap: ``_gluon_flash_step``. Masking, -inf rows and the
# saved log-sum-exp as in flash_attention_forward_kernel.
GLUON_FLASH_BLOCK_N = 128
GLUON_FLASH_STAGES = 2
# setmaxnreg (a multiple of 8): beside the loader's 40, both consumers get 232 of the 64K.
GLUON_FLASH_CONSUMER_REGISTERS = 232
# The consumers take turns to issue their products (FlashAttention-3's ping-pong: one's softmax
# under the other's MMAs), ordered by a pair of barriers in shared memory.
GLUON_FLASH_PINGPONG = True

# dK and dV: each consumer owns GLUON_BLOCK_M keys, streaming 64-query tiles of Q and dO through a TMA ring;
# S^T and dP^T issue together, P^T's exp under dP^T, dV's product while dS^T is made, dK's last.
GLUON_DKDV_STAGES = 2
GLUON_DKDV_CONSUMER_REGISTERS = 232

# dQ: the forward's query tiles, each consumer holding Q and dO and streaming K and V; S and dP issue together,
# P under dP, then dS = P (dP - D) and dQ += dS K. It also writes D = rowsum(dO * O) for dK/dV.
GLUON_DQ_STAGES = 2
GLUON_DQ_CONSUMER_REGISTERS = 232

if _GLUON is not None:
    (gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait, GluonTensorDescriptor) = _GLUON
    # The TMA load and store were renamed after triton 3.6 (the old names now raise); same arguments.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.jit
    def _gluon_softmax_loader(x_desc, v_desc, x_bufs, v_bufs, x_ready, x_free, v_ready, v_free,
                              batch, off_m, off_d3, n_steps):
        """The producer warp: every step's x and V tiles into the ring (float32 V as its TF32 parts, each part
        into its own buffer of the slot)."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        PARTS: gl.constexpr = v_bufs.type.shape[0] // STAGES
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[2]
        PARTED: gl.constexpr = len(v_desc.block_type.shape) == 4
        for i in range(n_steps):
            slot = i % STAGES
            # A fresh mbarrier acts as if the phase before 0 completed: the first pass's "free" waits return at once.
            phase = (i // STAGES) & 1
            mbarrier.wait(x_free.index(slot), phase ^ 1)
            mbarrier.expect(x_ready.index(slot), x_desc.block_type.nbytes)
            _tma_load(x_desc, [batch, off_m, i * BLOCK_N], x_ready.index(slot), x_bufs.index(slot))
            mbarrier.wait(v_free.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), PARTS * v_desc.block_type.nbytes)
            if PARTED:
                for part in gl.static_range(PARTS):
                    _tma_load(v_desc, [batch, part, off_d3, i * BLOCK_N], v_ready.index(slot),
                              v_bufs.index(slot * PARTS + part))
            else:
                _tma_load(v_desc, [batch, i * BLOCK_N, off_d3], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _gluon_tf32(w):
        """Non-negative finite float32 w rounded to the nearest TF32 value (half up), as
        ``_tf32_rounded`` does: the tensor core would truncate it."""
        bits = w.to(gl.int32, bitcast=True)
        return ((bits + 0x1000) & -8192).to(gl.float32, bitcast=True)

    @gluon.jit
    def _gluon_softmax_operands(w, p, q, p_layout: gl.constexpr, PARTS: gl.constexpr):
        """w as the products' register operands: 16-bit (q unchanged), TF32 (one product), or split (tf32x3)."""
        if p.dtype == gl.float32:
            hi = _gluon_tf32(w)
            if PARTS == 2:
                q = gl.convert_layout(w - hi, p_layout)
            p = gl.convert_layout(hi, p_layout)
        else:
            p = gl.convert_layout(w.to(p.dtype), p_layout)
        return p, q

    @gluon.jit
    def _gluon_softmax_products(p, q, v_bufs, slot, acc, PARTS: gl.constexpr):
        """Issues acc += weights @ V's tile as asynchronous warpgroup MMAs: 16-bit one product; float32 V's parts
        arrive K-major (a TF32 MMA's shared operand must be): p V ('high') or p V_hi + p V_lo + q V_hi
        (tf32x3), the small terms' truncation at float32's own rounding."""
        if len(v_bufs.type.shape) == 4:  # 16-bit: (slots, 1, BLOCK_N, BLOCK_D3); p in registers or shared memory
            BLOCK_N: gl.constexpr = v_bufs.type.shape[2]
            BLOCK_D3: gl.constexpr = v_bufs.type.shape[3]
            acc = warpgroup_mma(p, v_bufs.index(slot).reshape([BLOCK_N, BLOCK_D3]), acc, is_async=True)
        else:  # float32: (slots x parts, 1, 1, BLOCK_D3, BLOCK_N)
            BLOCK_D3: gl.constexpr = v_bufs.type.shape[3]
            BLOCK_N: gl.constexpr = v_bufs.type.shape[4]
            v_hi = v_bufs.index(slot * PARTS).reshape([BLOCK_D3, BLOCK_N]).permute((1, 0))
            if PARTS == 2:  # into a fresh accumulator (see _gluon_softmax_products_done)
                v_lo = v_bufs.index(slot * PARTS + 1).reshape([BLOCK_D3, BLOCK_N]).permute((1, 0))
                acc = warpgroup_mma(q, v_hi, acc, use_acc=False, is_async=True)
                acc = warpgroup_mma(p, v_lo, acc, is_async=True)
            acc = warpgroup_mma(p, v_hi, acc, is_async=True)
        return acc

    @gluon.jit
    def _gluon_softmax_products_done(acc, part, p, q, PARTS: gl.constexpr):
        """Waits for the products in flight. tf32x3: a step's products go to a fresh ``part``, added to acc here in
        float32, as the tensor core's accumulation does not round as float32 does (design notes: tf32x3 products)."""
        if PARTS == 2:
            part, p, q = warpgroup_mma_wait(0, deps=(part, p, q))
            acc = acc + part
        else:
            acc, p, q = warpgroup_mma_wait(0, deps=(acc, p, q))
        return acc, part, p, q

    @gluon.jit
    def _gluon_softmax_issue(i, p, q, p_buf, v_bufs, v_ready, my_turn, their_turn, acc, part, PINGPONG: gl.constexpr,
                             PARTS: gl.constexpr, P_SMEM: gl.constexpr):
        """Issues step i's products (its weights p, q, or P_SMEM those in p_buf, against V's tile
        in the step's slot) once the tile is in and, PINGPONG, once it is this consumer's turn."""
        STAGES: gl.constexpr = v_bufs.type.shape[0] // PARTS
        slot = i % STAGES
        mbarrier.wait(v_ready.index(slot), (i // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, i & 1)
        if P_SMEM:
            acc = _gluon_softmax_products(p_buf, q, v_bufs, slot, acc, PARTS)
        elif PARTS == 2:
            part = _gluon_softmax_products(p, q, v_bufs, slot, part, PARTS)
        else:
            acc = _gluon_softmax_products(p, q, v_bufs, slot, acc, PARTS)
        if PINGPONG:
            mbarrier.arrive(their_turn)
        return acc, part

    @gluon.jit
    def _gluon_softmax_step(i, x_bufs, v_bufs, p_buf, x_ready, x_free, v_ready, v_free, my_turn, their_turn,
                            acc, part, m, l, p, q, cols, d2, s_layout: gl.constexpr, acc_layout: gl.constexpr,
                            p_layout: gl.constexpr, CONSUMER: gl.constexpr, MASKED: gl.constexpr,
                            PINGPONG: gl.constexpr, LAZY: gl.constexpr, PARTS: gl.constexpr, FIRST: gl.constexpr,
                            P_SMEM: gl.constexpr):
        """Step i of one consumer: step i - 1's products issued (not FIRST), the online softmax of step i while they
        run, the wait, acc's rescale, step i's weights as the next operands. A step waits for its own products:
        an MMA in flight across the loop's back edge makes ptxas serialise every warpgroup MMA (warning C7512).
        MASKED: columns past d2 (TMA's zeros) weigh nothing."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        ROWS: gl.constexpr = x_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = x_bufs.type.shape[3]
        BLOCK_M: gl.constexpr = m.shape[0]
        LOG2E: gl.constexpr = 1.4426950408889634
        slot = i % STAGES
        mbarrier.wait(x_ready.index(slot), (i // STAGES) & 1)
        x_tile = x_bufs.index(slot).reshape([ROWS, BLOCK_N]).slice(CONSUMER * BLOCK_M, BLOCK_M)
        s = x_tile.load(s_layout).to(gl.float32)
        # The generic-proxy read of the slot must precede the TMA that refills it.
        fence_async_shared()
        mbarrier.arrive(x_free.index(slot))
        if not FIRST:
            acc, part = _gluon_softmax_issue(i - 1, p, q, p_buf, v_bufs, v_ready, my_turn, their_turn, acc, part,
                                             PINGPONG, PARTS, P_SMEM)
        if MASKED:
            s = gl.where(gl.expand_dims(i * BLOCK_N + cols < d2, 0), s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        # A row of only -inf subtracts 0 (no NaN); the max is subtracted before scaling to base 2, as x * log2(e)
        # overflows past 2.4e38.
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2((m - m_sub) * LOG2E)
        rescale = True
        if LAZY:
            # Lazy rescale as in fused_softmax_kernel; the test spans the warpgroup, so its warps take one branch.
            rescale = gl.max((m_new > m + 8.0).to(gl.int32), axis=0) > 0
        if rescale:
            m = m_new
            l = l * alpha
        else:
            m_sub = gl.where(m == float("-inf"), 0.0, m)
        w = gl.exp2((s - gl.expand_dims(m_sub, 1)) * LOG2E)
        l = l + gl.sum(w, axis=1)
        if not FIRST:
            # Step i - 1's products must be done before acc is rescaled and its V slot refilled;
            # their A operands (p and q in registers, or p_buf) must not be overwritten until then.
            acc, part, p, q = _gluon_softmax_products_done(acc, part, p, q, PARTS)
            mbarrier.arrive(v_free.index((i + STAGES - 1) % STAGES))
            if rescale:  # (before any product, acc is 0)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout)), 1)
        if P_SMEM:  # the next products read the weights from shared memory
            p_buf.store(w.to(p_buf.dtype))
            fence_async_shared()
        else:
            p, q = _gluon_softmax_operands(w, p, q, p_layout, PARTS)
        return acc, part, m, l, p, q

    @gluon.jit
    def _gluon_softmax_consumer(x_bufs, v_bufs, p_bufs, x_ready, x_free, v_ready, v_free, turns,
                                o_ptr, stride_ob, stride_o1, stride_o3, lse_ptr, stride_lb, stride_l1,
                                batch, off_m, off_d3, d1, d2, d3, n_steps,
                                s_layout: gl.constexpr, acc_layout: gl.constexpr, p_layout: gl.constexpr,
                                CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, LAZY: gl.constexpr,
                                STORE_LSE: gl.constexpr, PARTS: gl.constexpr, P_SMEM: gl.constexpr):
        """Consumer CONSUMER: rows off_m + CONSUMER * BLOCK_M on, every step, then their output (and lse)."""
        BLOCK_N: gl.constexpr = x_bufs.type.shape[3]
        BLOCK_D3: gl.constexpr = v_bufs.type.shape[3]
        BLOCK_M: gl.constexpr = x_bufs.type.shape[2] // turns.type.shape[0]  # the rows / the consumers
        LN2: gl.constexpr = 0.6931471805599453
        rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        my_turn = turns.index(CONSUMER)
        their_turn = turns.index(1 - CONSUMER)
        if PINGPONG:
            if CONSUMER == 1:  # consumer 0 issues first
                mbarrier.arrive(their_turn)
        m = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_l)
        l = gl.zeros([BLOCK_M], gl.float32, rows_l)
        acc = gl.zeros([BLOCK_M, BLOCK_D3], gl.float32, acc_layout)
        if PARTS == 2:  # acc in registers, each step's products in part
            part = gl.zeros([BLOCK_M, BLOCK_D3], gl.float32, acc_layout)
        else:  # the products accumulate in acc; part only passes through
            part = gl.zeros([BLOCK_M], gl.float32, rows_l)
        p_buf = p_bufs.index(CONSUMER)
        if P_SMEM:  # the weights go through p_buf: p only passes through
            p = gl.zeros([BLOCK_M], gl.float32, rows_l)
        else:
            p = gl.zeros([BLOCK_M, BLOCK_N], x_bufs.dtype, p_layout)
        if PARTS == 2:
            q = gl.zeros([BLOCK_M, BLOCK_N], x_bufs.dtype, p_layout)
        else:  # no second operand: q only passes through
            q = gl.zeros([BLOCK_M], gl.float32, rows_l)
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        full_steps = d2 // BLOCK_N
        # Step 0 (no products before it) is masked whatever it holds.
        acc, part, m, l, p, q = _gluon_softmax_step(0, x_bufs, v_bufs, p_buf, x_ready, x_free, v_ready, v_free,
                                                    my_turn, their_turn, acc, part, m, l, p, q, cols, d2, s_layout,
                                                    acc_layout, p_layout, CONSUMER, True, PINGPONG, LAZY, PARTS, True,
                                                    P_SMEM)
        for i in range(1, full_steps):
            acc, part, m, l, p, q = _gluon_softmax_step(i, x_bufs, v_bufs, p_buf, x_ready, x_free, v_ready, v_free,
                                                        my_turn, their_turn, acc, part, m, l, p, q, cols, d2, s_layout,
                                                        acc_layout, p_layout, CONSUMER, False, PINGPONG, LAZY, PARTS,
                                                        False, P_SMEM)
        for i in range(gl.maximum(full_steps, 1), n_steps):  # the last, part-filled step, if any
            acc, part, m, l, p, q = _gluon_softmax_step(i, x_bufs, v_bufs, p_buf, x_ready, x_free, v_ready, v_free,
                                                        my_turn, their_turn, acc, part, m, l, p, q, cols, d2, s_layout,
                                                        acc_layout, p_layout, CONSUMER, True, PINGPONG, LAZY, PARTS,
                                                        False, P_SMEM)
        acc, part = _gluon_softmax_issue(n_steps - 1, p, q, p_buf, v_bufs, v_ready, my_turn, their_turn, acc, part,
                                         PINGPONG, PARTS, P_SMEM)
        acc, part, p, q = _gluon_softmax_products_done(acc, part, p, q, PARTS)
        # A row of only -inf has l = 0 and acc = 0: 0 / 0 is NaN, torch's answer for that row.
        out = acc / gl.expand_dims(gl.convert_layout(l, gl.SliceLayout(1, acc_layout)), 1)
        first_row = off_m + CONSUMER * BLOCK_M
        rows = first_row + gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
        out_cols = off_d3 + gl.arange(0, BLOCK_D3, gl.SliceLayout(0, acc_layout))
        o_ptrs = (o_ptr + batch.to(gl.int64) * stride_ob + gl.expand_dims(rows.to(gl.int64) * stride_o1, 1)
                  + gl.expand_dims(out_cols * stride_o3, 0))
        mask = gl.expand_dims(rows < d1, 1) & gl.expand_dims(out_cols < d3, 0)
        gl.store(o_ptrs, out.to(x_bufs.dtype), mask=mask)
        if STORE_LSE:
            # The first d3 tile's programs write it; a row of only -inf gets -inf (a NaN backward, as torch's).
            if off_d3 == 0:
                lse_rows = first_row + gl.arange(0, BLOCK_M, rows_l)
                lse = (m + gl.log2(l) * LN2)
                gl.store(lse_ptr + batch.to(gl.int64) * stride_lb + lse_rows * stride_l1, lse, mask=lse_rows < d1)

    @gluon.jit
    def fused_softmax_gluon_kernel(x_desc, v_desc, o_ptr, lse_ptr, stride_ob, stride_o1, stride_o3, stride_lb,
                                   stride_l1, d1, d2, d3, n_tiles_d3, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                                   LOADER_REGISTERS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                                   PINGPONG: gl.constexpr, LAZY: gl.constexpr, STORE_LSE: gl.constexpr,
                                   PARTS: gl.constexpr, P_SMEM: gl.constexpr, num_warps: gl.constexpr):
        """softmax(x) @ V for one (CONSUMERS x BLOCK_M rows, BLOCK_D3 columns) tile of one batch
        element's output, through a ring of STAGES slots. 16-bit: v_desc reads V (batch, d2, d3).
        float32: v_desc reads V's PARTS TF32 parts, (batch, PARTS, d3, d2)."""
        ROWS: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = x_desc.block_type.shape[2]
        BLOCK_D3: gl.constexpr = v_desc.block_type.shape[2]
        BLOCK_M: gl.constexpr = 16 * num_warps
        dtype: gl.constexpr = x_desc.dtype
        gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
        gl.static_assert(CONSUMERS == 2, "the default partition and one worker consume")
        gl.static_assert(ROWS == CONSUMERS * BLOCK_M, "an x tile holds every consumer's rows")
        tile = gl.program_id(0)
        batch = gl.program_id(1)
        # Adjacent programs take the d3 tiles of one row block: its x tiles come from L2 after the first.
        off_m = (tile // n_tiles_d3) * ROWS
        off_d3 = (tile % n_tiles_d3) * BLOCK_D3
        n_steps = gl.cdiv(d2, BLOCK_N)
        # 16-bit: the logits share the accumulator's row distribution, so row statistics line up and the weights
        # reach the register operand's layout within each thread. float32: the operand's columns differ from the
        # accumulator's, so the logits are read from shared memory in the operand's layout.
        FP32: gl.constexpr = dtype == gl.float32
        K_WIDTH: gl.constexpr = 1 if FP32 else 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_D3, 8 * K_WIDTH])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=K_WIDTH)
        if FP32:
            s_layout: gl.constexpr = p_layout
        else:
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                               instr_shape=[16, BLOCK_N, 16])
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + v_desc.block_type.shape, v_desc.layout)
        if P_SMEM:  # each consumer's weights, the products' operand in shared memory
            gl.static_assert(not FP32, "float32's weights stay in registers")
            p_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, BLOCK_N],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        else:  # unused
            p_bufs = x_bufs
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        x_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(slot), count=1)
            mbarrier.init(x_free.index(slot), count=CONSUMERS)  # every consumer reads every slot
            mbarrier.init(v_ready.index(slot), count=1)
            mbarrier.init(v_free.index(slot), count=CONSUMERS)
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(turns.index(c), count=1)
        gl.warp_specialize([
            (_gluon_softmax_consumer, (x_bufs, v_bufs, p_bufs, x_ready, x_free, v_ready, v_free, turns, o_ptr, stride_ob,
                                       stride_o1, stride_o3, lse_ptr, stride_lb, stride_l1, batch, off_m, off_d3,
                                       d1, d2, d3, n_steps, s_layout, acc_layout, p_layout, 0, PINGPONG, LAZY,
                                       STORE_LSE, PARTS, P_SMEM)),
            (_gluon_softmax_consumer, (x_bufs, v_bufs, p_bufs, x_ready, x_free, v_ready, v_free, turns, o_ptr, stride_ob,
                                       stride_o1, stride_o3, lse_ptr, stride_lb, stride_l1, batch, off_m, off_d3,
                                       d1, d2, d3, n_steps, s_layout, acc_layout, p_layout, 1, PINGPONG, LAZY,
                                       STORE_LSE, PARTS, P_SMEM)),
            (_gluon_softmax_loader, (x_desc, v_desc, x_bufs, v_bufs, x_ready, x_free, v_ready, v_free,
                                     batch, off_m, off_d3, n_steps)),
        ], [num_warps, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


    @gluon.jit
    def _gluon_flash_tile(w, n_batch, n_queries, n_keys, IS_CAUSAL: gl.constexpr, BLOCK_Q: gl.constexpr,
                          BLOCK_N: gl.constexpr):
        """Work item w: (batch element, first query, key steps that need no mask, key steps) of a
        tile of BLOCK_Q queries. Full: batch-major, so the programs running together share K and V.
        Causal: the last query tiles of every batch element first (they see the most keys)."""
        n_tiles = gl.cdiv(n_queries, BLOCK_Q)
        if IS_CAUSAL:
            batch = w % n_batch
            off_m = (n_tiles - 1 - w // n_batch) * BLOCK_Q
        else:
            batch = w // n_tiles
            off_m = (w % n_tiles) * BLOCK_Q
        key_end = n_keys
        full_steps = n_keys // BLOCK_N
        if IS_CAUSAL:
            # The tile's last query sees keys up to its own index; in the forward the first
            # consumer's last step is the same one (BLOCK_Q is one key step; the dQ kernel's key
            # steps may be half that, its first consumer's last step then all masked). Steps before the tile's first query need
            # no mask (off_m is a multiple of BLOCK_N).
            key_end = gl.minimum(n_keys, off_m + BLOCK_Q)
            full_steps = gl.minimum(off_m, n_keys) // BLOCK_N
        return batch, off_m, full_steps, gl.cdiv(key_end, BLOCK_N)

    @gluon.jit
    def _gluon_flash_loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_free, v_ready,
                            v_free, first, n_work, n_batch, n_heads, group, n_queries, n_keys, IS_CAUSAL: gl.constexpr):
        """The producer: for each of the program's tiles, each consumer's Q tile once its last one
        is released, then every step's K and V tiles (of query head h's key/value head h // group) into the ring
        (a slot is free again once every consumer has released it). Ring slots and phases run on across tiles."""
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        CONSUMERS: gl.constexpr = q_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        it = 0
        t = 0
        for w in range(first, n_work, gl.num_programs(0)):
            batch, off_m, full_steps, n_steps = _gluon_flash_tile(w, n_batch, n_queries, n_keys, IS_CAUSAL,
                                                                  CONSUMERS * BLOCK_M, BLOCK_N)
            b = batch // n_heads
            h = batch % n_heads
            for c in gl.static_range(CONSUMERS):
                mbarrier.wait(q_free.index(c), (t & 1) ^ 1)  # a fresh barrier's "free" wait passes at once
                mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
                _tma_load(q_desc, [b, h, off_m + c * BLOCK_M, 0], q_ready.index(c), q_bufs.index(c))
            for i in range(n_steps):
                slot = it % STAGES
                phase = (it // STAGES) & 1
                mbarrier.wait(k_free.index(slot), phase ^ 1)
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                _tma_load(k_desc, [b, h // group, i * BLOCK_N, 0], k_ready.index(slot), k_bufs.index(slot))
                mbarrier.wait(v_free.index(slot), phase ^ 1)
                mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                _tma_load(v_desc, [b, h // group, i * BLOCK_N, 0], v_ready.index(slot), v_bufs.index(slot))
                it += 1
            t += 1

    @gluon.jit
    def _gluon_flash_scores(s, rows, cols, start, n_keys, m, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """(new row maxima in base 2, the rescale, fp32 weights). MASKED: hidden keys weigh 0; an unmasked step
        scales the row maxima, not the logits (as ``_flash_forward_tiles``)."""
        if MASKED:
            keys = start + cols
            visible = gl.expand_dims(keys < n_keys, 0)
            if IS_CAUSAL:
                visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1))
            s = gl.where(visible, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m, gl.max(s, axis=1))
        else:
            m_new = gl.maximum(m, gl.max(s, axis=1) * qk_scale)
        # A row whose logits so far are all -inf subtracts 0: exp2(-inf - -inf) would be NaN.
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_sub)
        if MASKED:
            w = gl.exp2(s - gl.expand_dims(m_sub, 1))
        else:
            w = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
        return m_new, alpha, w

    @gluon.jit
    def _gluon_flash_step(i, j, turn_phase, q, k_bufs, v_bufs, k_ready, k_free, v_ready, v_free, my_turn, their_turn,
                          acc, m, l, p, rows, cols, n_keys, qk_scale, s_zero, acc_layout: gl.constexpr,
                          p_layout: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                          PINGPONG: gl.constexpr):
        """Key step i >= 1, the program's j-th: issue S_i = Q K_i^T and O += P_{i-1} V_{i-1}, wait for S_i only
        (MMAs finish in issue order), run S_i's online softmax under P_{i-1} V_{i-1}, then wait and rescale
        O. PINGPONG: the consumers take turns to issue (this one's turn barrier at turn_phase)."""
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
        slot = j % STAGES
        phase = (j // STAGES) & 1
        prev = (j - 1) % STAGES
        prev_phase = ((j - 1) // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        if PINGPONG:
            mbarrier.wait(my_turn, turn_phase)
        s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        acc = warpgroup_mma(p, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(their_turn)
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_free.index(slot))
        m, alpha, w = _gluon_flash_scores(s, rows, cols, i * BLOCK_N, n_keys, m, qk_scale, MASKED, IS_CAUSAL)
        l = l * alpha + gl.sum(w, axis=1)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(v_free.index(prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_layout)), 1)
        p = gl.convert_layout(w.to(p.dtype), p_layout)
        return acc, m, l, p

    @gluon.jit
    def _gluon_flash_consumer(q_bufs, k_bufs, v_bufs, o_bufs, q_ready_all, q_free_all, k_ready, k_free, v_ready, v_free,
                              turns, o_desc, lse_ptr, stride_lb, stride_lm,
                              first, n_work, n_batch, n_heads, n_queries, n_keys, qk_scale,
                              IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr, acc_layout: gl.constexpr,
                              p_layout: gl.constexpr, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
        """Consumer CONSUMER: in each tile, queries from first + CONSUMER * BLOCK_M, every step (masked from
        full_steps); ring slots, phases and turns run on across tiles; O leaves by TMA store under the next tile."""
        q_buf = q_bufs.index(CONSUMER)
        o_buf = o_bufs.index(CONSUMER)
        q_ready = q_ready_all.index(CONSUMER)
        q_free = q_free_all.index(CONSUMER)
        CONSUMERS: gl.constexpr = q_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = q_buf.type.shape[2]
        HEAD_DIM: gl.constexpr = q_buf.type.shape[3]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        dtype: gl.constexpr = q_buf.dtype
        LN2: gl.constexpr = 0.6931471805599453
        rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        my_turn = turns.index(CONSUMER)
        their_turn = turns.index(1 - CONSUMER)
        q = q_buf.reshape([BLOCK_M, HEAD_DIM])
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        if PINGPONG:
            if CONSUMER == 1:  # consumer 0 issues first
                mbarrier.arrive(their_turn)
        it = 0  # the program's key steps so far: ring slot and phase
        turn = 0  # its steps past each tile's first: turn phase
        t = 0  # its tiles so far: Q phase
        for w in range(first, n_work, gl.num_programs(0)):
            batch, off_m, full_steps, n_steps = _gluon_flash_tile(w, n_batch, n_queries, n_keys, IS_CAUSAL,
                                                                  CONSUMERS * BLOCK_M, BLOCK_N)
            off_m = off_m + CONSUMER * BLOCK_M
            rows = off_m + gl.arange(0, BLOCK_M, rows_l)
            # Carried through the loop as a plain tensor: each step waits for its product before rescaling.
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
            mbarrier.wait(q_ready, t & 1)
            # Step 0: its logits alone (nothing to overlap with yet), masked whatever it holds.
            slot = it % STAGES
            mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
            s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_free.index(slot))
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_l)
            m, alpha, w8 = _gluon_flash_scores(s, rows, cols, 0, n_keys, m, qk_scale, True, IS_CAUSAL)
            l = gl.sum(w8, axis=1)
            p = gl.convert_layout(w8.to(dtype), p_layout)
            for i in range(1, full_steps):
                acc, m, l, p = _gluon_flash_step(i, it + i, (turn + i - 1) & 1, q, k_bufs, v_bufs, k_ready, k_free,
                                                 v_ready, v_free, my_turn, their_turn, acc, m, l, p, rows, cols,
                                                 n_keys, qk_scale, s_zero, acc_layout, p_layout, False, IS_CAUSAL,
                                                 PINGPONG)
            for i in range(gl.maximum(full_steps, 1), n_steps):
                acc, m, l, p = _gluon_flash_step(i, it + i, (turn + i - 1) & 1, q, k_bufs, v_bufs, k_ready, k_free,
                                                 v_ready, v_free, my_turn, their_turn, acc, m, l, p, rows, cols,
                                                 n_keys, qk_scale, s_zero, acc_layout, p_layout, True, IS_CAUSAL,
                                                 PINGPONG)
            mbarrier.arrive(q_free)  # every S of the tile is done: the loader may bring the next Q
            last = (it + n_steps - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((it + n_steps - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_free.index(last))
            # A row with no finite logit has l = 0 and acc = 0: output 0 and L = -inf, as SDPA gives.
            safe_l = gl.where(l == 0.0, 1.0, l)
            out = acc / gl.expand_dims(gl.convert_layout(safe_l, gl.SliceLayout(1, acc_layout)), 1)
            tma.store_wait(0)  # the last tile's O has left the buffer
            o_buf.reshape([BLOCK_M, HEAD_DIM]).store(out.to(dtype))
            fence_async_shared()
            # Rows past n_queries are not written.
            _tma_store(o_desc, [batch // n_heads, batch % n_heads, off_m, 0], o_buf)
            lse = (m + gl.log2(l)) * LN2
            gl.store(lse_ptr + batch.to(gl.int64) * stride_lb + rows * stride_lm, lse, mask=rows < n_queries)
            it += n_steps
            turn += n_steps - 1
            t += 1
        tma.store_wait(0)

    @gluon.jit
    def flash_attention_gluon_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, stride_lb, stride_lm, n_batch, n_heads,
                                     group, n_queries, n_keys, qk_scale, IS_CAUSAL: gl.constexpr,
                                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
                                     CONSUMER_REGISTERS: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
        """O and L of CONSUMERS x BLOCK_M-query tiles (``_gluon_flash_tile``); program p takes items p, p + grid..."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
        gl.static_assert(BLOCK_M == 16 * num_warps, "BLOCK_M is one warpgroup MMA's height")
        qk_scale = qk_scale.to(gl.float32)
        # The free barriers count every consumer's release, so all must run the same key steps.
        gl.static_assert(CONSUMERS * BLOCK_M == BLOCK_N, "the consumers' causal ends share a key step")
        n_work = n_batch * gl.cdiv(n_queries, CONSUMERS * BLOCK_M)
        first = gl.program_id(0)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        o_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(c), count=1)
            mbarrier.init(q_free.index(c), count=1)
            mbarrier.init(turns.index(c), count=1)
        for slot in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(slot), count=1)
            mbarrier.init(k_free.index(slot), count=CONSUMERS)  # every consumer reads every slot
            mbarrier.init(v_ready.index(slot), count=1)
            mbarrier.init(v_free.index(slot), count=CONSUMERS)
        gl.static_assert(CONSUMERS == 2, "the default partition and one worker consume")
        gl.warp_specialize([
            (_gluon_flash_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_free, k_ready, k_free, v_ready, v_free,
                                     turns, o_desc, lse_ptr, stride_lb, stride_lm,
                                     first, n_work, n_batch, n_heads, n_queries, n_keys, qk_scale, IS_CAUSAL,
                                     s_layout, acc_layout, p_layout, 0, PINGPONG)),
            (_gluon_flash_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_free, k_ready, k_free, v_ready, v_free,
                                     turns, o_desc, lse_ptr, stride_lb, stride_lm,
                                     first, n_work, n_batch, n_heads, n_queries, n_keys, qk_scale, IS_CAUSAL,
                                     s_layout, acc_layout, p_layout, 1, PINGPONG)),
            (_gluon_flash_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_free,
                                   v_ready, v_free, first, n_work, n_batch, n_heads, group, n_queries, n_keys,
                                   IS_CAUSAL)),
        ], [num_warps, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])

    @gluon.jit
    def _gluon_backward_loader(held_a, held_b, streamed_a, streamed_b, held_a_bufs, held_b_bufs, a_bufs, b_bufs,
                               held_ready, ready, free, batch, n_heads, held_start, stream_start, n_steps):
        """The producer of both backward kernels: each consumer's pair of held tiles once (K and V
        for dK/dV, Q and dO for dQ), then every step's pair of streamed tiles into the ring."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        CONSUMERS: gl.constexpr = held_a_bufs.type.shape[0]
        HELD: gl.constexpr = held_a.block_type.shape[2]
        STEP: gl.constexpr = streamed_a.block_type.shape[2]
        b = batch // n_heads
        h = batch % n_heads
        mbarrier.expect(held_ready, CONSUMERS * (held_a.block_type.nbytes + held_b.block_type.nbytes))
        for c in gl.static_range(CONSUMERS):
            _tma_load(held_a, [b, h, held_start + c * HELD, 0], held_ready, held_a_bufs.index(c))
            _tma_load(held_b, [b, h, held_start + c * HELD, 0], held_ready, held_b_bufs.index(c))
        for it in range(n_steps):
            slot = it % STAGES
            mbarrier.wait(free.index(slot), ((it // STAGES) & 1) ^ 1)  # a fresh barrier's "free" wait passes at once
            mbarrier.expect(ready.index(slot), streamed_a.block_type.nbytes + streamed_b.block_type.nbytes)
            _tma_load(streamed_a, [b, h, stream_start + it * STEP, 0], ready.index(slot), a_bufs.index(slot))
            _tma_load(streamed_b, [b, h, stream_start + it * STEP, 0], ready.index(slot), b_bufs.index(slot))

    @gluon.jit
    def _gluon_backward_ring(held_a, held_b, streamed_a, streamed_b, CONSUMERS: gl.constexpr, STAGES: gl.constexpr):
        """Both backward kernels' shared memory: each consumer's held pair, STAGES slots of the streamed pair, and
        the barriers (held, then each slot's ready and free; free counts every consumer's release)."""
        dtype: gl.constexpr = held_a.dtype
        held_a_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + held_a.block_type.shape, held_a.layout)
        held_b_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + held_b.block_type.shape, held_b.layout)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + streamed_a.block_type.shape, streamed_a.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + streamed_b.block_type.shape, streamed_b.layout)
        held_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(held_ready, count=1)
        for slot in gl.static_range(STAGES):
            mbarrier.init(ready.index(slot), count=1)
            mbarrier.init(free.index(slot), count=CONSUMERS)  # every consumer reads every slot
        return held_a_bufs, held_b_bufs, a_bufs, b_bufs, held_ready, ready, free

    @gluon.jit
    def _gluon_dkdv_visible(keys, cols, n_queries, IS_CAUSAL: gl.constexpr):
        """Which (key, query) pairs of a step count: the query exists and, causal, sees the key."""
        visible = gl.expand_dims(cols < n_queries, 0)
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(keys, 1) <= gl.expand_dims(cols, 0))
        return visible

    @gluon.jit
    def _gluon_dkdv_step(it, k, v, q_bufs, do_bufs, ready, free, dk, dv, keys, lse_row, delta_row, stride_lm,
                         stride_dm, query_start, n_queries, qk_scale, s_zero, s_layout: gl.constexpr,
                         p_layout: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """Step ``it``: dV += P^T dO and dK += dS^T Q for this consumer's keys and one query tile.
        MASKED: queries past the end, or (causal) before a key, weigh 0 in P^T and dS^T (a
        padding query's zeros against an infinite key would make NaN)."""
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
        slot = it % STAGES
        start = query_start + it * BLOCK_M
        cols = start + gl.arange(0, BLOCK_M, gl.SliceLayout(0, s_layout))
        col_ok = cols < n_queries
        # L in base 2, +inf for queries with no finite logit or past the end: P^T = exp2(S^T - L) is 0 there.
        lse = gl.load(lse_row + cols * stride_lm, mask=col_ok, other=float("inf")) * 1.4426950408889634
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
        delta = gl.load(delta_row + cols * stride_dm, mask=col_ok, other=0.0)
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        s_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse, 0))
        if MASKED:
            p_t = gl.where(_gluon_dkdv_visible(keys, cols, n_queries, IS_CAUSAL), p_t, 0.0)
        p16 = gl.convert_layout(p_t.to(q.dtype), p_layout)
        dv = warpgroup_mma(p16, do, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        if MASKED:
            ds_t = gl.where(_gluon_dkdv_visible(keys, cols, n_queries, IS_CAUSAL), ds_t, 0.0)
        ds16 = gl.convert_layout(ds_t.to(q.dtype), p_layout)
        dk = warpgroup_mma(ds16, q, dk, is_async=True)
        dv, dk, p16, ds16 = warpgroup_mma_wait(0, deps=(dv, dk, p16, ds16))
        mbarrier.arrive(free.index(slot))
        return dk, dv

    @gluon.jit
    def _gluon_dkdv_consumer(k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, ready, free, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                             stride_lb, stride_lm, stride_db, stride_dm, stride_dkb, stride_dkh, stride_dkn,
                             stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, batch, n_heads, key_start,
                             query_start, n_steps, n_diagonal, n_whole, n_queries, n_keys, sm_scale, qk_scale,
                             IS_CAUSAL: gl.constexpr,
                             s_layout: gl.constexpr, acc_layout: gl.constexpr, p_layout: gl.constexpr,
                             CONSUMER: gl.constexpr):
        """Consumer warpgroup CONSUMER: dK and dV of keys key_start + CONSUMER * BLOCK on, over every
        query step: the first n_diagonal steps (causal) and those past n_whole (a ragged last
        query tile) masked, the rest not."""
        BLOCK: gl.constexpr = k_bufs.type.shape[3]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
        BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
        first_key = key_start + CONSUMER * BLOCK
        k = k_bufs.index(CONSUMER).reshape([BLOCK, HEAD_DIM])
        v = v_bufs.index(CONSUMER).reshape([BLOCK, HEAD_DIM])
        keys = first_key + gl.arange(0, BLOCK, gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([BLOCK, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, acc_layout)
        lse_row = lse_ptr + batch.to(gl.int64) * stride_lb
        delta_row = delta_ptr + batch.to(gl.int64) * stride_db
        mbarrier.wait(kv_ready, 0)
        for it in range(0, n_diagonal):
            dk, dv = _gluon_dkdv_step(it, k, v, q_bufs, do_bufs, ready, free, dk, dv, keys, lse_row, delta_row,
                                      stride_lm, stride_dm, query_start, n_queries, qk_scale, s_zero, s_layout,
                                      p_layout, True, IS_CAUSAL)
        for it in range(n_diagonal, gl.maximum(n_diagonal, n_whole)):
            dk, dv = _gluon_dkdv_step(it, k, v, q_bufs, do_bufs, ready, free, dk, dv, keys, lse_row, delta_row,
                                      stride_lm, stride_dm, query_start, n_queries, qk_scale, s_zero, s_layout,
                                      p_layout, False, IS_CAUSAL)
        for it in range(gl.maximum(n_diagonal, n_whole), n_steps):
            dk, dv = _gluon_dkdv_step(it, k, v, q_bufs, do_bufs, ready, free, dk, dv, keys, lse_row, delta_row,
                                      stride_lm, stride_dm, query_start, n_queries, qk_scale, s_zero, s_layout,
                                      p_layout, True, IS_CAUSAL)
        # S = scale * Q K^T, so dK picks up the scale; the logits' log2(e) lives only inside exp2.
        dk = dk * sm_scale
        rows = first_key + gl.arange(0, BLOCK, gl.SliceLayout(1, acc_layout))
        dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
        row_ok = gl.expand_dims(rows < n_keys, 1)
        offsets = gl.expand_dims(rows.to(gl.int64), 1)
        b = batch.to(gl.int64) // n_heads
        h = batch.to(gl.int64) % n_heads
        gl.store(dk_ptr + b * stride_dkb + h * stride_dkh + offsets * stride_dkn + gl.expand_dims(dims, 0) * stride_dkd,
                 dk.to(dk_ptr.dtype.element_ty), mask=row_ok)
        gl.store(dv_ptr + b * stride_dvb + h * stride_dvh + offsets * stride_dvn + gl.expand_dims(dims, 0) * stride_dvd,
                 dv.to(dv_ptr.dtype.element_ty), mask=row_ok)

    @gluon.jit
    def flash_attention_backward_dkdv_gluon_kernel(
            q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
            stride_lb, stride_lm, stride_db, stride_dm, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
            stride_dvb, stride_dvh, stride_dvn, stride_dvd, n_batch, n_heads, n_queries, n_keys, sm_scale, qk_scale,
            IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
            CONSUMER_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        """dK and dV of CONSUMERS x BLOCK keys a program (D already in delta); causal: the first key tiles first."""
        BLOCK: gl.constexpr = k_desc.block_type.shape[2]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
        gl.static_assert(BLOCK == 16 * num_warps, "a consumer's keys are one warpgroup MMA's height")
        gl.static_assert(CONSUMERS == 2, "the default partition and one worker consume")
        sm_scale = sm_scale.to(gl.float32)
        qk_scale = qk_scale.to(gl.float32)
        n_tiles = gl.cdiv(n_keys, CONSUMERS * BLOCK)
        w = gl.program_id(0)
        if IS_CAUSAL:
            batch = w % n_batch
            tile = w // n_batch
        else:
            batch = w // n_tiles
            tile = w % n_tiles
        key_start = tile * (CONSUMERS * BLOCK)
        # Causal: queries before key_start see none of these keys; the first CONSUMERS x BLOCK /
        # BLOCK_M steps hold the diagonal. Query steps are whole up to n_whole, then ragged.
        query_start = key_start if IS_CAUSAL else 0
        first_step = query_start // BLOCK_M
        n_steps = gl.maximum(gl.cdiv(n_queries, BLOCK_M) - first_step, 0)
        n_whole = gl.maximum(n_queries // BLOCK_M - first_step, 0)
        if IS_CAUSAL:
            n_diagonal = gl.minimum(n_steps, (CONSUMERS * BLOCK) // BLOCK_M)
        else:
            n_diagonal = n_steps * 0
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, ready, free = _gluon_backward_ring(k_desc, v_desc, q_desc, do_desc,
                                                                                      CONSUMERS, STAGES)
        gl.warp_specialize([
            (_gluon_dkdv_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, ready, free, lse_ptr, delta_ptr, dk_ptr,
                                    dv_ptr, stride_lb, stride_lm, stride_db, stride_dm, stride_dkb, stride_dkh,
                                    stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, batch,
                                    n_heads, key_start, query_start,
                                    n_steps, n_diagonal, n_whole, n_queries, n_keys, sm_scale, qk_scale, IS_CAUSAL,
                                    s_layout, acc_layout, p_layout, 0)),
            (_gluon_dkdv_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, ready, free, lse_ptr, delta_ptr, dk_ptr,
                                    dv_ptr, stride_lb, stride_lm, stride_db, stride_dm, stride_dkb, stride_dkh,
                                    stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, batch,
                                    n_heads, key_start, query_start,
                                    n_steps, n_diagonal, n_whole, n_queries, n_keys, sm_scale, qk_scale, IS_CAUSAL,
                                    s_layout, acc_layout, p_layout, 1)),
            (_gluon_backward_loader, (k_desc, v_desc, q_desc, do_desc, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, ready,
                                      free, batch, n_heads, key_start, query_start, n_steps)),
        ], [num_warps, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])

    @gluon.jit
    def _gluon_dq_visible(rows, keys, n_keys, IS_CAUSAL: gl.constexpr):
        """Which (query, key) pairs of a step count: the key exists and, causal, the query sees it."""
        visible = gl.expand_dims(keys < n_keys, 0)
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1))
        return visible

    @gluon.jit
    def _gluon_dq_step(it, q, do, k_bufs, v_bufs, ready, free, dq, rows, cols, lse, delta, n_keys, qk_scale, s_zero,
                       p_layout: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """Step ``it``: dQ += dS K for this consumer's queries and one key tile. MASKED: keys past
        the end, or (causal) after a query, weigh 0 in dS (a padding key's exp may be inf)."""
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        k = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * (dp - gl.expand_dims(delta, 1))
        if MASKED:
            ds = gl.where(_gluon_dq_visible(rows, it * BLOCK_N + cols, n_keys, IS_CAUSAL), ds, 0.0)
        ds16 = gl.convert_layout(ds.to(q.dtype), p_layout)
        dq = warpgroup_mma(ds16, k, dq, is_async=True)
        dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))
        mbarrier.arrive(free.index(slot))
        return dq

    @gluon.jit
    def _gluon_dq_consumer(q_bufs, do_bufs, k_bufs, v_bufs, qd_ready, ready, free, lse_ptr, delta_ptr, dq_ptr, o_ptr,
                           stride_lb, stride_lm, stride_db, stride_dm, stride_dqb, stride_dqh, stride_dqm,
                           stride_dqd, stride_ob, stride_oh, stride_om, stride_od, batch, n_heads, off_m, full_steps,
                           n_steps, n_queries, n_keys, sm_scale, qk_scale, IS_CAUSAL: gl.constexpr,
                           s_layout: gl.constexpr, acc_layout: gl.constexpr, p_layout: gl.constexpr,
                           CONSUMER: gl.constexpr):
        """Consumer warpgroup CONSUMER: D and dQ of queries off_m + CONSUMER * BLOCK_M on, over every
        key step; steps from full_steps on (the causal diagonal, a ragged last key tile) masked."""
        BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.type.shape[4]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
        # O and dO rows for D: 8 contiguous elements a thread (one 16-byte load).
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        first = off_m + CONSUMER * BLOCK_M
        b = batch.to(gl.int64)
        o_ptr += (b // n_heads) * stride_ob + (b % n_heads) * stride_oh
        dq_ptr += (b // n_heads) * stride_dqb + (b % n_heads) * stride_dqh
        q = q_bufs.index(CONSUMER).reshape([BLOCK_M, HEAD_DIM])
        do = do_bufs.index(CONSUMER).reshape([BLOCK_M, HEAD_DIM])
        io_rows = first + gl.arange(0, BLOCK_M, gl.SliceLayout(1, io_layout))
        io_ok = io_rows < n_queries
        io_dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, io_layout))
        o = gl.load(o_ptr + gl.expand_dims(io_rows.to(gl.int64), 1) * stride_om
                    + gl.expand_dims(io_dims, 0) * stride_od, mask=gl.expand_dims(io_ok, 1), other=0.0)
        rows = first + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        row_ok = rows < n_queries
        # L in base 2, +inf for queries with no finite logit or past the end: P = exp2(S - L) is 0 there.
        lse = gl.load(lse_ptr + b * stride_lb + rows * stride_lm, mask=row_ok, other=float("inf")) * 1.4426950408889634
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
        mbarrier.wait(qd_ready, 0)
        # D = rowsum(dO * O) from the dO tile TMA brought (its rows past the end are zeros).
        delta = gl.sum(o.to(gl.float32) * do.load(io_layout).to(gl.float32), axis=1)
        gl.store(delta_ptr + b * stride_db + io_rows * stride_dm, delta, mask=io_ok)
        delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        for it in range(0, full_steps):
            dq = _gluon_dq_step(it, q, do, k_bufs, v_bufs, ready, free, dq, rows, cols, lse, delta, n_keys, qk_scale,
                                s_zero, p_layout, False, IS_CAUSAL)
        for it in range(full_steps, n_steps):
            dq = _gluon_dq_step(it, q, do, k_bufs, v_bufs, ready, free, dq, rows, cols, lse, delta, n_keys, qk_scale,
                                s_zero, p_layout, True, IS_CAUSAL)
        # S = scale * Q K^T, so dQ picks up the scale; the logits' log2(e) lives only inside exp2.
        dq = dq * sm_scale
        out_rows = first + gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
        dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
        gl.store(dq_ptr + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_dqm
                 + gl.expand_dims(dims, 0) * stride_dqd, dq.to(dq_ptr.dtype.element_ty),
                 mask=gl.expand_dims(out_rows < n_queries, 1))

    @gluon.jit
    def flash_attention_backward_dq_gluon_kernel(
            q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dq_ptr, o_ptr,
            stride_lb, stride_lm, stride_db, stride_dm, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            stride_ob, stride_oh, stride_om, stride_od, n_batch, n_heads, n_queries, n_keys, sm_scale, qk_scale,
            IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr,
            CONSUMER_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        """D and dQ of CONSUMERS x BLOCK_M queries a program, from every key they see (the tiles of
        ``_gluon_flash_tile``: causal, the last query tiles of every batch element first)."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(num_warps == 4, "each consumer is one warpgroup")
        gl.static_assert(BLOCK_M == 16 * num_warps, "a consumer's queries are one warpgroup MMA's height")
        gl.static_assert(CONSUMERS == 2, "the default partition and one worker consume")
        # Both consumers run every step of the tile (the free barriers count both): with key tiles
        # narrower than the tile's queries, the first consumer's last causal step is all masked.
        gl.static_assert((CONSUMERS * BLOCK_M) % BLOCK_N == 0, "a tile's queries span whole key steps")
        sm_scale = sm_scale.to(gl.float32)
        qk_scale = qk_scale.to(gl.float32)
        batch, off_m, full_steps, n_steps = _gluon_flash_tile(gl.program_id(0), n_batch, n_queries, n_keys, IS_CAUSAL,
                                                              CONSUMERS * BLOCK_M, BLOCK_N)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        q_bufs, do_bufs, k_bufs, v_bufs, qd_ready, ready, free = _gluon_backward_ring(q_desc, do_desc, k_desc, v_desc,
                                                                                      CONSUMERS, STAGES)
        gl.warp_specialize([
            (_gluon_dq_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, qd_ready, ready, free, lse_ptr, delta_ptr, dq_ptr,
                                  o_ptr, stride_lb, stride_lm, stride_db, stride_dm, stride_dqb, stride_dqh,
                                  stride_dqm, stride_dqd, stride_ob, stride_oh, stride_om, stride_od, batch, n_heads,
                                  off_m, full_steps, n_steps,
                                  n_queries, n_keys, sm_scale, qk_scale, IS_CAUSAL, s_layout, acc_layout, p_layout,
                                  0)),
            (_gluon_dq_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, qd_ready, ready, free, lse_ptr, delta_ptr, dq_ptr,
                                  o_ptr, stride_lb, stride_lm, stride_db, stride_dm, stride_dqb, stride_dqh,
                                  stride_dqm, stride_dqd, stride_ob, stride_oh, stride_om, stride_od, batch, n_heads,
                                  off_m, full_steps, n_steps,
                                  n_queries, n_keys, sm_scale, qk_scale, IS_CAUSAL, s_layout, acc_layout, p_layout,
                                  1)),
            (_gluon_backward_loader, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, qd_ready,
                                      ready, free, batch, n_heads, off_m, 0, n_steps)),
        ], [num_warps, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def gluon_softmax_v_operand(V: torch.Tensor, parts: int, keep=None) -> torch.Tensor:
    """float32 V (batch, d2, d3) as its ``parts`` TF32 parts, (batch, parts, d3, d2), rows on 16 bytes (padding
    never read); ``keep`` receives the launch (a ``Replay`` of (V, operand))."""
    batch, d2, d3 = V.shape
    out = _gluon_v_operand_buffer(V.shape, parts, V.device)
    block = 64
    grid = (cdiv(d2, block) * cdiv(d3, block), batch)
    launch_and_keep(jit_kernel(tf32_transposed_parts_kernel, traced=False), grid,
                    (V, out, d2, d3, *V.stride(), *out.stride()[:3]), dict(PARTS=parts, BLOCK_2=block, BLOCK_3=block),
                    keep, 2)
    return out


def _gluon_v_operand_buffer(shape: tuple, parts: int, device: torch.device) -> torch.Tensor:
    """An empty operand of ``gluon_softmax_v_operand`` for V of ``shape``."""
    batch, d2, d3 = shape
    return _empty_rows_on_16_bytes((batch, parts, d3, d2), torch.float32, device)


@on_input_device
def fused_softmax_gluon(x: torch.Tensor, V: torch.Tensor, *, launch: GluonSoftmaxLaunch | None = None) -> torch.Tensor:
    """softmax(x, dim=-1) @ V by the warp-specialised Hopper kernel; what ``fused_softmax`` computes.

    x: (batch, d1, d2), V: (batch, d2, d3), float16, bfloat16 or float32 -> (batch, d1, d3) in
    x's dtype, accumulated in float32; float32 products follow torch's float32 matmul setting
    (TF32 under 'high' and 'medium', tf32x3 under 'highest'), with V first copied into its TF32
    parts, d3 by d2 (``gluon_softmax_v_operand``: an allocation the size of V, or twice that under
    'highest'). Only where ``gluon_softmax_unsupported(x, V)`` is None; otherwise a ValueError
    says why. ``launch`` overrides ``gluon_softmax_launch``'s tiles, for tuning. Forward only:
    an input that requires grad is refused (``fused_softmax`` has the backward).
    """
    check_softmax_matmul_inputs(x, V)
    if torch.is_grad_enabled() and (x.requires_grad or V.requires_grad):
        raise RuntimeError("fused_softmax_gluon has no backward, and x or V requires grad: call fused_softmax, "
                           "or call this under torch.no_grad()")
    if transformed(x, V):
        raise RuntimeError("fused_softmax_gluon has no derivative, and x or V carries a tangent (a dual tensor) "
                           "or is a torch.func transform's tensor: call fused_softmax")
    reason = gluon_softmax_unsupported(x, V)
    if reason is not None:
        raise ValueError(f"fused_softmax_gluon cannot take these inputs: {reason}")
    if launch is not None:
        if not isinstance(launch, GluonSoftmaxLaunch):
            raise TypeError(f"launch must be a GluonSoftmaxLaunch, got {type(launch).__name__}")
        launch.check(x.dtype)
    out = _fused_output(x, V)
    _gluon_fused_forward(x, V, out, None, launch)
    return out


def _gluon_fused_forward(x: torch.Tensor, V: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                         launch: GluonSoftmaxLaunch | None = None, keep=None) -> None:
    """``fused_softmax_gluon`` past its checks, into out and lse if given; ``keep`` receives a DescriptorReplay
    of (x, V, out, lse or out) (float32: a ReplayChain, V's parts first)."""
    batch, d1, d2 = x.shape
    d3 = V.shape[2]
    launch = launch or gluon_softmax_launch(d2, d3, x.dtype)
    x_block = [1, GLUON_SOFTMAX_ROWS, launch.block_n]
    parts = _gluon_v_parts(x.dtype)
    kept = []
    if x.dtype == torch.float32:
        # TF32 products take V K-major from shared memory: its parts first, d3 by d2.
        operand = gluon_softmax_v_operand(V, parts, None if keep is None else kept.append)
        descs = _gluon_descriptors(gl.float32, (x, x_block), (operand, [1, 1, launch.block_d3, launch.block_n]))
    else:
        gl_dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
        descs = _gluon_descriptors(gl_dtype, (x, x_block), (V, [1, launch.block_n, launch.block_d3]))
    n_tiles_d3 = cdiv(d3, launch.block_d3)
    grid = (cdiv(d1, GLUON_SOFTMAX_ROWS) * n_tiles_d3, batch)
    kernel = jit_kernel(fused_softmax_gluon_kernel, traced=False)
    lse_strides = (0, 0) if lse is None else lse.stride()
    args = (*descs, out, out if lse is None else lse, *out.stride(), *lse_strides, d1, d2, d3, n_tiles_d3)
    options = dict(STAGES=launch.stages, CONSUMERS=GLUON_SOFTMAX_CONSUMERS, LOADER_REGISTERS=GLUON_SOFTMAX_LOADER_REGISTERS,
                   CONSUMER_REGISTERS=GLUON_SOFTMAX_CONSUMER_REGISTERS, PINGPONG=launch.pingpong, LAZY=launch.lazy_rescale,
                   STORE_LSE=lse is not None, PARTS=parts, P_SMEM=launch.p_smem, num_warps=GLUON_BLOCK_M // 16)
    replay = launch_kept(kernel, grid, args, options, 4, tuple(descs), keep is not None)
    if replay is None:
        return
    if x.dtype != torch.float32:
        keep(replay)
    elif kept:  # float32: V's parts into a fresh operand, then the kernel, over (x, V, out, lse, operand)
        shape, device = tuple(V.shape), V.device
        keep(ReplayChain((lambda x, V, out, lse: _gluon_v_operand_buffer(shape, parts, device),),
                         ((kept[0], (1, 4)), (replay, (0, 4, 2, 3)))))


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block: tuple, gl_dtype):
    """The shared-memory layout of a TMA tile of this block and dtype, built once (some us a call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _gluon_descriptors(gl_dtype, *tiles) -> list:
    """Host TMA descriptors of (tensor, block) pairs, each in the shared layout its block's tile takes."""
    return [GluonTensorDescriptor(t, list(t.shape), list(t.stride()), block, _nvmma_layout(tuple(block), gl_dtype))
            for t, block in tiles]


@on_input_device
def flash_attention_gluon(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False, *,
                          stages: int = GLUON_FLASH_STAGES, pingpong: bool = GLUON_FLASH_PINGPONG,
                          persistent: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L): FlashAttentionTriton's forward by the warp-specialised Hopper kernel.

    Q: (batch, n_queries, d), K and V: (batch, n_keys, d) (or (batch, heads, n, d) each), float16
    or bfloat16, d 64 or 128 -> O in Q's dtype and L = logsumexp of each query's scaled logits,
    Q's shape but d, float32.
    ValueError where ``gluon_flash_unsupported`` says why not. Forward only: inputs that require
    grad or carry a tangent are refused. ``stages``: K and V ring slots (3 fit at d = 64 only);
    ``pingpong``: the consumers take turns to issue their products; ``persistent``: one program
    an SM over the tiles, or one tile a program (None: ``gluon_flash_persistent``'s choice).
    """
    is_causal = check_attention_inputs(Q, K, V, is_causal)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (Q, K, V)):
        raise RuntimeError("flash_attention_gluon has no backward, and Q, K or V requires grad: call "
                           "FlashAttentionTriton.apply, or call this under torch.no_grad()")
    if transformed(Q, K, V):
        raise RuntimeError("flash_attention_gluon has no derivative, and Q, K or V carries a tangent (a dual "
                           "tensor) or is a torch.func transform's tensor: the launch would drop it")
    reason = gluon_flash_unsupported(Q, K, V)
    if reason is not None:
        raise ValueError(f"flash_attention_gluon cannot take these inputs: {reason}")
    check_int("stages", stages, 2, 4)
    check_flag("pingpong", pingpong)
    if persistent is not None:
        check_flag("persistent", persistent)
    O, L = flash_forward_outputs(Q)
    _gluon_flash_forward(Q, K, V, is_causal, O, L, stages, pingpong, persistent=persistent)
    return O, L


def _flash_descriptors(gl_dtype, *tiles) -> list:
    """``_gluon_descriptors`` of (tensor, rows) pairs as (batch, heads, n, d) tensors, tiles of one
    head's rows x d (a (batch, n, d) tensor as one head)."""
    shaped = []
    for t, rows in tiles:
        batch_heads, heads, n, d = flash_dims(t)
        strides = flash_strides(t)
        shaped.append(GluonTensorDescriptor(t, [batch_heads // heads, heads, n, d],
                                            [strides[0], strides[1] or strides[0], *strides[2:]], [1, 1, rows, d],
                                            _nvmma_layout((1, 1, rows, d), gl_dtype)))
    return shaped


def _gluon_setup(Q: torch.Tensor, ring_bytes: int, what: str) -> tuple:
    """(gl dtype, launch constexprs shared by the three kernels) after checking that ``what``
    (``ring_bytes`` of tiles) fits a block's shared memory (KernelCapacityError if not)."""
    if ring_bytes > _SHARED_MEMORY_BUDGET:
        raise KernelCapacityError(f"{what} need {ring_bytes // 1024} KiB of shared memory, more than "
                                  f"{_SHARED_MEMORY_BUDGET // 1024} KiB")
    options = dict(CONSUMERS=GLUON_FLASH_CONSUMERS, LOADER_REGISTERS=GLUON_LOADER_REGISTERS,
                   num_warps=GLUON_BLOCK_M // 16)
    return gl.bfloat16 if Q.dtype == torch.bfloat16 else gl.float16, options


def _gluon_flash_forward(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool, O: torch.Tensor,
                         L: torch.Tensor, stages: int = GLUON_FLASH_STAGES, pingpong: bool = GLUON_FLASH_PINGPONG,
                         kept: list | None = None, persistent: bool | None = None,
                         programs: int | None = None, scale: float | None = None) -> None:
    """``flash_attention_gluon`` past its checks, into O and L; kept (``_launch_flash``) as a
    DescriptorReplay of (Q, K, V, O, L). ``programs`` caps a persistent grid (tests). K and V may have
    fewer heads, each serving a group of Q's (``flash_attention``'s GQA); ``scale``: None is d^-0.5."""
    batch, heads, n_queries, d = flash_dims(Q)
    n_keys = K.shape[-2]
    ring = (stages * 2 * GLUON_FLASH_BLOCK_N + 2 * GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M) * d * Q.element_size()
    gl_dtype, options = _gluon_setup(Q, ring, f"{stages} slots of K and V tiles ({GLUON_FLASH_BLOCK_N} x {d}) and "
                                              f"{GLUON_FLASH_CONSUMERS} Q and O tiles")
    descs = _flash_descriptors(gl_dtype, (Q, GLUON_BLOCK_M), (K, GLUON_FLASH_BLOCK_N), (V, GLUON_FLASH_BLOCK_N),
                               (O, GLUON_BLOCK_M))
    n_work = batch * cdiv(n_queries, GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M)
    if persistent is None:
        persistent = gluon_flash_persistent(n_keys, is_causal)
    grid = (min(n_work, programs or _sm_count(Q.device)) if persistent else n_work,)
    scale = d ** -0.5 if scale is None else scale
    args = (*descs, L, L.stride(-2), L.stride(-1), batch, heads, heads // flash_dims(K)[1], n_queries, n_keys,
            scale * LOG2_E.value)
    options.update(IS_CAUSAL=is_causal, STAGES=stages, CONSUMER_REGISTERS=GLUON_FLASH_CONSUMER_REGISTERS,
                   PINGPONG=pingpong)
    _launch_flash(jit_kernel(flash_attention_gluon_kernel, traced=False), grid, args, options, 5, kept, tuple(descs))


def _gluon_flash_dkdv(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, dO: torch.Tensor, L: torch.Tensor,
                      delta: torch.Tensor, dK: torch.Tensor, dV: torch.Tensor, is_causal: bool,
                      stages: int = GLUON_DKDV_STAGES, kept: list | None = None) -> None:
    """dK and dV by the Hopper kernel from L and the dQ kernel's delta; kept as a DescriptorReplay
    of (Q, K, V, dO, L, delta, dK, dV)."""
    batch, heads, n_queries, d = flash_dims(Q)
    n_keys = K.shape[-2]
    ring = (2 * GLUON_FLASH_CONSUMERS + 2 * stages) * GLUON_BLOCK_M * d * Q.element_size()
    gl_dtype, options = _gluon_setup(Q, ring, f"{stages} slots of Q and dO tiles and {GLUON_FLASH_CONSUMERS} K and "
                                              f"V tiles ({GLUON_BLOCK_M} x {d})")
    descs = _flash_descriptors(gl_dtype, *((t, GLUON_BLOCK_M) for t in (Q, K, V, dO)))
    grid = (batch * cdiv(n_keys, GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M),)
    args = (*descs, L, delta, dK, dV, L.stride(-2), L.stride(-1), *delta.stride(), *flash_strides(dK),
            *flash_strides(dV), batch, heads, n_queries, n_keys, d ** -0.5, d ** -0.5 * LOG2_E.value)
    options.update(IS_CAUSAL=is_causal, STAGES=stages, CONSUMER_REGISTERS=GLUON_DKDV_CONSUMER_REGISTERS)
    _launch_flash(jit_kernel(flash_attention_backward_dkdv_gluon_kernel, traced=False), grid, args, options, 8, kept,
                  tuple(descs))


def _gluon_flash_dq(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, O: torch.Tensor, dO: torch.Tensor,
                    L: torch.Tensor, delta: torch.Tensor, dQ: torch.Tensor, is_causal: bool,
                    stages: int = GLUON_DQ_STAGES, block_n: int | None = None, kept: list | None = None) -> None:
    """D into delta and dQ by the Hopper kernel from O and L; ``block_n``: keys a step (None:
    ``gluon_dq_block_n``'s). Kept as a DescriptorReplay of (Q, K, V, dO, L, delta, dQ, O)."""
    batch, heads, n_queries, d = flash_dims(Q)
    n_keys = K.shape[-2]
    block_n = block_n or gluon_dq_block_n(d, n_keys)
    ring = (2 * GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M + 2 * stages * block_n) * d * Q.element_size()
    gl_dtype, options = _gluon_setup(Q, ring, f"{GLUON_FLASH_CONSUMERS} Q and dO tiles and {stages} slots of K and "
                                              f"V tiles ({block_n} x {d})")
    descs = _flash_descriptors(gl_dtype, (Q, GLUON_BLOCK_M), (K, block_n), (V, block_n), (dO, GLUON_BLOCK_M))
    grid = (batch * cdiv(n_queries, GLUON_FLASH_CONSUMERS * GLUON_BLOCK_M),)
    args = (*descs, L, delta, dQ, O, L.stride(-2), L.stride(-1), *delta.stride(), *flash_strides(dQ),
            *flash_strides(O), batch, heads, n_queries, n_keys, d ** -0.5, d ** -0.5 * LOG2_E.value)
    options.update(IS_CAUSAL=is_causal, STAGES=stages, CONSUMER_REGISTERS=GLUON_DQ_CONSUMER_REGISTERS)
    _launch_flash(jit_kernel(flash_attention_backward_dq_gluon_kernel, traced=False), grid, args, options, 8, kept,
                  tuple(descs))
