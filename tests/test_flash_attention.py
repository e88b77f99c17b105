"""FlashAttention forward and backward, in PyTorch and in Triton, against float64 attention.

Every answer is judged against the materialised attention computed in float64 on the same
(rounded) inputs; the allowed error is PyTorch's own at the input precision (FlashAttention's
rule, ``support.assert_close``). In interpreter mode the shapes are small and the Triton kernels
get 16 x 16 tiles, so a small problem still spans several tiles, a ragged last tile and, when
causal, tiles on, below and above the diagonal. On a GPU the wrapper's own launch and the real
sizes run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fused_softmax_matmul import (
    FlashAttentionPytorch, FlashAttentionTriton, FlashLaunch, attention_flops, attention_logsumexp,
    attention_reference, flash_attention_bytes,
)
from support import DTYPES, ON_GPU, UNIT_ROUNDOFF, assert_close, attention_inputs, needs_gpu, randn

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


def check_against_float64(impl, batch, n_queries, n_keys, d, dtype, is_causal, scale=1.0, launches=TEST_LAUNCHES):
    """The whole check on fresh inputs of this shape: O, L, dQ, dK, dV within PyTorch's own error at ``dtype``."""
    Q, K, V = attention_inputs(batch, n_queries, n_keys, d, dtype, seed=batch + n_queries + d, scale=scale)
    dO = randn((batch, n_queries, d), dtype, seed=7)
    assert_matches_float64(impl, Q, K, V, dO, is_causal, launches)


def assert_matches_float64(impl, Q, K, V, dO, is_causal, launches=TEST_LAUNCHES):
    """O, L, dQ, dK, dV of ``impl`` on these inputs within PyTorch's own error at their dtype."""
    ours = run_with_grads(impl, Q, K, V, dO, is_causal, launches)
    exact = reference_with_grads(Q, K, V, dO, is_causal, torch.float64)
    torchs = reference_with_grads(Q, K, V, dO, is_causal, Q.dtype)
    L64 = attention_logsumexp(Q.double(), K.double(), is_causal)
    names = ("O", "dQ", "dK", "dV")
    ours_no_L = (ours[0],) + ours[2:]
    for name, out, ref64, torch_out in zip(names, ours_no_L, exact, torchs):
        try:
            assert_close(out, ref64, torch_out, algorithm_error=0.0 if name == "O" else recompute_error(L64))
        except AssertionError as e:
            raise AssertionError(f"{impl} {name}: {e}") from None
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
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(impl, dtype, is_causal):
    shape = (2, 113, 203, 64) if ON_GPU else (1, 37, 53, 32)
    check_against_float64(impl, *shape, DTYPES[dtype], is_causal)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_sized_case(dtype):
    """The benchmark's sequence length and head (batch 2, not 16: the float64 autograd reference
    holds several 8192 x 8192 float64 matrices per batch element), checked before it is timed."""
    check_against_float64("flash_triton", 2, 8192, 8192, 64, DTYPES[dtype], True, launches=None)


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
    ("V-float64", lambda: _with(2, _inputs()[2].double()), TypeError, "V must be float32, float16 or bfloat16"),
    ("K-other-dtype", lambda: _with(1, _inputs()[1].half()), TypeError, "K has dtype"),
    ("Q-wrong-device", lambda: _with(0, _inputs()[0].to(WRONG_DEVICE)), ValueError, "Q is on"),
    ("K-other-batch", lambda: _with(1, attention_inputs(2, 8, 8, 16, torch.float32)[1]), ValueError, "K must be .* batch"),
    ("K-other-d", lambda: _with(1, _inputs(d=32)[1]), ValueError, "K must be .* d 16"),
    ("V-other-length", lambda: _with(2, _inputs(nk=9)[2]), ValueError, "V must have K's shape"),
    ("no-keys", lambda: (*_inputs(nk=0), False), ValueError, "K has no keys"),
    ("d-0", lambda: (*_inputs(d=0), False), ValueError, "Q has d = 0"),
    ("is_causal-int", lambda: (*_inputs(), 1), TypeError, "is_causal must be a bool"),
]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("make_args,error,pattern", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_input(impl, make_args, error, pattern):
    with pytest.raises(error, match=pattern):
        IMPLS[impl].apply(*make_args())


TRITON_BAD_INPUTS = [
    # The kernels' tiles need a power-of-two head of at least 16 (tl.dot) and at most 128.
    ("d-48", lambda: (*_inputs(d=48), False), ValueError, r"d \(the last dimension of Q, K, V\) must be one of"),
    ("d-8", lambda: (*_inputs(d=8), False), ValueError, r"d \(the last dimension of Q, K, V\) must be one of"),
    ("d-256", lambda: (*_inputs(d=256), False), ValueError, r"d \(the last dimension of Q, K, V\) must be one of"),
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

