"""Benchmark group softmax: row softmax, memory bound, judged against the measured copy bandwidth.

Implementations: naive (the course's naive_softmax), torch, compile, triton_row (``row_softmax``)
and triton_online (``online_softmax``) at their own or a chosen block size, and the row kernel
as a caller may run it (triton_compiled, triton_graph).

The group's triton_compiled row is at its first shape (test_bench_softmax_matmul.py says why).

    pytest --benchmark-only -p no:xdist tests/test_bench_softmax.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from candidates import candidate_call, candidate_impls
from conftest import BenchGroup, caller_form, compiled, compiled_op
from online_softmax import naive_softmax, naive_softmax_bytes, online_softmax, online_softmax_tiles, row_softmax, softmax_bytes
from support import DTYPES, ON_GPU, at_one_case, error_bound, relative_error, row_softmax_inputs

GROUP = BenchGroup(
    name="softmax",
    csv="softmax_benchmark.csv",
    columns=("M", "N", "dtype", "impl", "BLOCK_SIZE", "forward_ms_mean", "forward_ms_std", "gbps", "pct_of_copy"),
    case=("M", "N", "dtype"),
    impls=("naive", "torch", "compile", "triton_row", "triton_online", "triton_compiled", "triton_graph",
           *candidate_impls("softmax")),
    sort=("dtype", "M", "N", "_impl_order", "BLOCK_SIZE"),
    plot=("bar", "pct_of_copy"),
)


def _softmax_last(x):
    return torch.softmax(x, dim=-1)


def online_at(block: int | None):
    def online(x):
        return online_softmax(x.unsqueeze(0), *online_softmax_tiles(x.shape[-1], block))[0]
    return online


# Each factory takes the row's block size (None: the wrapper's own choice) and returns f(x).
# The caller forms run the row kernel at its wrapper's own block size.
IMPLS = {
    "naive": lambda block: naive_softmax,
    "torch": lambda block: _softmax_last,
    "compile": lambda block: compiled(_softmax_last),
    "triton_row": lambda block: functools.partial(row_softmax, BLOCK_SIZE=block),
    "triton_online": online_at,
    "triton_compiled": lambda block: compiled_op(row_softmax),
    "triton_graph": lambda block: row_softmax,
    # --candidate's softmax names (tests/candidates.py), called f(x) on the rows
    **{impl: lambda block, impl=impl: candidate_call(impl) for impl in candidate_impls("softmax")},
}

if ON_GPU:
    SHAPES = [(8192, 8192, "float32"), (4096, 32768, "float32"), (32768, 4096, "float32"),
              (16384, 131072, "float32"), (8192, 8192, "bfloat16"), (1024, 1024, "float32")]
    STUDY_SHAPE, STUDY_BLOCKS = (1024, 1024, "float32"), [128, 256, 512]
    IMPL_NAMES = tuple(IMPLS)
else:
    SHAPES = [(6, 100, "float32"), (4, 300, "bfloat16")]
    STUDY_SHAPE, STUDY_BLOCKS = (6, 100, "float32"), [32]
    # Inductor on CPU compiles C++ for every shape, tens of seconds each on two cores.
    IMPL_NAMES = tuple(impl for impl in IMPLS if impl != "compile")
CASES = at_one_case(SHAPES, [(impl, None) for impl in IMPL_NAMES], at=SHAPES[0]) + [
    (*STUDY_SHAPE, impl, b) for impl in ("triton_row", "triton_online") for b in STUDY_BLOCKS
]


def softmax_error(out: torch.Tensor, inputs) -> float:
    """On the first 64 rows: a float64 copy of all could be 16 GiB."""
    (x,) = inputs
    return relative_error(out[:64], torch.softmax(x[:64].double(), dim=-1))


def softmax_bound(inputs) -> float:
    """As the correctness tests: twice PyTorch's own error at x's dtype on the same rows, plus the roundoff floor."""
    (x,) = inputs
    return error_bound(softmax_error(torch.softmax(x[:64], dim=-1), inputs), x.dtype)


@pytest.mark.parametrize("M,N,dtype,impl,BLOCK_SIZE", CASES)
def test_softmax(bench, M, N, dtype, impl, BLOCK_SIZE):
    torch_dtype = DTYPES[dtype]

    def build():
        x = row_softmax_inputs(M, N, torch_dtype)
        return caller_form(impl, functools.partial(IMPLS[impl](BLOCK_SIZE), x)), (x,)

    # The naive version is charged the traffic it really makes, the others the least possible,
    # so each GB/s says how well that implementation uses the memory system.
    size = torch_dtype.itemsize
    moved = naive_softmax_bytes(M, N, size) if impl == "naive" else softmax_bytes(M, N, size)
    bench(GROUP, dict(M=M, N=N, dtype=dtype, impl=impl, BLOCK_SIZE=BLOCK_SIZE), build, bytes_moved=moved,
          error=softmax_error, bound=softmax_bound)
