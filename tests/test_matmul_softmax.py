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
    MATMUL_SOFTMAX_IMPLS, SIMPLE_MAX_CLASSES, MatmulLaunch, check_launch, matmul_softmax_fused_simple, matmul_softmax_fused_tiled,
    matmul_softmax_ref, simple_launch, tiled_launch,
)
from support import DEVICE, DTYPES, UNIT_ROUNDOFF, assert_close, matmul_softmax_inputs, needs_gpu

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
    # 257 class tiles of 16 > the 256 tiles a rescale step covers (4096 // 16): the rescale's
    # two loops take two steps. Row 0's largest logit is in the last class, so its maximum grows
    # in the second step and the first step's sum must be rescaled; row 1's is in the first
    # class, so the second step must keep the first's maximum: at scale 4 the peak (~190) is
    # ~180 above the second step's logits, so using the step's own maximum would overflow exp.
    # Too wide for the simple kernel.
    "rescale 2 steps": (2, 16, 4100, (16, 16, 16), "max at both ends", 4.0),
    # Strided x (row stride 2K, column stride 2) and transposed W (strides 1, K) read in place.
    "x strided": (24, 40, 70, (16, 32, 16), "x_strided", 1.0),
    "W transposed": (24, 40, 70, (16, 32, 16), "W_transposed", 1.0),
    # K split in 3 slices of 48 (the last holds 4) over 3 row blocks (the last holds 8 rows):
    # split_k_kernel, in matmul (unfused) and in the tiled wrapper.
    "split K": (40, 100, 50, (16, 64, 16, 3), "contiguous", 1.0),
    # 8 slices asked of 3 K steps: 3 slices of one step each; C = 20 in a 32-wide tile.
    "split K past its steps": (17, 37, 20, (16, 32, 16, 8), "contiguous", 1.0),
    # Split K with logits of size ~1000: the partial sums are added before the maximum is taken.
    "split K, extreme logits": (20, 64, 30, (16, 32, 16, 4), "contiguous", 1000.0),
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
                yield pytest.param(impl, dtype, B, K, C, tiles, layout, scale, id=f"{case}-{impl}-{dtype}")


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


@pytest.mark.parametrize("impl", ["triton_unfused", "triton_fused_tiled"])
def test_split_k_needs_one_class_tile(impl):
    x, W = _good(C=40)
    with pytest.raises(ValueError, match="launch.split_k = 2 needs all C = 40 classes in one tile"):
        TRITON_IMPLS[impl](x, W, MatmulLaunch(16, 32, 16, split_k=2))


def test_simple_refuses_split_k():
    x, W = _good(C=40)
    with pytest.raises(ValueError, match="launch.split_k must be 1 in the simple kernel"):
        matmul_softmax_fused_simple(x, W, MatmulLaunch(16, 64, 16, split_k=2))


# B, K, C, dtype -> (block_b, split_k) the tiled wrapper picks on a 132-SM H100.
SPLIT_CHOICES = {
    (64, 128, 10, "float32"): (16, 1),  # 4 K steps: too short to split
    (256, 512, 50, "float32"): (32, 8),  # 8 row blocks x 8 slices of 2 steps
    (1024, 1024, 100, "float32"): (32, 4),  # 32 row blocks x 4 slices
    (4096, 4096, 32768, "bfloat16"): (128, 1),  # many class tiles: never split
}


@pytest.mark.parametrize("B,K,C,dtype", SPLIT_CHOICES)
def test_tiled_launch_splits_k_where_rows_leave_sms_idle(monkeypatch, B, K, C, dtype):
    import fused_softmax_matmul

    monkeypatch.setattr(fused_softmax_matmul, "_sm_count", lambda device: 132)
    launch = tiled_launch(B, C, DTYPES[dtype], torch.device(DEVICE), K=K)
    assert (launch.block_b, launch.split_k) == SPLIT_CHOICES[B, K, C, dtype]
    check_launch(launch)


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
        launch = simple_launch(B, C, DTYPES[dtype], torch.device(DEVICE))
        check_launch(launch)
        assert launch.block_c >= C


# On a GPU: the benchmark sizes themselves, compiled, bf16 with real tensor-core tl.dot (the
# interpreter cannot check that: it upcasts bf16, see upcast_dot_operands).
@needs_gpu
@pytest.mark.parametrize("impl", TRITON_IMPLS)
@pytest.mark.parametrize("B,K,C,dtype", BENCH_SIZES)
def test_benchmark_sizes_on_gpu(impl, B, K, C, dtype):
    if impl == "triton_fused_simple" and C > SIMPLE_MAX_CLASSES:
        pytest.skip("refused by design: test_simple_refuses_too_many_classes")
    x, W = matmul_softmax_inputs(B, K, C, DTYPES[dtype])
    out = TRITON_IMPLS[impl](x, W)
    # A float64 reference of the LM-head sizes would need 8 GB per (B, C) buffer: check up to
    # 512 rows spread over the whole batch (every row block of the kernels is still launched).
    rows = torch.arange(0, B, max(1, B // 512), device=x.device)
    ref64 = torch.softmax(x[rows].double() @ W.double(), dim=-1)
    assert_close(out[rows], ref64, matmul_softmax_ref(x, W)[rows])


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
