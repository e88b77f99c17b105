"""softmax(x @ W): every Triton version against float64, bad input, and the launch choices.

Accuracy follows FlashAttention's rule (``support.assert_close``): the error against float64 may
be at most twice PyTorch's own in the same dtype. Shapes are small because the interpreter costs
about 3 ms per program per K step; tile overrides make small shapes reach the multi-tile paths.
"""

from __future__ import annotations

import pytest
import torch
import triton

from fused_softmax_matmul import (
    SIMPLE_MAX_CLASSES, MatmulLaunch, check_launch, matmul, matmul_softmax_fused_simple, matmul_softmax_fused_tiled,
    matmul_softmax_plan, matmul_softmax_ref, split_k_slices, tiled_launch, _device_facts, _plan_of,
)
import support
from support import (
    DEVICE, DTYPES, MATMUL_SOFTMAX_IMPLS, ON_GPU, UNIT_ROUNDOFF, assert_close, matmul_softmax_inputs, needs_gpu,
    record_files,
)

# The versions under test: all but the PyTorch reference they are judged against.
TRITON_IMPLS = {name: fn for name, fn in MATMUL_SOFTMAX_IMPLS.items() if name.startswith("triton_")}


def launch_for(impl: str, C: int, tiles: tuple[int, ...] | None) -> MatmulLaunch | None:
    """A (block_b, block_c, block_k[, split_k]) override as each version takes it; None: the
    wrapper's choice.

    The simple kernel holds all C classes in one tile and never splits K, so it keeps the rows
    and K step of the override but widens the class tile to cover C.
    """
    if tiles is None:
        return None
    block_b, block_c, block_k, split_k = (*tiles, 1)[:4]
    if impl == "triton_fused_simple":
        block_c, split_k = max(block_c, triton.next_power_of_2(C)), 1
    return MatmulLaunch(block_b, block_c, block_k, split_k=split_k)


# B, K, C, tiles (block_b, block_c, block_k) or None, layout, logit scale: the code path each exercises.
CASES = {
    # The smallest benchmark size itself, wrappers' own tiles: one class tile, so the tiled
    # wrapper runs the one-launch kernel; simple takes 16-wide class tiles (C = 10 + 6 padding).
    "64x128x10": (64, 128, 10, None, "contiguous", 1.0),
    # 256x512x50 and 1024x1024x100 scaled down by 8 and ~20: still one class tile each.
    "32x64x50": (32, 64, 50, None, "contiguous", 1.0),
    "48x96x100": (48, 96, 100, None, "contiguous", 1.0),
    # Wrappers' own 128-wide class tiles: 3 tiles, the last holding 44 classes -> tile kernel,
    # then one rescale step whose (TILES, BLOCK_C) block masks a fourth, absent tile.
    "40x64x300": (40, 64, 300, None, "contiguous", 1.0),
    # C = 1: every probability is exactly 1; 15 padding classes must weigh nothing (-inf).
    "C=1": (5, 16, 1, None, "contiguous", 1.0),
    # Odd K = 37 with 16-deep K steps: 3 steps, the last with 5 live entries.
    "odd_K": (9, 37, 20, (16, 32, 16), "contiguous", 1.0),
    # B = 17 rows in 16-row blocks (a block of 1 live row) and C = 33 in 32-wide tiles
    # (a tile of 1 live class): masks on both edges of the tile kernel and the rescale.
    "B,C past tile": (17, 32, 33, (16, 32, 16), "contiguous", 1.0),
    # 1025 class tiles of 16 > the 1024 tiles a step of the rescale's merge covers
    # (RESCALE_MERGE), and > the 256 a step of its scaling covers (4096 // 16): the merge takes
    # two steps, the scaling five. Row 0's largest logit is in the last class, so its maximum
    # grows in the second merge step and the first step's sum must be rescaled; row 1's is in the
    # first class, so the second step must keep the first's maximum: at scale 4 the peak (~190)
    # is ~180 above the second step's logits, so using the step's own maximum would overflow exp.
    # Too wide for the simple kernel.
    "rescale 2 steps": (2, 16, 16400, (16, 16, 16), "max at both ends", 4.0),
    # Strided x (row stride 2K, column stride 2) and transposed W (strides 1, K) read in place.
    "x strided": (24, 40, 70, (16, 32, 16), "x_strided", 1.0),
    "W transposed": (24, 40, 70, (16, 32, 16), "W_transposed", 1.0),
    # W K-major with K, C and W's class stride all multiples of 8: its class stride goes divided
    # by the vector (4 float32 or 8 16-bit values), as a row-major W's K stride does; with K split
    # over class tiles too.
    "W transposed, vectors": (24, 48, 72, (16, 32, 16), "W_transposed", 1.0),
    "W transposed, split K, class tiles": (20, 96, 72, (16, 32, 16, 3), "W_transposed", 1.0),
    # x laid out as a transpose (strides (1, B), as x^T in dW = x^T @ dz) with B, K, C and W's K
    # stride multiples of 8: x's K stride goes divided (X_TRANSPOSED); alone, with K split, and
    # with W K-major too.
    "x transposed, vectors": (24, 48, 72, (16, 32, 16), "x_transposed", 1.0),
    "x transposed, split K, class tiles": (24, 96, 72, (16, 32, 16, 3), "x_transposed", 1.0),
    "x and W transposed": (24, 48, 72, (16, 32, 16), "both_transposed", 1.0),
    "x transposed, no vectors": (21, 40, 70, (16, 32, 16), "x_transposed", 1.0),
    # K split in 3 slices of 48 (the last holds 4) over 3 row blocks (the last holds 8 rows):
    # split_k_kernel, in matmul (unfused) and in the tiled wrapper.
    "split K": (40, 100, 50, (16, 64, 16, 3), "contiguous", 1.0),
    # 8 slices asked of 3 K steps: 3 slices of one step each; C = 20 in a 32-wide tile.
    "split K past its steps": (17, 37, 20, (16, 32, 16, 8), "contiguous", 1.0),
    # Split K with logits of size ~1000: the partial sums are added before the maximum is taken.
    "split K, extreme logits": (20, 64, 30, (16, 32, 16, 4), "contiguous", 1000.0),
    # K split over several class tiles: 3 slices x 2 row blocks x 3 class tiles of 32 (the last
    # holds 6 classes); the tiled wrapper's last slice of each tile writes its part and (max,
    # sum), then the rescale; matmul's writes the tile's logits.
    "split K, class tiles": (20, 100, 70, (16, 32, 16, 3), "contiguous", 1.0),
    # The same with logits of size ~1000: each tile's maximum from the summed partials.
    "split K, class tiles, extreme logits": (20, 64, 70, (16, 32, 16, 4), "contiguous", 1000.0),
    # Logits of size ~1000 (in fp16 range): exp overflows unless the maximum is subtracted, and
    # far tiles' factors exp(tile max - row max) underflow to 0.
    "extreme logits": (20, 32, 100, (16, 32, 16), "contiguous", 1000.0),
}


def build_inputs(B, K, C, dtype, layout, scale):
    if layout != "max at both ends":
        return matmul_softmax_inputs(B, K, C, dtype, layout=layout, scale=scale)
    x, W = matmul_softmax_inputs(B, K, C, dtype, scale=scale)
    # Row 0's logit on the last class, row 1's on the first: 3 |x_r|^2 / sqrt(K) ~ 3 scale^2 sqrt(K),
    # while the other logits are ~ scale N(0, 1) (~ 3 scale^2 N(0, 1) for the cross terms).
    W[:, -1] = (3 * x[0].float() / K ** 0.5).to(dtype)
    W[:, 0] = (3 * x[1].float() / K ** 0.5).to(dtype)
    x_ = x.float()
    assert (x_ @ W.float()).argmax(dim=1).tolist() == [C - 1, 0], "the inputs no longer test both ends"
    return x, W


def correctness_params():
    for case, (B, K, C, tiles, layout, scale) in CASES.items():
        for impl in TRITON_IMPLS:
            if impl == "triton_fused_simple" and C > SIMPLE_MAX_CLASSES:
                continue  # refused by design: test_simple_refuses_too_many_classes
            for dtype in DTYPES:
                # One dtype of each case and kernel under compute-sanitizer: its paths are the dtypes' paths.
                marks = pytest.mark.memcheck if dtype == "float16" else ()
                yield pytest.param(impl, dtype, B, K, C, tiles, layout, scale, id=f"{case}-{impl}-{dtype}", marks=marks)


@pytest.mark.parametrize("impl,dtype,B,K,C,tiles,layout,scale", list(correctness_params()))
def test_matches_float64(impl, dtype, B, K, C, tiles, layout, scale):
    x, W = build_inputs(B, K, C, DTYPES[dtype], layout, scale)
    out = TRITON_IMPLS[impl](x, W, launch_for(impl, C, tiles))
    assert out.dtype == x.dtype
    ref64 = torch.softmax(x.double() @ W.double(), dim=-1)
    assert_close(out, ref64, matmul_softmax_ref(x, W))
    # Rows sum to 1 up to the output's rounding: each element is rounded at most twice (the
    # tiled kernel stores exp(logit - tile max), then its rescaled value), each by <= u
    # relative, so the p-weighted error of a row sum is <= 2u; 3u leaves the float64 sum's slack.
    row_sums = out.double().sum(dim=-1)
    assert (row_sums - 1).abs().max().item() <= 3 * UNIT_ROUNDOFF[out.dtype], row_sums
    assert ((out >= 0) & (out <= 1)).all()


@pytest.mark.parametrize("impl", TRITON_IMPLS)
@pytest.mark.parametrize("B,K,C", [(0, 8, 5), (4, 8, 0)], ids=["B=0", "C=0"])
def test_empty_output(impl, B, K, C):
    x, W = matmul_softmax_inputs(B, K, C, torch.float32)
    out = TRITON_IMPLS[impl](x, W)
    assert out.shape == (B, C) and out.dtype == torch.float32


def test_split_k_slices_cover_k_in_at_most_split_k_whole_steps():
    for K in (1, 15, 16, 37, 100, 1000, 4096, 4099):
        for block_k in (16, 32, 64):
            for split_k in (1, 2, 3, 5, 16, 256):
                k_slice, slices = split_k_slices(K, block_k, split_k)
                assert k_slice % block_k == 0 and 1 <= slices <= split_k, (K, block_k, split_k)
                assert (slices - 1) * k_slice < K <= slices * k_slice, (K, block_k, split_k)
    assert split_k_slices(1000, 16, 16) == (64, 16)


def test_simple_refuses_too_many_classes():
    # One past the limit: the error must name C and the limit, before anything is launched.
    x, W = matmul_softmax_inputs(2, 16, SIMPLE_MAX_CLASSES + 1, torch.float32)
    with pytest.raises(ValueError, match=rf"C = {SIMPLE_MAX_CLASSES + 1}.*{SIMPLE_MAX_CLASSES}"):
        matmul_softmax_fused_simple(x, W)


def _good(B=4, K=16, C=8, dtype=torch.float32):
    return matmul_softmax_inputs(B, K, C, dtype)


# name: (x, W, launch) builder, exception type, text the message must contain.
BAD_INPUTS = {
    "x not a tensor": (lambda: ([[1.0]], _good()[1], None), TypeError, "x must be a torch.Tensor"),
    "W not a tensor": (lambda: (_good()[0], 3.0, None), TypeError, "W must be a torch.Tensor"),
    "x 3-D": (lambda: (_good()[0][None], _good()[1], None), ValueError, "x must have 2 dimensions"),
    "W 1-D": (lambda: (_good()[0], _good()[1][0], None), ValueError, "W must have 2 dimensions"),
    "x integer": (lambda: (_good()[0].int(), _good()[1], None), TypeError, "x must be float32"),
    "W dtype differs": (lambda: (_good()[0], _good()[1].half(), None), TypeError, "W has dtype"),
    "K mismatch": (lambda: (_good(K=16)[0], _good(K=8)[1], None), ValueError, "W must have K = 16"),
    "launch not a MatmulLaunch": (lambda: (*_good(), (16, 16, 16)), TypeError, "launch must be a MatmulLaunch"),
    "block_b not a power of two": (lambda: (*_good(), MatmulLaunch(24, 16, 16)), ValueError, "launch.block_b"),
    "block_k below tl.dot's 16": (lambda: (*_good(), MatmulLaunch(16, 16, 8)), ValueError, "launch.block_k"),
    "num_stages zero": (lambda: (*_good(), MatmulLaunch(16, 16, 16, num_stages=0)), ValueError, "launch.num_stages"),
    "split_k zero": (lambda: (*_good(), MatmulLaunch(16, 16, 16, split_k=0)), ValueError, "launch.split_k"),
}


@pytest.mark.parametrize("impl", TRITON_IMPLS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input(case, impl):
    build, error, text = BAD_INPUTS[case]
    x, W, launch = build()
    with pytest.raises(error, match=text):
        TRITON_IMPLS[impl](x, W, launch)


def test_simple_refuses_split_k():
    x, W = _good(C=40)
    with pytest.raises(ValueError, match="launch.split_k must be 1 in the simple kernel"):
        matmul_softmax_fused_simple(x, W, MatmulLaunch(16, 64, 16, split_k=2))


# B, K, C, dtype -> (block_b, block_c, split_k) the tiled wrapper picks on a 132-SM H100.
SPLIT_CHOICES = {
    (64, 128, 10, "float32"): (16, 16, 1),  # 4 K steps: too short to split
    (256, 512, 50, "float32"): (32, 64, 8),  # 8 row blocks x 8 slices of 2 steps
    (1024, 1024, 100, "float32"): (32, 128, 4),  # 32 row blocks x 4 slices
    (4096, 4096, 32768, "bfloat16"): (128, 256, 1),  # many class tiles: never split
    # float32, several class tiles, few of them: 8 (row block, class tile) pairs x 16 slices
    (1, 4096, 1000, "float32"): (16, 128, 16),
    # 16-bit: row blocks down to 64 rows (the warpgroup MMA's height), then class tiles down to
    # 64, then thinner rows or K slices (matmul_tma_probe.txt)
    (32, 4096, 1000, "bfloat16"): (16, 64, 4), (1, 2048, 1000, "bfloat16"): (16, 64, 8),
    (512, 2048, 1000, "bfloat16"): (64, 64, 1), (1024, 4096, 1000, "bfloat16"): (128, 64, 1),
    (256, 2048, 1000, "bfloat16"): (64, 64, 2), (512, 768, 1000, "bfloat16"): (64, 64, 1),
    (32, 768, 1000, "bfloat16"): (16, 64, 1),  # K too short to split
    (1, 768, 50257, "bfloat16"): (16, 256, 1),  # 197 class tiles
}


@pytest.mark.parametrize("B,K,C,dtype", SPLIT_CHOICES)
def test_tiled_launch_splits_k_where_rows_leave_sms_idle(monkeypatch, B, K, C, dtype):
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 132)
    launch = tiled_launch(B, C, DTYPES[dtype], torch.device(DEVICE), K=K)
    assert (launch.block_b, launch.block_c, launch.split_k) == SPLIT_CHOICES[B, K, C, dtype]
    check_launch(launch)


@pytest.mark.parametrize("B,K,block_k,stages", [(4096, 4096, 128, 4), (4096, 768, 128, 4), (512, 4096, 32, 3)])
def test_narrow_float32_class_tiles_take_long_k_steps(monkeypatch, B, K, block_k, stages):
    # 10 classes: one 16-wide tile. Unsplit, K steps of 128 over 4 stages; split (512 rows), the
    # usual 32, so the slices stay as many.
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 132)
    launch = tiled_launch(B, 10, torch.float32, torch.device(DEVICE), K=K)
    assert (launch.block_k, launch.num_stages) == (block_k, stages)
    assert (launch.split_k > 1) == (B == 512)


@pytest.mark.parametrize("B,K,C,dtype,block_b", [
    (32, 2048, 32000, "float32", 32), (1, 4096, 128256, "bfloat16", 16), (20, 768, 50257, "bfloat16", 32),
    (8192, 4096, 128256, "bfloat16", 128),  # the LM head keeps its swept tile
    # float32: 32-row tiles, not 64 where there are many rows, and thinned to 16 only below half
    # the SMs' worth of programs (512 x 1000: 128 programs of 32 rows, kept; 256 x 1000: 64, thinned;
    # both choices measured: outputs/profiles/matmul_tile_probe.txt)
    (512, 2048, 1000, "float32", 32), (256, 2048, 1000, "float32", 16), (4096, 4096, 4096, "float32", 32),
    (8, 768, 1000, "float32", 16),
    # 16-bit likewise: 4096 x 1000 takes 256-row tiles (128 programs, not 256 of 64 rows:
    # outputs/profiles/matmul_pitch_probe.txt; test_l2_bound_16bit_tiles); 512 x 1000 keeps 64
    # rows, narrower class tiles (test_tiled_launch_splits_k_where_rows_leave_sms_idle)
    (4096, 4096, 1000, "bfloat16", 256), (512, 2048, 1000, "bfloat16", 64),
])
def test_tiled_row_block_no_taller_than_the_rows(monkeypatch, B, K, C, dtype, block_b):
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 132)
    launch = tiled_launch(B, C, DTYPES[dtype], torch.device(DEVICE), K=K)
    assert launch.block_b == block_b
    check_launch(launch)


@pytest.mark.parametrize("shape,w_kmajor,tile", [
    # W in L2, its rows no whole sectors or K-major: the fewest values read over whole waves, and
    # no program groups (outputs/profiles/w_lines_probe.txt, l2_tile_rule_probe.txt,
    # l2_tile_steps_probe.txt); (rows, classes, warps, group_b)
    ((4096, 4096, 1000), False, (256, 128, 8, 1)), ((8192, 4096, 1000), True, (256, 128, 8, 1)),  # ties: the taller
    ((4096, 4096, 5000), False, (256, 128, 8, 1)), ((2048, 4096, 1000), False, (128, 128, 8, 1)),
    ((1024, 4096, 1000), True, (128, 64, 4, 1)), ((512, 4096, 1000), False, (64, 64, 4, 1)),
    ((4096, 4096, 2048), True, (256, 128, 8, 1)),
    # a row-major W of whole sectors, a W read from DRAM (250 MiB), C within one default tile:
    # the earlier rule
    ((4096, 4096, 2048), False, (128, 256, 8, 8)), ((4096, 4096, 256), True, (32, 256, 4, 8)),
    # ... except that a K-major W over several class tiles takes 256 x 128 from 256 rows
    # (outputs/profiles/kmajor_gemm_probe.txt, kmajor_tma_probe.txt)
    ((4096, 4096, 32000), True, (256, 128, 8, 8)), ((4096, 4096, 32000), False, (128, 256, 8, 8)),
    ((128, 4096, 32000), True, (128, 256, 8, 8)),
    # rows fewer than the rule's tiles: none taller than B, so the earlier rule (thin rows)
    ((32, 1024, 20000), True, (32, 256, 4, 8)), ((1, 4096, 5000), True, (16, 64, 4, 8)),
    ((100, 4096, 3000), False, (64, 64, 4, 1)),
])
def test_l2_bound_16bit_tiles(monkeypatch, shape, w_kmajor, tile):
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 132)
    B, K, C = shape
    for dtype in (torch.bfloat16, torch.float16):
        launch = tiled_launch(B, C, dtype, torch.device(DEVICE), K=K, w_kmajor=w_kmajor)
        assert (launch.block_b, launch.block_c, launch.num_warps, launch.group_b, launch.split_k) == (*tile, 1)
        check_launch(launch)


@pytest.mark.parametrize("B,n_tiles,block_c,sms,split", [
    (4096, 501, 256, 132, (16, 501)),  # rows enough: one program a row, steps of 4096 values
    (32, 501, 256, 132, (16, 64)),  # 9 programs a row wanted: 8 of 4 steps (the last 53 tiles)
    (1, 501, 256, 132, (1, 2)),  # one row: steps of one tile, two a program
    (3, 19, 16, 8, (2, 4)),  # test_rescale_over_programs_of_a_row's split
    (1, 501, 256, None, (16, 501)),  # the interpreter: one program a row
])
def test_rescale_split(B, n_tiles, block_c, sms, split):
    from fused_softmax_matmul import rescale_split

    assert rescale_split(B, n_tiles, block_c, sms) == split


@pytest.mark.parametrize("C", [300, 301])
def test_rescale_over_programs_of_a_row(monkeypatch, C):
    # As if on 8 SMs: 3 rows of 19 class tiles of 16, each row's tiles dealt over 5 programs of
    # 4 tiles in steps of 2 (the last program's 3 tiles end with a step that masks an absent
    # tile, after a tile of 12 or 13 live classes). C = 301: rows 0, 1 and 2 start 0, 1 and 2
    # values past a 16-byte boundary, so the blocks are laid from it (SHIFT) and the last
    # program's frame runs into the absent tile.
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 8)
    x, W = matmul_softmax_inputs(3, 16, C, torch.float32, scale=2.0)
    out = matmul_softmax_fused_tiled(x, W, MatmulLaunch(16, 16, 16))
    assert_close(out, torch.softmax(x.double() @ W.double(), dim=-1), matmul_softmax_ref(x, W))


def test_simple_refuses_narrow_class_tile():
    x, W = _good(C=40)
    with pytest.raises(ValueError, match="launch.block_c = 32 must cover all C = 40"):
        matmul_softmax_fused_simple(x, W, MatmulLaunch(16, 32, 16))


# The benchmark sizes (B, K, C, dtype): the launches the wrappers pick for them must be valid.
BENCH_SIZES = [
    (64, 128, 10, "float32"), (256, 512, 50, "float32"), (1024, 1024, 100, "float32"),
    (4096, 4096, 32768, "bfloat16"), (8192, 4096, 128256, "bfloat16"),
]


@pytest.mark.parametrize("B,K,C,dtype", BENCH_SIZES)
def test_default_launches_are_valid(B, K, C, dtype):
    check_launch(tiled_launch(B, C, DTYPES[dtype], torch.device(DEVICE), K=K))
    if C <= SIMPLE_MAX_CLASSES:
        launch = matmul_softmax_plan("matmul_softmax_fused_simple", B, K, C, DTYPES[dtype],
                                     sms=_device_facts(torch.device(DEVICE))[0]).launch
        check_launch(launch)
        assert launch.block_c >= C


# ----------------------------------------------------------------------------------------------
# The plan (matmul_softmax_plan): every branch on the CPU, as an H100 (132 SMs, sm_90) would take it
# ----------------------------------------------------------------------------------------------
H100 = dict(sms=132, capability=(9, 0))
TILED, SIMPLE, UNFUSED = "matmul_softmax_fused_tiled", "matmul_softmax_fused_simple", "matmul_softmax_unfused"


def kernel_name(plan) -> str:
    return plan.kernel.__name__ if hasattr(plan.kernel, "__name__") else plan.kernel.fn.__name__


# name, (B, K, C, dtype), plan keywords -> path, kernel, normalise, buffer kinds
PLAN_BRANCHES = {
    "matmul, pointer": ("matmul", (64, 128, 1000, torch.float32), {}, "pointer", "matmul_kernel", "none", ()),
    "unfused: matmul's plan, then rows": (UNFUSED, (64, 128, 1000, torch.float32), {}, "pointer", "matmul_kernel",
                                          "rows", ()),
    "tiled, one class tile": (TILED, (64, 128, 10, torch.float32), {}, "pointer", "matmul_softmax_simple_kernel",
                              "kernel", ()),
    "tiled, class tiles": (TILED, (64, 128, 1000, torch.float32), {}, "pointer", "matmul_softmax_tile_kernel",
                           "rescale", ("float32",)),
    "simple": (SIMPLE, (64, 128, 1000, torch.float32), {}, "pointer", "matmul_softmax_simple_kernel", "kernel", ()),
    "tiled, split K, one tile": (TILED, (256, 512, 50, torch.float32), {}, "split_k", "split_k_kernel", "kernel",
                                 ("float32", "counts")),
    "tiled, split K, class tiles": (TILED, (1, 4096, 1000, torch.float32), {}, "split_k", "split_k_kernel", "rescale",
                                    ("float32", "float32", "counts")),
    "tiled, TMA": (TILED, (4096, 4096, 32768, torch.bfloat16), dict(tma_readable=True), "tma",
                   "matmul_softmax_tma_tile_kernel", "rescale", ("float32",)),
    "matmul, TMA, W K-major": ("matmul", (4096, 4096, 1000, torch.bfloat16), dict(w_kmajor=True, tma_readable=True),
                               "tma", "matmul_tma_kernel", "none", ()),
    "tiled, unreadable by TMA": (TILED, (4096, 4096, 32768, torch.bfloat16), {}, "pointer",
                                 "matmul_softmax_tile_kernel", "rescale", ("float32",)),
    "tiled, presplit": (TILED, (4096, 4096, 50257, torch.float32), {}, "presplit", "matmul_presplit_kernel", "rescale",
                        ("float32",) * 5 + ("int32",)),
    "matmul, presplit": ("matmul", (4096, 4096, 4096, torch.float32), {}, "presplit", "matmul_presplit_kernel", "none",
                         ("float32",) * 4 + ("int32",)),
    "tiled, presplit under 'high': TF32": (TILED, (4096, 4096, 50257, torch.float32), dict(setting="high"), "pointer",
                                           "matmul_softmax_tile_kernel", "rescale", ("float32",)),
    "tiled, presplit off sm_90": (TILED, (4096, 4096, 50257, torch.float32), dict(capability=(8, 0)), "pointer",
                                  "matmul_softmax_tile_kernel", "rescale", ("float32",)),
    "simple ignores presplit": (SIMPLE, (4096, 4096, 1000, torch.float32), {}, "pointer",
                                "matmul_softmax_simple_kernel", "kernel", ()),
}


@pytest.mark.parametrize("case", PLAN_BRANCHES)
def test_plan_branches(case):
    name, (B, K, C, dtype), options, path, kernel, normalise, buffers = PLAN_BRANCHES[case]
    plan = matmul_softmax_plan(name, B, K, C, dtype, **{**H100, **options})
    assert (plan.path, kernel_name(plan), plan.normalise) == (path, kernel, normalise)
    assert tuple(kind for kind, _ in plan.buffers) == buffers
    check_launch(plan.launch)
    n_b, n_c = plan.tiles
    assert (n_b, n_c) == (triton.cdiv(B, plan.launch.block_b), triton.cdiv(C, plan.launch.block_c))
    assert (plan.rescale is not None) == (normalise == "rescale")
    if normalise == "rescale":
        assert plan.buffers[0] == ("float32", (2, B, n_c))  # the (max, sum) table, the first buffer
    if path == "split_k":
        k_slice, n_splits = plan.split
        assert plan.grid == (n_b * n_c * n_splits,) and plan.buffers[-1] == ("counts", (n_b * n_c,))
        assert plan.constants["SOFTMAX"] and plan.constants["TILED"] == (normalise == "rescale")
    if path == "presplit":
        assert plan.split[0][0] == 0 and sum(width for _, width in plan.split) == C
        assert plan.buffers[-1] == ("int32", (B + C,))
    elif path in ("pointer", "tma"):
        assert plan.grid == ((n_b,) if normalise == "kernel" else (n_b * n_c,))


@pytest.mark.parametrize("name", ["matmul", TILED])
@pytest.mark.parametrize("dtype,setting,K", [(torch.float32, "highest", 48), (torch.float16, "highest", 48),
                                             (torch.float32, "high", 48), (torch.float32, "highest", 0)])
def test_plan_takes_an_asked_presplit_where_it_applies(name, dtype, setting, K):
    """A launch asking for presplit gets it for float32 'highest' products of a K, anywhere (the
    interpreter too); elsewhere the pointer kernels, and the simple kernel never."""
    launch = MatmulLaunch(16, 32, 16, presplit=True)
    plan = matmul_softmax_plan(name, 20, K, 72, dtype, setting=setting, launch=launch)
    assert (plan.path == "presplit") == (dtype == torch.float32 and setting == "highest" and K > 0)
    simple = MatmulLaunch(16, 128, 16, presplit=True)
    assert matmul_softmax_plan(SIMPLE, 20, K, 72, dtype, setting=setting, launch=simple).path == "pointer"


@pytest.mark.parametrize("C,dtype,shift,vec", [(300, torch.float32, 1, 4), (301, torch.float32, 4, 1),
                                               (1000, torch.bfloat16, 1, 8), (1024, torch.float32, 1, 1),
                                               (50257, torch.bfloat16, 8, 1)])
def test_plan_rescale(C, dtype, shift, vec):
    """Rows of an odd width do not start on 16-byte boundaries: the rescale lays its blocks from them
    (SHIFT); rows that do take their stride divided (VEC) where Triton would not see it aligned."""
    plan = matmul_softmax_plan(TILED, 64, 128, C, dtype, launch=MatmulLaunch(16, 64, 16))
    grid, per_program, constants = plan.rescale
    assert (constants["SHIFT"], constants["VEC"]) == (shift, vec)
    assert (grid, per_program) == ((64, 1), plan.tiles[1])  # the interpreter: one program a row


def test_plan_of_asks_the_capability_only_where_an_sm90_route_may_apply(monkeypatch, presplit_calls):
    """A call's plan asks the device's capability for TMA-readable 16-bit operands or a float32
    product the presplit path pays for, never otherwise (nor under a trace, where TMA cannot serve)."""
    import fused_softmax_matmul

    asked = []
    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fused_softmax_matmul, "_device_index", lambda device: 0)
    monkeypatch.setattr(fused_softmax_matmul, "_device_capability", lambda index: asked.append(index) or (9, 0))
    small = torch.empty((64, 128)), torch.empty((128, 10))
    big = torch.empty((4096, 4096)), torch.empty((4096, 4096))
    half = tuple(t.half() for t in matmul_softmax_inputs(20, 48, 72, torch.float32))
    assert _plan_of(TILED, *small, None, False).path == "pointer" and not asked
    assert _plan_of(TILED, *half, None, True).path == "pointer" and not asked
    assert _plan_of(TILED, *big, MatmulLaunch(32, 128, 32), False).path == "pointer" and not asked
    assert _plan_of(TILED, *big, None, False).path == "presplit" and len(asked) == 1
    assert _plan_of("matmul", *half, MatmulLaunch(16, 32, 16), False).path == "pointer" and len(asked) == 2


# The matmul_softmax group's cases (tests/test_bench_matmul_softmax.py) and the path the record
# names for each (outputs/README.md, "softmax(x @ W)"): the float32 sizes split K, the bfloat16 ones
# run the TMA tile kernel (W row-major, TMA-readable as the builder makes it). The smallest size
# is one class tile over 4 K steps: too short to split (SPLIT_CHOICES), one pointer launch.
RECORD_PATHS = {
    (64, 128, 10, "float32"): "pointer", (256, 512, 50, "float32"): "split_k", (1024, 1024, 100, "float32"): "split_k",
    (4096, 4096, 32768, "bfloat16"): "tma", (8192, 4096, 128256, "bfloat16"): "tma",
}


@pytest.mark.parametrize("B,K,C,dtype", RECORD_PATHS)
def test_plan_of_the_benchmark_cases_is_the_recorded_path(B, K, C, dtype):
    plan = matmul_softmax_plan(TILED, B, K, C, DTYPES[dtype], tma_readable=DTYPES[dtype] != torch.float32, **H100)
    assert plan.path == RECORD_PATHS[B, K, C, dtype]


def recorded_paths():
    """Rows of the committed records' CSVs that name the path a softmax(x @ W) case took."""
    import pandas as pd

    rows = []
    for path in record_files("*.csv"):
        frame = pd.read_csv(path)
        if not {"workload", "case", "path"} <= set(frame.columns):
            continue
        named = frame[frame.workload.astype(str).str.startswith("matmul_softmax") & frame.path.notna()]
        rows += [(path.name, row.case, row.path) for row in named.itertuples()]
    return rows


def test_plan_of_the_recorded_grid_cases_is_the_recorded_path():
    rows = recorded_paths()
    if not rows:
        pytest.skip("no committed CSV names the path of a softmax(x @ W) case (the shape grid leaves its path "
                    "column empty for them); the benchmark group's cases are checked against outputs/README.md")
    for csv, case, recorded in rows:  # "B=1 K=2048 C=10 bfloat16[ W=weight.t()]"
        sizes = dict(part.split("=") for part in case.split() if part[0] in "BKC" and "=" in part)
        dtype = DTYPES[case.split()[3]]
        plan = matmul_softmax_plan(TILED, int(sizes["B"]), int(sizes["K"]), int(sizes["C"]), dtype,
                                   w_kmajor="W=weight.t()" in case, tma_readable=dtype != torch.float32, **H100)
        assert plan.path == recorded, (csv, case)


# On a GPU: the benchmark sizes themselves, compiled, bf16 with real tensor-core tl.dot (the
# interpreter cannot check that: it upcasts bf16, see upcast_dot_operands).
def takes(impl: str, C: int) -> bool:
    """Whether impl takes C classes: the simple kernel refuses more than it keeps on chip by design
    (test_simple_refuses_too_many_classes), so those cases are not tests of it."""
    return impl != "triton_fused_simple" or C <= SIMPLE_MAX_CLASSES


@needs_gpu
@pytest.mark.parametrize("impl,B,K,C,dtype", [(impl, *size) for size in BENCH_SIZES for impl in TRITON_IMPLS
                                             if takes(impl, size[2])])
def test_benchmark_sizes_on_gpu(impl, B, K, C, dtype):
    x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype])
    out = TRITON_IMPLS[impl](x, W)
    # A float64 reference of the LM-head sizes would need 8 GB per (B, C) buffer: check up to
    # 512 rows spread over the whole batch (every row block of the kernels is still launched).
    rows = torch.arange(0, B, max(1, B // 512), device=x.device)
    ref64 = torch.softmax(x[rows].double() @ W.double(), dim=-1)
    assert_close(out[rows], ref64, matmul_softmax_ref(x, W)[rows])


# On a GPU: the tiles of the rule for a W that stays in L2 (test_l2_bound_16bit_tiles), reached
# through the wrappers' own choice, W in both layouts, softmax(x @ W) and x @ W against float64.
@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["contiguous", "W_transposed"])
@pytest.mark.parametrize("B,tile", [(4096, (256, 128)), (2048, (128, 128)), (1024, (128, 64))])
def test_l2_bound_tiles_on_gpu(B, tile, layout, dtype):
    K, C = 256, 1000
    if torch.cuda.get_device_properties(DEVICE).multi_processor_count != 132:
        pytest.skip("the tiles named are those of a 132-SM GPU")
    launch = tiled_launch(B, C, DTYPES[dtype], torch.device(DEVICE), K=K, w_kmajor=layout == "W_transposed")
    assert (launch.block_b, launch.block_c, launch.split_k) == (*tile, 1)
    x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype], seed=B, layout=layout)
    rows = torch.arange(0, B, 4, device=x.device)
    logits64 = x[rows].double() @ W.double()
    assert_close(matmul_softmax_fused_tiled(x, W)[rows], torch.softmax(logits64, -1), matmul_softmax_ref(x, W)[rows])
    assert_close(matmul(x, W)[rows], logits64, (x @ W)[rows])


HOPPER = ON_GPU and torch.cuda.get_device_capability(DEVICE) == (9, 0)
TMA_LAUNCH = MatmulLaunch(16, 32, 16)


@pytest.mark.parametrize("layout,B,K,C,dtype,launch,tma", [
    # Rows TMA can read: x's of K values, W's of C (row-major) or of K (K-major), 16 bytes apart.
    ("contiguous", 20, 48, 72, "float16", TMA_LAUNCH, True),
    ("W_transposed", 20, 40, 70, "bfloat16", TMA_LAUNCH, True),
    # W's rows of 70 classes are 140 bytes apart; x's of 36 values 72 bytes apart.
    ("contiguous", 20, 48, 70, "float16", TMA_LAUNCH, False),
    ("W_transposed", 20, 36, 72, "float16", TMA_LAUNCH, False),
    # x read with a column stride of 2, or along its columns (x^T in dW = x^T @ dz).
    ("x_strided", 20, 48, 72, "float16", TMA_LAUNCH, False),
    ("x_transposed", 24, 48, 72, "float16", TMA_LAUNCH, False),
    # float32 (its products split into TF32 parts in registers), K split, a class tile past 256.
    ("contiguous", 20, 48, 72, "float32", TMA_LAUNCH, False),
    ("contiguous", 20, 48, 72, "float16", MatmulLaunch(16, 32, 16, split_k=2), False),
    ("contiguous", 20, 48, 1024, "float16", MatmulLaunch(16, 512, 16), False),
])
def test_tma_path_where_tma_reads_the_operands(monkeypatch, layout, B, K, C, dtype, launch, tma):
    import fused_softmax_matmul

    x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype], layout=layout)
    if ON_GPU:  # compiled, small products keep the pointer kernels (test_tma_path_from_its_sizes)
        assert _plan_of("matmul", x, W, launch, False).path != "tma"
        monkeypatch.setattr(fused_softmax_matmul, "TMA_LEAST_PRODUCT", 0)
        monkeypatch.setattr(fused_softmax_matmul, "TMA_LEAST_KMAJOR_ROWS", 0)
    taken = _plan_of("matmul", x, W, launch, False).path == "tma"
    assert taken == (tma and (HOPPER or not ON_GPU))  # compiled, sm_90 only
    assert _plan_of("matmul", x, W, launch, True).path != "tma"  # traced: the pointer kernels


@pytest.mark.parametrize("w_kmajor,B,K,C,capability,tma", [
    # sm_90: W K-major from 256 rows, W row-major from B x K x C = 2^32 (design notes: TMA)
    (True, 256, 64, 1000, (9, 0), True), (True, 255, 4096, 1000, (9, 0), False),
    (False, 1024, 4096, 1024, (9, 0), True), (False, 1024, 4096, 1000, (9, 0), False),
    # another GPU: never; the interpreter (no SM count): any size, so CI runs the path
    (True, 4096, 4096, 1000, (8, 0), False), (False, 20, 48, 72, None, True),
])
def test_tma_path_from_its_sizes(w_kmajor, B, K, C, capability, tma):
    sms = None if capability is None else 132
    plan = matmul_softmax_plan("matmul", B, K, C, torch.bfloat16, w_kmajor, True, sms, capability,
                               launch=TMA_LEAST_LAUNCH)
    assert (plan.path == "tma") == tma
    # operands TMA cannot read, and float32, keep the pointer kernels
    assert matmul_softmax_plan("matmul", B, K, C, torch.bfloat16, w_kmajor, False, sms, capability,
                               launch=TMA_LEAST_LAUNCH).path == "pointer"
    assert matmul_softmax_plan("matmul", B, K, C, torch.float32, w_kmajor, True, sms, capability,
                               launch=TMA_LEAST_LAUNCH).path == "pointer"


TMA_LEAST_LAUNCH = MatmulLaunch(256, 128, 64)


@pytest.fixture
def tma_everywhere(monkeypatch):
    """The TMA path for every size its operands allow (compiled, small shapes keep the pointer
    kernels)."""
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "TMA_LEAST_PRODUCT", 0)
    monkeypatch.setattr(fused_softmax_matmul, "TMA_LEAST_KMAJOR_ROWS", 0)


@pytest.mark.skipif(ON_GPU and not HOPPER, reason="the TMA path runs on sm_90 (and in the interpreter)")
@pytest.mark.usefixtures("tma_everywhere")
@pytest.mark.parametrize("layout", ["contiguous", "W_transposed"])
@pytest.mark.parametrize("B,K,C,tiles,scale", [
    # Rows, classes and K all past the tiles' last edge (TMA fills them with zeros): 3 row
    # blocks (the last of 5 rows), 3 class tiles (the last of 8 classes), 3 K steps (the last 8).
    (37, 40, 72, (16, 32, 16), 1.0),
    # Logits of size ~1000 over 5 class tiles: exp overflows unless each tile's maximum is taken.
    (16, 32, 80, (16, 16, 16), 1000.0),
    # Program groups of 2 row blocks over 4 of them.
    (64, 48, 64, (16, 16, 16, 2), 1.0),
])
def test_tma_path_matches_float64_and_the_pointer_path(monkeypatch, layout, B, K, C, tiles, scale):
    import fused_softmax_matmul

    launch = MatmulLaunch(*tiles)
    for dtype in (torch.float16, torch.bfloat16):
        x, W = matmul_softmax_inputs(B, K, C, dtype, layout=layout, scale=scale)
        assert _plan_of("matmul_softmax_fused_tiled", x, W, launch, False).path == "tma"
        ref = x.double() @ W.double()
        tma = matmul_softmax_fused_tiled(x, W, launch), matmul(x, W, launch)
        assert_close(tma[0], torch.softmax(ref, -1), matmul_softmax_ref(x, W))
        assert_close(tma[1], ref, x @ W)
        with monkeypatch.context() as patched:
            patched.setattr(fused_softmax_matmul, "TensorDescriptor", None)
            fused_softmax_matmul._MATMUL_REPLAYS.clear()  # the TMA launches kept above would serve the calls
            pointer = matmul_softmax_fused_tiled(x, W, launch), matmul(x, W, launch)
            fused_softmax_matmul._MATMUL_REPLAYS.clear()
        # The same products in the same order: the same values, bit for bit.
        assert torch.equal(tma[0], pointer[0]) and torch.equal(tma[1], pointer[1])


@pytest.mark.skipif(not HOPPER, reason="the TMA path's kept launches and capture: sm_90")
@pytest.mark.usefixtures("tma_everywhere")
@pytest.mark.parametrize("layout", ["contiguous", "W_transposed"])
def test_tma_path_replays_and_captures(layout):
    """A second call replays the first's kept launches (descriptors of the new tensors), and a CUDA
    graph captures them."""
    import fused_softmax_matmul

    B, K, C = 1024, 256, 1000
    x, W = matmul_softmax_inputs(B, K, C, torch.bfloat16, seed=60, layout=layout)
    launch = tiled_launch(B, C, torch.bfloat16, x.device, K=K, w_kmajor=layout == "W_transposed")
    assert _plan_of("matmul_softmax_fused_tiled", x, W, None, False).path == "tma"
    for fn in (matmul_softmax_fused_tiled, matmul):
        first = fn(x, W)
        x2, W2 = (t.clone() for t in (x, W))  # new addresses, the same layout
        if layout == "W_transposed":
            W2 = W.t().clone().t()
        assert torch.equal(fn(x2, W2), first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(x2, W2)
        x2.copy_(matmul_softmax_inputs(B, K, C, torch.bfloat16, seed=61)[0])
        graph.replay()
        assert torch.equal(out, fn(x2, W2))


# ----------------------------------------------------------------------------------------------
# float32 'highest' by three TF32 products of operands split beforehand (``presplit``)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def presplit_calls(monkeypatch):
    """How many calls went through ``_presplit_forward`` (a list of their plans)."""
    import fused_softmax_matmul

    calls = []
    real = fused_softmax_matmul._presplit_forward

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_softmax_matmul, "_presplit_forward", counted)
    fused_softmax_matmul._MATMUL_REPLAYS.clear()  # a launch kept by an earlier test would serve the call
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield calls
    torch.set_float32_matmul_precision(before)


PRESPLIT_IMPLS = {"triton_matmul": matmul, "triton_fused_tiled": matmul_softmax_fused_tiled,
                  "triton_unfused": TRITON_IMPLS["triton_unfused"]}


def _assert_presplit_close(impl: str, out: torch.Tensor, x: torch.Tensor, W: torch.Tensor) -> None:
    """out (x @ W for the matmul, else softmax(x @ W)) against float64, as accurate as torch's."""
    ref = x.double() @ W.double()
    if impl == "triton_matmul":
        assert_close(out, ref, x @ W)
    else:
        assert_close(out, torch.softmax(ref, -1), matmul_softmax_ref(x, W))


@pytest.mark.parametrize("impl", PRESPLIT_IMPLS)
@pytest.mark.parametrize("layout", ["contiguous", "W_transposed", "x_transposed", "x_strided"])
@pytest.mark.parametrize("B,K,C,tiles,scale", [
    # Rows, classes and K past the tiles' edges: 3 row blocks (the last of 5 rows), 3 class tiles
    # (the last of 8 classes), 3 K steps (the last of 8): masks, the tile kernel and the rescale.
    (37, 40, 72, (16, 32, 16), 1.0),
    # One class tile: the kernel normalises the whole row itself.
    (20, 33, 30, (16, 32, 16), 1.0),
    # Logits of size ~1000: each tile's maximum from the three products' sum.
    (16, 32, 80, (16, 16, 16), 1000.0),
])
@pytest.mark.parametrize("chunked", [False, True], ids=["W at once", "W a class tile at a time"])
def test_presplit_matches_float64(monkeypatch, presplit_calls, impl, layout, B, K, C, tiles, scale, chunked):
    import fused_softmax_matmul

    if chunked:  # W's parts a class tile at a time, over the same two buffers
        monkeypatch.setattr(fused_softmax_matmul, "PRESPLIT_CHUNK_BYTES", 1)
    x, W = matmul_softmax_inputs(B, K, C, torch.float32, layout=layout, scale=scale, seed=B + C)
    out = PRESPLIT_IMPLS[impl](x, W, MatmulLaunch(*tiles, presplit=True))
    assert len(presplit_calls) == 1
    _assert_presplit_close(impl, out, x, W)


@pytest.mark.parametrize("chunked", [False, True], ids=["W at once", "W a class tile at a time"])
@pytest.mark.parametrize("impl", PRESPLIT_IMPLS)
def test_presplit_keeps_torchs_infinities_and_nans(monkeypatch, presplit_calls, impl, chunked):
    """lo of inf or NaN is 0 and small products that are not finite are dropped (lo may differ
    in sign from hi, 0 x inf is NaN): the hi product carries each input's inf and NaN, so out has
    NaN and inf where torch's has them, of the same signs."""
    import fused_softmax_matmul

    if chunked:  # the class flags of the second chunk on
        monkeypatch.setattr(fused_softmax_matmul, "PRESPLIT_CHUNK_BYTES", 1)
    x, W = matmul_softmax_inputs(20, 40, 50, torch.float32, seed=70)
    x[0, 3], x[1, 5], W[7, 9], W[2, 40] = float("inf"), float("nan"), float("-inf"), float("inf")
    x[2, 7] = 0.0  # 0 x -inf: NaN in row 2's class 9, as in torch
    out = PRESPLIT_IMPLS[impl](x, W, MatmulLaunch(16, 32, 16, presplit=True))
    theirs = x @ W if impl == "triton_matmul" else matmul_softmax_ref(x, W)
    assert len(presplit_calls) == 1
    assert torch.equal(out.isnan(), theirs.isnan())
    assert torch.equal(out.isinf(), theirs.isinf())
    assert torch.equal(out[out.isinf()], theirs[theirs.isinf()])  # the same signs


@pytest.mark.parametrize("impl", PRESPLIT_IMPLS)
def test_presplit_of_values_near_the_largest_float(presplit_calls, impl):
    """A finite value within half a TF32 unit of float32's largest rounds to inf: its hi part is
    truncated instead, so the products stay finite where torch's are (NaN before: inf x 0)."""
    x, W = matmul_softmax_inputs(8, 40, 50, torch.float32, seed=76)
    x[0, 0] = 3.4022e38
    W[0] = 0.25
    out = PRESPLIT_IMPLS[impl](x, W, MatmulLaunch(16, 32, 16, presplit=True))
    assert len(presplit_calls) == 1
    theirs = x @ W if impl == "triton_matmul" else matmul_softmax_ref(x, W)
    assert theirs.isfinite().all() and out.isfinite().all()
    torch.testing.assert_close(out, theirs)


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "highest"), ("float16", "highest"), ("float32", "high")])
def test_presplit_asked_elsewhere_is_ignored(presplit_calls, dtype, precision):
    """16-bit products and float32 under 'high' (one TF32 product) take their own kernels."""
    torch.set_float32_matmul_precision(precision)
    x, W = matmul_softmax_inputs(20, 48, 72, DTYPES[dtype], seed=71)
    launch = MatmulLaunch(16, 32, 16, presplit=True)
    out = matmul_softmax_fused_tiled(x, W, launch)
    assert not presplit_calls
    assert torch.equal(out, matmul_softmax_fused_tiled(x, W, MatmulLaunch(16, 32, 16)))


@pytest.mark.parametrize("impl", PRESPLIT_IMPLS)
def test_presplit_of_an_empty_k(presplit_calls, impl):
    """K = 0: nothing to split; the pointer kernels' logits of 0."""
    x, W = matmul_softmax_inputs(20, 0, 50, torch.float32)
    out = PRESPLIT_IMPLS[impl](x, W, MatmulLaunch(16, 32, 16, presplit=True))
    assert not presplit_calls
    torch.testing.assert_close(out, x @ W if impl == "triton_matmul" else matmul_softmax_ref(x, W))


def test_presplit_launch_refusals():
    with pytest.raises(TypeError, match="launch.presplit must be a bool"):
        check_launch(MatmulLaunch(16, 32, 16, presplit=1))
    with pytest.raises(ValueError, match="launch.presplit takes an unsplit K"):
        check_launch(MatmulLaunch(16, 32, 16, split_k=2, presplit=True))


@pytest.mark.parametrize("B,K,C,w_kmajor,pays", [
    # The LM head and bigger: the pass is a few % of the product.
    (4096, 4096, 50257, False, True), (4096, 4096, 1000, True, True), (4096, 768, 32000, False, True),
    (4096, 4096, 4096, False, True), (512, 768, 32000, False, True),
    # Where the pointer kernels are slowest, with W K-major (outputs/profiles/presplit_host_probe.txt).
    (512, 4096, 1000, True, True), (512, 4096, 1000, False, False),
    # A W of few classes, or few rows: the pass costs as much as the product saves.
    (4096, 4096, 100, True, False), (32, 4096, 50257, True, False), (256, 4096, 1000, True, False),
    (1, 4096, 128256, True, False),
    # Small products: the pass's extra launches outweigh it.
    (1024, 100, 1024, True, False), (1024, 1024, 100, True, False),
])
def test_presplit_pays_from_its_sizes(B, K, C, w_kmajor, pays):
    from fused_softmax_matmul import presplit_pays

    assert presplit_pays(B, K, C, w_kmajor) == pays
    # More rows, classes or K never make it pay less.
    for more in ((2 * B, K, C), (B, 2 * K, C), (B, K, 2 * C)):
        assert presplit_pays(*more, w_kmajor) >= pays


@pytest.mark.parametrize("K,C,block_c,chunk", [
    (4096, 50257, 128, 8192), (4096, 1000, 128, 1024), (768, 128256, 128, 43648), (1 << 20, 1000, 64, 64),
])
def test_presplit_chunk(K, C, block_c, chunk):
    from fused_softmax_matmul import PRESPLIT_CHUNK_BYTES, presplit_chunk

    assert presplit_chunk(K, C, block_c) == chunk
    assert chunk % block_c == 0 and (chunk == block_c or 8 * K * chunk <= PRESPLIT_CHUNK_BYTES)


@pytest.mark.parametrize("B,C,tile", [
    (4096, 50257, (128, 128, 8, 3)), (4096, 1000, (128, 128, 8, 3)),
    # 8 x 8 tiles of 128 leave SMs idle: 64 x 128 (4 warps), then 64 x 64.
    (1024, 1000, (64, 64, 4, 4)), (2048, 1000, (64, 128, 4, 4)),
])
def test_presplit_launch_fills_the_sms(B, C, tile):
    from fused_softmax_matmul import presplit_launch

    launch = presplit_launch(B, C, 132)
    assert (launch.block_b, launch.block_c, launch.num_warps, launch.num_stages) == tile
    assert launch.presplit and launch.split_k == 1 and launch.block_k == 32
    check_launch(launch)


@pytest.mark.parametrize("impl", ["triton_fused_tiled", "triton_unfused"])
def test_presplit_bytes_in_the_model(monkeypatch, presplit_calls, impl):
    """The bytes model counts the split pass and the parts' reads where the wrapper takes the path."""
    import support

    B, K, C = 4096, 4096, 50257
    monkeypatch.setattr(support, "_device_facts", lambda device: (132, (8, 0)))  # a GPU without the path
    plain = support.matmul_softmax_impl_bytes(impl, B, K, C, torch.float32, "cpu")
    theirs = support.matmul_softmax_impl_bytes("torch", B, K, C, torch.float32, "cpu")
    plan = matmul_softmax_plan("matmul_softmax_fused_tiled", B, K, C, torch.float32, sms=132, capability=(9, 0))
    assert plan.path == "presplit" and plan.launch.block_c == 128
    monkeypatch.setattr(support, "_device_facts", lambda device: (132, (9, 0)))
    split = support.matmul_softmax_impl_bytes(impl, B, K, C, torch.float32, "cpu")
    from fused_softmax_matmul import presplit_bytes

    assert presplit_bytes(B, K, C) == 16 * K * (B + C)
    if impl == "triton_unfused":
        assert split == plain + presplit_bytes(B, K, C)
    else:  # the tiled kernel's stats follow the path's 128-class tiles
        assert split >= plain + presplit_bytes(B, K, C) - 2 * B * C // 32 * 4
    assert support.matmul_softmax_impl_bytes("torch", B, K, C, torch.float32, "cpu") == theirs  # torch splits nothing


def test_presplit_not_chosen_on_other_machines():
    """The wrappers take it by themselves only compiled on sm_90 (the interpreter runs it where a
    launch asks): a big float32 product on this machine keeps the pointer kernels."""
    x = torch.empty((4096, 4096), device=DEVICE)
    W = torch.empty((4096, 50257), device=DEVICE)
    assert (_plan_of("matmul_softmax_fused_tiled", x, W, None, False).path == "presplit") == HOPPER
    other_gpu = matmul_softmax_plan("matmul", 4096, 4096, 50257, torch.float32, sms=132, capability=(8, 0))
    assert other_gpu.path != "presplit"


@pytest.mark.skipif(not HOPPER, reason="compiled, the presplit kernels are chosen on sm_90")
@pytest.mark.parametrize("layout", ["contiguous", "W_transposed"])
@pytest.mark.parametrize("impl", PRESPLIT_IMPLS)
def test_presplit_chosen_and_accurate_on_gpu(presplit_calls, impl, layout):
    """4096 x 2048 x 1000 float32: the wrappers' own launch splits the operands (both W layouts),
    as accurate as torch's SGEMM; under 'high' they keep the TF32 kernels."""
    B, K, C = 4096, 2048, 1000
    x, W = matmul_softmax_inputs(B, K, C, torch.float32, seed=72, layout=layout)
    fn = PRESPLIT_IMPLS[impl]
    out = fn(x, W)
    assert len(presplit_calls) == 1
    _assert_presplit_close(impl, out, x, W)
    torch.set_float32_matmul_precision("high")
    fn(x, W)
    assert len(presplit_calls) == 1


@pytest.mark.parametrize("backend", ["inductor"] if ON_GPU else ["aot_eager"])
@pytest.mark.parametrize("impl", ["triton_matmul", "triton_fused_tiled"])
@pytest.mark.usefixtures("fresh_compile")
def test_presplit_compiles_without_graph_break(presplit_calls, impl, backend):
    fn = PRESPLIT_IMPLS[impl]
    launch = MatmulLaunch(16, 32, 16, presplit=True)
    x, W = (t.requires_grad_() for t in matmul_softmax_inputs(19, 40, 50, torch.float32, seed=73))
    out = torch.compile(lambda x, W: fn(x, W, launch).sin(), fullgraph=True, backend=backend)(x, W)
    out.sum().backward()
    xe, We = (t.detach().requires_grad_() for t in (x, W))
    eager = fn(xe, We, launch).sin()
    eager.sum().backward()
    assert presplit_calls
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(W.grad, We.grad)


@needs_gpu
@pytest.mark.parametrize("impl", PRESPLIT_IMPLS)
def test_presplit_replays_and_captures(monkeypatch, presplit_calls, impl):
    """W split two class tiles at a time (4 chunks): a second call replays the first's kept chain
    (its own buffers, every chunk), and a CUDA graph captures the split passes with their
    buffers, then the products."""
    import fused_softmax_matmul

    B, K, C = 300, 256, 500
    monkeypatch.setattr(fused_softmax_matmul, "PRESPLIT_CHUNK_BYTES", 8 * K * 128)
    fn = PRESPLIT_IMPLS[impl]
    launch = MatmulLaunch(64, 64, 32, presplit=True)
    x, W = matmul_softmax_inputs(B, K, C, torch.float32, seed=74)
    first = fn(x, W, launch)
    x2, W2 = x.clone(), W.clone()
    assert torch.equal(fn(x2, W2, launch), first)
    assert len(presplit_calls) == 1  # the second call replayed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x2, W2, launch)
    x2.copy_(matmul_softmax_inputs(B, K, C, torch.float32, seed=75)[0])
    graph.replay()
    assert torch.equal(out, fn(x2, W2, launch))
    _assert_presplit_close(impl, out, x2, W2)


@needs_gpu
def test_tiled_peak_memory_is_output_plus_stats():
    # The LM head's promise: no (B, C) buffer beyond the output; stats are 2 x B x C/128 floats.
    B, K, C = 4096, 4096, 32768
    x, W = matmul_softmax_inputs(B, K, C, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = matmul_softmax_fused_tiled(x, W)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    stats_bytes = 2 * B * triton.cdiv(C, 128) * 4
    assert extra <= out.numel() * out.element_size() + stats_bytes + (1 << 20), extra


# ----------------------------------------------------------------------------------------------
# -inf logits: a class tile of only -inf in any position, rows of only -inf
# ----------------------------------------------------------------------------------------------
def masked_class_tiles(K: int, C: int, tile: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x of ones and W whose row 0 (weighted by every x row) puts -inf on whole class tiles:
    rows see their first tile all -inf, a middle one, and the last (ragged) one; the rest of W
    is normal. Every row then has the same masked classes, and finite logits elsewhere."""
    x = torch.ones((3, K), dtype=dtype, device=DEVICE)
    W = matmul_softmax_inputs(3, K, C, dtype, seed=50)[1]
    W[:, :tile] = 0  # only the -inf of row 0 makes those logits: 1 * -inf + 0 + ... = -inf
    W[0, :tile] = -float("inf")
    W[:, 2 * tile:3 * tile] = 0
    W[0, 2 * tile:3 * tile] = -float("inf")
    W[:, -(C % tile or tile):] = 0
    W[0, -(C % tile or tile):] = -float("inf")
    return x, W


# Float16: its tl.dot multiplies -inf exactly. A float32 product under 'highest' (tf32x3) splits
# each operand into two TF32 halves, and the low half of -inf is -inf - -inf = NaN: on a GPU an
# infinite operand gives NaN logits there, a matter of the product, not of the softmax tested here.
MASK_DTYPE = torch.float16

# impl, launch: every kernel that takes a row maximum over tiles.
MASKED_LAUNCHES = {
    "tiled, 4 class tiles": ("triton_fused_tiled", MatmulLaunch(16, 32, 16)),
    "tiled, split K": ("triton_fused_tiled", MatmulLaunch(16, 128, 16, split_k=2)),
    "tiled, split K, class tiles": ("triton_fused_tiled", MatmulLaunch(16, 32, 16, split_k=2)),
    "simple": ("triton_fused_simple", MatmulLaunch(16, 128, 16)),
    "unfused": ("triton_unfused", MatmulLaunch(16, 32, 16)),
}


@pytest.mark.parametrize("case", MASKED_LAUNCHES)
def test_masked_class_tiles(case):
    impl, launch = MASKED_LAUNCHES[case]
    x, W = masked_class_tiles(40, 100, 32, MASK_DTYPE)
    want = torch.softmax(x.double() @ W.double(), dim=-1)
    assert not want.isnan().any()
    assert_close(TRITON_IMPLS[impl](x, W, launch), want, matmul_softmax_ref(x, W))


def test_issue_repro_tile_of_minus_inf():
    """The reported case: two 128-wide class tiles (float32's default width), the first all -inf."""
    x = torch.ones(2, 16, device=DEVICE, dtype=MASK_DTYPE)
    W = torch.randn(16, 256, generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE).to(MASK_DTYPE)
    W[:, :128] = 0
    W[0, :128] = -float("inf")
    out = matmul_softmax_fused_tiled(x, W, MatmulLaunch(16, 128, 16))
    assert_close(out, torch.softmax(x.double() @ W.double(), dim=-1), matmul_softmax_ref(x, W))


@pytest.mark.parametrize("case", MASKED_LAUNCHES)
def test_row_of_minus_inf_is_nan(case):
    """A row whose every logit is -inf: NaN, torch's answer; the other rows are untouched."""
    impl, launch = MASKED_LAUNCHES[case]
    x, W = matmul_softmax_inputs(20, 40, 100, MASK_DTYPE, seed=51)
    W[0] = W[0].abs() + 0.1
    x[3, 0] = -float("inf")  # row 3: -inf * positive + finite = -inf for every class
    want = torch.softmax(x.double() @ W.double(), dim=-1)
    assert want[3].isnan().all() and not want[:3].isnan().any()
    assert_close(TRITON_IMPLS[impl](x, W, launch), want, matmul_softmax_ref(x, W))


# ----------------------------------------------------------------------------------------------
# Autograd: dx and dW against float64, double backward refused
# ----------------------------------------------------------------------------------------------
def check_gradients(impl: str, x: torch.Tensor, W: torch.Tensor, launch=None, seed: int = 0,
                    transposed: bool = False) -> None:
    """(dx, dW) of each version against torch autograd in float64, bounded by PyTorch's own
    gradients in the inputs' dtype (``assert_close``); ``matmul`` is checked as x @ W. ``transposed``:
    the upstream gradient is a transposed tensor's view (column stride other than 1)."""
    fn = IMPLS_WITH_MATMUL[impl]
    ref = (lambda a, b: a @ b) if impl == "triton_matmul" else matmul_softmax_ref
    out = fn(x, W, launch)
    shape = out.shape[::-1] if transposed else out.shape
    dout = torch.randn(shape, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE).to(out.dtype)
    dout = dout.t() if transposed else dout
    grads = torch.autograd.grad(out, (x, W), dout)
    x64, W64 = (t.detach().double().requires_grad_() for t in (x, W))
    grads64 = torch.autograd.grad(ref(x64, W64), (x64, W64), dout.double())
    xt, Wt = (t.detach().requires_grad_() for t in (x, W))
    grads_torch = torch.autograd.grad(ref(xt, Wt), (xt, Wt), dout)
    for got, want, theirs in zip(grads, grads64, grads_torch):
        assert got.dtype == theirs.dtype and got.shape == theirs.shape
        assert_close(got, want, theirs)


IMPLS_WITH_MATMUL = {"triton_matmul": matmul, **TRITON_IMPLS}

# B, K, C, tiles (block_b, block_c, block_k[, split_k]) or None: the forward's paths.
GRAD_CASES = {
    # The wrappers' own launches: one class tile.
    "19x37x50": (19, 37, 50, None),
    # Four class tiles (the tile kernel and the rescale), ragged rows and K.
    "tiles": (19, 37, 100, (16, 32, 16)),
    # K split over 3 slices.
    "split K": (17, 100, 30, (16, 32, 16, 3)),
    # K split over 3 slices of 3 class tiles each.
    "split K, class tiles": (17, 100, 70, (16, 32, 16, 3)),
    # More classes than the backward's softmax-gradient tile (1024): its row sum spans two tiles.
    "past a gradient tile": (4, 32, 1500, None),
}


def grad_params():
    for case, (B, K, C, tiles) in GRAD_CASES.items():
        for impl in IMPLS_WITH_MATMUL:
            if impl == "triton_fused_simple" and tiles is not None and len(tiles) == 4 or not takes(impl, C):
                continue  # the simple kernel never splits K, nor holds more than SIMPLE_MAX_CLASSES
            for dtype in DTYPES:
                yield pytest.param(impl, dtype, B, K, C, tiles, id=f"{case}-{impl}-{dtype}")


@pytest.mark.parametrize("impl,dtype,B,K,C,tiles", list(grad_params()))
def test_gradients_match_float64(impl, dtype, B, K, C, tiles):
    x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype], seed=B + K + C, scale=2.0)
    launch = launch_for(impl, C, tiles)
    check_gradients(impl, x.requires_grad_(), W.requires_grad_(), launch, seed=C)


@needs_gpu
@pytest.mark.parametrize("impl,B,K,C,dtype", [
    (impl, *size) for size in [(1024, 1024, 100, "float32"), (256, 1024, 3000, "bfloat16"), (256, 1024, 3000, "float16")]
    for impl in IMPLS_WITH_MATMUL if takes(impl, size[2])])
def test_gpu_gradients(impl, B, K, C, dtype):
    """Compiled backward at benchmark-like sizes: split K in the forward (the first), many
    class tiles and bf16 tensor cores (the others)."""
    x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype], seed=60, scale=2.0)
    check_gradients(impl, x.requires_grad_(), W.requires_grad_(), None, seed=61)


@pytest.mark.parametrize("impl", IMPLS_WITH_MATMUL)
def test_gradient_broadcast_and_of_one_input(impl):
    """(y.sum(0) * w).sum() hands the backward dy = w expanded over rows (row stride 0); W frozen:
    dx only, and W gets no gradient."""
    x, W = matmul_softmax_inputs(9, 20, 30, torch.float32, seed=52)
    w = torch.linspace(-1, 1, 30, device=DEVICE)
    ref = (lambda a, b: a @ b) if impl == "triton_matmul" else matmul_softmax_ref
    grads = []
    for fn, x_ in ((IMPLS_WITH_MATMUL[impl], x), (ref, x.double()), (ref, x)):
        x_ = x_.detach().requires_grad_()
        (fn(x_, W.to(x_.dtype)).sum(0) * w.to(x_.dtype)).sum().backward()
        grads.append(x_.grad)
    assert W.grad is None
    assert_close(*grads)


@pytest.mark.parametrize("impl", IMPLS_WITH_MATMUL)
def test_gradient_of_a_transposed_upstream(impl):
    """dy of column stride other than 1 (a transposed gradient) is read through its strides."""
    x, W = (t.requires_grad_() for t in matmul_softmax_inputs(8, 16, 24, torch.float32, seed=56))
    check_gradients(impl, x, W, seed=57, transposed=True)


@pytest.mark.parametrize("impl", IMPLS_WITH_MATMUL)
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_autocast_casts_the_operands(impl, x_dtype):
    """Under autocast a float32 weight beside x (float32, or bfloat16 activations) is cast to
    autocast's dtype as torch's matmul casts it: the op on the cast operands, bit for bit, and
    W's gradient back in float32. Outside autocast mixed dtypes stay refused, naming W."""
    fn = IMPLS_WITH_MATMUL[impl]
    x, W = matmul_softmax_inputs(9, 20, 30, torch.float32, seed=55)
    x = x.to(DTYPES[x_dtype]).requires_grad_()
    W.requires_grad_()
    g = torch.linspace(-1, 1, 9 * 30, device=DEVICE).view(9, 30)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fn(x, W)
        assert out.dtype == torch.bfloat16
        (out.float() * g).sum().backward()
    xb, Wb = (t.detach().bfloat16().requires_grad_() for t in (x, W))
    want = fn(xb, Wb)
    (want.float() * g).sum().backward()
    assert torch.equal(out, want)
    assert W.grad.dtype == torch.float32 and x.grad.dtype == x.dtype
    assert torch.equal(W.grad, Wb.grad.float()) and torch.equal(x.grad, xb.grad.to(x.dtype))
    if x_dtype == "bfloat16":
        with pytest.raises(TypeError, match="W has dtype torch.float32"):
            fn(x.detach(), W.detach())
    with torch.autocast(DEVICE, dtype=torch.bfloat16), pytest.raises(ValueError, match="x"):
        fn(x.detach().to("meta"), W.detach().to("meta"))  # a device autocast has no state for: the checks' error


@pytest.mark.parametrize("impl", IMPLS_WITH_MATMUL)
def test_double_backward_is_refused(impl):
    x, W = (t.requires_grad_() for t in matmul_softmax_inputs(9, 20, 30, torch.float32, seed=53))
    (dx,) = torch.autograd.grad(IMPLS_WITH_MATMUL[impl](x, W).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward .* torch\.func\.hessian") as raised:
        torch.autograd.grad(dx.sum(), W)
    assert "register_autograd" not in str(raised.value)


# ----------------------------------------------------------------------------------------------
# torch.compile, CUDA graphs, host-side caches
# ----------------------------------------------------------------------------------------------
fresh_compile = support.fresh_compile  # the fixture, under this module's name for pytest
COMPILE_BACKENDS = ["inductor"] if ON_GPU else ["aot_eager"]


SPLIT_KERNELS = ("triton_matmul", "triton_fused_tiled")  # the versions a launch override splits K in


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("impl,block_c", [(impl, 64) for impl in IMPLS_WITH_MATMUL] + [(impl, 32) for impl in SPLIT_KERNELS],
                         ids=[f"{impl}-one class tile" for impl in IMPLS_WITH_MATMUL] +
                             [f"{impl}-class tiles" for impl in SPLIT_KERNELS])
@pytest.mark.usefixtures("fresh_compile")
def test_compiles_without_graph_break(impl, block_c, backend):
    """fullgraph=True, forward and backward; the matmul and tiled versions with K split, over one
    class tile or two (the tiled one then with its (max, sum) table and rescale)."""
    fn = IMPLS_WITH_MATMUL[impl]
    launch = MatmulLaunch(16, block_c, 16, split_k=2) if impl in SPLIT_KERNELS else None
    x, W = (t.requires_grad_() for t in matmul_softmax_inputs(19, 40, 50, torch.float32, seed=54))
    compiled = torch.compile(lambda x, W: fn(x, W, launch).sin(), fullgraph=True, backend=backend)
    out = compiled(x, W)
    out.sum().backward()
    xe, We = (t.detach().requires_grad_() for t in (x, W))
    eager = fn(xe, We, launch).sin()
    eager.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(W.grad, We.grad)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.usefixtures("fresh_compile")
def test_autocast_compiles_without_graph_break(backend):
    """fullgraph=True under autocast: the cast of a float32 W beside bfloat16 x is traced with the op."""
    x, W = matmul_softmax_inputs(19, 40, 50, torch.float32, seed=56)
    x = x.bfloat16()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = torch.compile(lambda x, W: matmul_softmax_fused_tiled(x, W).sin(), fullgraph=True, backend=backend)(x, W)
        eager = matmul_softmax_fused_tiled(x, W).sin()
    assert out.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(out, eager)


@pytest.mark.parametrize("block_c,tiles", [(64, 3), (32, 6)], ids=["one class tile", "class tiles"])
def test_split_k_counts_are_reset_by_the_kernel(block_c, tiles):
    """The split-K counts (one a row block and class tile) live in one cached buffer: after a
    call every count is 0 again, so the next call (or a CUDA-graph replay) finds them zeroed
    with no memset of its own."""
    import fused_softmax_matmul

    x, W = matmul_softmax_inputs(40, 100, 50, torch.float32, seed=55)
    launch = MatmulLaunch(16, block_c, 16, split_k=3)
    first = matmul_softmax_fused_tiled(x, W, launch)
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    counts = fused_softmax_matmul._split_k_counts(x.device, stream, triton.next_power_of_2(tiles))
    assert counts.numel() == triton.next_power_of_2(tiles) and not counts.any(), counts
    assert torch.equal(matmul_softmax_fused_tiled(x, W, launch), first)


@needs_gpu
def test_capture_makes_its_own_split_k_counts():
    """Counts cached during a CUDA-graph capture would live in that graph's pool, zeroed only by
    its first replay and shared with the next graph captured on the stream: capture makes its own."""
    import fused_softmax_matmul

    x, W = matmul_softmax_inputs(40, 100, 50, torch.float32, seed=56)
    launch = MatmulLaunch(16, 64, 16, split_k=3)
    want = matmul_softmax_fused_tiled(x, W, launch)
    cached = fused_softmax_matmul._split_k_counts.cache_info().currsize
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul_softmax_fused_tiled(x, W, launch)
    assert fused_softmax_matmul._split_k_counts.cache_info().currsize == cached
    for _ in range(2):
        graph.replay()
        torch.testing.assert_close(out, want)


def test_launch_choices_are_cached():
    import fused_softmax_matmul

    before = fused_softmax_matmul._tiled_launch.cache_info().hits
    args = (1000, 3000, torch.bfloat16, torch.device(DEVICE))
    assert tiled_launch(*args, K=77) is tiled_launch(*args, K=77)
    assert fused_softmax_matmul._tiled_launch.cache_info().hits == before + 1


@needs_gpu
@pytest.mark.parametrize("impl", IMPLS_WITH_MATMUL)
def test_cuda_graph_replay_matches_eager(impl):
    """Split K included (1024 x 1024 x 100 splits on an H100): its counts must be zero at every replay."""
    fn = IMPLS_WITH_MATMUL[impl]
    x, W = matmul_softmax_inputs(1024, 1024, 100, torch.float32, seed=56)
    fn(x, W)  # warm-up: compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, W)
    for seed in (57, 58):
        x.copy_(matmul_softmax_inputs(1024, 1024, 100, torch.float32, seed=seed)[0])
        graph.replay()
        torch.testing.assert_close(out, fn(x, W), rtol=0, atol=0)


@needs_gpu
@pytest.mark.parametrize("impl", IMPLS_WITH_MATMUL)
@pytest.mark.usefixtures("fresh_compile")
def test_reduce_overhead_compile(impl):
    fn = IMPLS_WITH_MATMUL[impl]
    x, W = matmul_softmax_inputs(256, 512, 50, torch.float32, seed=59)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = compiled(x, W)
    torch.testing.assert_close(out.clone(), fn(x, W))


@needs_gpu
@pytest.mark.parametrize("which", ["x", "W"])
def test_cpu_tensor_mixed_with_cuda_refused(which):
    x, W = matmul_softmax_inputs(4, 16, 8, torch.float32)
    x, W = (x.cpu(), W) if which == "x" else (x, W.cpu())
    with pytest.raises(ValueError, match=rf"{which} is on cpu, but compiled Triton kernels need a CUDA tensor"):
        matmul_softmax_fused_tiled(x, W)


@pytest.mark.parametrize("which", ["x", "W"])
def test_sparse_input_refused(which):
    x, W = _good()
    x, W = (x.to_sparse(), W) if which == "x" else (x, W.to_sparse())
    with pytest.raises(TypeError, match=rf"{which} must be a dense \(strided\) tensor, got layout torch\.sparse_coo"):
        matmul_softmax_fused_tiled(x, W)
