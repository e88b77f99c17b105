"""FlashAttention's forward by the Gluon kernel for Hopper (``flash_attention_gluon``) against float64.

Judged as the Triton kernels are (tests/test_flash_attention.py): O within twice PyTorch's own
error at the inputs' dtype, against attention in float64 on the same rounded inputs; L (float32)
within twice PyTorch's float32 log-sum-exp error. The kernel only compiles for sm_90 with Gluon:
its tests skip elsewhere, except those that check what it refuses, which run everywhere.

Shapes are chosen against its tiles: two consumer warpgroups of 64 queries per tile (the second
with no query in "one tile", 36 in "ragged"), key steps of 128 through a ring of 2 slots (K and V),
steps with and without the mask, TMA's zero fill past the last row (and its clipped store), causal
tiles taken last tile first, and programs running several tiles in turn (a persistent grid).
"""

from __future__ import annotations

import pytest
import torch

from fused_softmax_matmul import (
    FlashAttentionTriton, attention_logsumexp, attention_reference, flash_attention_gluon, flash_plan_of,
    gluon_flash_unsupported,
)
from support import DTYPES, ON_GPU, assert_close, attention_inputs


def _missing_hopper_gluon() -> str | None:
    if not ON_GPU:
        return "needs a GPU running compiled Triton"
    probe = torch.empty((1, 8, 64), dtype=torch.bfloat16, device="cuda")
    return gluon_flash_unsupported(probe, probe, probe)


MISSING = _missing_hopper_gluon()
needs_hopper_gluon = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

# (batch, n_queries, n_keys, d): the path each exercises.
SHAPES = {
    "one tile": (1, 64, 128, 64),
    "ragged": (2, 100, 200, 64),      # a second query tile of 36 rows, a last key step of 72
    "one key": (1, 70, 1, 64),        # a key step of 127 zero-filled rows, all masked
    "ring": (3, 130, 1000, 128),      # 8 key steps through 2 slots: each barrier changes phase 4 times
    "more keys": (2, 64, 640, 64),    # causal: queries see only the first 64 keys of 640
    "more queries": (2, 640, 64, 128),  # causal: every query past 63 sees all keys
    "many steps": (2, 1000, 1000, 128),  # 8 programs (the last two consumers 104 rows short), up to 8 steps
    "second ragged": (1, 200, 200, 64),  # the second program's second consumer holds 8 rows
    "long keys": (1, 300, 700, 64),     # causal: 3 programs of 1 to 3 key steps, run last first
}


@pytest.mark.memcheck
@needs_hopper_gluon
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_three_slot_ring(is_causal, pingpong):
    """stages=3: the slots change phase at other steps than with the default 2."""
    Q, K, V = attention_inputs(2, 300, 900, 64, torch.bfloat16, seed=5, scale=4.0)
    with torch.no_grad():
        O, _ = flash_attention_gluon(Q, K, V, is_causal, stages=3, pingpong=pingpong)
    Q64, K64, V64 = (t.double() for t in (Q, K, V))
    assert_close(O, attention_reference(Q64, K64, V64, is_causal), attention_reference(Q, K, V, is_causal))


@needs_hopper_gluon
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_against_float64(shape, dtype, is_causal, pingpong):
    """pingpong: the consumers take turns to issue their products, or run free."""
    batch, n_queries, n_keys, d = shape
    Q, K, V = attention_inputs(batch, n_queries, n_keys, d, DTYPES[dtype], seed=n_queries + n_keys, scale=4.0)
    with torch.no_grad():
        O, L = flash_attention_gluon(Q, K, V, is_causal, pingpong=pingpong)
    Q64, K64, V64 = (t.double() for t in (Q, K, V))
    assert_close(O, attention_reference(Q64, K64, V64, is_causal), attention_reference(Q, K, V, is_causal))
    assert L.dtype == torch.float32 and L.shape == (batch, n_queries)
    assert_close(L, attention_logsumexp(Q64, K64, is_causal), attention_logsumexp(Q.float(), K.float(), is_causal))


@pytest.mark.memcheck
@needs_hopper_gluon
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_programs_of_several_tiles(d, is_causal, pingpong):
    """A persistent grid of 3 programs over 3 x 6 tiles of 128 queries (the last one ragged): ring
    slots, barrier phases and turns run on from tile to tile, Q and the O buffer are reused, tiles
    of different lengths (causal) follow each other; equal to the grid of one tile a program."""
    import fused_softmax_matmul as fsm
    Q, K, V = attention_inputs(3, 700, 700, d, torch.bfloat16, seed=d, scale=4.0)
    outs = []
    for programs in (3, None):
        O, L = torch.empty_like(Q), torch.empty(Q.shape[:2], dtype=torch.float32, device=Q.device)
        with torch.no_grad():
            fsm._gluon_flash_forward(Q, K, V, is_causal, O, L, pingpong=pingpong, persistent=programs is not None,
                                     programs=programs)
        outs.append((O, L))
    (O, L), (O1, L1) = outs
    assert torch.equal(O, O1) and torch.equal(L, L1)  # the same tiles, computed the same way
    Q64, K64, V64 = (t.double() for t in (Q, K, V))
    assert_close(O, attention_reference(Q64, K64, V64, is_causal), attention_reference(Q, K, V, is_causal))
    assert_close(L, attention_logsumexp(Q64, K64, is_causal), attention_logsumexp(Q.float(), K.float(), is_causal))


@needs_hopper_gluon
def test_rows_of_minus_inf_follow_sdpa():
    """A query whose logits are all -inf: output 0 and L = -inf (SDPA's answer, and the Triton kernel's)."""
    Q, K, V = attention_inputs(2, 100, 256, 64, torch.bfloat16, seed=3)
    K[0, :, 0] = -float("inf")
    Q[0, :, 0] = Q[0, :, 0].abs() + 1  # batch 0: every logit is (positive) x -inf + finite = -inf
    with torch.no_grad():
        O, L = flash_attention_gluon(Q, K, V, False)
    assert torch.equal(O[0], torch.zeros_like(O[0])) and bool((L[0] == -float("inf")).all())
    assert torch.isfinite(O[1]).all() and torch.isfinite(L[1]).all()  # the other batch element is untouched


def test_refuses_by_name_what_it_cannot_take():
    """Everywhere: inputs that need grad, and (off Hopper or without Gluon) the reason it cannot run."""
    # The kernels' device: a CUDA tensor with compiled Triton, a CPU one in interpreter mode.
    Q = torch.zeros((1, 8, 64), requires_grad=True, device="cuda" if ON_GPU else "cpu")
    with pytest.raises(RuntimeError, match="flash_attention_gluon has no backward"):
        flash_attention_gluon(Q, Q, Q)
    if MISSING is not None:
        with pytest.raises(ValueError, match="flash_attention_gluon cannot take these inputs"):
            with torch.no_grad():
                flash_attention_gluon(Q.detach(), Q.detach(), Q.detach())


# (batch, heads, n, d, is_causal): the Gluon kernels each shape takes (``flash_plan`` on an H100's 132 SMs).
VIEW_CASES = {
    "d64-full": (4, 4, 2048, 64, False),  # forward (persistent: full, 2048 keys), dQ and dK/dV
    "d64-causal": (4, 4, 2048, 64, True),  # forward and dQ in Gluon, dK/dV in Triton
    "d128-causal": (2, 3, 320, 128, True),  # all three, ragged tiles
}


@needs_hopper_gluon
@pytest.mark.parametrize("name", VIEW_CASES)
def test_gluon_kernels_read_a_models_qkv_views_in_place(name):
    """q, k, v as (batch, heads, n, d) views of one (batch, n, 3, heads, d) projection: the Gluon
    kernels' 4-d TMA descriptors read them where they lie, and out and the gradients (written in
    (batch, n, heads, d)) equal those of contiguous copies bit for bit: the same tiles, computed
    the same way."""
    batch, heads, n, d, is_causal = VIEW_CASES[name]
    qkv = torch.randn((batch, n, 3, heads, d), dtype=torch.bfloat16, device="cuda").requires_grad_()
    views = [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    plan = flash_plan_of(*views, is_causal)
    assert set(plan.gluon) == ({"forward", "dq"} if name == "d64-causal" else {"forward", "dq", "dkdv"})
    dout = torch.randn((batch, n, heads, d), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    out = FlashAttentionTriton.apply(*views, is_causal)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    copies = [t.detach().contiguous().requires_grad_() for t in views]
    want = FlashAttentionTriton.apply(*copies, is_causal)
    grads = torch.autograd.grad(want, copies, dout.contiguous())
    assert out.transpose(1, 2).is_contiguous()
    assert torch.equal(out, want)
    for i, g in enumerate(grads):
        assert torch.equal(dqkv[:, :, i].transpose(1, 2), g), f"gradient {i}"
