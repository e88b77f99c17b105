"""Benchmark group softmax_matmul: softmax(x) @ V on the specified grid, float32 under PyTorch's
default precision, in PyTorch, torch.compile and the fused Triton kernel at each block size.

The CSV outputs/softmax_matmul_benchmark.csv has the specification's nine columns and PyTorch
and Triton rows only; the other implementations land in the run's JSON and the plot.

triton_compiled (the op under torch.compile(fullgraph=True), a compile per shape) runs at one case
of the group: it runs the launch a plain call makes, and in the record before, its GPU time was
within 2 % of that launch replayed from a CUDA graph (triton_graph, kept at every shape) at every
shape of these groups but three small ones (4-10 %: 1024 x 1024 rows, d2 1024 'highest',
softmax(x @ W) 256 x 512 x 50).

    pytest --benchmark-only -p no:xdist tests/test_bench_softmax_matmul.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from candidates import candidate_call, candidate_impls
from conftest import BenchGroup, caller_form, compiled, compiled_op
from fused_softmax_matmul import fused_blocks, fused_softmax, fused_softmax_bytes, softmax_matmul_flops, softmax_mult, softmax_mult_bytes
from support import ON_GPU, at_one_case, torch_error_bound, relative_error, softmax_matmul_inputs

GROUP = BenchGroup(
    name="softmax_matmul",
    csv="softmax_matmul_benchmark.csv",
    columns=("batch_size", "d1", "d2", "d3", "triton", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB"),
    case=("batch_size", "d1", "d2", "d3"),
    impls=("torch", "compile", "triton", "triton_compiled", "triton_graph", *candidate_impls("softmax_matmul")),
    csv_impls=("torch", "triton"),  # the specified table has PyTorch and Triton rows only (candidates: JSON and plot)
    sort=("d2", "_impl_order", "BLOCK"),
    plot=("line", "d2"),
    spec=True,
)


@functools.cache
def fused_at(block: int | None):
    """fused_softmax's fused kernel at one block size (None: the wrapper's): one object per size,
    so its compiled form is cached. The groups time the fused kernel, so the caller forms too
    (materialize=False; the shape grid times what a plain call runs, ``fused_softmax_path``)."""
    return functools.partial(fused_softmax, BLOCK_1=block, BLOCK_2=block, materialize=False)


# Each factory takes the row's block size (None where the implementation has none) and returns
# f(x, V). The Triton op is also timed as a caller may run it: under torch.compile(fullgraph=True)
# and replayed from a CUDA graph (which removes the host's launch cost), at the wrapper's own
# blocks (``fused_blocks``: what a caller who names none runs), which the row's BLOCK records.
IMPLS = {
    "torch": lambda block: softmax_mult,
    "compile": lambda block: compiled(softmax_mult),
    "triton": fused_at,
    "triton_compiled": lambda block: compiled_op(fused_at(block)),
    "triton_graph": fused_at,
    # --candidate's fused_softmax (tests/candidates.py), called f(x, V)
    **{impl: lambda block, impl=impl: candidate_call(impl) for impl in candidate_impls("softmax_matmul")},
}
CALLER_FORMS = ("triton_compiled", "triton_graph")

if ON_GPU:
    SPEC = dict(batch_size=16, d1=2048, d3=512)
    SPEC_D2 = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    SPEC_BLOCKS = [16, 32, 64]
    # Inductor on CPU compiles C++ for every shape, tens of seconds each on two cores: the
    # interpreter grids leave torch.compile out. On a GPU it is a peer in every group.
    COMPILE = ("compile",)
else:  # interpreter: ~3 ms per program per step, so a handful of programs and steps
    SPEC = dict(batch_size=1, d1=32, d3=24)
    SPEC_D2 = [32, 80]
    SPEC_BLOCKS = [16, 32]
    COMPILE = ()
CASES = [(d2, impl, None) for d2 in SPEC_D2 for impl in ("torch", *COMPILE)] + [
    (d2, "triton", b) for d2 in SPEC_D2 for b in SPEC_BLOCKS
] + at_one_case([(d2,) for d2 in SPEC_D2],
                [(impl, None) for impl in (*CALLER_FORMS, *candidate_impls("softmax_matmul"))], at=(SPEC_D2[-1],))


def wrapper_block(impl: str, block: int | None, d2: int, d3: int, dtype: torch.dtype) -> int | None:
    """The row's BLOCK: the given one, or for a caller form the wrapper's choice for contiguous
    inputs (under the float32 matmul precision set now)."""
    if block is None and impl in CALLER_FORMS:
        return fused_blocks(d2, d3, dtype, d2 * dtype.itemsize % 16 == 0)
    return block


def build_softmax_matmul(impl: str, block: int | None, batch: int, d1: int, d2: int, d3: int, dtype: torch.dtype):
    """(fn, (x, V)) for the bench fixture, from the correctness tests' input builder."""
    x, V = softmax_matmul_inputs(batch, d1, d2, d3, dtype)
    return caller_form(impl, functools.partial(IMPLS[impl](block), x, V)), (x, V)


def softmax_matmul_error(out: torch.Tensor, inputs) -> float:
    """||out - ref|| / ||ref|| on the first batch entry, ref in float64 from the same inputs."""
    x, V = (t[:1].double() for t in inputs)
    return relative_error(out[:1], torch.softmax(x, dim=-1) @ V)


def softmax_matmul_bound(inputs) -> float:
    """Twice PyTorch's own error at x's dtype (and float32 matmul precision) on the timed call,
    plus the roundoff floor."""
    return torch_error_bound(softmax_mult, softmax_matmul_error, inputs)


def softmax_matmul_bytes(impl: str, batch: int, d1: int, d2: int, d3: int, itemsize: int) -> int:
    model = softmax_mult_bytes if impl in ("torch", "compile") else fused_softmax_bytes  # a candidate: the least
    return model(batch, d1, d2, d3, itemsize)


@pytest.mark.parametrize("d2,impl,B", CASES)
def test_softmax_matmul(bench, d2, impl, B):
    batch, d1, d3 = SPEC["batch_size"], SPEC["d1"], SPEC["d3"]
    row = dict(batch_size=batch, d1=d1, d2=d2, d3=d3, triton=impl.startswith("triton"),
               BLOCK=wrapper_block(impl, B, d2, d3, torch.float32), impl=impl, dtype="float32")
    bench(GROUP, row, lambda: build_softmax_matmul(impl, B, batch, d1, d2, d3, torch.float32),
          bytes_moved=softmax_matmul_bytes(impl, batch, d1, d2, d3, 4), flops=softmax_matmul_flops(batch, d1, d2, d3),
          dtype=torch.float32, error=softmax_matmul_error, bound=softmax_matmul_bound)
