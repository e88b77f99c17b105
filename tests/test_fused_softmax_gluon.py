"""softmax(x) @ V by the Gluon kernel for Hopper (``fused_softmax_gluon``) against float64.

Judged like ``fused_softmax`` (tests/test_fused_softmax_matmul.py): at most twice the error of
``softmax_mult`` in the inputs' own dtype, against ``softmax_mult`` in float64 on the same rounded
inputs (``support.assert_close``). The kernel only compiles for sm_90 with Gluon: its tests skip
elsewhere, except the ones that check it refuses inputs it cannot take, which run everywhere.

Shapes are chosen against the kernel's tiles (128 rows of x per program, 64 for each of its two
consumer warpgroups; d2 in steps of up to 128 (64 in float32), d3 in tiles of up to 256 (128
under tf32x3), a ring of 2 slots) and TMA's rule that every stride but the last is a multiple of
16 bytes (d2 and d3 multiples of 8 for contiguous 16-bit inputs, d2 of 4 for float32 x; float32
V is copied into its TF32 parts first, and may have any strides).

float32 follows ``torch.get_float32_matmul_precision()`` (one TF32 product under 'high', three
under 'highest'); those tests pin it and compare with PyTorch under the same setting.
"""

from __future__ import annotations

import pytest
import torch

import fused_softmax_matmul as fsm
from fused_softmax_matmul import (
    FUSED_MAX_D3, GLUON_BLOCK_M, GluonSoftmaxLaunch, fused_softmax, fused_softmax_gluon, fused_softmax_path,
    fused_softmax_plan, gluon_softmax_launch, gluon_softmax_unsupported, softmax_mult,
)
from online_softmax import KernelCapacityError
import support
from support import DEVICE, DTYPES, ON_GPU, assert_close, extreme_logits, masked_logits, randn, softmax_matmul_inputs

matmul_precision = support.matmul_precision  # the fixture, under this module's name for pytest


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
    assert gluon_softmax_unsupported(x, V) is None, gluon_softmax_unsupported(x, V)
    out = fused_softmax_gluon(x, V, launch=launch)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], x.shape[1], V.shape[2]), (out.dtype, tuple(out.shape))
    assert_close(out, softmax_mult(x.double(), V.double()), softmax_mult(x, V))
    return out


# (batch, d1, d2, d3), logit scale: the code path each exercises.
CASES = {
    # Whole tiles: one row block, two d2 steps, one d3 tile.
    "128x128x128": ((1, 128, 128, 128), 1.0),
    # d1 = 100: the second consumer has 36 live rows (TMA reads zeros past d1, the store masks
    # them); d2 = 200: a last step of 8 columns (zeros past d2 masked to -inf); d3 = 40: one
    # 64-wide d3 tile, 24 columns of it past d3.
    "ragged 100x200x40": ((2, 100, 200, 40), 1.0),
    # d2 = 8 under the least step of 16; d3 = 8 under the least tile of 16; 17 rows, none for
    # the second consumer.
    "tiny 17x8x8": ((1, 17, 8, 8), 1.0),
    # 16 steps through a 4-slot ring (each slot's barriers change phase four times), two d3
    # tiles of 256 with 8 live columns in the second, a second row block with 2 live rows,
    # logits of size 8 so the running max moves.
    "ring 130x1000x264": ((3, 130, 1000, 264), 8.0),
    # The spec's d3 = 512 (two d3 tiles per row block) with 64 steps of d2.
    "d3 512": ((2, 128, 4096, 512), 1.0),
    # Logits of size 100: earlier steps' weights underflow to 0 when the max grows.
    "scale 100": ((2, 70, 520, 24), 100.0),
}


@pytest.mark.memcheck
@needs_hopper_gluon
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_against_float64(case, dtype_name):
    shape, scale = CASES[case]
    x, V = softmax_matmul_inputs(*shape, DTYPES[dtype_name], scale=scale)
    check_gluon(x, V)


@needs_hopper_gluon
@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("case", CASES)
def test_float32_against_float64(case, precision, matmul_precision):
    """float32 as TF32 products: one of the weights and V rounded to TF32 ('high'), or tf32x3
    ('highest'), each within twice PyTorch's error under the same setting."""
    matmul_precision(precision)
    shape, scale = CASES[case]
    x, V = softmax_matmul_inputs(*shape, torch.float32, scale=scale)
    check_gluon(x, V)


@needs_hopper_gluon
@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("launch", [GluonSoftmaxLaunch(32, 128, 2), GluonSoftmaxLaunch(16, 64, 3, pingpong=True),
                                    GluonSoftmaxLaunch(64, 64, 2, lazy_rescale=False)], ids=str)
def test_float32_launches(launch, precision, matmul_precision):
    """float32 through other tiles: 32- and 16-wide steps of d2, three slots, the consumers in
    turns, a rescale at every step, d3 tiles of 128 and 64 (three and five over d3 264, 8 live
    columns in the last); two row blocks, 2 live rows in the second."""
    matmul_precision(precision)
    x, V = softmax_matmul_inputs(2, 130, 1000, 264, torch.float32, scale=8.0)
    check_gluon(x, V, launch)


@needs_hopper_gluon
@pytest.mark.parametrize("precision", ["high", "highest"])
def test_float32_v_of_any_strides(precision, matmul_precision):
    """float32 V is copied into its parts, so any strides do: V transposed, with d3 = 37, and x a
    column slice whose rows are 16-byte aligned (d2 = 99, row stride 104: V's parts padded to
    rows of 100); masked logits.

    At this shape torch's product under 'high' is a full float32 one (error 1.6e-7 on an H100),
    not TF32, so the bound is that of PyTorch's TF32 arithmetic instead: softmax(x) and V rounded
    to TF32 (to nearest, as cuBLAS converts), their product in float64, rounded to float32."""
    matmul_precision(precision)
    x = masked_logits((2, 70, 104), torch.float32)[:, :, :99]
    V = randn((2, 37, 99), torch.float32, seed=2).transpose(1, 2)
    if precision == "highest":
        check_gluon(x, V)
        return
    out = fused_softmax_gluon(x, V)

    def tf32(t):
        return ((t.contiguous().view(torch.int32) + 0x1000) & -8192).view(torch.float32)

    torch_tf32 = torch.bmm(tf32(torch.softmax(x, dim=-1)).double(), tf32(V).double()).float()
    assert_close(out, softmax_mult(x.double(), V.double()), torch_tf32)


@needs_hopper_gluon
def test_float32_rows_tma_cannot_read(matmul_precision):
    """Contiguous float32 x with d2 = 99 has rows of 396 bytes, which TMA cannot step by: the
    kernel refuses it by name, and fused_softmax takes a Triton path at a shape its rule sends to
    the Gluon kernel otherwise. Under 'highest': at this odd d2 torch's own product may be a full
    float32 one, against which only tf32x3 is judged fairly."""
    matmul_precision("highest")
    x, V = softmax_matmul_inputs(1, 128 * fsm._sm_count(torch.device("cuda")), 99 * 11, 64, torch.float32)
    assert gluon_wins(*x.shape, 64, fsm._sm_count(x.device), torch.float32, "highest")
    assert "x's address" in gluon_softmax_unsupported(x, V)
    with pytest.raises(ValueError, match="x's address"):
        fused_softmax_gluon(x, V)
    assert fused_softmax_path(x, V) != "gluon"
    assert_close(fused_softmax(x, V), softmax_mult(x.double(), V.double()), softmax_mult(x, V))


@needs_hopper_gluon
def test_float32_v_expanded(matmul_precision):
    """float32 V broadcast along d2 (stride 0, every row alike): its parts are read through the
    strides; softmax rows sum to 1, so every output row is V's row, to TF32's rounding."""
    matmul_precision("highest")
    x = randn((2, 130, 1000), torch.float32, seed=6, scale=4.0)
    V = randn((2, 1, 40), torch.float32, seed=7).expand(2, 1000, 40)
    out = check_gluon(x, V)
    assert ((out - V[:, :1]).abs() <= 1e-5 * V.abs().amax()).all()


@needs_hopper_gluon
def test_a_kept_float32_launch_follows_the_setting(matmul_precision):
    """The kept float32 launches are kept by setting: calls under 'high', then 'highest', then
    'high' again each give what fused_softmax_gluon gives under that setting (one or three TF32
    products), from two kept chains."""
    x, V = softmax_matmul_inputs(*_ruled_shape(64), torch.float32, scale=4.0)
    fsm._FUSED_REPLAYS.clear()
    for precision in ("high", "highest", "high"):
        matmul_precision(precision)
        assert torch.equal(fused_softmax(x, V), fused_softmax_gluon(x, V)), precision
    assert len(fsm._FUSED_REPLAYS) == 2
    matmul_precision("high")
    high = fused_softmax(x, V)
    matmul_precision("highest")
    assert not torch.equal(high, fused_softmax(x, V))  # one product or three: not the same bits


@needs_hopper_gluon
@pytest.mark.parametrize("launch", [GluonSoftmaxLaunch(64, 256, 4, pingpong=True), GluonSoftmaxLaunch(32, 256, 6),
                                    GluonSoftmaxLaunch(128, 256, 2), GluonSoftmaxLaunch(64, 128, 4),
                                    GluonSoftmaxLaunch(64, 256, 4, lazy_rescale=False),
                                    GluonSoftmaxLaunch(128, 256, 2, p_smem=True),
                                    GluonSoftmaxLaunch(64, 128, 3, pingpong=True, p_smem=True)], ids=str)
@pytest.mark.parametrize("scale", [8.0, 100.0])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_other_launches(launch, scale, dtype_name):
    """Launches beside the default: the consumers taking turns, 32- and 128-wide steps of d2 (32
    or 8 of them through 6 or 2 slots), 128-wide d3 tiles (three over 264, 8 live columns in the
    last), a rescale at every step, and the weights through shared memory (the default for
    bfloat16 at some d3 only); logits of size 8 and 100 (the lazy rescale's skipped and taken
    steps)."""
    x, V = softmax_matmul_inputs(2, 130, 1000, 264, DTYPES[dtype_name], scale=scale)
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_refuses_cpu_tensors_and_float64(dtype):
    """CPU tensors (float32: by the kernel's predicate in the interpreter, by the input checks
    where Triton compiles) and float64 anywhere are refused by name."""
    x, V = (randn((1, 16, 16), dtype, seed=seed) for seed in (0, 1))
    if dtype == torch.float32:
        x, V = x.cpu(), V.cpu()
    assert gluon_softmax_unsupported(x, V) is not None
    error, message = ((ValueError, "fused_softmax_gluon cannot take these inputs|x is on cpu")
                      if dtype == torch.float32 else (TypeError, "x must be float32, float16 or bfloat16"))
    with pytest.raises(error, match=message):
        fused_softmax_gluon(x, V)


@pytest.mark.parametrize("which", ["x", "V"])
def test_refuses_inputs_that_require_grad(which):
    """Forward only: a gradient would silently go missing, so an input needing one is refused."""
    x, V = softmax_matmul_inputs(1, 16, 16, 16, torch.bfloat16)
    (x if which == "x" else V).requires_grad_()
    with pytest.raises(RuntimeError, match="fused_softmax_gluon has no backward, and x or V requires grad"):
        fused_softmax_gluon(x, V)
    with torch.no_grad():  # no gradient wanted: the usual checks apply (here: not this machine's kernel)
        assert gluon_softmax_unsupported(x, V) == gluon_softmax_unsupported(x.detach(), V.detach())


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
    assert name in gluon_softmax_unsupported(x, V)
    with pytest.raises(ValueError, match=name):
        fused_softmax_gluon(x, V)


def test_launch_refuses_a_ring_past_shared_memory():
    """3 slots of 128 x 128 x tiles and 128 x 256 V tiles are 288 KiB: refused by name before any launch."""
    GluonSoftmaxLaunch(128, 256, 2).check()
    GluonSoftmaxLaunch(128, 256, 2, p_smem=True).check()  # 192 KiB and the weights' 32
    GluonSoftmaxLaunch(256, 16, 3).check()  # 3 x (64 + 8) KiB
    with pytest.raises(KernelCapacityError, match="the weights' 128 x 256 need 280 KiB"):
        GluonSoftmaxLaunch(256, 16, 3, p_smem=True).check()  # and 64 KiB of weights
    with pytest.raises(KernelCapacityError, match="shared memory"):
        GluonSoftmaxLaunch(128, 256, 3).check()
    with pytest.raises(ValueError, match="p_smem is for 16-bit inputs"):
        GluonSoftmaxLaunch(64, 128, 2, p_smem=True).check(torch.float32)


def test_launch_tiles_follow_the_shape(matmul_precision):
    """d3 tiles of up to 256 and d2 steps of up to 128 where d2 and d3 allow, down to 16 (the MMA's
    K step) for narrow ones; 2 slots; bfloat16 weights through shared memory where one d3 tile of
    more than 64 columns covers d3. float32: steps of up to 64, and d3 tiles of up to 128 under 'highest' (two V parts
    a slot)."""
    assert gluon_softmax_launch(8192, 512) == gluon_softmax_launch(256, 512) == GluonSoftmaxLaunch(128, 256, 2)
    assert gluon_softmax_launch(8, 40) == GluonSoftmaxLaunch(16, 64, 2)
    assert gluon_softmax_launch(1000, 96) == GluonSoftmaxLaunch(128, 128, 2, p_smem=True)
    assert gluon_softmax_launch(8192, 256) == GluonSoftmaxLaunch(128, 256, 2, p_smem=True)
    assert gluon_softmax_launch(8192, 256, torch.float16) == GluonSoftmaxLaunch(128, 256, 2)
    matmul_precision("high")
    assert gluon_softmax_launch(8192, 512, torch.float32) == GluonSoftmaxLaunch(64, 256, 2)
    assert gluon_softmax_launch(8, 40, torch.float32) == GluonSoftmaxLaunch(16, 64, 2)
    matmul_precision("highest")
    assert gluon_softmax_launch(8192, 512, torch.float32) == GluonSoftmaxLaunch(64, 128, 2)
    GluonSoftmaxLaunch(64, 128, 2).check(torch.float32)
    with pytest.raises(KernelCapacityError, match="2 x 32 x 256 V tiles of torch.float32"):
        GluonSoftmaxLaunch(32, 256, 2).check(torch.float32)  # fits shared memory, not the registers
    with pytest.raises(KernelCapacityError, match="shared memory"):
        GluonSoftmaxLaunch(64, 128, 3).check(torch.float32)  # 3 x (32 + 2 x 32) KiB


@pytest.mark.parametrize("parts", [1, 2])
def test_float32_v_operand(parts):
    """The TF32 parts of float32 V, d3 by d2 (the pass runs in the interpreter too): part 0 is V
    rounded to the nearest TF32 value (its low 13 bits clear, within half a TF32 unit), part 1
    the rest, exactly; rows padded to 16 bytes; V of other strides read in place. float32's
    largest values, which round to inf, are truncated instead (their parts stay finite)."""
    V = randn((2, 9, 30), torch.float32, seed=4).transpose(1, 2)[:, :, :7]  # (2, 30, 7) of strides (270, 1, 30)
    big = torch.finfo(torch.float32).max
    V[0, 3, 2], V[1, 29, 6] = big, -big
    out = fsm.gluon_softmax_v_operand(V, parts)
    assert out.shape == (2, parts, 7, 30) and out.stride() == (parts * 7 * 32, 7 * 32, 32, 1)
    want = V.transpose(1, 2)
    hi = out[:, 0]
    assert not (hi.view(torch.int32) & 0x1FFF).any() and torch.isfinite(hi).all()
    assert ((hi - want).abs() <= want.abs() * 2.0 ** -10).all()
    rounded = want.abs() < big
    assert ((hi - want).abs()[rounded] <= want.abs()[rounded] * 2.0 ** -11).all()
    if parts == 2:
        assert torch.equal(hi + out[:, 1], want)


@pytest.mark.parametrize("field, value", [("block_n", 48), ("block_d3", 512), ("stages", 1), ("pingpong", 1),
                                          ("p_smem", 1)])
def test_launch_refuses_bad_fields(field, value):
    """Each field is checked by name: powers of two within the MMA's and TMA's bounds, 2 to 8
    slots, a bool."""
    fields = {**dict(block_n=64, block_d3=256, stages=4, pingpong=False), field: value}
    with pytest.raises((ValueError, TypeError), match=field):
        GluonSoftmaxLaunch(**fields).check()


# ----------------------------------------------------------------------------------------------
# fused_softmax's "gluon" path
# ----------------------------------------------------------------------------------------------
def gluon_wins(batch, d1, d2, d3, sms, dtype=torch.bfloat16, setting="highest") -> bool:
    """Whether a plain call with inputs TMA reads takes the Gluon kernel on sm_90 of ``sms`` SMs (the rule)."""
    plan = fused_softmax_plan(batch, d1, d2, d3, dtype, sms=sms, capability=(9, 0), setting=setting)
    return plan.path == "gluon"


def test_the_rule_is_a_function_of_the_shape():
    """d3 up to 256 with d2 from 512 (d3 <= 128) or 1024 and programs (128 rows each) for 7 in 10
    SMs; or two d3 tiles (d3 384 to 512) with d2 from 3000 and programs for 96 in 100 SMs."""
    assert gluon_wins(16, 2048, 8192, 64, 132) and gluon_wins(16, 2048, 1024, 256, 132)
    assert gluon_wins(16, 2048, 512, 128, 132) and not gluon_wins(16, 2048, 512, 256, 132)
    assert not gluon_wins(16, 2048, 256, 64, 132)  # short rows: the Triton kernel's
    assert gluon_wins(16, 2048, 8192, 512, 132) and gluon_wins(8, 2048, 3000, 384, 132)  # two d3 tiles
    assert not gluon_wins(16, 2048, 2048, 512, 132)  # two d3 tiles, shorter rows: materialised
    assert not gluon_wins(16, 2048, 8192, 320, 132)  # the second tile part-empty: not measured
    assert not gluon_wins(16, 2048, 8192, 1024, 132)  # four: materialised
    assert gluon_wins(4, 2048, 8192, 512, 132) and not gluon_wins(4, 1536, 8192, 512, 132)  # 128, 96
    assert gluon_wins(8, 1536, 4096, 64, 132)  # 96 programs for 132 SMs
    assert not gluon_wins(8, 1000, 8192, 64, 132)  # 64
    assert gluon_wins(8, 1000, 8192, 64, 64) and not gluon_wins(16, 2048, 8192, 64, None)


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_the_float32_rule(precision):
    """float32, from d2 1024 (below, the kept launch's host time passes its GPU time): programs
    (128 rows, a d3 tile of up to 256 under 'high' or 128 under 'highest') for 7 in 10 SMs, at
    d3 up to 512 (nothing wider was measured); with fewer, down to 64 on 132 SMs, under 'high'
    only and from d2 2048."""
    def wins(*shape):
        return gluon_wins(*shape, torch.float32, precision)
    assert wins(16, 2048, 1024, 512, 132) and wins(16, 2048, 8192, 64, 132)
    assert not wins(16, 2048, 256, 512, 132) and not wins(8, 1000, 256, 64, 132)
    assert not wins(8, 1000, 1024, 64, 132)  # 64 programs
    assert wins(8, 1000, 2048, 64, 132) == (precision == "high")
    assert wins(8, 1000, 1024, 256, 132) == (precision == "highest")  # 128 programs there
    assert not wins(1, 128, 8192, 128, 132)  # one program
    assert not wins(16, 2048, 8192, 1024, 132)  # d3 past what was measured
    assert not wins(16, 2048, 8192, 64, None)


def test_a_gluon_launch_asks_for_the_gluon_kernel():
    """A GluonSoftmaxLaunch is the Gluon path; where the kernel cannot run (here, a CPU tensor or
    no Hopper) fused_softmax says so by name instead of running something else."""
    x, V = softmax_matmul_inputs(1, 16, 16, 16, torch.bfloat16)
    launch = GluonSoftmaxLaunch(16, 16)
    assert fused_softmax_plan(1, 16, 16, 16, torch.bfloat16, sms=132, capability=(9, 0), launch=launch).path == "gluon"
    if gluon_softmax_unsupported(x, V) is not None:
        with pytest.raises(ValueError, match="GluonSoftmaxLaunch, but the Gluon kernel cannot take these inputs"):
            fused_softmax(x, V, launch=launch)
    with pytest.raises(ValueError, match="materialize=False asks for the Triton kernel and launch is a GluonSoftmaxLaunch"):
        fused_softmax(x, V, launch=launch, materialize=False)
    with pytest.raises(ValueError, match="materialize=True does not run"):
        fused_softmax(x, V, launch=launch, materialize=True)
    with pytest.raises(TypeError, match="launch must be a FusedLaunch or a GluonSoftmaxLaunch"):
        fused_softmax(x, V, launch=(64, 4, 3))


def _ruled_shape(d3: int) -> tuple:
    """A (batch, d1, d2, d3) the rule sends to the Gluon kernel on this GPU: a program of 128 rows
    (and a d3 tile) for every SM, d2 1024, or 3072 past d3 256 (two d3 tiles)."""
    return (1, 128 * fsm._sm_count(torch.device("cuda")), 1024 if d3 <= 256 else 3072, d3)


@needs_hopper_gluon
@pytest.mark.parametrize("dtype_name, precision", [("bfloat16", "highest"), ("float32", "high"), ("float32", "highest")])
@pytest.mark.parametrize("d3", [64, 256, 512])
def test_fused_softmax_runs_the_gluon_kernel_where_the_rule_says(d3, dtype_name, precision, matmul_precision):
    """A plain call at a ruled shape takes the Gluon path, and gives what fused_softmax_gluon gives."""
    matmul_precision(precision)
    x, V = softmax_matmul_inputs(*_ruled_shape(d3), DTYPES[dtype_name], scale=4.0)
    assert fused_softmax_path(x, V) == "gluon"
    out = fused_softmax(x, V)
    assert torch.equal(out, fused_softmax_gluon(x, V))
    assert_close(out, softmax_mult(x.double(), V.double()), softmax_mult(x, V))
    assert fused_softmax_path(x, V, materialize=False) == "fused"


@needs_hopper_gluon
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_gradients_through_the_gluon_forward(dtype_name):
    """A GluonSoftmaxLaunch with autograd recording at a ruled shape: the Gluon forward saves the
    log-sum-exp the Triton backward reads; the forward and both gradients against float64,
    PyTorch's error the bound. (The rule itself leaves calls that record to the Triton kernel.)"""
    from test_fused_softmax_matmul import check_gradients

    x, V = softmax_matmul_inputs(*_ruled_shape(64), DTYPES[dtype_name], scale=4.0)
    x.requires_grad_()
    V.requires_grad_()
    block = fsm.fused_blocks(x.shape[2], V.shape[2], x.dtype)
    check_gradients(x, V, gluon_softmax_launch(x.shape[2], V.shape[2], x.dtype), (block, block), seed=3)


@needs_hopper_gluon
def test_gradients_under_a_gluon_launch_at_a_wide_d3():
    """A GluonSoftmaxLaunch at d3 > 128 with grad: the Gluon forward and the Triton backward
    (not the rule's choice there, where the materialised path's backward is torch's)."""
    from test_fused_softmax_matmul import check_gradients

    x, V = softmax_matmul_inputs(2, 130, 1000, 264, torch.bfloat16, scale=4.0)
    check_gradients(x.requires_grad_(), V.requires_grad_(), GluonSoftmaxLaunch(128, 256, 2), (32, 32), seed=5)


@needs_hopper_gluon
@pytest.mark.parametrize("d3", [64, 256])
def test_calls_that_record_autograd_keep_the_triton_paths(d3):
    """The rule's Gluon kernel serves calls without autograd recording only: with grad the path
    is the Triton kernel's (d3 <= 128) or the materialised one, as the plan's rule says."""
    x, V = softmax_matmul_inputs(*_ruled_shape(d3), torch.bfloat16)
    assert fused_softmax_path(x, V) == "gluon"
    x.requires_grad_()
    assert fused_softmax_path(x, V) == ("fused" if d3 <= FUSED_MAX_D3 else "materialized")
    with torch.no_grad():
        assert fused_softmax_path(x, V) == "gluon"


@needs_hopper_gluon
def test_compiled_calls_take_the_triton_kernel():
    """Under torch.compile the path is the Triton one: the Gluon launch is no op the compiler sees."""
    x, V = softmax_matmul_inputs(*_ruled_shape(64), torch.bfloat16)
    out = torch.compile(fused_softmax, fullgraph=True)(x, V)
    torch._dynamo.reset()
    assert_close(out, softmax_mult(x.double(), V.double()), softmax_mult(x, V))


def test_a_gluon_launch_refuses_a_tensor_subclass():
    """A fake tensor (shape propagation) goes through the op, which only has the Triton kernel: a
    GluonSoftmaxLaunch is refused by name rather than read as a FusedLaunch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, V = (torch.empty((1, 16, 16), dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        with pytest.raises(ValueError, match="a GluonSoftmaxLaunch runs in eager calls only"):
            fused_softmax(x, V, launch=GluonSoftmaxLaunch(16, 16))


@needs_hopper_gluon
@pytest.mark.parametrize("dtype_name, precision", [("bfloat16", "highest"), ("float32", "high"), ("float32", "highest")])
def test_a_kept_gluon_launch_serves_fresh_inputs(monkeypatch, dtype_name, precision, matmul_precision):
    """A plain call on the gluon path keeps its launch (descriptors rebuilt from the kept ones;
    float32: after V's parts, made into a fresh operand): a second call with fresh inputs of the
    same key replays it without the checked path, and both give what fused_softmax_gluon gives."""
    from online_softmax import DescriptorReplay, ReplayChain

    matmul_precision(precision)
    dtype = DTYPES[dtype_name]
    shape = _ruled_shape(64)
    x, V = softmax_matmul_inputs(*shape, dtype, scale=4.0)
    fsm._FUSED_REPLAYS.clear()
    first = fused_softmax(x, V)
    kept = list(fsm._FUSED_REPLAYS.values())
    assert len(kept) == 1 and isinstance(kept[0], ReplayChain if dtype == torch.float32 else DescriptorReplay)
    x2, V2 = softmax_matmul_inputs(*shape, dtype, seed=9, scale=4.0)
    want = fused_softmax_gluon(x2, V2)

    def checked_path(*args, **kwargs):
        raise AssertionError("the kept launch should have served this call")
    monkeypatch.setattr(fsm, "_plan_call", checked_path)
    second = fused_softmax(x2, V2)
    monkeypatch.undo()
    assert torch.equal(second, want)
    assert torch.equal(first, fused_softmax_gluon(x, V))


def test_the_route_is_plain_eager_calls():
    """A plain call may take the Gluon kernel, and so may one under no_grad on an input that
    requires grad; one that records autograd may not (the Function, with the Triton backward),
    nor one on a fake tensor (the custom op): the call the plan is made for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, V = softmax_matmul_inputs(1, 16, 16, 16, torch.bfloat16)
    assert fsm._plan_call(x, V, None, None, None, None).call == "eager"
    assert fsm._plan_call(x.requires_grad_(), V, None, None, None, None).call == "autograd"
    with torch.no_grad():
        assert fsm._plan_call(x, V, None, None, None, None).call == "eager"
    with FakeTensorMode():
        fake = torch.empty((1, 16, 16), dtype=torch.bfloat16, device=DEVICE)
        assert fsm._plan_call(fake, fake, None, None, None, None).call == "op"
