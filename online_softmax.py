"""Softmax over the last dimension, in Triton, beside the PyTorch code it must agree with.

Softmax is memory bound: it does a handful of flops per element, so its speed is the number of
bytes it moves over the device's copy bandwidth. The step-by-step PyTorch version below moves
about four times the minimum (it re-reads its intermediates); the Triton kernels read the input
once and write the output once whenever a row fits on chip.

Three Triton kernels, each for a different question:

* ``online_softmax`` (``online_softmax_kernel``): the streaming algorithm. One pass over a row
  keeps a running maximum and a running sum rescaled whenever the maximum grows; a second pass
  writes ``exp(x - max) / sum``. It works for rows of any length with fixed-size tiles of
  ``BLOCK_1`` rows by ``BLOCK_2`` columns. Its backward (``OnlineSoftmax``) is a Triton kernel too.
* ``row_softmax`` (``softmax_row_kernel``): one pass for rows that fit in one program's registers,
  persistent over rows. This is the one to set against ``torch.softmax``.
* ``softmax_split_row_kernel``: rows too long for one program are split over several programs
  that are all resident at once; they swap their partial (max, sum) through a small workspace, so
  the input is still read only once. ``row_softmax`` picks it for long rows on a GPU.

All kernels compute in float32 whatever the input dtype and write the input dtype. A row whose
entries are all ``-inf`` gives NaN, as ``torch.softmax`` does.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is the mode of this module.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Input checks shared by every wrapper (fused_softmax_matmul.py uses them too)
# ----------------------------------------------------------------------------------------------
class KernelCapacityError(ValueError):
    """A valid input this kernel cannot hold on this device (a size past what fits on chip)."""


def check_tensor(name: str, t, ndim: int | tuple[int, ...]) -> None:
    """Raise TypeError/ValueError, naming ``name``, unless ``t`` is a usable kernel input."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in ranks:
        raise ValueError(f"{name} must have {' or '.join(map(str, ranks))} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if INTERPRET:
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, but Triton runs in interpreter mode (TRITON_INTERPRET=1): pass CPU tensors")
    elif t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}, but compiled Triton kernels need a CUDA tensor")


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Both tensors must share dtype and device (the kernels do no implicit promotion)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_b} has dtype {b.dtype} but {name_a} has {a.dtype}: they must match")
    if a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}: they must be on one device")


def check_block(name: str, value, minimum: int, maximum: int = 1024) -> None:
    """A tile size must be a power of two in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or value > maximum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two between {minimum} and {maximum}, got {value}")


# ----------------------------------------------------------------------------------------------
# Custom ops: how every public op reaches torch.compile, CUDA graphs and autograd
# ----------------------------------------------------------------------------------------------
OP_NAMESPACE = "softmax_kernels"


def kernel_op(name: str, fake, mutates_args=()):
    """Decorator: the launch function becomes the torch custom op ``softmax_kernels::name``.

    Compiled, it is a ``torch.library.triton_op``: torch.compile traces through it to the Triton
    launches (written ``wrap_triton(kernel)[grid](...)``) and can capture them in a CUDA graph. In
    the interpreter it is an opaque ``torch.library.custom_op``: triton_op traces its body with
    fake tensors, which an interpreted kernel cannot take. ``fake`` (the op's signature, returning
    empty outputs of the right shapes, dtypes and devices) is its meta implementation either way.
    Autograd is registered on the returned op (``op.register_autograd``) by the caller.
    """
    def register(fn):
        make = torch.library.custom_op if INTERPRET else torch.library.triton_op
        op = make(f"{OP_NAMESPACE}::{name}", mutates_args=mutates_args)(fn)
        op.register_fake(fake)
        return op
    return register


def needs_op(*tensors) -> bool:
    """Whether a call must go through its custom op rather than launch its kernels directly.

    Under torch.compile the op is what the compiler sees; with autograd recording, the op carries
    the registered backward. A plain eager call skips torch's dispatcher, whose cost per call is
    of the order of a kernel launch itself, so small softmaxes stay as cheap to call as torch's.
    """
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------
def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """What every kernel here must equal: ``torch.softmax`` over the last dimension."""
    return torch.softmax(x, dim=-1)


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax in five PyTorch steps; each launches its own kernel and goes through memory.

    For x of M rows and N columns, counted in elements (see ``naive_softmax_bytes``):
    """
    x_max = x.max(dim=-1, keepdim=True).values  # read MN, write M
    z = x - x_max  # read MN + M, write MN
    numerator = torch.exp(z)  # read MN, write MN
    denominator = numerator.sum(dim=-1, keepdim=True)  # read MN, write M
    return numerator / denominator  # read MN + M, write MN


def naive_softmax_bytes(M: int, N: int, element_size: int) -> int:
    """Bytes ``naive_softmax`` moves: reads 5MN + 2M, writes 3MN + 2M elements.

    (The course notes count 5MN + M reads; the division re-reads the M sums, hence 2M here.)
    """
    return (5 * M * N + 2 * M + 3 * M * N + 2 * M) * element_size


def softmax_bytes(M: int, N: int, element_size: int) -> int:
    """The least any softmax can move: read the input once, write the output once."""
    return 2 * M * N * element_size


# ----------------------------------------------------------------------------------------------
# Online softmax: BLOCK_1 rows x BLOCK_2 columns per step, any row length
# ----------------------------------------------------------------------------------------------
@triton.jit
def online_softmax_kernel(
    x_ptr, y_ptr,
    d1, d2,
    stride_xb, stride_x1, stride_x2,
    stride_yb, stride_y1, stride_y2,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr,
):
    """Softmax over d2 for a BLOCK_1-row tile of one batch element (grid: row tiles x batch)."""
    rows = tl.program_id(0) * BLOCK_1 + tl.arange(0, BLOCK_1)
    batch = tl.program_id(1).to(tl.int64)
    row_ok = rows < d1
    x_rows = x_ptr + batch * stride_xb + rows[:, None].to(tl.int64) * stride_x1
    y_rows = y_ptr + batch * stride_yb + rows[:, None].to(tl.int64) * stride_y1

    # Pass 1: running max m and running sum l of exp(x - m), rescaled when m grows.
    m = tl.full((BLOCK_1,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_1,), tl.float32)
    for start in range(0, d2, BLOCK_2):
        cols = start + tl.arange(0, BLOCK_2)
        mask = row_ok[:, None] & (cols[None, :] < d2)
        x = tl.load(x_rows + cols[None, :] * stride_x2, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # While a row has seen only -inf, m_new is -inf and exp(-inf - -inf) would be NaN:
        # such a row has nothing to sum yet, so keep l at 0 instead.
        seen = m_new > float("-inf")
        alpha = tl.where(seen, tl.exp(m - m_new), 1.0)
        p = tl.where(seen[:, None], tl.exp(x - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    # Pass 2: normalise. A row of only -inf keeps m = -inf, so exp(x - m) is NaN there: torch's answer.
    inv_l = 1.0 / l
    for start in range(0, d2, BLOCK_2):
        cols = start + tl.arange(0, BLOCK_2)
        mask = row_ok[:, None] & (cols[None, :] < d2)
        x = tl.load(x_rows + cols[None, :] * stride_x2, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m[:, None]) * inv_l[:, None]
        tl.store(y_rows + cols[None, :] * stride_y2, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def online_softmax_backward_kernel(
    y_ptr, dy_ptr, dx_ptr,
    d1, d2,
    stride_yb, stride_y1, stride_y2,
    stride_gb, stride_g1, stride_g2,
    stride_db, stride_d1, stride_d2,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr,
):
    """dx = y * (dy - sum(dy * y)) per row, in the same BLOCK_1 x BLOCK_2 tiles as the forward."""
    rows = tl.program_id(0) * BLOCK_1 + tl.arange(0, BLOCK_1)
    batch = tl.program_id(1).to(tl.int64)
    row_ok = rows < d1
    y_rows = y_ptr + batch * stride_yb + rows[:, None].to(tl.int64) * stride_y1
    g_rows = dy_ptr + batch * stride_gb + rows[:, None].to(tl.int64) * stride_g1
    d_rows = dx_ptr + batch * stride_db + rows[:, None].to(tl.int64) * stride_d1

    dot = tl.zeros((BLOCK_1,), tl.float32)
    for start in range(0, d2, BLOCK_2):
        cols = start + tl.arange(0, BLOCK_2)
        mask = row_ok[:, None] & (cols[None, :] < d2)
        y = tl.load(y_rows + cols[None, :] * stride_y2, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_rows + cols[None, :] * stride_g2, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(y * g, axis=1)
    for start in range(0, d2, BLOCK_2):
        cols = start + tl.arange(0, BLOCK_2)
        mask = row_ok[:, None] & (cols[None, :] < d2)
        y = tl.load(y_rows + cols[None, :] * stride_y2, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_rows + cols[None, :] * stride_g2, mask=mask, other=0.0).to(tl.float32)
        dx = y * (g - dot[:, None])
        tl.store(d_rows + cols[None, :] * stride_d2, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _as_3d(name: str, x: torch.Tensor) -> torch.Tensor:
    check_tensor(name, x, 3)
    return x


def online_softmax(x: torch.Tensor, BLOCK_1: int = 16, BLOCK_2: int = 16) -> torch.Tensor:
    """Softmax over the last dimension of x: (batch, d1, d2), by the online algorithm.

    BLOCK_1 rows by BLOCK_2 columns per step (powers of two; BLOCK_2 up to 4096). Strided inputs are read in
    place; the output is contiguous, in x's dtype.
    """
    _as_3d("x", x)
    check_block("BLOCK_1", BLOCK_1, 1)
    check_block("BLOCK_2", BLOCK_2, 1, 4096)
    batch, d1, d2 = x.shape
    y = torch.empty((batch, d1, d2), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    grid = (triton.cdiv(d1, BLOCK_1), batch)
    online_softmax_kernel[grid](
        x, y, d1, d2, *x.stride(), *y.stride(), BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2,
        num_warps=_warps_for_tile(BLOCK_1 * BLOCK_2),
    )
    return y


def online_softmax_backward(y: torch.Tensor, dy: torch.Tensor, BLOCK_1: int = 16, BLOCK_2: int = 16) -> torch.Tensor:
    """Gradient of softmax given its output y and the incoming gradient dy, both (batch, d1, d2)."""
    _as_3d("y", y)
    _as_3d("dy", dy)
    check_same("y", y, "dy", dy)
    if dy.shape != y.shape:
        raise ValueError(f"dy must have the shape of y {tuple(y.shape)}, got {tuple(dy.shape)}")
    check_block("BLOCK_1", BLOCK_1, 1)
    check_block("BLOCK_2", BLOCK_2, 1, 4096)
    batch, d1, d2 = y.shape
    dx = torch.empty_like(y, memory_format=torch.contiguous_format)
    if dx.numel() == 0:
        return dx
    grid = (triton.cdiv(d1, BLOCK_1), batch)
    online_softmax_backward_kernel[grid](
        y, dy, dx, d1, d2, *y.stride(), *dy.stride(), *dx.stride(), BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2,
        num_warps=_warps_for_tile(BLOCK_1 * BLOCK_2),
    )
    return dx


class OnlineSoftmax(torch.autograd.Function):
    """``OnlineSoftmax.apply(x, BLOCK_1, BLOCK_2)``: online softmax with a Triton backward."""

    @staticmethod
    def forward(ctx, x, BLOCK_1=16, BLOCK_2=16):
        y = online_softmax(x, BLOCK_1, BLOCK_2)
        ctx.save_for_backward(y)
        ctx.blocks = (BLOCK_1, BLOCK_2)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return online_softmax_backward(y, dy, *ctx.blocks), None, None


def online_softmax_tiles(n_cols: int, BLOCK_2: int | None = None) -> tuple[int, int]:
    """Tiles for ``online_softmax`` on rows of n_cols: about 4096 elements per step.

    Wide steps along the row keep loads long and contiguous; short rows take several rows per
    step instead, so each program still moves enough bytes to hide memory latency.
    """
    block_2 = BLOCK_2 or min(triton.next_power_of_2(n_cols), 4096)
    return max(1, 4096 // block_2), block_2


def _warps_for_tile(elements: int) -> int:
    # About 8 to 16 fp32 values per thread keeps loads wide without spilling.
    return max(1, min(16, elements // 256))


# ----------------------------------------------------------------------------------------------
# Row softmax: one read, one write; rows that fit in one program, or split over resident programs
# ----------------------------------------------------------------------------------------------
@triton.jit
def softmax_row_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y,
    BLOCK_SIZE: tl.constexpr,
):
    """Each program walks rows pid, pid + grid, ...; a whole row sits in registers."""
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x = tl.load(x_ptr + tl.cast(row, tl.int64) * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        y = p / tl.sum(p, axis=0)
        tl.store(y_ptr + tl.cast(row, tl.int64) * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_split_row_kernel(
    x_ptr, y_ptr, stats_ptr, arrived_ptr, n_rows, n_cols, stride_x, stride_y, n_groups,
    CHUNK: tl.constexpr, SPLIT: tl.constexpr,
):
    """SPLIT programs share a row, each holding CHUNK columns in registers.

    Each publishes its chunk's (max, sum), counts itself in ``arrived[row]`` and waits until all
    SPLIT have arrived; then each combines the SPLIT pairs and writes its chunk. Programs only
    wait on programs of their own group, and the wrapper launches no more programs than fit on
    the device at once, so every wait ends.
    """
    pid = tl.program_id(0)
    group = pid // SPLIT
    part = pid % SPLIT
    cols = part * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    parts = tl.arange(0, SPLIT)
    for row in range(group, n_rows, n_groups):
        x = tl.load(x_ptr + tl.cast(row, tl.int64) * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        # A chunk of only -inf contributes nothing (and must not contribute NaN).
        s = tl.where(m > float("-inf"), tl.sum(tl.exp(x - m), axis=0), 0.0)
        slot = stats_ptr + (row * SPLIT + part) * 2
        tl.store(slot, m)
        tl.store(slot + 1, s)
        # Every thread's stores are done before the release below publishes them.
        tl.debug_barrier()
        tl.atomic_add(arrived_ptr + row, 1, sem="release")
        while tl.atomic_add(arrived_ptr + row, 0, sem="acquire") < SPLIT:
            pass
        tl.debug_barrier()
        # .cg reads from L2, never from this SM's L1, which other programs' stores don't update.
        ms = tl.load(stats_ptr + (row * SPLIT + parts) * 2, cache_modifier=".cg")
        ss = tl.load(stats_ptr + (row * SPLIT + parts) * 2 + 1, cache_modifier=".cg")
        row_max = tl.max(ms, axis=0)
        row_sum = tl.sum(ss * tl.exp(ms - row_max), axis=0)
        y = tl.exp(x - row_max) / row_sum
        tl.store(y_ptr + tl.cast(row, tl.int64) * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# Past this many bytes a row no longer fits in one program's registers without spilling
# (32 warps x 32 threads x 32 fp32 values = 128 KiB of fp32 values).
ROW_BYTES_ON_CHIP = 128 * 1024
SPLIT_CHUNK = 8192


@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _row_warps(block: int) -> int:
    # 16 to 32 values per thread: enough bytes in flight per SM, few enough to stay in registers.
    return max(4, min(32, block // 512))


def row_softmax(x: torch.Tensor, BLOCK_SIZE: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of x (any rank >= 1), reading x once.

    BLOCK_SIZE=None lets the wrapper choose: the whole row in one program when it fits
    (``softmax_row_kernel``), else the row split over resident programs
    (``softmax_split_row_kernel``; in interpreter mode, where programs run one after another and
    cannot wait for each other, the online kernel instead). A given BLOCK_SIZE (a power of two)
    forces the online kernel with tiles of one row by BLOCK_SIZE columns when it is smaller than
    the row, and the one-pass kernel otherwise.
    """
    check_tensor("x", x, tuple(range(1, 9)))
    if BLOCK_SIZE is not None:
        check_block("BLOCK_SIZE", BLOCK_SIZE, 8, 1 << 17)
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols) if n_cols else x.reshape(0, 0)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()  # the row kernels assume unit column stride for wide vector loads
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    if y.numel() == 0:
        return y.reshape(x.shape)
    full = triton.next_power_of_2(n_cols)
    if BLOCK_SIZE is not None and BLOCK_SIZE < full:
        online = online_softmax(x2.unsqueeze(0), 1, BLOCK_SIZE)
        return online.reshape(x.shape)
    if BLOCK_SIZE is None and full * 4 > ROW_BYTES_ON_CHIP:
        if INTERPRET:
            return online_softmax(x2.unsqueeze(0), *online_softmax_tiles(n_cols)).reshape(x.shape)
        _split_row_softmax(x2, y)
        return y.reshape(x.shape)
    block = max(full, BLOCK_SIZE or 0)
    warps = _row_warps(block)
    if INTERPRET:
        grid = (min(n_rows, 4),)
    elif block >= 2048:
        # One program per row: on an H100 this beat every persistent grid (1 to 16 programs per
        # SM) by 3 to 8 points of copy bandwidth for rows of 8 KiB and more; the hardware
        # scheduler balances the tail better than a fixed row-per-program split.
        grid = (n_rows,)
    else:
        # Short rows: a few resident programs per SM, each looping over rows, save launch work.
        sms = _device_properties(x.device.index or 0).multi_processor_count
        per_sm = max(1, 2048 // (warps * 32))
        grid = (min(n_rows, sms * per_sm),)
    softmax_row_kernel[grid](x2, y, n_rows, n_cols, x2.stride(0), y.stride(0), BLOCK_SIZE=block, num_warps=warps)
    return y.reshape(x.shape)


def _split_row_softmax(x2: torch.Tensor, y: torch.Tensor, chunk: int | None = None, warps: int | None = None) -> None:
    n_rows, n_cols = x2.shape
    # 8192 columns over 8 warps (32 values per thread): within 1 point of the best of a sweep of
    # chunks 2048..32768 and 4 to 32 warps on an H100, at 16384 x 131072 (94 % of copy) and at
    # 1024 x 65536 (90 %); small programs let several groups share each SM.
    chunk = chunk or SPLIT_CHUNK
    split = triton.next_power_of_2(triton.cdiv(n_cols, chunk))
    chunk = triton.next_power_of_2(triton.cdiv(n_cols, split))
    warps = warps or max(1, min(32, chunk // 1024))
    stats = torch.empty((n_rows, split, 2), dtype=torch.float32, device=x2.device)
    arrived = torch.zeros(n_rows, dtype=torch.int32, device=x2.device)
    props = _device_properties(x2.device.index or 0)
    args = (x2, y, stats, arrived, n_rows, n_cols, x2.stride(0), y.stride(0))
    compiled = softmax_split_row_kernel.warmup(*args, 1, CHUNK=chunk, SPLIT=split, num_warps=warps, grid=(1,))
    capacity = resident_programs(compiled, warps, props) * props.multi_processor_count
    if capacity < split:  # a group that cannot all be resident at once would wait forever
        raise KernelCapacityError(f"x: rows of {n_cols} columns need {split} programs of softmax_split_row_kernel "
                                  f"resident at once, but the device holds {capacity}")
    n_groups = min(n_rows, capacity // split)
    softmax_split_row_kernel[(n_groups * split,)](*args, n_groups, CHUNK=chunk, SPLIT=split, num_warps=warps)


def resident_programs(compiled, num_warps: int, props) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers, shared memory, threads)."""
    threads = num_warps * 32
    if getattr(compiled, "n_regs", None) is None:
        compiled._init_handles()  # triton 3.6 loads the binary (and learns n_regs) lazily
    by_regs = props.regs_per_multiprocessor // max(1, compiled.n_regs * threads)
    shared = compiled.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else by_regs
    by_threads = props.max_threads_per_multi_processor // threads
    return max(0, min(by_regs, by_smem, by_threads))


def row_softmax_flops(M: int, N: int) -> int:
    """Rough arithmetic per element: max, subtract, exp, sum, divide."""
    return 5 * M * N


__all__ = [
    "INTERPRET", "KernelCapacityError", "OnlineSoftmax", "naive_softmax", "naive_softmax_bytes", "online_softmax", "online_softmax_tiles",
    "online_softmax_backward", "row_softmax", "softmax_bytes", "softmax_reference",
]
