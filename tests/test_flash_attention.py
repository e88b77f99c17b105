"""FlashAttention forward and backward, in PyTorch and in Triton, against float64 attention.

Every answer is judged against the materialised attention computed in float64 on the same
(rounded) inputs; the allowed error is PyTorch's own at the input precision (FlashAttention's
rule, ``support.assert_close``). In interpreter mode the shapes are small and the Triton kernels
get 16 x 16 tiles, so a small problem still spans several tiles, a ragged last tile and, when
causal, tiles on, below and above the diagonal. On a GPU the wrapper's own launch and the real
sizes run.
"""

from __future__ import annotations

import math
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fused_softmax_matmul as fsm
from fused_softmax_matmul import (
    FlashAttentionPytorch, FlashAttentionTriton, FlashLaunch, FlashPlan, attention_flops, attention_logsumexp,
    attention_reference, flash_attention_bytes, flash_grid, flash_launches, flash_plan, flash_plan_of,
)
from online_softmax import forget_kept_launches
from support import (
    DEVICE, DTYPES, ON_GPU, UNIT_ROUNDOFF, assert_close, attention_inputs, attention_route, needs_gpu, randn,
    record_files,
)

IMPLS = {"flash_pytorch": FlashAttentionPytorch, "flash_triton": FlashAttentionTriton}

# Interpreter: 16 x 16 tiles (the least tl.dot takes) for every kernel, one warp group, no
# pipelining, so that lengths in the tens already cross several tiles. GPU: the wrapper's choice.
SMALL_TILES = {k: FlashLaunch(16, 16, 4, 1) for k in ("forward", "dkdv", "dq")}
TEST_LAUNCHES = None if ON_GPU else SMALL_TILES


def flash(impl: str, Q, K, V, is_causal: bool, launches=TEST_LAUNCHES):
    """Call an implementation the course's way; the Triton one takes the test's tiles too."""
    if impl == "flash_triton":
        return FlashAttentionTriton.apply(Q, K, V, is_causal, launches)
    return IMPLS[impl].apply(Q, K, V, is_causal)


def run_with_grads(impl, Q, K, V, dO, is_causal, launches=TEST_LAUNCHES):
    """(O, L, dQ, dK, dV) of one implementation; L is read from what its forward saved."""
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
    O = flash(impl, *leaves, is_causal, launches)
    L = O.grad_fn.saved_tensors[4]
    dQ, dK, dV = torch.autograd.grad(O, leaves, dO)
    return O.detach(), L, dQ, dK, dV


def reference_with_grads(Q, K, V, dO, is_causal, dtype):
    """(O, dQ, dK, dV) of materialised attention computed in ``dtype`` by torch autograd."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (Q, K, V)]
    O = attention_reference(*leaves, is_causal)
    return (O.detach(), *torch.autograd.grad(O, leaves, dO.to(dtype)))


def recompute_error(L64: torch.Tensor) -> float:
    """The relative error of P = exp(S - L) recomputed from a float32 L, which PyTorch's softmax avoids.

    PyTorch subtracts the row maximum exactly; FlashAttention's backward subtracts L, known only
    to float32's absolute error u |L|, from S (the same size where P matters), so each recomputed
    P carries a relative error of about u (|S| + |L|), and twice that again for the base-2
    conversions (S and L each rounded once more when scaled by log2(e)): 4 u max|L|. It grows
    with the logits, so the peaked cases show it; with logits of size 1 it is below the floor.
    """
    return 4 * UNIT_ROUNDOFF[torch.float32] * L64.abs().max().item() if L64.numel() else 0.0


def accumulation_error(n_summed: int) -> float:
    """The relative error of summing n_summed rows in float32 one tile at a time, which PyTorch's
    product (split over many blocks by cuBLAS) avoids.

    Each program streams the tiles of the dimension it sums (keys for O and dQ, queries for dK and
    dV) into one float32 accumulator: a recursive sum of ceil(n / 16) tile products (16, the least
    tile), whose roundoff grows like u sqrt(steps) (Higham, Accuracy and Stability, 4.2), not u.
    It matters only at lengths far past the usual: 65537 tiles give u x 256 = 1.5e-5, where
    summing each tile's exact product in float32 in that order (no other error) measured 4.8e-6
    against float64 on the long-queries case, and the H100's dK 4.6e-6 (torch's 1.2e-6). At 8192
    rows (512 tiles) the term is 1.3e-6; at the other tests' hundreds of rows, about the 4 u floor.
    """
    return UNIT_ROUNDOFF[torch.float32] * math.sqrt(-(-n_summed // 16))


def algorithm_error(name: str, L64: torch.Tensor, n_queries: int, n_keys: int) -> float:
    """What the flash algorithm adds to output ``name``'s error by design: its sums (O, dQ over
    keys; dK, dV over queries) and, in the backward, P recomputed from L."""
    summed = accumulation_error(n_keys if name in ("O", "dQ") else n_queries)
    return summed if name == "O" else summed + recompute_error(L64)


def check_against_float64(impl, batch, n_queries, n_keys, d, dtype, is_causal, scale=1.0, launches=TEST_LAUNCHES):
    """The whole check on fresh inputs of this shape: O, L, dQ, dK, dV within PyTorch's own error at ``dtype``."""
    Q, K, V = attention_inputs(batch, n_queries, n_keys, d, dtype, seed=batch + n_queries + d, scale=scale)
    dO = randn((batch, n_queries, d), dtype, seed=7)
    assert_matches_float64(impl, Q, K, V, dO, is_causal, launches)


def assert_matches_float64(impl, Q, K, V, dO, is_causal, launches=TEST_LAUNCHES):
    """O, L, dQ, dK, dV of ``impl`` on these inputs within PyTorch's own error at their dtype."""
    ours = run_with_grads(impl, Q, K, V, dO, is_causal, launches)
    assert_outputs_and_gradients(impl, (ours[0],) + ours[2:], Q, K, V, dO, is_causal)
    L64 = attention_logsumexp(Q.double(), K.double(), is_causal)
    # L is float32 whatever the inputs, so PyTorch's float32 logsumexp (of the same inputs) sets its bound.
    assert ours[1].shape == Q.shape[:2] and ours[1].dtype == torch.float32
    assert_close(ours[1], L64, attention_logsumexp(Q.float(), K.float(), is_causal))


# ----------------------------------------------------------------------------------------------
# float32 against float64: shapes, causal or not, forward and gradients
# ----------------------------------------------------------------------------------------------
if ON_GPU:
    SHAPES = [
        pytest.param(2, 113, 203, 64, 1.0, id="113q-203k"),      # the odd lengths: ragged query and key tiles
        pytest.param(2, 203, 113, 64, 1.0, id="203q-113k"),      # more queries than keys: late queries see every key
        pytest.param(1, 1024, 1024, 64, 1.0, id="1024-square"),  # many unmasked tiles between diagonal tiles
        pytest.param(3, 257, 255, 128, 4.0, id="257q-255k-d128-peaked"),  # the largest head; max moves across tiles
    ]
else:
    SHAPES = [
        pytest.param(1, 37, 53, 16, 1.0, id="37q-53k"),      # nq < nk, both ragged: 3 x 4 tiles, masked last key tile
        pytest.param(2, 53, 37, 16, 1.0, id="53q-37k"),      # nq > nk: causal query tiles past the keys see them all
        pytest.param(1, 32, 48, 32, 1.0, id="32q-48k-exact"),  # multiples of 16: only the causal diagonal is masked
        pytest.param(1, 29, 41, 16, 4.0, id="29q-41k-peaked"),  # logits of size 4: the rescale of acc and l matters
    ]


@pytest.mark.memcheck
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,n_queries,n_keys,d,scale", SHAPES)
def test_float32_matches_float64(impl, batch, n_queries, n_keys, d, scale, is_causal):
    check_against_float64(impl, batch, n_queries, n_keys, d, torch.float32, is_causal, scale)


# Each head dimension the Triton kernels take (HEAD_DIM is a constexpr: one compiled kernel
# each), on a short ragged sequence; the interpreter's cost does not grow with d.
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_head_dims(impl, d, is_causal):
    n = (200, 300) if ON_GPU else (19, 35)
    check_against_float64(impl, 1, *n, d, torch.float32, is_causal)


# The wrapper's own launch (flash_launches: 64-query tiles for float32 d = 64, 128 for 16-bit),
# not the tests' 16 x 16 tiles: one program covers the whole short sequence in the interpreter.
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_triton_default_launch(dtype, is_causal):
    n = (300, 500) if ON_GPU else (37, 70)
    check_against_float64("flash_triton", 2, *n, 64, DTYPES[dtype], is_causal, launches=None)


# Query and key tiles of different heights, as the GPU launches use (128 x 64 forward, 32 x 128
# dK/dV): the causal diagonal then spans several streamed tiles, or a streamed tile spans the
# diagonal of several programs, and the unmasked range must start and end on the right tile.
UNEQUAL_TILES = {
    "tall-queries": {"forward": FlashLaunch(32, 16, 4, 1), "dkdv": FlashLaunch(16, 32, 4, 1), "dq": FlashLaunch(32, 16, 4, 1)},
    "tall-keys": {"forward": FlashLaunch(16, 32, 4, 1), "dkdv": FlashLaunch(32, 16, 4, 1), "dq": FlashLaunch(16, 32, 4, 1)},
}


@pytest.mark.parametrize("launches", list(UNEQUAL_TILES.values()), ids=list(UNEQUAL_TILES))
@pytest.mark.parametrize("n_queries,n_keys", [(75, 90), (90, 75)], ids=["75q-90k", "90q-75k"])
def test_triton_unequal_tiles(launches, n_queries, n_keys):
    check_against_float64("flash_triton", 1, n_queries, n_keys, 16, torch.float32, True, launches=launches)


# ----------------------------------------------------------------------------------------------
# Low precision: judged by PyTorch's own error at that precision
# ----------------------------------------------------------------------------------------------
# float16: tl.dot in half precision (the interpreter multiplies exactly as a GPU would).
# bfloat16: in the interpreter the kernels take upcast_dot_operands' path (bf16 tl.dot is wrong
# there), so the GPU run is the real test of the bf16 tensor-core path.
@pytest.mark.memcheck
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(impl, dtype, is_causal):
    shape = (2, 113, 203, 64) if ON_GPU else (1, 37, 53, 32)
    check_against_float64(impl, *shape, DTYPES[dtype], is_causal)


def assert_outputs_and_gradients(label, ours, Q, K, V, dO, is_causal):
    """(O, dQ, dK, dV) against float64, each within the error of torch at Q's dtype."""
    exact = reference_with_grads(Q, K, V, dO, is_causal, torch.float64)
    torchs = reference_with_grads(Q, K, V, dO, is_causal, Q.dtype)
    L64 = attention_logsumexp(Q.double(), K.double(), is_causal)
    for name, out, ref64, torch_out in zip(("O", "dQ", "dK", "dV"), ours, exact, torchs):
        try:
            assert_close(out, ref64, torch_out, algorithm_error=algorithm_error(name, L64, Q.shape[1], K.shape[1]))
        except AssertionError as e:
            raise AssertionError(f"{label} {name}: {e}") from None


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_sized_case(dtype):
    """The benchmark's sequence length and head (batch 2, not 16: the float64 autograd reference
    holds several 8192 x 8192 float64 matrices per batch element), checked before it is timed."""
    check_against_float64("flash_triton", 2, 8192, 8192, 64, DTYPES[dtype], True, launches=None)


def _gluon_missing() -> str | None:
    if not ON_GPU:
        return "needs a GPU running compiled Triton"
    probe = torch.empty((1, 8, 128), dtype=torch.bfloat16, device="cuda")
    return fsm.gluon_flash_unsupported(probe, probe, probe)


def _force_gluon(monkeypatch, kernel):
    """The plan takes ``kernel``'s Gluon version wherever it takes the inputs (the others by their rule)."""
    faster = fsm._gluon_faster
    monkeypatch.setattr(fsm, "_gluon_faster", lambda *args: tuple({kernel, *faster(*args)}))


@pytest.mark.skipif(_gluon_missing() is not None, reason=_gluon_missing() or "")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("batch,n_queries,n_keys,scale", [(2, 113, 203, 1.0), (3, 257, 255, 4.0), (1, 640, 64, 1.0)])
def test_gluon_forward_path(monkeypatch, batch, n_queries, n_keys, scale, d, dtype, is_causal):
    """Where the rule picks it (forced here for these small shapes), the Function's forward runs
    the Gluon kernel (its O and L then feed the Triton backward): the whole check against
    float64, as for the Triton path."""
    _force_gluon(monkeypatch, "forward")
    forget_kept_launches()  # an earlier test's kept launch would skip the path choice forced here
    Q, K, V = attention_inputs(batch, n_queries, n_keys, d, DTYPES[dtype], seed=n_queries, scale=scale)
    assert flash_plan_of(Q, K, V, is_causal).path("forward") == "gluon"
    assert_matches_float64("flash_triton", Q, K, V, randn(Q.shape, DTYPES[dtype], 7), is_causal, launches=None)


@pytest.mark.skipif(_gluon_missing() is not None, reason=_gluon_missing() or "")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("batch,n_queries,n_keys,scale", [
    (2, 113, 203, 1.0),   # ragged query steps; the second key tile's second consumer holds 11 keys
    (3, 257, 255, 4.0),   # five query steps through two ring slots, the last of one query
    (1, 40, 60, 1.0),     # one query step, short; the second consumer has no key at all
    (2, 640, 64, 1.0),    # causal: one key tile that every query past 63 sees whole
    (1, 64, 640, 4.0),    # causal: key tiles past the last query see no query (zero dK, dV)
])
def test_gluon_dkdv_path(monkeypatch, batch, n_queries, n_keys, scale, d, dtype, is_causal):
    """Where the rule picks it (forced here for these small shapes), the Function's backward makes
    dK and dV by the Gluon kernel (dQ and D by the Triton one): all gradients against float64,
    as on the Triton path."""
    _force_gluon(monkeypatch, "dkdv")
    forget_kept_launches()
    Q, K, V = attention_inputs(batch, n_queries, n_keys, d, DTYPES[dtype], seed=n_keys, scale=scale)
    assert flash_plan_of(Q, K, V, is_causal).path("dkdv") == "gluon"
    assert_matches_float64("flash_triton", Q, K, V, randn(Q.shape, DTYPES[dtype], 9), is_causal, launches=None)


@pytest.mark.skipif(_gluon_missing() is not None, reason=_gluon_missing() or "")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("step", ["own", "other"], ids=["own_keys_a_step", "other_keys_a_step"])
@pytest.mark.parametrize("batch,n_queries,n_keys,scale", [
    (2, 113, 203, 1.0),   # ragged: the second consumer's last 15 rows and the last key step zero-filled
    (3, 257, 255, 4.0),   # a last query tile of one row; key steps through both ring slots
    (1, 40, 60, 1.0),     # one short key step; the second consumer has no query at all
    (2, 640, 64, 1.0),    # causal: query tiles past the first see the one key tile whole
    (1, 64, 640, 4.0),    # causal: the one query tile sees only the first keys of 640
])
def test_gluon_dq_path(monkeypatch, batch, n_queries, n_keys, scale, d, dtype, is_causal, step):
    """Where the rule picks it (forced here for these small shapes), the Function's backward makes
    D and dQ by the Gluon kernel (dK and dV by the kernel its own rule picks): all gradients
    against float64, as on the Triton path. "other": the key step these shapes do not take by
    default (64 keys at d = 64: the first consumer's last causal step is all masked; 128 at d = 128)."""
    _force_gluon(monkeypatch, "dq")
    if step == "other":
        monkeypatch.setattr(fsm, "gluon_dq_block_n", lambda d, n_keys: 64 if d == 64 else 128)
    forget_kept_launches()
    Q, K, V = attention_inputs(batch, n_queries, n_keys, d, DTYPES[dtype], seed=n_queries + 1, scale=scale)
    assert flash_plan_of(Q, K, V, is_causal).path("dq") == "gluon"
    assert_matches_float64("flash_triton", Q, K, V, randn(Q.shape, DTYPES[dtype], 5), is_causal, launches=None)
    forget_kept_launches()


@needs_gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_triton_kernel_at_d128(kernel, dtype, is_causal):
    """On Hopper an eager 16-bit call at d = 128 takes the Gluon forward and backward kernels: the
    Triton kernel's own (what torch.compile traces, and other GPUs run) through its launch
    override, with the wrapper's other launches, against float64."""
    forget_kept_launches()
    override = {kernel: fsm.flash_launches(128, DTYPES[dtype])[kernel]}
    Q, K, V = attention_inputs(2, 300, 500, 128, DTYPES[dtype], seed=11 if kernel == "forward" else 12, scale=4.0)
    assert flash_plan_of(Q, K, V, is_causal, override).path(kernel) == "triton"
    assert_matches_float64("flash_triton", Q, K, V, randn(Q.shape, DTYPES[dtype], 7), is_causal, launches=override)


H100 = dict(sms=132, capability=(9, 0), tma=True)


def _gluon_kernels(batch, n_queries, d, is_causal, dtype=torch.bfloat16, n_keys=None, **options):
    plan = flash_plan(batch, n_queries, n_queries if n_keys is None else n_keys, d, dtype, is_causal, **{**H100, **options})
    return set(plan.gluon)


def test_plan_takes_gluon_where_it_measured_faster():
    """Gluon's forward at d = 128 and at d = 64 past 1.5 waves of 128-query tiles (132 SMs); dQ at
    d = 128 and from 2048 queries at d = 64; dK/dV at d = 128 and on full attention from 2048
    queries at d = 64."""
    for shape in ((64, 512), (1, 40), (8, 2048), (32, 1024), (1, 32768)):
        assert _gluon_kernels(*shape, 128, False) == _gluon_kernels(*shape, 128, True) == {"forward", "dq", "dkdv"}
    assert "forward" in _gluon_kernels(16, 2048, 64, False) and "forward" in _gluon_kernels(16, 2048, 64, True)
    assert "forward" not in _gluon_kernels(8, 3000, 64, False) and "forward" in _gluon_kernels(9, 3000, 64, False)
    assert "forward" not in _gluon_kernels(9, 3000, 64, False, sms=160)  # the same 216 tiles on more SMs
    assert "forward" not in _gluon_kernels(1, 16384, 64, True) and "forward" in _gluon_kernels(2, 16384, 64, True)
    assert "dq" not in _gluon_kernels(64, 2047, 64, False) and "dq" in _gluon_kernels(1, 2048, 64, True)
    assert "dkdv" not in _gluon_kernels(64, 2047, 64, False) and "dkdv" in _gluon_kernels(1, 2048, 64, False)
    assert "dkdv" not in _gluon_kernels(4, 32768, 64, True)


@pytest.mark.parametrize("bar", ["d32", "float32", "other-gpu", "no-gpu", "no-tma", "no-sms", "empty"])
def test_plan_takes_gluon_only_where_it_runs(bar):
    """Gluon kernels only on Hopper, 16-bit, d 64 or 128, non-empty inputs TMA reads."""
    args = dict(d32=dict(d=32), float32=dict(dtype=torch.float32), **{"other-gpu": dict(capability=(10, 0)),
                "no-gpu": dict(capability=None), "no-tma": dict(tma=False), "no-sms": dict(sms=None)},
                empty=dict(n_keys=0))[bar]
    assert _gluon_kernels(**{**dict(batch=32, n_queries=4096, d=128, is_causal=False), **args}) == set()


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_plan_launch_override_keeps_its_triton_kernel(kernel):
    """A launch for one kernel runs that kernel in Triton at that launch; the others keep their path."""
    mine = FlashLaunch(64, 64, 4, 2)
    plan = flash_plan(32, 4096, 4096, 128, torch.bfloat16, False, **H100, launches={kernel: mine})
    assert getattr(plan, kernel) == mine and plan.path(kernel) == "triton"
    assert set(plan.gluon) == set(fsm.FLASH_KERNELS) - {kernel}


class _SaysCuda(torch.Tensor):
    """A CPU tensor that reports CUDA device 0: the Gluon rule's callers read a tensor's device,
    dtype, shape, strides and address, never its data, so its answers on a GPU can be asked here."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 0)


# Each cell: why the Gluon attention kernels refuse the inputs (gluon_flash_unsupported's reason,
# by its kind), or "ok". Rows: where the tensors are (no Gluon, a CPU tensor, or a GPU of that
# capability) and what the inputs are (TMA reads them, TMA cannot (a transposed K), empty);
# columns: dtype and head dim. The eager plan takes Gluon kernels at "ok" only; the compiled
# route (which sees no alignment in a trace, and asks for GLUON_COMPILED_MIN_WORK) at "ok" and "tma".
GLUON_ROUTE_COLUMNS = [(dtype, d) for dtype in ("float32", "float16", "bfloat16") for d in (32, 64, 128)]
GLUON_ROUTES = """
no-gluon readable   | gluon gluon gluon | gluon gluon gluon | gluon gluon gluon
no-gluon unreadable | gluon gluon gluon | gluon gluon gluon | gluon gluon gluon
no-gluon empty      | gluon gluon gluon | gluon gluon gluon | gluon gluon gluon
cpu      readable   | cuda  cuda  cuda  | cuda  cuda  cuda  | cuda  cuda  cuda
cpu      unreadable | cuda  cuda  cuda  | cuda  cuda  cuda  | cuda  cuda  cuda
cpu      empty      | cuda  cuda  cuda  | cuda  cuda  cuda  | cuda  cuda  cuda
sm80     readable   | sm    sm    sm    | sm    sm    sm    | sm    sm    sm
sm80     unreadable | sm    sm    sm    | sm    sm    sm    | sm    sm    sm
sm80     empty      | sm    sm    sm    | sm    sm    sm    | sm    sm    sm
sm90     readable   | dtype dtype dtype | d     ok    ok    | d     ok    ok
sm90     unreadable | dtype dtype dtype | d     tma   tma   | d     tma   tma
sm90     empty      | dtype dtype dtype | d     empty empty | d     empty empty
sm100    readable   | sm    sm    sm    | sm    sm    sm    | sm    sm    sm
sm100    unreadable | sm    sm    sm    | sm    sm    sm    | sm    sm    sm
sm100    empty      | sm    sm    sm    | sm    sm    sm    | sm    sm    sm
"""
NO_GLUON = "Gluon is not installed"  # the stand-in reason of a machine without Gluon
REASON_KINDS = {"gluon": NO_GLUON, "cuda": "must be CUDA tensors", "sm": "written for sm_90",
                "dtype": "must be float16 or bfloat16", "d": "d must be one of", "empty": "empty inputs",
                "tma": "last dimension must be contiguous for TMA"}


def _gluon_routes(monkeypatch, where: str, inputs: str, dtype: torch.dtype, d: int) -> tuple:
    """(gluon_flash_unsupported's reason, the Gluon kernels of flash_plan and of flash_plan_of,
    compiled_gluon_route) for one cell, Gluon and the GPU stood in for by monkeypatch."""
    capability = {"sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0)}.get(where)
    monkeypatch.setattr(fsm, "GLUON_UNAVAILABLE", NO_GLUON if where == "no-gluon" else None)
    monkeypatch.setattr(fsm, "_device_capability", lambda index: capability)
    monkeypatch.setattr(fsm, "_sm_count", lambda device: 132)
    # Every kernel's Gluon version faster, and work enough for the compiled route, non-empty.
    batch, n = (32, 0) if inputs == "empty" else (32, 4096)
    Q, K, V = (torch.empty(batch, n, d, dtype=dtype) for _ in range(3))
    if inputs == "unreadable":
        K = torch.empty(batch, d, n, dtype=dtype).transpose(1, 2)
    if where != "cpu":
        Q, K, V = (t.as_subclass(_SaysCuda) for t in (Q, K, V))
    reason = fsm.gluon_flash_unsupported(Q, K, V)
    plan = flash_plan(batch, n, n, d, dtype, False, sms=132, capability=capability,
                      tma=inputs != "unreadable")
    plan_of = flash_plan_of(Q, K, V, False)
    with monkeypatch.context() as tracing:
        tracing.setattr(torch.compiler, "is_compiling", lambda: True)
        compiled = fsm.compiled_gluon_route(Q, K, False)
    return reason, plan.gluon, plan_of.gluon, compiled


def _route_rows() -> list:
    """GLUON_ROUTES as (where, inputs, the kind of each column's answer)."""
    rows = []
    for line in GLUON_ROUTES.strip().splitlines():
        head, *cells = line.split("|")
        rows.append(pytest.param(*head.split(), " ".join(cells).split(), id="-".join(head.split())))
    return rows


@pytest.mark.parametrize("where,inputs,kinds", _route_rows())
def test_gluon_routes_follow_one_rule(monkeypatch, where, inputs, kinds):
    """Each route's answer on one row of GLUON_ROUTES: the reason gluon_flash_unsupported gives
    (by its kind), the Gluon kernels of the pure plan and of the plan for tensors, and whether a
    compiled call takes the opaque ops."""
    for (dtype, d), kind in zip(GLUON_ROUTE_COLUMNS, kinds, strict=True):
        reason, plan, plan_of, compiled = _gluon_routes(monkeypatch, where, inputs, DTYPES[dtype], d)
        cell = f"{where} {inputs} {dtype} d={d}"
        assert (reason is None) if kind == "ok" else REASON_KINDS[kind] in (reason or ""), f"{cell}: {reason}"
        takes = set(fsm.FLASH_KERNELS) if kind == "ok" else set()
        assert set(plan) == set(plan_of) == takes, f"{cell}: flash_plan {plan}, flash_plan_of {plan_of}"
        assert compiled == (kind in ("ok", "tma")), f"{cell}: compiled_gluon_route {compiled}"


@pytest.mark.parametrize("batch,n_queries,n_keys,d,causal,opaque", [
    (16, 8192, 8192, 64, True, True), (64, 4096, 4096, 128, True, True), (128, 4096, 4096, 64, False, True),
    (32, 4096, 4096, 64, True, False), (96, 1024, 1024, 64, True, False), (8, 4096, 4096, 128, False, False),
    (1, 32768, 32768, 64, True, True), (32, 8192, 16, 64, False, False)])
def test_compiled_gluon_route_needs_work(monkeypatch, batch, n_queries, n_keys, d, causal, opaque):
    """Under torch.compile the opaque Gluon ops take only calls of GLUON_COMPILED_MIN_WORK or more
    (batch x n_queries x n_keys x d, causal halved; design notes: compiled attention route): a
    GPT-2 layer's (96, 1024, 64) traces its Triton launches, (16, 8192, 64) causal does not."""
    monkeypatch.setattr(fsm, "GLUON_UNAVAILABLE", None)
    monkeypatch.setattr(fsm, "_device_capability", lambda index: (9, 0))
    Q = torch.empty(batch, n_queries, d, dtype=torch.bfloat16, device="meta").as_subclass(_SaysCuda)
    K = torch.empty(batch, n_keys, d, dtype=torch.bfloat16, device="meta").as_subclass(_SaysCuda)
    with monkeypatch.context() as tracing:
        tracing.setattr(torch.compiler, "is_compiling", lambda: True)
        assert fsm.compiled_gluon_route(Q, K, causal) == opaque

@pytest.mark.parametrize("capability,dtype,d", [((9, 0), "bfloat16", 64), ((9, 0), "float32", 64),
                                                ((9, 0), "float16", 32), ((8, 0), "bfloat16", 128)])
def test_gluon_rule_traces(monkeypatch, capability, dtype, d):
    """compiled_gluon_route asks gluon_flash_unfit inside Dynamo's trace, the capability a constant
    (``_traced_capability``): torch.compile(fullgraph=True) takes eager's answer, the reasons'
    strings built in the trace, the head dim static or symbolic."""
    monkeypatch.setattr(fsm, "_device_capability", lambda index: capability)

    def route(x):
        fits = fsm.gluon_flash_unfit(x.dtype, x.shape[-1], fsm._traced_capability(0)) is None
        return x + 1 if fits else x - 1

    x = torch.zeros(2, 3, d, dtype=DTYPES[dtype])
    for dynamic in (False, True):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(route, fullgraph=True, dynamic=dynamic, backend="eager")(x), route(x))

def test_tma_refuses_what_it_cannot_read():
    """dO, contiguous as the backward makes it, can still be a slice TMA cannot read: 2 bytes off,
    or a broadcast batch of one (stride 0); then the backward plan takes no Gluon kernel."""
    aligned = torch.empty(2, 100, 128, dtype=torch.bfloat16)
    shifted = torch.empty(1 + aligned.numel(), dtype=torch.bfloat16)[1:].view(2, 100, 128)
    broadcast = torch.empty(100, 128, dtype=torch.bfloat16).as_strided((1, 100, 128), (0, 128, 1))
    assert shifted.is_contiguous() and broadcast.is_contiguous()
    assert fsm.tma_unreadable("dO", aligned) is None
    assert "dO's address" in fsm.tma_unreadable("dO", shifted) and fsm.tma_unreadable("dO", broadcast) is not None
    assert "must be contiguous" in fsm.tma_unreadable("K", aligned.transpose(1, 2))


def test_dkdv_full_tile_masks_rule():
    """The dK/dV kernel drops the row masks of its whole query tiles at d <= 64, and at d = 128 on
    full attention over a length no multiple of 16; it keeps them at d = 128 otherwise."""
    assert not fsm.dkdv_full_tile_masks(64, True, 4096) and not fsm.dkdv_full_tile_masks(64, False, 3000)
    assert not fsm.dkdv_full_tile_masks(128, False, 3000) and not fsm.dkdv_full_tile_masks(128, False, 4097)
    assert fsm.dkdv_full_tile_masks(128, False, 4096) and fsm.dkdv_full_tile_masks(128, True, 3000)


# ----------------------------------------------------------------------------------------------
# The contract: what is saved, conventions, edges
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", list(IMPLS))
def test_saves_only_q_k_v_o_and_logsumexp(impl):
    """Forward saves Q, K, V, O, L: (batch, n_queries) and nothing of size n_queries x n_keys."""
    batch, nq, nk, d = 2, 37, 53, 16
    Q, K, V = (t.requires_grad_() for t in attention_inputs(batch, nq, nk, d, torch.float32))
    O = flash(impl, Q, K, V, True)
    saved = O.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(batch, nq, d), (batch, nk, d), (batch, nk, d), (batch, nq, d), (batch, nq)]
    for given, kept in zip((Q, K, V, O), saved):
        assert torch.equal(given.detach(), kept.detach())
    # However it might be reshaped, an (nq, nk) tensor would hold at least nq * nk elements.
    assert all(t.numel() < nq * nk for t in saved), [tuple(t.shape) for t in saved]


def test_causal_convention_is_sdpas():
    """Top-left causal masking, as torch's SDPA: the benchmark compares against it, so the two must agree."""
    Q, K, V = attention_inputs(2, 37, 53, 16, torch.float64)
    for is_causal in (False, True):
        for nq, nk in ((37, 53), (37, 20)):
            want = F.scaled_dot_product_attention(Q, K[:, :nk], V[:, :nk], is_causal=is_causal)
            torch.testing.assert_close(attention_reference(Q, K[:, :nk], V[:, :nk], is_causal), want)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_causal_first_query_sees_only_first_key(impl):
    """Query 0 attends to key 0 alone, so its output row is V[:, 0] (to rounding of a division by 1)."""
    Q, K, V = attention_inputs(2, 37, 53, 16, torch.float32, scale=3.0)
    O = flash(impl, Q, K, V, True)
    # Its softmax is exactly 1 and its sum exactly 1, so the one product 1 * V[:, 0] is all the
    # error: none in the interpreter, but tf32x3 on a GPU keeps about 22 of float32's 24 bits.
    torch.testing.assert_close(O[:, 0], V[:, 0], rtol=2.0**-21, atol=0)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("batch,n_queries", [(0, 5), (2, 0)], ids=["empty-batch", "no-queries"])
def test_empty_outputs(impl, batch, n_queries):
    """No queries or no batch: empty O and zero-size gradients, no launch."""
    Q, K, V = (t.requires_grad_() for t in attention_inputs(batch, n_queries, 7, 16, torch.float32))
    O = flash(impl, Q, K, V, True)
    assert O.shape == (batch, n_queries, 16)
    grads = torch.autograd.grad(O, (Q, K, V), torch.ones_like(O))
    assert [g.shape for g in grads] == [Q.shape, K.shape, V.shape]
    assert all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_strided_inputs_are_read_in_place(impl):
    """Q as a transposed view, K and V as every other row: the kernels take strides, not copies."""
    batch, nq, nk, d = 1, 29, 41, 16
    Q = randn((batch, d, nq), torch.float32, 1).transpose(1, 2)
    K = randn((batch, 2 * nk, d), torch.float32, 2)[:, ::2]
    V = randn((batch, 2 * nk, d), torch.float32, 3)[:, ::2]
    dO = randn((batch, nq, d), torch.float32, 4)
    assert_matches_float64(impl, Q, K, V, dO, True)


def test_cost_models():
    """Causal counts half the flops; the backward 2.5x the forward; no nq x nk term in the bytes."""
    assert attention_flops(2, 128, 256, 64, False) == 4 * 2 * 128 * 256 * 64
    assert attention_flops(2, 128, 256, 64, True) == 2 * 2 * 128 * 256 * 64
    assert attention_flops(2, 128, 256, 64, True, "fwd_bwd") == 7 * (2 * 2 * 128 * 256 * 64) // 2  # 3.5x forward
    fwd = flash_attention_bytes(1, 4096, 4096, 64, 2)
    assert flash_attention_bytes(1, 8192, 8192, 64, 2) == 2 * fwd  # linear in the sequence length


# ----------------------------------------------------------------------------------------------
# Bad input: one case per check, each error naming the argument
# ----------------------------------------------------------------------------------------------
def _inputs(nq=8, nk=8, d=16, dtype=torch.float32):
    return attention_inputs(1, nq, nk, d, dtype)


def _with(i, value):
    args = list(_inputs())
    args[i] = value
    return (*args, False)


WRONG_DEVICE = "meta" if not ON_GPU else "cpu"  # a device the kernels cannot read in this mode

BAD_INPUTS = [
    # (id, args builder, exception, message pattern)
    ("Q-not-tensor", lambda: _with(0, [[1.0]]), TypeError, "Q must be a torch.Tensor"),
    ("K-2d", lambda: _with(1, _inputs()[1][0]), ValueError, "K must have 3 dimensions"),
    ("V-int32", lambda: _with(2, _inputs()[2].int()), TypeError, "V must be float32, float16"),
    ("K-other-dtype", lambda: _with(1, _inputs()[1].half()), TypeError, "K has dtype"),
    # One input on another device: the Triton kernels name the device they need, PyTorch's the mismatch.
    ("K-other-device", lambda: _with(1, _inputs()[1].to("meta")), ValueError, "K is on meta"),
    ("Q-sparse", lambda: _with(0, _inputs()[0].to_sparse()), TypeError, r"Q must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    ("K-other-batch", lambda: _with(1, attention_inputs(2, 8, 8, 16, torch.float32)[1]), ValueError, "K must be .* batch"),
    ("K-other-d", lambda: _with(1, _inputs(d=32)[1]), ValueError, "K must be .* d 16"),
    ("V-other-length", lambda: _with(2, _inputs(nk=9)[2]), ValueError, "V must have K's shape"),
    ("no-keys", lambda: (*_inputs(nk=0), False), ValueError, "K has no keys"),
    ("d-0", lambda: (*_inputs(d=0), False), ValueError, "Q has d = 0"),
    ("is_causal-int", lambda: (*_inputs(), 1), TypeError, "is_causal must be a bool"),
    ("is_causal-numpy-int", lambda: (*_inputs(), np.int64(1)), TypeError,
     r"is_causal must be a bool \(or numpy.bool_\), got numpy.int64"),
]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_input(impl, make_args, error, pattern):
    with pytest.raises(error, match=pattern):
        IMPLS[impl].apply(*make_args())


TRITON_BAD_INPUTS = [
    # Float64 and devices other than Triton's are for the plain-PyTorch version only.
    ("V-float64", lambda: _with(2, _inputs()[2].double()), TypeError, "V must be float32, float16 or bfloat16"),
    ("Q-wrong-device", lambda: (*(t.to(WRONG_DEVICE) for t in _inputs()), False), ValueError, "Q is on"),
    # The kernels' tiles need a power-of-two head of at least 16 (tl.dot) and at most 128.
    ("d-48", lambda: (*_inputs(d=48), False), ValueError, r"d \(the last dimension of Q, K, V\) must be one of"),
    ("d-8", lambda: (*_inputs(d=8), False), ValueError, r"d \(the last dimension of Q, K, V\) must be one of"),
    ("d-256", lambda: (*_inputs(d=256), False), ValueError, r"d \(the last dimension of Q, K, V\) must be one of"),
    # SDPA's (batch, heads, n, d): K and V of Q's rank, batch and heads.
    ("K-3d-Q-4d", lambda: (_inputs()[0][None], *_inputs()[1:], False), ValueError, "K must have 4 dimensions"),
    ("K-other-heads", lambda: (_inputs()[0][None], _inputs()[1].expand(1, 2, 8, 16), _inputs()[2][None], False),
     ValueError, r"K must be \(batch, heads, n_keys, d\) with Q's \(batch, heads\) \(1, 1\)"),
    ("launch-not-dict", lambda: (*_inputs(), False, [FlashLaunch(16, 16, 4, 1)]), TypeError, "launches must be a dict"),
    ("launch-unknown-kernel", lambda: (*_inputs(), False, {"fwd": FlashLaunch(16, 16, 4, 1)}), ValueError,
     "launches has unknown kernel 'fwd'"),
    ("launch-not-FlashLaunch", lambda: (*_inputs(), False, {"dq": (16, 16, 4, 1)}), TypeError,
     r"launches\['dq'\] must be a FlashLaunch"),
    ("launch-block-24", lambda: (*_inputs(), False, {"forward": FlashLaunch(24, 16, 4, 1)}), ValueError,
     r"launches\['forward'\].block_m must be a power of two"),
    ("launch-block-8", lambda: (*_inputs(), False, {"dkdv": FlashLaunch(16, 8, 4, 1)}), ValueError,
     r"launches\['dkdv'\].block_n must be a power of two"),
    ("launch-stages-0", lambda: (*_inputs(), False, {"forward": FlashLaunch(16, 16, 4, 0)}), ValueError,
     r"launches\['forward'\].num_stages"),
]


@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*case[1:], id=case[0]) for case in TRITON_BAD_INPUTS])
def test_triton_bad_input(make_args, error, pattern):
    with pytest.raises(error, match=pattern):
        FlashAttentionTriton.apply(*make_args())



# ----------------------------------------------------------------------------------------------
# is_causal as numpy gives it; the plain-PyTorch version on any device
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", list(IMPLS))
def test_numpy_bool_is_causal(impl):
    """np.bool_ (what comparing numpy values gives) means the same as the Python bool."""
    Q, K, V = attention_inputs(1, 19, 21, 16, torch.float32)
    for flag in (True, False):
        torch.testing.assert_close(flash(impl, Q, K, V, np.bool_(flag)), flash(impl, Q, K, V, flag), rtol=0, atol=0)


def test_pytorch_version_on_cpu_tensors():
    """FlashAttentionPytorch takes CPU tensors whether or not a GPU is there (with one, Triton's
    rule would say CUDA), and float64: forward and gradients as accurate as PyTorch's own."""
    batch, nq, nk, d = 1, 70, 150, 16  # two key tiles of 128, two query tiles of 64
    Q, K, V = (t.cpu() for t in attention_inputs(batch, nq, nk, d, torch.float32))
    dO = randn((batch, nq, d), torch.float32, 7).cpu()
    assert_matches_float64("flash_pytorch", Q, K, V, dO, True)
    O = FlashAttentionPytorch.apply(Q.double(), K.double(), V.double(), True)
    torch.testing.assert_close(O, attention_reference(Q.double(), K.double(), V.double(), True))


def test_pytorch_version_on_meta_tensors():
    """Any device torch runs on, the meta device included: shapes only, no data."""
    Q, K, V = (t.to("meta").requires_grad_() for t in attention_inputs(2, 9, 11, 8, torch.float32))
    O = FlashAttentionPytorch.apply(Q, K, V, True)
    assert O.device.type == "meta" and O.shape == (2, 9, 8)
    grads = torch.autograd.grad(O, (Q, K, V), torch.ones_like(O))
    assert [g.shape for g in grads] == [Q.shape, K.shape, V.shape]


# ----------------------------------------------------------------------------------------------
# Infinite and NaN inputs: SDPA's answer (torch.nn.functional.scaled_dot_product_attention)
# ----------------------------------------------------------------------------------------------
# Every case on (1, 37, 53, 16) with 16 x 16 tiles (compiled too), so that the key tiles are
# 0-15, 16-31, 32-47 and the ragged 48-52. Q[..., 0] > 0, so K[j, 0] = -inf makes S[:, j] = -inf
# for every query: key j is masked by the data itself.
INF = float("inf")
NAN = float("nan")


def _set(t, index, value):
    t[index] = value


def _row_of_minus_inf(Q, K, V):
    """Query 5 = (inf, 0, ...) against keys with K[:, 0] < 0: all of row 5's logits are -inf."""
    Q[:, 5] = 0
    Q[:, 5, 0] = INF
    K[..., 0] = -K[..., 0].abs() - 0.1


EDGE_CASES = {
    # (change to the inputs, whether causal masking keeps the comparison with SDPA meaningful)
    "first-key-tile-minus-inf": (lambda Q, K, V: _set(K, (slice(None), slice(0, 16), 0), -INF), True),
    "middle-key-tile-minus-inf": (lambda Q, K, V: _set(K, (slice(None), slice(16, 32), 0), -INF), True),
    "ragged-last-tile-minus-inf": (lambda Q, K, V: _set(K, (slice(None), slice(48, None), 0), -INF), True),
    "every-key-minus-inf": (lambda Q, K, V: _set(K, (Ellipsis, 0), -INF), True),  # every row: output 0
    "one-row-minus-inf": (_row_of_minus_inf, True),
    "Q-nan": (lambda Q, K, V: _set(Q, (slice(None), 3, 2), NAN), True),        # row 3 NaN
    "Q-inf": (lambda Q, K, V: _set(Q, (slice(None), 3, 1), INF), True),        # row 3: +inf and -inf logits, NaN
    # A NaN key or an infinite value reaches rows that cannot see it through SDPA's math backend
    # (a -inf bias added to NaN, 0 x inf): SDPA's backends disagree there, so no causal case.
    "K-nan": (lambda Q, K, V: _set(K, (slice(None), 7, 1), NAN), False),
    "V-inf": (lambda Q, K, V: _set(V, (slice(None), 4, 0), INF), False),
}


def _edge_inputs(case):
    Q, K, V = attention_inputs(1, 37, 53, 16, torch.float32)
    Q[..., 0] = Q[..., 0].abs() + 0.1
    EDGE_CASES[case][0](Q, K, V)
    return Q, K, V


def _sdpa_with_grads(Q, K, V, dO, is_causal, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (Q, K, V)]
    O = F.scaled_dot_product_attention(*leaves, is_causal=is_causal)
    return (O.detach(), *torch.autograd.grad(O, leaves, dO.to(dtype)))


def assert_same_nonfinite_then_close(name, out, ref64, torch_out, only_where_finite=False):
    """out has ref64's NaNs and infinities (with their signs), and is as close as PyTorch elsewhere.

    ``only_where_finite``: compare only where ref64 is finite (out must be finite there too).
    """
    out = out.double()
    if only_where_finite:
        keep = torch.isfinite(ref64)
        out, ref64, torch_out = out[keep], ref64[keep], torch_out[keep]
    else:
        inf_out, inf_ref = torch.isinf(out), torch.isinf(ref64)
        assert torch.equal(inf_out, inf_ref) and torch.equal(out[inf_out], ref64[inf_ref]), (
            f"{name}: {int(inf_out.sum())} infinities, SDPA has {int(inf_ref.sum())}")
    try:
        assert_close(out.float(), ref64, torch_out)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,is_causal", [(case, causal) for case, (_, with_causal) in EDGE_CASES.items()
                                            for causal in ((False, True) if with_causal else (False,))],
                         ids=lambda v: {False: "full", True: "causal"}.get(v, v) if isinstance(v, bool) else v)
def test_nonfinite_inputs_follow_sdpa(impl, case, is_causal):
    """O and its gradients as SDPA gives them on the same inputs: NaN and inf where SDPA has them.

    Causal gradients are compared where SDPA's are finite: SDPA's math backend multiplies the
    infinities of query-key pairs that cannot see each other by 0 (NaN); the flash versions never
    visit most such pairs and give the true (finite) derivative there.
    """
    Q, K, V = _edge_inputs(case)
    dO = randn(Q.shape, torch.float32, 7)
    ours = run_with_grads(impl, Q, K, V, dO, is_causal, SMALL_TILES)
    exact = _sdpa_with_grads(Q, K, V, dO, is_causal, torch.float64)
    torchs = _sdpa_with_grads(Q, K, V, dO, is_causal, torch.float32)
    ours_no_L = (ours[0],) + ours[2:]
    for i, name in enumerate(("O", "dQ", "dK", "dV")):
        assert_same_nonfinite_then_close(name, ours_no_L[i], exact[i], torchs[i], only_where_finite=is_causal and i > 0)


# ----------------------------------------------------------------------------------------------
# Second derivatives: correct for both (the Triton one's backward then runs the recorded tiling)
# ----------------------------------------------------------------------------------------------
def test_pytorch_double_backward_gradgradcheck(monkeypatch):
    """torch's own finite-difference check of the first and second derivatives, in float64, with
    tiles of 4 keys and 2 queries so that a 5 x 7 problem crosses several tiles of each."""
    monkeypatch.setattr(fsm, "FLASH_PYTORCH_KEY_TILE", 4)
    monkeypatch.setattr(fsm, "FLASH_PYTORCH_QUERY_TILE", 2)
    for is_causal in (False, True):
        Q, K, V = (t.double().cpu().requires_grad_() for t in attention_inputs(1, 5, 7, 3, torch.float32, seed=3))
        fn = lambda q, k, v: FlashAttentionPytorch.apply(q, k, v, is_causal)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (Q, K, V))
        assert torch.autograd.gradgradcheck(fn, (Q, K, V))


def _second_order(fn, Q, K, V, W, U):
    """d/d(Q, K, V, W) of <U, d<W, O>/d(Q, K, V)>: a gradient penalty's derivative, every input involved."""
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V, W)]
    O = fn(*leaves[:3])
    first = torch.autograd.grad(O, leaves[:3], leaves[3], create_graph=True)
    penalty = sum((g * u).sum() for g, u in zip(first, U))
    return [g.detach() for g in first] + list(torch.autograd.grad(penalty, leaves))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_double_backward_matches_float64(impl, is_causal):
    """First and second derivatives (through create_graph=True) against float64 autograd of the reference."""
    batch, nq, nk, d = 1, 37, 53, 16
    Q, K, V = attention_inputs(batch, nq, nk, d, torch.float32)
    W = randn((batch, nq, d), torch.float32, 5)
    U = [randn(t.shape, torch.float32, 6 + i) for i, t in enumerate((Q, K, V))]
    ours = _second_order(lambda q, k, v: flash(impl, q, k, v, is_causal), Q, K, V, W, U)
    ref = lambda q, k, v: attention_reference(q, k, v, is_causal)  # noqa: E731
    exact = _second_order(ref, *(t.double() for t in (Q, K, V, W)), [u.double() for u in U])
    torchs = _second_order(ref, Q, K, V, W, U)
    names = ("dQ", "dK", "dV", "d2/dQ", "d2/dK", "d2/dV", "d2/dW")
    for name, out, ref64, torch_out in zip(names, ours, exact, torchs):
        try:
            assert_close(out, ref64, torch_out)
        except AssertionError as e:
            raise AssertionError(f"{impl} {name}: {e}") from None


# ----------------------------------------------------------------------------------------------
# Grids and launch choices
# ----------------------------------------------------------------------------------------------
def test_grid_is_one_axis_within_cudas_limit():
    """Batch x tiles programs on grid axis 0 (CUDA: 2^31 - 1), never on axis 1 (65535)."""
    assert flash_grid(3, 70000 * 16, 16) == (3 * 70000,)  # 70000 tiles: past axis 1's cap, fine here
    assert flash_grid(100000, 5, 16) == (100000,)
    with pytest.raises(ValueError, match="past CUDA's grid limit"):
        flash_grid(2**16, 2**16 * 16, 16)


def test_plan_is_pure_and_overrides_one_kernel():
    """The plan is a frozen value of its arguments; an override replaces one kernel's launch and
    leaves the table as it was."""
    before = flash_launches(64, torch.float16)
    plan = flash_plan(2, 300, 300, 64, torch.float16, False)
    assert plan == flash_plan(2, 300, 300, 64, torch.float16, False) and plan.gluon == ()
    assert plan == FlashPlan(**before)
    mine = flash_plan(2, 300, 300, 64, torch.float16, False, launches={"dq": FlashLaunch(16, 16, 4, 1)})
    assert mine.dq == FlashLaunch(16, 16, 4, 1) and mine.forward == before["forward"]
    flash_launches(64, torch.float16)["dq"] = None  # each call makes its own dict
    assert flash_launches(64, torch.float16) == before
    with pytest.raises(AttributeError):
        plan.forward = None


# ----------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs (compiled Triton only: Dynamo cannot trace interpreted kernels)
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="the GPU tests below compile for real")
def test_kernels_compile_for_sm90_with_fp64_scalars():
    """Inductor re-launches user kernels with fp64 float arguments; the kernels must compile so
    (Triton's CUDA backend builds a cubin with no GPU, outside the interpreter: a subprocess). The
    Gluon kernels compile there too, at this Triton version (their API moves between versions)."""
    script = Path(__file__).with_name("compile_flash_kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _on_fresh_leaves(step, Q, K, V, dO):
    """step(Q, K, V, dO) -> tensors, run on fresh leaves that require grad; results detached."""
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
    return [t.detach() for t in step(*leaves, dO)]


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_compiled_fullgraph_matches_float64(dtype, is_causal):
    """torch.compile(apply, fullgraph=True) with the default backend (Inductor re-compiles the
    kernels, float arguments as fp64): O and the gradients as accurate as eager's. The gradient
    of O.sum(), as the course's leaderboard takes it, reaches the backward as a stride-0 dO."""
    torch._dynamo.reset()
    Q, K, V = attention_inputs(2, 300, 500, 64, DTYPES[dtype])
    dO = torch.ones(Q.shape, dtype=Q.dtype, device=Q.device)
    compiled_apply = torch.compile(FlashAttentionTriton.apply, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
    O = compiled_apply(*leaves, is_causal)
    O.sum().backward()
    ours = (O.detach(), *(t.grad for t in leaves))
    assert_outputs_and_gradients("compiled", ours, Q, K, V, dO, is_causal)


@needs_gpu
@pytest.mark.parametrize("path", ["triton", "gluon"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_cuda_graph_replay_matches_eager(monkeypatch, is_causal, path):
    """Forward and backward captured in one CUDA graph, replayed on new inputs copied into the
    captured ones: the same bits as eager calls (no host sync, no allocation outside the graph's
    pool). "gluon": d = 128 with the Gluon forward forced by its rule."""
    shape = (2, 300, 500, 64)
    if path == "gluon":
        if _gluon_missing() is not None:
            pytest.skip(_gluon_missing())
        _force_gluon(monkeypatch, "forward")
        shape = (2, 300, 500, 128)
    forget_kept_launches()
    Q, K, V = (t.requires_grad_() for t in attention_inputs(*shape, torch.bfloat16))
    dO = randn(Q.shape, torch.bfloat16, 7)
    assert flash_plan_of(Q, K, V, is_causal).path("forward") == path

    def step(Q, K, V, dO):
        O = FlashAttentionTriton.apply(Q, K, V, is_causal)
        return [O, *torch.autograd.grad(O, (Q, K, V), dO)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, autograd sets up
        for _ in range(2):
            step(Q, K, V, dO)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(Q, K, V, dO)

    fresh = (*attention_inputs(*shape, torch.bfloat16, seed=11), randn(Q.shape, torch.bfloat16, 12))
    with torch.no_grad():
        for static, new in zip((Q, K, V, dO), fresh):
            static.copy_(new)
    graph.replay()
    eager = _on_fresh_leaves(step, *fresh)
    for name, got, want in zip(("O", "dQ", "dK", "dV"), captured, eager):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(_gluon_missing() is not None, reason=_gluon_missing() or "")
def test_compiled_call_runs_the_gluon_kernels(monkeypatch):
    """torch.compile(apply, fullgraph=True) on Hopper at d = 128 bf16 (compiled_gluon_route, its
    least work lowered to this small case): the opaque ops run the Gluon forward, dQ and dK/dV
    kernels, as an eager call would, keep their launches and replay them on the next call (no
    kernel chosen again); results against float64."""
    monkeypatch.setattr(fsm, "GLUON_COMPILED_MIN_WORK", 0)
    calls = []
    for name in ("_gluon_flash_forward", "_gluon_flash_dq", "_gluon_flash_dkdv"):
        def counted(*args, _name=name, _launch=getattr(fsm, name), **kwargs):
            calls.append(_name)
            return _launch(*args, **kwargs)
        monkeypatch.setattr(fsm, name, counted)
    forget_kept_launches()
    torch._dynamo.reset()
    Q, K, V = attention_inputs(2, 300, 500, 128, torch.bfloat16)
    dO = randn(Q.shape, torch.bfloat16, 7)
    compiled = torch.compile(FlashAttentionTriton.apply, fullgraph=True)
    for _ in range(2):
        ours = [t.clone() for t in run_with_grads_of(compiled, Q, K, V, dO, True)]
    assert calls == ["_gluon_flash_forward", "_gluon_flash_dq", "_gluon_flash_dkdv"]
    assert_outputs_and_gradients("compiled, Gluon kernels", ours, Q, K, V, dO, True)
    forget_kept_launches()


@needs_gpu
def test_reduce_overhead_matches_float64():
    """torch.compile(mode="reduce-overhead"): Inductor's CUDA graphs of the forward and the
    backward, replayed from the third call on; the replayed results judged like eager ones."""
    torch._dynamo.reset()
    Q, K, V = attention_inputs(2, 300, 500, 64, torch.bfloat16)
    dO = randn(Q.shape, torch.bfloat16, 7)
    apply = torch.compile(FlashAttentionTriton.apply, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        ours = [t.clone() for t in run_with_grads_of(apply, Q, K, V, dO, True)]
    assert_outputs_and_gradients("reduce-overhead", ours, Q, K, V, dO, True)


@needs_gpu
@pytest.mark.parametrize("impl", list(IMPLS))
def test_cpu_tensor_mixed_with_cuda(impl):
    """One input left on the CPU: an error naming it, not a crash inside a kernel."""
    Q, K, V = attention_inputs(1, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="K is on cpu"):
        IMPLS[impl].apply(Q, K.cpu(), V, False)


@needs_gpu
@pytest.mark.parametrize("n_queries,n_keys", [(16 * 65536 + 5, 40), (40, 16 * 65536 + 5)], ids=["long-queries", "long-keys"])
def test_more_tiles_than_grid_axis_1_takes(n_queries, n_keys):
    """65537 tiles of 16 (queries, or keys in the dK/dV kernel): more than CUDA's 65535 on grid
    axis 1, which the one-axis grids never use."""
    check_against_float64("flash_triton", 1, n_queries, n_keys, 16, torch.float32, True, launches=SMALL_TILES)


def run_with_grads_of(apply, Q, K, V, dO, is_causal):
    """(O, dQ, dK, dV) of apply(Q, K, V, is_causal) on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K, V)]
    O = apply(*leaves, is_causal)
    return (O.detach(), *torch.autograd.grad(O, leaves, dO))


class _StandInKernel:
    """A PyTorch stand-in for one flash kernel, launched as ``kernel[grid](*args, **constexprs)``.

    It writes what the kernel writes (positions as in the kernels' signatures), so that the
    autograd Function around it runs end to end where Dynamo cannot trace an interpreted kernel.
    """

    def __init__(self, which):
        self.which = which

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **constexprs):
        causal = constexprs.get("IS_CAUSAL", False)
        if self.which == "forward":
            Q, K, V, O, L = args[:5]
            o, lse = fsm.flash_pytorch_forward(Q, K, V, causal)
            O.copy_(o)
            L.copy_(lse)
        else:
            Q, K, V, dO, L = args[:5]
            O, _ = fsm.flash_pytorch_forward(Q, K, V, causal)
            dq, dk, dv = fsm.flash_pytorch_backward(Q, K, V, O, L, dO, causal)
            if self.which == "dkdv":
                args[6].copy_(dk)
                args[7].copy_(dv)
            else:  # dQ, and D = rowsum(dO * O) for the dK/dV kernel
                args[6].copy_(dq)
                args[5].copy_((args[7] * dO).sum(-1))


def test_export_is_told_from_compile():
    """compiled_gluon_route takes the opaque ops under torch.compile but not under torch.export:
    inside each trace ``_exporting`` must say which (torch 2.11's Dynamo answers
    torch.compiler.is_exporting() True under both, which kept every compiled call off the route)."""
    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if fsm._exporting() else x - 1

    x = torch.zeros(3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(Probe(), fullgraph=True, backend="eager")(x), x - 1)
    assert torch.equal(torch.export.export(Probe(), (x,)).module()(x), x + 1)
    assert not fsm._exporting()


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_compiled_call_runs_the_gluon_kernels takes this route with the real kernels")
def test_compiled_route_through_opaque_ops(monkeypatch):
    """Where compiled_gluon_route holds (Hopper, 16-bit), a compiled call runs its kernels inside
    the opaque ops flash_forward_by_path and flash_backward_by_path, which choose each kernel when
    they run: here (no Gluon) the Triton ones, stood in for by PyTorch, launched at run time and
    not traced; O and the gradients as the reference's."""
    monkeypatch.setattr(fsm, "_flash_kernel", lambda kernel: kernel)
    monkeypatch.setattr(fsm, "compiled_gluon_route", lambda Q, K, is_causal: torch.compiler.is_compiling())
    launched_while_tracing = []
    for name in ("_triton_flash_forward", "_triton_flash_backward"):
        def record(*args, _launch=getattr(fsm, name)):
            launched_while_tracing.append(torch.compiler.is_compiling())
            return _launch(*args)
        monkeypatch.setattr(fsm, name, record)
    _compiled_with_stand_ins(monkeypatch)
    assert launched_while_tracing == [False, False, False]  # forward, dQ, dK/dV: all from the ops


def _compiled_with_stand_ins(monkeypatch):
    """torch.compile(apply, fullgraph=True, backend="aot_eager") with each kernel replaced by its
    PyTorch stand-in, checked on a small causal case (O and the gradients against the reference);
    returns (compiled, Q, K, V)."""
    for name, which in (("forward", "forward"), ("backward_dkdv", "dkdv"), ("backward_dq", "dq")):
        monkeypatch.setattr(fsm, f"flash_attention_{name}_kernel", _StandInKernel(which))
    torch._dynamo.reset()
    compiled = torch.compile(FlashAttentionTriton.apply, fullgraph=True, backend="aot_eager")
    # On DEVICE: the Function's input checks refuse CPU tensors where the kernels are compiled.
    Q, K, V = attention_inputs(2, 21, 19, 16, torch.float32)
    dO = randn(Q.shape, torch.float32, 7)
    got = run_with_grads_of(compiled, Q, K, V, dO, True)
    want = reference_with_grads(Q, K, V, dO, True, torch.float32)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
    return compiled, Q, K, V


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_compiled_fullgraph_matches_eager compiles the Function with its real kernels")
def test_function_body_traces_with_no_graph_break(monkeypatch):
    """torch.compile(apply, fullgraph=True) over the Function's own code (input checks, cached
    launches, grids, saved tensors, both methods), each kernel replaced by a PyTorch stand-in:
    the half of test_compiled_fullgraph_matches_eager that runs on a CPU too. A numpy bool, which torch.compile
    traces as a tensor, gets an error saying to pass a Python bool."""
    compiled, Q, K, V = _compiled_with_stand_ins(monkeypatch)
    with pytest.raises(Exception, match="must be a Python bool under torch.compile"):
        compiled(Q, K, V, np.bool_(True))


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_gluon_forward_path and the compiled tests run the real kernels")
def test_compiled_function_keeps_the_triton_forward(monkeypatch):
    """Where compiled_gluon_route does not hold (here float32 in the interpreter; elsewhere other
    GPUs, calls of little work, launch overrides, torch.export) but an eager call would take the
    Gluon kernels (here: Gluon said to run on this device and to read the inputs),
    torch.compile(fullgraph=True) traces the Triton kernels' launches (Gluon kernels are no
    wrap_triton user kernels): the trace never reaches a Gluon kernel."""
    for name, which in (("forward", "forward"), ("backward_dkdv", "dkdv"), ("backward_dq", "dq")):
        monkeypatch.setattr(fsm, f"flash_attention_{name}_kernel", _StandInKernel(which))
    monkeypatch.setattr(fsm, "_gluon_capability", lambda device: (9, 0))
    monkeypatch.setattr(fsm, "tma_unreadable", lambda name, t: None)
    monkeypatch.setattr(fsm, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fsm, "_GLUON_DTYPES", (torch.float32,))  # the interpreter's exact dtype

    def no_gluon(*args, **kwargs):
        raise AssertionError("a Gluon kernel ran under torch.compile")

    for name in ("_gluon_flash_forward", "_gluon_flash_dq", "_gluon_flash_dkdv"):
        monkeypatch.setattr(fsm, name, no_gluon)
    Q, K, V = attention_inputs(1, 20, 24, 128, torch.float32)
    assert flash_plan_of(Q, K, V, False).path("forward") == "gluon"  # what an eager call would take
    torch._dynamo.reset()
    compiled = torch.compile(FlashAttentionTriton.apply, fullgraph=True, backend="aot_eager")
    dO = randn(Q.shape, torch.float32, 7)
    got = run_with_grads_of(compiled, Q, K, V, dO, False)
    want = reference_with_grads(Q, K, V, dO, False, torch.float32)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")


def test_offsets_past_32_bits_are_refused():
    """One batch element spanning 2^31 elements would wrap the kernels' 32-bit offsets: an error
    naming the tensor (checked on meta tensors: no memory behind them)."""
    fsm.check_flash_offsets(Q=torch.empty((4, 2**21, 1024), device="meta"))  # 2^31 - 1 at most: fine
    with pytest.raises(ValueError, match=r"K of shape \(1, 2097153, 1024\) .* past the kernels' 32-bit offsets"):
        fsm.check_flash_offsets(K=torch.empty((1, 2**21 + 1, 1024), device="meta"))
    wide = torch.empty((1, 4096, 2**20), device="meta")[..., :64]  # 64 columns of rows 2^20 apart: 2^32 span
    with pytest.raises(ValueError, match="dO of shape"):
        fsm.check_flash_offsets(dO=wide)


def test_heads_expanded_from_one_get_contiguous_gradients(monkeypatch):
    """K and V heads expanded from one (stride 0, MQA written as expand): their gradients are
    written contiguous, rows d apart, not heads x d apart as a qkv view's (which would span heads
    times past K's own span, unseen by the forward's offset check); out and the gradients equal
    those of contiguous copies of the expanded K and V bit for bit."""
    Q = randn((1, 4, 16, 16), torch.float32, 0)
    K1, V1 = randn((1, 1, 16, 16), torch.float32, 1), randn((1, 1, 16, 16), torch.float32, 2)
    dO = randn(Q.shape, torch.float32, 3)
    # Every span the forward checks (Q, K, V, O: 15 x 16 + 15) fits; 4 heads of rows 64 apart would not.
    monkeypatch.setattr(fsm, "FLASH_MAX_OFFSET", 15 * 16 + 15)
    leaves = [t.detach().clone().requires_grad_() for t in (Q, K1, V1)]
    K, V = (t.expand(1, 4, 16, 16) for t in leaves[1:])
    layouts = []
    K.register_hook(lambda g: layouts.append(g.is_contiguous()))
    out = FlashAttentionTriton.apply(leaves[0], K, V, True)
    grads = torch.autograd.grad(out, leaves, dO)
    assert layouts == [True]
    copies = [t.detach().clone().requires_grad_() for t in (Q, K1, V1)]
    want = FlashAttentionTriton.apply(copies[0], *(t.expand(1, 4, 16, 16).contiguous() for t in copies[1:]), True)
    assert torch.equal(out, want)
    for name, g, w in zip(("dQ", "dK", "dV"), grads, torch.autograd.grad(want, copies, dO)):
        assert torch.equal(g, w), name


def test_backward_op_reads_any_layout_of_L():
    """flash_backward_by_path called directly with (batch, heads, n) O and L of other strides (its
    docstring: they need not be fresh and contiguous): the kernels read L's rows as (batch x heads)
    flat, so such an L answers as the contiguous one; empty inputs answer in the layouts of the fake."""
    qkv = randn((2, 20, 3, 3, 16), torch.float32, 0)
    Q, K, V = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dO = randn(Q.shape, torch.float32, 1)
    O, L = fsm.flash_forward_by_path(Q, K, V, True)
    want = fsm.flash_backward_by_path(Q, K, V, O, L, dO, True)
    L_heads_outer = L.transpose(0, 1).contiguous().transpose(0, 1)  # no (batch x heads) view of it
    for name, g, w in zip(("dQ", "dK", "dV"), fsm.flash_backward_by_path(Q, K, V, O, L_heads_outer, dO, True), want):
        assert torch.equal(g, w), name
    from torch._subclasses.fake_tensor import FakeTensorMode
    empty = (qkv[:, :0, 0].transpose(1, 2), K, V)  # no queries: dQ empty, dK and dV zeros
    O, L = fsm.flash_forward_by_path(*empty, True)
    real = fsm.flash_backward_by_path(*empty, O, L, O, True)
    with FakeTensorMode() as mode:
        fake = fsm.flash_backward_by_path(*(mode.from_tensor(t) for t in (*empty, O, L, O)), True)
    assert [g.stride() for g in real] == [g.stride() for g in fake]
    assert not any(g.any() for g in real)


def test_opaque_ops_are_plain_torch_ops():
    """The ops a compiled step calls as they are run their body straight from the dispatcher: no
    Python autograd layer between (a custom_op's, which a step paid on every call: design notes,
    plain opaque ops). Having no derivative, they refuse inputs that record a gradient, which
    torch's fallback would drop."""
    for op in (fsm.flash_forward_by_path, fsm.flash_backward_by_path):
        assert isinstance(op, torch._ops.OpOverload)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd"), op
    Q = randn((2, 20, 16), torch.float32, 0).requires_grad_()
    with pytest.raises(RuntimeError, match="flash_forward_by_path has no derivative of its own"):
        fsm.flash_forward_by_path(Q, Q, Q, True)
    with torch.no_grad():
        assert torch.equal(fsm.flash_forward_by_path(Q, Q, Q, True)[0], fsm.FlashAttentionTriton.apply(Q, Q, Q, True))


def test_opaque_ops_survive_reloads():
    """Reloading the module that defines the ops keeps the ones the other module defined; reloading
    that one defines them again, as custom_op does (a fresh process: reloads touch every module),
    on the suite's device."""
    script = (
        "import importlib, torch, online_softmax, fused_softmax_matmul as f\n"
        "importlib.reload(online_softmax)\n"
        f"Q = torch.randn(1, 8, 16, device='{DEVICE}')\n"
        "a = f.flash_forward_by_path(Q, Q, Q, True)[0]\n"
        "f = importlib.reload(f)\n"
        "assert torch.equal(torch.ops.softmax_kernels.flash_forward_by_path(Q, Q, Q, True)[0], a)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0" if ON_GPU else "1"})
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
    # The reloaded op's autograd replaces the old one's with it, not over a registration left behind.
    assert "Overriding a previously registered kernel" not in done.stderr, done.stderr[-3000:]


def test_launch_choice_follows_the_shape():
    """Few query tiles per SM take 64-query forward tiles; causal dK/dV takes 64-key tiles at
    d = 64 whatever the length (the 128-key tile spills beside the diagonal loop)."""
    assert flash_plan(16, 3000, 3000, 64, torch.bfloat16, False, sms=132).forward.block_m == 64  # 384 tiles < 4 x 132
    assert flash_plan(16, 8192, 8192, 64, torch.bfloat16, False, sms=132).forward.block_m == 128  # 1024
    assert flash_plan(1, 16, 16, 64, torch.bfloat16, False).forward.block_m == 128  # SMs unknown (the interpreter)
    for few in (False, True):
        causal, full = flash_launches(64, torch.bfloat16, few, True), flash_launches(64, torch.bfloat16, few, False)
        assert causal["dkdv"] == FlashLaunch(64, 64, 4, 3) and full["dkdv"].block_n == 128
        assert causal["forward"].block_m == full["forward"].block_m == (64 if few else 128)


# ----------------------------------------------------------------------------------------------
# The committed record: the plans give the path each benchmarked attention row says ran
# ----------------------------------------------------------------------------------------------
MODEL_CASE = re.compile(r"B=(\d+) H=(\d+)/(\d+) Nq=(\d+) Nk=(\d+) d=(\d+) (full|causal|causal-br)"
                        r"(?: window=\((\d+), (\d+)\))?(?: softcap=([\d.]+))?$")
GRID_CASE = re.compile(r"BH=(\d+) heads=\d+ L=(\d+) d=(\d+) (full|causal) ")


def planned_path(workload: str, case: str, dtype: str) -> str:
    """The path the plans give a recorded case on the record's H100 (132 SMs, sm_90, fresh
    inputs TMA reads): FlashAttentionTriton's forward kernel for the shape grid's attention,
    attention_plan's path for flash_attention at model shapes."""
    if workload.startswith("attention_models"):
        b, h, hk, nq, nk, d, mask, left, right, softcap = MODEL_CASE.search(case).groups()
        return attention_route(fsm.attention_plan(
            int(d), int(d), DTYPES[dtype], int(nq), int(nk), is_causal=mask != "full",
            causal_align="bottom_right" if mask == "causal-br" else "top_left",
            window=None if left is None else (int(left), int(right)), grouped=int(h) // int(hk) if h != hk else False,
            softcap=None if softcap is None else float(softcap), batch_heads=int(b) * int(h)))
    bh, n, d, mask = GRID_CASE.match(case).groups()
    plan = flash_plan(int(bh), int(n), int(n), int(d), DTYPES[dtype], mask == "causal", sms=132, capability=(9, 0),
                      tma=True)
    return plan.path("forward")


@pytest.mark.parametrize("pattern", ["flash_attention_benchmark.csv", "attention_models_benchmark.csv", "shape_grid*.csv"])
def test_plans_give_the_recorded_paths(pattern):
    """Every committed attention row of this project's op that says which path ran: the plan for
    its case gives that path."""
    import pandas as pd

    files = record_files(pattern)
    if not files:
        pytest.skip(f"outputs/{pattern}: no such file")
    tables = [pd.read_csv(f).assign(file=f.name) for f in files]
    rows = pd.concat([t for t in tables if "path" in t.columns and "workload" in t.columns] or [pd.DataFrame()])
    if rows.empty:
        pytest.skip(f"outputs/{pattern}: no path column (the group does not record which kernels ran)")
    rows = rows[rows.workload.str.startswith("attention") & rows.path.notna()]
    assert len(rows) > 0, f"outputs/{pattern}: no attention row with a path"
    for row in rows.itertuples():
        assert planned_path(row.workload, row.case, row.dtype) == row.path, (row.file, row.case, row.dtype)
