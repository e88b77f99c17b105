"""softmax(x) @ V by the Gluon kernel for Hopper (``fused_softmax_gluon``) against float64.

Judged like ``fused_softmax`` (tests/test_fused_softmax_matmul.py): at most twice the error of
``softmax_mult`` in the inputs' own dtype, against ``softmax_mult`` in float64 on the same rounded
inputs (``support.assert_close``). The kernel only compiles for sm_90 with Gluon: its tests skip
elsewhere, except the ones that check it refuses inputs it cannot take, which run everywhere.

Shapes are chosen against the kernel's tiles (64 rows of x per program, d2 in steps of up to 128,
d3 in tiles of up to 128, a ring of 3 slots) and TMA's rule that every stride but the last is a
multiple of 16 bytes (d2 and d3 multiples of 8 for contiguous 16-bit inputs).
"""

from __future__ import annotations

import pytest
import torch

from fused_softmax_matmul import (
    GLUON_BLOCK_M, GluonSoftmaxLaunch, fused_softmax_gluon, gluon_softmax_applies, gluon_softmax_launch,
    gluon_softmax_unsupported, softmax_mult,
)
from online_softmax import KernelCapacityError
from support import DTYPES, ON_GPU, assert_close, extreme_logits, masked_logits, randn, softmax_matmul_inputs


def _missing_hopper_gluon() -> str | None:
    """Why the kernel cannot run here (no GPU, not sm_90, no Gluon), or None."""
    if not ON_GPU:
        return "needs a GPU running compiled Triton"
    probe = torch.empty((1, 8, 8), dtype=torch.bfloat16, device="cuda")
    return gluon_softmax_unsupported(probe, probe)


MISSING = _missing_hopper_gluon()
needs_hopper_gluon = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def check_gluon(x: torch.Tensor, V: torch.Tensor, launch: GluonSoftmaxLaunch | None = None) -> torch.Tensor:
    """fused_softmax_gluon(x, V) is softmax(x) @ V in x's dtype, as accurate as PyTorch's own."""
    assert gluon_softmax_applies(x, V), gluon_softmax_unsupported(x, V)
    out = fused_softmax_gluon(x, V, launch=launch)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], x.shape[1], V.shape[2]), (out.dtype, tuple(out.shape))
    assert_close(out, softmax_mult(x.double(), V.double()), softmax_mult(x, V))
    return out


# (batch, d1, d2, d3), logit scale: the code path each exercises.
CASES = {
    # Whole tiles: one row block, one d2 step, one d3 tile.
    "64x128x128": ((1, 64, 128, 128), 1.0),
    # d1 = 100: the second row block has 36 live rows (TMA reads zeros past d1, the store masks
    # them); d2 = 200: a last step of 72 columns (zeros past d2 masked to -inf); d3 = 40: one
    # 64-wide d3 tile, 24 columns of it past d3.
    "ragged 100x200x40": ((2, 100, 200, 40), 1.0),
    # d2 = 8 under the least step of 16; d3 = 8 under the least tile of 16; 17 rows.
    "tiny 17x8x8": ((1, 17, 8, 8), 1.0),
    # 8 steps through a 3-slot ring (each slot's barriers change phase twice or more), three d3
    # tiles of 128 with 8 live columns in the last, logits of size 8 so the running max moves.
    "ring 130x1000x264": ((3, 130, 1000, 264), 8.0),
    # The spec's d3 = 512 (four d3 tiles per row block) with 32 steps of d2.
    "d3 512": ((2, 128, 4096, 512), 1.0),
    # Logits of size 100: earlier steps' weights underflow to 0 when the max grows.
    "scale 100": ((2, 70, 520, 24), 100.0),
}


@needs_hopper_gluon
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_against_float64(case, dtype_name):
    shape, scale = CASES[case]
    x, V = softmax_matmul_inputs(*shape, DTYPES[dtype_name], scale=scale)
    check_gluon(x, V)


@needs_hopper_gluon
@pytest.mark.parametrize("launch", [GluonSoftmaxLaunch(128, 256, 2), GluonSoftmaxLaunch(64, 256, 4),
                                    GluonSoftmaxLaunch(128, 128, 2, maxnreg=128)], ids=str)
def test_other_launches(launch):
    """The launches the check script times beside the default: 256-wide d3 tiles (two over 264, 8
    live columns in the second; 8 or 16 steps of d2 through 2 or 4 slots), and two programs per SM."""
    x, V = softmax_matmul_inputs(2, 130, 1000, 264, torch.bfloat16, scale=8.0)
    check_gluon(x, V, launch)


@needs_hopper_gluon
@pytest.mark.parametrize("logits", ["masked", "extreme"])
def test_masked_and_extreme_logits(logits):
    """-inf logits (whole tiles of them, an all -inf row: NaN as torch) and +-BIG (x - max overflows)."""
    batch, d1, d2, d3 = 2, 70, 200, 24
    build = masked_logits if logits == "masked" else extreme_logits
    x = build((batch, d1, d2), torch.bfloat16)
    V = randn((batch, d2, d3), torch.bfloat16, seed=1)
    check_gluon(x, V)


@needs_hopper_gluon
def test_strided_inputs():
    """Strides other than contiguous ones are read in place: x every other row block of a wider
    tensor (row stride 2 x d2), V a d3-slice of a wider one, the batch strides padded."""
    batch, d1, d2, d3 = 2, 80, 136, 48
    x = randn((batch, d1, 2 * d2), torch.bfloat16, seed=3)[:, :, :d2]
    V = randn((batch + 1, d2, d3 + 16), torch.bfloat16, seed=4)[1:, :, 8:8 + d3]
    assert not x.is_contiguous() and not V.is_contiguous()
    check_gluon(x, V)


@needs_hopper_gluon
def test_smoke_rows_sum_to_one():
    """Tiny and timing-free: softmax rows sum to 1, so softmax(x) @ ones is exactly ones after rounding."""
    x = randn((1, GLUON_BLOCK_M, 64), torch.bfloat16, seed=5, scale=4.0)
    V = torch.ones((1, 64, 16), dtype=torch.bfloat16, device=x.device)
    out = fused_softmax_gluon(x, V)
    torch.cuda.synchronize()
    assert out.shape == (1, GLUON_BLOCK_M, 16) and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.ones_like(out)), out


# ----------------------------------------------------------------------------------------------
# What it refuses (runs everywhere: the predicate and the error need no GPU)
# ----------------------------------------------------------------------------------------------
def test_refuses_float32_and_cpu():
    x = randn((1, 16, 16), torch.float32, seed=0)
    V = randn((1, 16, 16), torch.float32, seed=1)
    assert not gluon_softmax_applies(x, V)
    with pytest.raises(ValueError, match="fused_softmax_gluon cannot take these inputs"):
        fused_softmax_gluon(x, V)


@pytest.mark.parametrize("which", ["x", "V"])
def test_refuses_inputs_that_require_grad(which):
    """Forward only: a gradient would silently go missing, so an input needing one is refused."""
    x, V = softmax_matmul_inputs(1, 16, 16, 16, torch.bfloat16)
    (x if which == "x" else V).requires_grad_()
    with pytest.raises(RuntimeError, match="fused_softmax_gluon has no backward, and x or V requires grad"):
        fused_softmax_gluon(x, V)
    with torch.no_grad():  # no gradient wanted: the usual checks apply (here: not this machine's kernel)
        assert gluon_softmax_applies(x, V) == gluon_softmax_applies(x.detach(), V.detach())


@needs_hopper_gluon
@pytest.mark.parametrize("layout", ["d2 not a multiple of 8", "V transposed"])
def test_refuses_what_tma_cannot_read(layout):
    """TMA needs 16-byte strides and a contiguous last dimension: the predicate says no, by name."""
    if layout == "V transposed":
        x, _ = softmax_matmul_inputs(1, 64, 64, 64, torch.bfloat16)
        V = randn((1, 64, 64), torch.bfloat16, seed=2).transpose(1, 2)
        name = "V's last dimension"
    else:
        x, V = softmax_matmul_inputs(1, 64, 100, 64, torch.bfloat16)  # x's row stride: 200 bytes
        name = "x's address"
    assert not gluon_softmax_applies(x, V)
    with pytest.raises(ValueError, match=name):
        fused_softmax_gluon(x, V)


def test_launch_refuses_a_ring_past_shared_memory():
    """3 slots of 128 x 256 V tiles are 240 KiB: refused by name before any launch."""
    GluonSoftmaxLaunch(128, 256, 2).check()
    with pytest.raises(KernelCapacityError, match="shared memory"):
        GluonSoftmaxLaunch(128, 256, 3).check()


def test_launch_tiles_follow_the_shape():
    """128-wide tiles where d2 and d3 allow, down to 16 (the MMA's K step) for narrow ones."""
    assert gluon_softmax_launch(8192, 512) == gluon_softmax_launch(256, 512)
    assert (gluon_softmax_launch(8192, 512).block_n, gluon_softmax_launch(8192, 512).block_d3) == (128, 128)
    assert (gluon_softmax_launch(8, 40).block_n, gluon_softmax_launch(8, 40).block_d3) == (16, 64)
