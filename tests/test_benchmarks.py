"""Benchmarks of the softmax and softmax-matmul kernels against PyTorch (and torch.compile).

Each group is declared once, as data: its implementations, its grid (the full one on a GPU, a
small one through the interpreter) and the CSV it feeds. conftest.py times, records and writes.

    pytest tests/test_benchmarks.py --benchmark-only            # on a GPU: writes outputs/*.csv
"""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import BenchGroup, compiled_op, graph_replay
from fused_softmax_matmul import (
    fused_softmax, fused_softmax_bytes, softmax_matmul_flops, softmax_mult, softmax_mult_bytes,
)
from online_softmax import naive_softmax, naive_softmax_bytes, online_softmax, online_softmax_tiles, row_softmax, softmax_bytes
from support import DTYPES, ON_GPU, relative_error, row_softmax_inputs, softmax_matmul_inputs

# torch.compile specialises on each shape; the default recompile limit (8) would silently fall back
# to eager after a few shapes of one function, so raise it for the grids below.
torch._dynamo.config.cache_size_limit = 256
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 256


@functools.cache
def compiled(fn):
    return torch.compile(fn, dynamic=False)


# Inductor on CPU compiles C++ for every shape, tens of seconds each on two cores: the interpreter
# smoke grids leave torch.compile out. On a GPU it is a peer in every group.
COMPILE = ("compile",) if ON_GPU else ()


# ----------------------------------------------------------------------------------------------
# softmax(x) @ V: the specified grid (issue spec), float32 under PyTorch's default precision
# ----------------------------------------------------------------------------------------------
SOFTMAX_MATMUL = BenchGroup(
    name="softmax_matmul",
    csv="softmax_matmul_benchmark.csv",
    columns=("batch_size", "d1", "d2", "d3", "triton", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB"),
    case=("batch_size", "d1", "d2", "d3"),
    impls=("torch", "compile", "triton", "triton_compiled", "triton_graph"),
    csv_impls=("torch", "triton"),  # the specified table has PyTorch and Triton rows only
    sort=("d2", "_impl_order", "BLOCK"),
    plot=("line", "d2"),
    spec=True,
)
if ON_GPU:
    SPEC = dict(batch_size=16, d1=2048, d3=512)
    SPEC_D2 = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    SPEC_BLOCKS = [16, 32, 64]
else:  # interpreter: ~3 ms per program per step, so a handful of programs and steps
    SPEC = dict(batch_size=1, d1=32, d3=24)
    SPEC_D2 = [32, 80]
    SPEC_BLOCKS = [16, 32]

# The Triton op as a caller may also run it: under torch.compile(fullgraph=True), and replayed
# from a CUDA graph (which removes the host's launch cost); at the largest block size.
CALLER_FORMS = ("triton_compiled", "triton_graph")
SOFTMAX_MATMUL_CASES = [(d2, impl, None) for d2 in SPEC_D2 for impl in ("torch", *COMPILE)] + [
    (d2, "triton", b) for d2 in SPEC_D2 for b in SPEC_BLOCKS
] + [(d2, impl, SPEC_BLOCKS[-1]) for d2 in SPEC_D2 for impl in CALLER_FORMS]


def softmax_matmul_error(inputs: dict):
    """error(out) for the bench fixture: ||out - ref|| / ||ref|| on the first batch entry, ref
    computed in float64 from the inputs that ``build`` left in ``inputs``."""
    def error(out: torch.Tensor) -> float:
        x, V = inputs["x"][:1], inputs["V"][:1]
        return relative_error(out[:1], torch.softmax(x.double(), dim=-1) @ V.double())
    return error


def softmax_matmul_impl(impl: str, block: int | None):
    if impl == "torch":
        return softmax_mult
    if impl == "compile":
        return compiled(softmax_mult)
    fused = functools.partial(fused_softmax, BLOCK_1=block, BLOCK_2=block)
    return compiled_op(fused) if impl == "triton_compiled" else fused


def callable_for(impl: str, fn, *args):
    """The zero-argument call to time; triton_graph rows replay it from a CUDA graph."""
    call = functools.partial(fn, *args)
    return graph_replay(call) if impl.endswith("_graph") else call


@pytest.mark.parametrize("d2,impl,B", SOFTMAX_MATMUL_CASES)
def test_softmax_matmul(bench, d2, impl, B):
    batch, d1, d3 = SPEC["batch_size"], SPEC["d1"], SPEC["d3"]
    row = dict(batch_size=batch, d1=d1, d2=d2, d3=d3, triton=impl.startswith("triton"), BLOCK=B, impl=impl, dtype="float32")

    inputs = {}

    def build():
        x, V = inputs["x"], inputs["V"] = softmax_matmul_inputs(batch, d1, d2, d3, torch.float32)
        return callable_for(impl, softmax_matmul_impl(impl, B), x, V)

    model = fused_softmax_bytes if impl.startswith("triton") else softmax_mult_bytes
    bench(SOFTMAX_MATMUL, row, build, bytes_moved=model(batch, d1, d2, d3, 4),
          flops=softmax_matmul_flops(batch, d1, d2, d3), dtype=torch.float32, error=softmax_matmul_error(inputs))


# ----------------------------------------------------------------------------------------------
# softmax(x) @ V across precisions
# ----------------------------------------------------------------------------------------------
PRECISION = BenchGroup(
    name="softmax_matmul_precision",
    csv="softmax_matmul_precision.csv",
    columns=("batch_size", "d1", "d2", "d3", "dtype", "precision", "impl", "BLOCK", "forward_ms_mean",
             "forward_ms_std", "forward_peak_MiB", "gbps", "tflops"),
    case=("batch_size", "d1", "d2", "d3", "dtype", "precision"),
    impls=("torch", "compile", "triton", *CALLER_FORMS),
    plot=("line", "d2"),
)
# (dtype, float32 matmul precision): the precision setting only matters for float32.
VARIANTS = [("float32", "highest"), ("float32", "high"), ("bfloat16", "n/a"), ("float16", "n/a")]
if ON_GPU:
    # d2 1024 and 8192 for every variant; bfloat16 also at every other d2 >= 256 of the spec grid,
    # where the fused kernel must beat PyTorch too. Triton at every block size of the spec grid.
    PRECISION_CASES = [(dt, p, d2) for dt, p in VARIANTS for d2 in (1024, 8192)] + [
        ("bfloat16", "n/a", d2) for d2 in (256, 512, 2048, 4096)]
    PRECISION_BLOCKS = SPEC_BLOCKS
else:
    PRECISION_CASES = [(dt, p, 48) for dt, p in VARIANTS]
    PRECISION_BLOCKS = [16]
PRECISION_IMPLS = [(impl, None) for impl in ("torch", *COMPILE)] + [("triton", b) for b in PRECISION_BLOCKS] + [
    (impl, PRECISION_BLOCKS[-1]) for impl in CALLER_FORMS]


@pytest.fixture
def matmul_precision(request):
    """Set torch's float32 matmul precision for one test and restore it after."""
    before = torch.get_float32_matmul_precision()
    yield lambda p: torch.set_float32_matmul_precision(p) if p != "n/a" else None
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("impl,block", PRECISION_IMPLS)
@pytest.mark.parametrize("dtype,precision,d2", PRECISION_CASES)
def test_softmax_matmul_precision(bench, matmul_precision, dtype, precision, d2, impl, block):
    matmul_precision(precision)
    batch, d1, d3 = SPEC["batch_size"], SPEC["d1"], SPEC["d3"]
    row = dict(batch_size=batch, d1=d1, d2=d2, d3=d3, dtype=dtype, precision=precision, impl=impl, BLOCK=block)
    torch_dtype = DTYPES[dtype]
    inputs = {}

    def build():
        x, V = inputs["x"], inputs["V"] = softmax_matmul_inputs(batch, d1, d2, d3, torch_dtype)
        return callable_for(impl, softmax_matmul_impl(impl, block), x, V)

    model = fused_softmax_bytes if impl.startswith("triton") else softmax_mult_bytes
    bench(PRECISION, row, build, bytes_moved=model(batch, d1, d2, d3, torch_dtype.itemsize),
          flops=softmax_matmul_flops(batch, d1, d2, d3), dtype=torch_dtype, error=softmax_matmul_error(inputs))


# ----------------------------------------------------------------------------------------------
# Row softmax: memory bound, judged against the measured copy bandwidth
# ----------------------------------------------------------------------------------------------
SOFTMAX = BenchGroup(
    name="softmax",
    csv="softmax_benchmark.csv",
    columns=("M", "N", "dtype", "impl", "BLOCK_SIZE", "forward_ms_mean", "forward_ms_std", "gbps", "pct_of_copy"),
    case=("M", "N", "dtype"),
    impls=("naive", "torch", "compile", "triton_row", "triton_online", *CALLER_FORMS),
    sort=("dtype", "M", "N", "_impl_order", "BLOCK_SIZE"),
    plot=("bar", "pct_of_copy"),
)
if ON_GPU:
    ROW_SHAPES = [(8192, 8192, "float32"), (4096, 32768, "float32"), (32768, 4096, "float32"),
                  (16384, 131072, "float32"), (8192, 8192, "bfloat16"), (1024, 1024, "float32")]
    STUDY_SHAPE, STUDY_BLOCKS = (1024, 1024, "float32"), [128, 256, 512]
else:
    ROW_SHAPES = [(6, 100, "float32"), (4, 300, "bfloat16")]
    STUDY_SHAPE, STUDY_BLOCKS = (6, 100, "float32"), [32]

SOFTMAX_CASES = [(*shape, impl, None) for shape in ROW_SHAPES
                 for impl in ("naive", "torch", *COMPILE, "triton_row", "triton_online", *CALLER_FORMS)] + [
    (*STUDY_SHAPE, impl, b) for impl in ("triton_row", "triton_online") for b in STUDY_BLOCKS
]


def row_softmax_impl(impl: str, block: int | None):
    if impl == "naive":
        return naive_softmax
    if impl == "torch":
        return functools.partial(torch.softmax, dim=-1)
    if impl == "compile":
        return compiled(functools.partial(torch.softmax, dim=-1))
    if impl == "triton_row":
        return functools.partial(row_softmax, BLOCK_SIZE=block)
    if impl in CALLER_FORMS:  # the row kernel, each wrapper's own block size
        return compiled_op(row_softmax) if impl == "triton_compiled" else row_softmax

    def online(x):
        return online_softmax(x.unsqueeze(0), *online_softmax_tiles(x.shape[-1], block))[0]

    return online


@pytest.mark.parametrize("M,N,dtype,impl,BLOCK_SIZE", SOFTMAX_CASES)
def test_softmax(bench, M, N, dtype, impl, BLOCK_SIZE):
    torch_dtype = DTYPES[dtype]
    inputs = {}

    def build():
        x = inputs["x"] = row_softmax_inputs(M, N, torch_dtype)
        return callable_for(impl, row_softmax_impl(impl, BLOCK_SIZE), x)

    def error(out: torch.Tensor) -> float:  # on the first 64 rows: a float64 copy of all could be 16 GiB
        return relative_error(out[:64], torch.softmax(inputs["x"][:64].double(), dim=-1))

    # The naive version is charged the traffic it really makes, the others the least possible,
    # so each GB/s says how well that implementation uses the memory system.
    size = torch_dtype.itemsize
    moved = naive_softmax_bytes(M, N, size) if impl == "naive" else softmax_bytes(M, N, size)
    bench(SOFTMAX, dict(M=M, N=N, dtype=dtype, impl=impl, BLOCK_SIZE=BLOCK_SIZE), build, bytes_moved=moved, error=error)
