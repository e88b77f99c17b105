"""flash_attention, attention as models call it, against float64 attention with every option.

The judge is ``flash_attention_reference`` in float64 on the same (rounded) inputs: materialised
logits, the mask as explicit bounds, softcap by torch.tanh, grouped key/value heads repeated by
repeat_interleave. The allowed error is PyTorch's own at the input precision (the same
reference computed in that dtype), FlashAttention's rule (``support.assert_close``), for out,
lse and the three gradients; the loss takes both out and lse, so lse's own gradient is checked
too. In interpreter mode the shapes are small (lengths 1 to 70, odd ones among them) and each
case runs twice: with the plan's tiles (one or two per sequence) and with 16 x 16 tiles, so
that windows and diagonals cross many tiles and the skipped, masked and whole ranges all occur.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fused_softmax_matmul

from fused_softmax_matmul import (
    ATTENTION_MAX_HEAD_DIM, AttentionPlan, FlashLaunch, attention_head_dims, attention_heads_in_tile, attention_splits,
    attention_mask_bounds, attention_plan, attention_visible_pairs,
    check_flash_attention_inputs, flash_attention, flash_attention_flops, flash_attention_reference, _attention_args,
)
from online_softmax import forget_kept_launches, option_key
from support import DEVICE, DTYPES, ON_GPU, assert_close, fresh_compile, needs_gpu, randn  # noqa: F401 - a fixture
from test_flash_attention import accumulation_error, recompute_error

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: shapes (batch, query heads, key/value heads, n_queries, n_keys, d, dv) and
    flash_attention's keyword options; ``logit_scale`` multiplies q (peaked softmaxes)."""

    batch: int
    heads: int
    kv_heads: int
    n_queries: int
    n_keys: int
    d: int
    dv: int
    options: dict = dataclasses.field(default_factory=dict)
    logit_scale: float = 1.0


# Each case's comment says which path it takes. Head dims cover the padded ones (24 -> 32, 40 ->
# 64, 80 and 96 -> 128) and d != dv; the lengths cross tiles of 16 and leave ragged ends.
CPU_CASES = {
    "full-37q-53k-d16": Case(1, 2, 2, 37, 53, 16, 16),
    "causal-53q-37k-d24": Case(2, 2, 2, 53, 37, 24, 24, dict(is_causal=True)),  # top-left, more queries than keys
    "gqa4:2-causal-d40": Case(1, 4, 2, 45, 45, 40, 40, dict(is_causal=True, enable_gqa=True)),
    "gqa4:1-d80-dv40": Case(1, 4, 1, 29, 41, 80, 40, dict(enable_gqa=True)),  # dv != d, both padded
    "d96-dv16-scale": Case(1, 2, 2, 33, 19, 96, 16, dict(scale=0.3)),
    "bottom-right-5q-70k": Case(1, 2, 2, 5, 70, 16, 16, dict(is_causal=True, causal_align="bottom_right")),
    "decode-1q-70k-gqa": Case(2, 4, 2, 1, 70, 24, 24, dict(is_causal=True, causal_align="bottom_right",
                                                           enable_gqa=True)),
    # a decode step: four heads of a group in one forward tile, a window across its key tiles
    "gqa8:2-1q-window": Case(1, 8, 2, 1, 70, 16, 16, dict(window=(20, 4), causal_align="bottom_right",
                                                          enable_gqa=True)),
    # the same with heads that take a tail (80 = 64 + 16, dv 40 = 32 + 8 of 16): four heads of a tile read it
    "gqa8:2-1q-d80-tails": Case(1, 8, 2, 1, 70, 80, 40, dict(is_causal=True, causal_align="bottom_right",
                                                             enable_gqa=True)),
    # two queries of a group of 6 heads (padded to 8) in one forward tile
    "gqa6:1-2q": Case(1, 6, 1, 2, 70, 24, 24, dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)),
    # a chunk of 3 queries: a group of 8 heads shares the forward's tiles, 2 queries of each a tile
    "gqa8:1-3q-chunk": Case(1, 8, 1, 3, 70, 16, 16, dict(is_causal=True, causal_align="bottom_right",
                                                         enable_gqa=True)),
    # bottom-right with more queries than keys: the first 30 queries see no key (out 0, lse -inf)
    "bottom-right-50q-20k": Case(1, 2, 2, 50, 20, 16, 16, dict(is_causal=True, causal_align="bottom_right")),
    "window-7-3": Case(1, 2, 2, 70, 70, 16, 16, dict(window=(7, 3))),  # masked tiles on both sides of whole ones
    "window-left-causal": Case(1, 2, 2, 61, 66, 24, 24, dict(window=(9, None), is_causal=True)),
    "window-right-only": Case(1, 2, 2, 40, 33, 16, 16, dict(window=(None, 5))),
    # top-left window past the keys: queries from 13 on see none of the 10 keys
    "window-past-keys": Case(1, 2, 2, 40, 10, 16, 16, dict(window=(2, 2))),
    "softcap-peaked": Case(1, 2, 2, 37, 45, 16, 16, dict(softcap=2.0), logit_scale=4.0),  # tanh saturates
    "softcap-window-causal-gqa": Case(1, 4, 2, 5, 66, 40, 24, dict(
        softcap=5.0, window=(20, None), is_causal=True, causal_align="bottom_right", enable_gqa=True), 2.0),
    "d256-small": Case(1, 1, 1, 17, 20, 256, 256, dict(is_causal=True)),  # the largest head (slow: one case)
}
GPU_CASES = {
    name: dataclasses.replace(case, n_queries=case.n_queries * 7, n_keys=case.n_keys * 9,
                              options={**case.options, **({"window": tuple(None if w is None else 9 * w
                                                                           for w in case.options["window"])}
                                                          if "window" in case.options else {})})
    for name, case in CPU_CASES.items()
}
GPU_CASES["gemma-like-d256"] = Case(1, 4, 2, 600, 900, 256, 256, dict(
    softcap=50.0, window=(300, 0), is_causal=True, enable_gqa=True), 4.0)
# d 192 over dv 128 (split heads): the tiles at 256 of a head dim with a tail
GPU_CASES["split-heads-d192-dv128"] = Case(1, 4, 2, 500, 700, 192, 128, dict(is_causal=True, enable_gqa=True))
CASES = GPU_CASES if ON_GPU else CPU_CASES

# Interpreter: 16 x 16 tiles everywhere (the least tl.dot takes), one warp group, no pipelining.
SMALL_TILES = {kernel: FlashLaunch(16, 16, 4, 1) for kernel in ("forward", "dq", "dkdv")}


def case_plan(case: Case, dtype: torch.dtype, **sizes) -> AttentionPlan:
    """``attention_plan`` of the case's shapes and mask options (``sizes``: batch_heads, say)."""
    masks = {k: v for k, v in case.options.items() if k in ("is_causal", "causal_align", "window")}
    return attention_plan(case.d, case.dv, dtype, case.n_queries, case.n_keys, grouped=case.heads // case.kv_heads,
                          **sizes, **masks)


def small_tile_plan(case: Case, dtype: torch.dtype) -> AttentionPlan:
    return dataclasses.replace(case_plan(case, dtype), **SMALL_TILES)


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0):
    """q, k, v of the case in dtype, and the upstream gradients of out and lse."""
    b, h, hk, nq, nk = case.batch, case.heads, case.kv_heads, case.n_queries, case.n_keys
    q = randn((b, h, nq, case.d), dtype, seed, scale=case.logit_scale)
    k = randn((b, hk, nk, case.d), dtype, seed + 1)
    v = randn((b, hk, nk, case.dv), dtype, seed + 2)
    dout = randn((b, h, nq, case.dv), dtype, seed + 3)
    dlse = randn((b, h, nq), torch.float32, seed + 4)
    return q, k, v, dout, dlse


def _loss(out, lse, dout, dlse):
    """<out, dout> + <lse, dlse> over the queries that see a key (lse = -inf elsewhere)."""
    return (out.float() * dout.float()).sum() + (lse.float().masked_fill(lse == NEG_INF, 0.0) * dlse).sum()


def run_ours(q, k, v, dout, dlse, options, plan=None, fn=flash_attention):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, return_lse=True, plan=plan, **options)
    grads = torch.autograd.grad(_loss(out, lse, dout, dlse), leaves)
    return out.detach(), lse.detach(), *grads


def run_reference(q, k, v, dout, dlse, options, dtype):
    """(out, lse, dq, dk, dv) of the materialised reference computed in dtype by torch autograd."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    reference_options = {key: value for key, value in options.items() if key != "enable_gqa"}
    out, lse = flash_attention_reference(*leaves, **reference_options)
    grads = torch.autograd.grad(_loss(out, lse, dout.to(dtype), dlse.to(dtype)), leaves)
    return out.detach(), lse.detach(), *grads


def assert_matches_float64(ours, q, k, v, dout, dlse, options):
    """out, lse, dq, dk, dv within PyTorch's own error at q's dtype (lse: float32's, as it is
    float32 whatever the inputs), plus what the flash algorithm adds by design (its tile sums
    and P recomputed from a float32 lse: test_flash_attention's ``recompute_error``)."""
    exact = run_reference(q, k, v, dout, dlse, options, torch.float64)
    torchs = run_reference(q, k, v, dout, dlse, options, q.dtype)
    torch_lse = run_reference(q, k, v, dout, dlse, options, torch.float32)[1]
    lse64 = exact[1]
    assert torch.equal(ours[1] == NEG_INF, lse64 == NEG_INF), "queries that see no key differ"
    assert ours[1].dtype == torch.float32 and ours[1].shape == q.shape[:3]
    recompute = recompute_error(lse64[lse64 > NEG_INF])
    summed = accumulation_error(max(q.shape[2], k.shape[2]))
    extra = {"out": summed, "lse": 0.0, "dq": summed + recompute, "dk": summed + recompute, "dv": summed + recompute}
    for name, out, ref64, torch_out in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, torchs):
        if name == "lse":
            torch_out = torch_lse
        try:
            assert_close(out, ref64, torch_out, algorithm_error=extra[name])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


# The cases whose masks cut tiles in most ways, run again on 16 x 16 tiles in the interpreter
# (float32 only: each takes some seconds there).
SMALL_TILE_CASES = ["causal-53q-37k-d24", "bottom-right-50q-20k", "window-7-3", "window-left-causal",
                    "window-past-keys", "softcap-window-causal-gqa"]
MATCH_PARAMS = [(name, dtype, "plan") for name in CASES for dtype in (
    ("float32", "float16", "bfloat16") if ON_GPU else ("float32",) if name == "d256-small" else ("float32", "float16"))]
if not ON_GPU:
    MATCH_PARAMS += [(name, "float32", "16x16") for name in SMALL_TILE_CASES]
# The forward's keys in three splits merged by their lse (what decode-like calls take): queries
# that one split, or every split, shows no key among them.
SPLIT_CASES = ["decode-1q-70k-gqa", "bottom-right-50q-20k", "window-7-3", "softcap-window-causal-gqa"]
MATCH_PARAMS += [(name, "float32" if ON_GPU else "float16", "split3") for name in SPLIT_CASES]
if not ON_GPU:
    # bfloat16 once: the interpreter's products take the operands upcast (upcast_dot_operands), so
    # this checks the roundings around them; the GPU runs every case in bfloat16.
    MATCH_PARAMS += [("softcap-window-causal-gqa", "bfloat16", "plan")]


@pytest.mark.memcheck
@pytest.mark.parametrize("name,dtype,tiles", MATCH_PARAMS, ids=["-".join(p) for p in MATCH_PARAMS])
def test_matches_float64(name, dtype, tiles):
    case = CASES[name]
    torch_dtype = DTYPES[dtype]
    q, k, v, dout, dlse = make_inputs(case, torch_dtype, seed=len(name))
    plan = {"plan": None, "16x16": small_tile_plan(case, torch_dtype),
            "split3": dataclasses.replace(small_tile_plan(case, torch_dtype), splits=3)}[tiles]
    ours = run_ours(q, k, v, dout, dlse, case.options, plan)
    assert_matches_float64(ours, q, k, v, dout, dlse, case.options)


def test_queries_that_see_no_key_match_sdpa():
    """Bottom-right alignment with more queries than keys hides every key from the first ones:
    out 0, lse -inf and zero gradients there, which is what SDPA gives for a row its boolean
    attn_mask hides entirely (checked here against this torch's SDPA with that mask)."""
    case = CPU_CASES["bottom-right-50q-20k"]
    q, k, v, dout, dlse = make_inputs(case, torch.float32)
    out, lse, dq, _, _ = run_ours(q, k, v, dout, dlse, case.options)
    hidden = slice(0, case.n_queries - case.n_keys)
    assert torch.equal(out[:, :, hidden], torch.zeros_like(out[:, :, hidden]))
    assert (lse[:, :, hidden] == NEG_INF).all() and (lse[:, :, hidden.stop:] > NEG_INF).all()
    assert torch.equal(dq[:, :, hidden], torch.zeros_like(dq[:, :, hidden]))
    lo, hi = attention_mask_bounds(case.n_queries, case.n_keys, True, "bottom_right")
    mask = torch.ones(case.n_queries, case.n_keys, dtype=torch.bool, device=DEVICE).tril(hi)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    (sdpa_dq,) = torch.autograd.grad((sdpa * dout).sum(), leaves[:1])
    assert torch.equal(sdpa[:, :, hidden], torch.zeros_like(sdpa[:, :, hidden]))
    assert torch.equal(sdpa_dq[:, :, hidden], torch.zeros_like(sdpa_dq[:, :, hidden]))
    torch.testing.assert_close(out, sdpa.detach(), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("options", [dict(), dict(is_causal=True), dict(enable_gqa=True, scale=0.5)],
                         ids=["full", "causal", "gqa-scale"])
def test_same_answer_as_sdpa(options):
    """Where SDPA has the option, the same call gives SDPA's answer (float32, top-left causal)."""
    heads_kv = 1 if options.get("enable_gqa") else 2
    q, k, v = randn((2, 2, 21, 24), torch.float32, 0), randn((2, heads_kv, 30, 24), torch.float32, 1), \
        randn((2, heads_kv, 30, 24), torch.float32, 2)
    torch.testing.assert_close(flash_attention(q, k, v, **options), F.scaled_dot_product_attention(q, k, v, **options),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("D", [40, 32, pytest.param(128, marks=needs_gpu)], ids=["general", "course", "gluon"])
def test_fused_qkv_view_is_read_in_place(D):
    """q, k, v as a model holds them: one (B, N, 3, H, D) projection, each (B, N, H, D) part
    transposed to (B, H, N, D) without a copy. The kernels read those strides, the gradients
    reach the projection, and the answers are those of contiguous copies. The course's kernels
    (D 32) write out and dq in (B, N, H, D) too, so that the model's reshape back copies nothing.
    D 128 in bfloat16 with a scale of its own: the general path's Gluon forward on Hopper (TMA over the views)."""
    B, N, H = 2, (200 if D == 128 else 37), 3
    dtype, options = (torch.bfloat16, dict(scale=0.1)) if D == 128 else (torch.float32, {})
    qkv = randn((B, N, 3, H, D), dtype, 0).requires_grad_()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous() and q.data_ptr() == qkv.data_ptr()
    plan = attention_plan(D, D, dtype, N, N, is_causal=True, batch_heads=B * H, **options)
    assert plan.path == ("course" if D == 32 else "general") and plan.gluon_forward == (D == 128)
    grad_layouts = []
    q.register_hook(lambda g: grad_layouts.append(g.transpose(1, 2).is_contiguous()))
    out = flash_attention(q, k, v, is_causal=True, **options)
    dout = randn(out.shape, dtype, 1)
    (dqkv,) = torch.autograd.grad((out * dout).sum(), [qkv])
    if D == 32:
        assert out.transpose(1, 2).is_contiguous() and grad_layouts == [True]
    copies = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    want = flash_attention(*copies, is_causal=True, **options)
    grads = torch.autograd.grad((want * dout).sum(), copies)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    for i, g in enumerate(grads):
        torch.testing.assert_close(dqkv[:, :, i], g.transpose(1, 2), atol=0, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_plain_calls_take_the_course_kernels(is_causal):
    """A call FlashAttentionTriton can take runs there (its tuned kernels, in SDPA's layout), with
    the answers of the general kernels (forced by a plan); an option it lacks keeps the general ones."""
    q, k, v = randn((2, 3, 37, 32), torch.float32, 0), randn((2, 3, 45, 32), torch.float32, 1), \
        randn((2, 3, 45, 32), torch.float32, 2)
    assert check_flash_attention_inputs(q, k, v, is_causal, None, False, "top_left", None, None)["scale"] == 32 ** -0.5
    path = lambda d=32, dv=32, nq=37, nk=45, **o: attention_plan(d, dv, torch.float32, nq, nk, **o).path  # noqa: E731
    assert path(is_causal=is_causal, scale=32 ** -0.5) == path(is_causal=is_causal) == "course"
    assert path(nq=45, is_causal=True, causal_align="bottom_right") == "course"  # square: the same mask
    general = [dict(return_lse=True), dict(scale=0.5), dict(d=24, dv=24), dict(dv=16), dict(grouped=True),
               dict(window=(4, 0)), dict(softcap=5.0), dict(nk=0), dict(is_causal=True, causal_align="bottom_right")]
    assert [path(**o) for o in general] == ["general"] * len(general)
    q = randn((2, 37, 3, 32), torch.float32, 3).transpose(1, 2)  # (B, N, H, D) heads, read in place
    dout = randn(q.shape, torch.float32, 4)
    zeros = torch.zeros(q.shape[:3], device=q.device)
    course = run_ours(q, k, v, dout, zeros, {"is_causal": is_causal},
                      fn=lambda *a, return_lse, plan, **o: (flash_attention(*a, **o), zeros))
    plan = attention_plan(32, 32, torch.float32, 37, 45, is_causal=is_causal)
    general = run_ours(q, k, v, dout, zeros, {"is_causal": is_causal}, plan=plan)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (course[0], *course[2:]), (general[0], *general[2:])):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("d,dv", [(40, 24), (96, 80)])
def test_head_dims_read_at_a_stride(d, dv):
    """q, k and v whose head dim steps by 2 (every other element of a wider tensor, NaN between), at head
    dims that are no power of two: the kernels read them in place, and the gradients land on the same
    elements."""
    case = Case(1, 4, 2, 21, 29, d, dv, dict(is_causal=True, enable_gqa=True))
    q, k, v, dout, dlse = make_inputs(case, torch.float32)

    def widened(t):
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), device=t.device, dtype=t.dtype)
        wide[..., ::2] = t
        return wide.requires_grad_()

    wides = [widened(t) for t in (q, k, v)]
    out, lse = flash_attention(*(w[..., ::2] for w in wides), return_lse=True, **case.options)
    grads = torch.autograd.grad(_loss(out, lse, dout, dlse), wides)
    assert all(g[..., 1::2].eq(0).all() for g in grads)
    assert_matches_float64((out.detach(), lse.detach(), *(g[..., ::2] for g in grads)), q, k, v, dout, dlse,
                           case.options)


def test_gqa_gradients_sum_over_the_group():
    """dk and dv of a key/value head are the sums of what its query heads give it: the same as
    repeating k and v per query head (plain attention) and summing their gradients by group."""
    q, k, v = randn((1, 6, 23, 16), torch.float32, 0), randn((1, 2, 31, 16), torch.float32, 1), \
        randn((1, 2, 31, 16), torch.float32, 2)
    dout = randn((1, 6, 23, 16), torch.float32, 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grouped = torch.autograd.grad((flash_attention(*leaves, enable_gqa=True, is_causal=True) * dout).sum(), leaves)
    repeated = [q.clone().requires_grad_(), *(t.repeat_interleave(3, dim=1).requires_grad_() for t in (k, v))]
    plain = torch.autograd.grad((flash_attention(*repeated, is_causal=True) * dout).sum(), repeated)
    torch.testing.assert_close(grouped[0], plain[0], atol=1e-6, rtol=1e-6)
    for got, want in zip(grouped[1:], plain[1:]):
        torch.testing.assert_close(got, want.unflatten(1, (2, 3)).sum(2), atol=1e-6, rtol=1e-6)


# Calls of the general path whose forward is the Gluon kernel's on Hopper (``AttentionPlan.gluon_forward``): grouped
# heads, a scale or a log-sum-exp of their own, causal top-left with more keys than queries, lengths off its tiles
# (at least its 128 queries).
GLUON_CASES = {
    "gqa4:1-causal": Case(2, 8, 2, 300, 300, 128, 128, dict(is_causal=True, enable_gqa=True)),
    "gqa4:1-full-scale": Case(2, 4, 1, 200, 333, 128, 128, dict(enable_gqa=True, scale=0.2)),
    "causal-150q-300k": Case(1, 2, 2, 150, 300, 128, 128, dict(is_causal=True)),
}
# The interpreter runs one, shorter: the plan's Gluon forward falls back to Triton's there.
GLUON_PARAMS = ([(name, dtype) for name in GLUON_CASES for dtype in ("float16", "bfloat16")] if ON_GPU
                else [("gqa4:1-full-scale", "float16")])


def test_plan_gives_the_gluon_forward_only_calls_it_takes():
    """Which calls' plans take the Gluon forward, and a given plan's refused where it cannot run the call."""
    bf16 = torch.bfloat16
    assert attention_plan(128, 128, bf16, 4096, 4096, is_causal=True, batch_heads=32, grouped=4).gluon_forward
    assert attention_plan(128, 128, torch.float16, 1000, 3000, is_causal=True, batch_heads=64, scale=0.1).gluon_forward
    for kwargs in (dict(softcap=30.0), dict(window=(100, 0)), dict(causal_align="bottom_right", n_keys=5000)):
        sizes = dict(n_queries=4096, n_keys=kwargs.pop("n_keys", 4096))
        assert not attention_plan(128, 128, bf16, is_causal=True, batch_heads=32, **sizes, **kwargs).gluon_forward
    for d, dv, dtype in ((64, 64, bf16), (96, 96, bf16), (128, 64, bf16), (128, 128, torch.float32)):
        assert not attention_plan(d, dv, dtype, 4096, 4096, batch_heads=32).gluon_forward, (d, dv, dtype)
    decode = attention_plan(128, 128, bf16, 1, 32768, is_causal=True, causal_align="bottom_right", batch_heads=256,
                            grouped=4)
    assert not decode.gluon_forward and decode.heads_in_tile == 4
    # Under its tile of 128 queries; a scale not above 0 (its whole key tiles scale the row maximum, not the logits)
    assert not attention_plan(128, 128, bf16, 127, 4096, batch_heads=1024).gluon_forward
    assert attention_plan(128, 128, bf16, 128, 4096, batch_heads=1024).gluon_forward
    for scale in (-0.1, 0.0):
        assert not attention_plan(128, 128, bf16, 4096, 4096, batch_heads=32, scale=scale).gluon_forward
    q = randn((1, 2, 32, 128), bf16, 0)
    capped = dataclasses.replace(attention_plan(128, 128, bf16, 32, 32), gluon_forward=True)
    with pytest.raises(ValueError, match="plan.gluon_forward is True, .* no softcap or window"):
        flash_attention(q, q, q, softcap=20.0, plan=capped)
    with pytest.raises(ValueError, match="plan.gluon_forward is True, .* scale above 0, got -0.5"):
        flash_attention(q, q, q, scale=-0.5, plan=capped)
    with pytest.raises(TypeError, match="plan.gluon_forward"):
        flash_attention(q, q, q, plan=dataclasses.replace(capped, gluon_forward="yes"))


@pytest.mark.parametrize("name,dtype", GLUON_PARAMS, ids=["-".join(p) for p in GLUON_PARAMS])
def test_gluon_forward_of_general_calls_matches_float64(name, dtype, monkeypatch):
    """The general path's calls whose plan takes the Gluon forward, out, lse and the gradients against float64
    (the backward is Triton's, from the Gluon forward's lse); the Gluon kernel ran where Hopper's Gluon runs."""
    case = GLUON_CASES[name]
    if not ON_GPU:
        case = dataclasses.replace(case, n_queries=128, n_keys=33)
    q, k, v, dout, dlse = make_inputs(case, DTYPES[dtype], seed=len(name))
    ran = []
    original = fused_softmax_matmul._gluon_flash_forward
    monkeypatch.setattr(fused_softmax_matmul, "_gluon_flash_forward",
                        lambda *args, **kwargs: ran.append(args[0].shape) or original(*args, **kwargs))
    plan = case_plan(case, DTYPES[dtype], batch_heads=case.batch * case.heads)
    assert plan.gluon_forward
    assert_matches_float64(run_ours(q, k, v, dout, dlse, case.options), q, k, v, dout, dlse, case.options)
    assert len(ran) == (fused_softmax_matmul.gluon_flash_unsupported(q, k, v) is None)


def test_lse_alone_and_no_double_backward():
    """A loss of lse alone (out unused) differentiates through lse's own gradient; a second
    derivative is refused with a clear error, not a wrong answer."""
    q, k, v = (randn((1, 2, 19, 16), torch.float32, s).requires_grad_() for s in range(3))
    _, lse = flash_attention(q, k, v, return_lse=True)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(flash_attention_reference(qd, kd, vd)[1].sum(), (qd, kd, vd), allow_unused=True)
    torch.testing.assert_close(dq.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk.double(), want[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(dv, torch.zeros_like(dv))  # lse does not depend on v
    out = flash_attention(q, k, v, scale=0.5)  # the general kernels (not the course's, which have one)
    with pytest.raises(RuntimeError, match="double backward.*use flash_attention_reference"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_vmap_and_transforms_it_refuses():
    """torch.func.vmap folds its dimension into the batch (an unmapped k or v shared), with or
    without gradients; torch.func's grad and forward-mode AD are refused by name, not answered
    with a zero tangent or a misleading error."""
    from torch import func

    q, k, v = randn((3, 1, 4, 8, 16), torch.float32, 4), randn((1, 2, 10, 16), torch.float32, 5), \
        randn((3, 1, 2, 10, 16), torch.float32, 6)

    def f(q, v):
        return flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", enable_gqa=True)

    looped = torch.stack([f(q[i], v[i]) for i in range(3)])
    assert torch.equal(func.vmap(f)(q, v), looped)
    leaves = [q.clone().requires_grad_(), v.clone().requires_grad_()]
    mapped = torch.autograd.grad(func.vmap(f)(*leaves).square().sum(), leaves)
    each = [t.clone().requires_grad_() for t in (q, v)]
    for got, want in zip(mapped, torch.autograd.grad(torch.stack([f(each[0][i], each[1][i]) for i in range(3)])
                                                      .square().sum(), each)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(NotImplementedError, match="not under torch.func's grad"):
        func.grad(lambda q: f(q, v[0]).square().sum())(q[0])
    with pytest.raises(NotImplementedError, match="forward-mode"):
        func.jvp(lambda q: f(q, v[0]), (q[0],), (torch.ones_like(q[0]),))
    # A plain call (the course's kernels outside transforms) takes the same rule and refusals.
    kp = randn((1, 1, 10, 16), torch.float32, 7)
    plain = func.vmap(lambda q: flash_attention(q, kp, kp))(q[:, :, :1])  # the general kernels there
    torch.testing.assert_close(plain, torch.stack([flash_attention(q[i, :, :1], kp, kp) for i in range(3)]),
                               atol=1e-6, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="not under torch.func's grad"):
        func.grad(lambda q: flash_attention(q, kp, kp).square().sum())(q[0, :, :1])


def test_empty_inputs():
    """No queries: empty outputs; no keys: every query sees none (out 0, lse -inf, zero gradients)."""
    q = randn((2, 2, 0, 16), torch.float32, 0)
    k = randn((2, 2, 5, 16), torch.float32, 1)
    out, lse = flash_attention(q, k, k, return_lse=True)
    assert out.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0)
    q = randn((1, 2, 3, 16), torch.float32, 0).requires_grad_()
    k = randn((1, 2, 0, 16), torch.float32, 1).requires_grad_()
    out, lse = flash_attention(q, k, k, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == NEG_INF).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq, torch.zeros_like(dq))
    # no query heads, grouped: empty, as SDPA gives
    out = flash_attention(randn((1, 0, 7, 16), torch.float32, 0), k.new_zeros((1, 2, 9, 16)),
                          k.new_zeros((1, 2, 9, 16)), enable_gqa=True)
    assert out.shape == (1, 0, 7, 16)
    # no heads at all (q's and k's): empty, as SDPA gives, on either path and with a plan
    q, k = randn((1, 0, 7, 16), torch.float32, 0), randn((1, 0, 9, 16), torch.float32, 1)
    plan = attention_plan(16, 16, torch.float32, 7, 9)
    for options in (dict(), dict(scale=0.5, return_lse=True), dict(plan=plan)):
        got = flash_attention(q, k, k, **options)
        assert (got[0] if isinstance(got, tuple) else got).shape == F.scaled_dot_product_attention(q, k, k).shape


@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_window_past_any_length_is_unbounded(causal_align):
    """A window side of any size (2^31 - 5, sys.maxsize, 2^64 as "unlimited") shows what None
    shows, gradients included: uncapped, near 2^31 a bound plus a row would overflow the kernels'
    int32, and past int64 (more queries than keys, bottom-right) a bound is no kernel argument."""
    case = Case(1, 2, 2, 13, 9, 16, 16)
    q, k, v, dout, dlse = make_inputs(case, torch.float32)
    for window, same in (((0, 2**31 - 5), (0, None)), ((2**63 - 1, 0), (None, 0)), ((3, 2**64), (3, None))):
        want = run_ours(q, k, v, dout, dlse, dict(window=same, causal_align=causal_align))
        got = run_ours(q, k, v, dout, dlse, dict(window=window, causal_align=causal_align))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{window} {name}: {m}")
        reference = flash_attention_reference(q, k, v, window=window, causal_align=causal_align)[0]
        torch.testing.assert_close(reference, want[0], atol=1e-6, rtol=1e-6)


def test_softcap_of_a_model_is_as_accurate_as_torch():
    """Gemma 2's attention softcap (50), float32: logits well inside the cap, where tanh is near 0
    (one exp2's tanh, 1 - 2 / (e^2x + 1), errs by softcap x 6e-8 a logit there: 6x torch's error)."""
    case = Case(1, 2, 2, 37, 45, 16, 16, dict(softcap=50.0))
    q, k, v, dout, dlse = make_inputs(case, torch.float32)
    assert_matches_float64(run_ours(q, k, v, dout, dlse, case.options), q, k, v, dout, dlse, case.options)


# ----------------------------------------------------------------------------------------------
# Bad inputs: each error names the argument
# ----------------------------------------------------------------------------------------------
def _qkv(hq=2, hk=2, d=16, dv=16, dtype=torch.float32):
    return (torch.zeros((1, hq, 5, d), dtype=dtype, device=DEVICE), torch.zeros((1, hk, 7, d), dtype=dtype, device=DEVICE),
            torch.zeros((1, hk, 7, dv), dtype=dtype, device=DEVICE))


BAD_INPUTS = {
    "q-rank": (lambda: (torch.zeros((2, 5, 16), device=DEVICE), *_qkv()[1:]), {}, ValueError, "q must have 4"),
    "v-rank": (lambda: (*_qkv()[:2], torch.zeros((7, 16), device=DEVICE)), {}, ValueError, "v must have 4"),
    "heads-not-multiple": (lambda: _qkv(hq=3, hk=2), dict(enable_gqa=True), ValueError, "multiple of k's"),
    "gqa-without-flag": (lambda: _qkv(hq=4, hk=2), {}, ValueError, "enable_gqa=True"),
    "d-not-multiple-of-8": (lambda: _qkv(d=20, dv=20), {}, ValueError, r"d \(the last dimension of q and k\)"),
    "d-over-256": (lambda: _qkv(d=264, dv=16), {}, ValueError, r"d \(the last dimension"),
    "dv-over-256": (lambda: _qkv(dv=512), {}, ValueError, r"dv \(the last dimension of v\)"),
    "k-d-differs": (lambda: (_qkv()[0], *_qkv(d=32)[1:]), {}, ValueError, "k must be"),
    "v-length-differs": (lambda: (*_qkv()[:2], torch.zeros((1, 2, 6, 16), device=DEVICE)), {}, ValueError, "v must be"),
    "dtype-mismatch": (lambda: (*_qkv()[:2], _qkv(dtype=torch.float16)[2]), {}, TypeError, "v has dtype"),
    "float64": (lambda: _qkv(dtype=torch.float64), {}, TypeError, "q must be float32"),
    "device-mismatch": (lambda: (*_qkv()[:2], torch.zeros((1, 2, 7, 16), device="meta")), {}, ValueError, "v is on"),
    "scale-nan": (lambda: _qkv(), dict(scale=float("nan")), ValueError, "scale must be a finite float"),
    "scale-string": (lambda: _qkv(), dict(scale="1"), TypeError, "scale must be None or a float"),
    "softcap-zero": (lambda: _qkv(), dict(softcap=0.0), ValueError, "softcap must be a positive finite"),
    "softcap-inf": (lambda: _qkv(), dict(softcap=float("inf")), ValueError, "softcap must be a positive finite"),
    # The kernels hold scale / softcap and softcap log2(e) in float32: outside its normal range they
    # overflow or flush to 0, and out is NaN.
    "softcap-huge": (lambda: _qkv(), dict(softcap=2.4e38), ValueError, "scale and softcap give the kernels' factor"),
    "softcap-tiny": (lambda: _qkv(), dict(softcap=1e-40), ValueError, r"factor scale / softcap = 2.5e\+39"),
    "scale-huge": (lambda: _qkv(), dict(scale=3e38), ValueError, r"scale gives the kernels' factor scale x log2\(e\)"),
    "scale-huge-int": (lambda: _qkv(), dict(scale=10**400), ValueError, "scale must be a finite float, got an int"),
    # The 16-bit kernels' one-exp2 tanh errs by softcap x 6e-8 a logit.
    "softcap-16-bit": (lambda: _qkv(dtype=torch.bfloat16), dict(softcap=2e4), ValueError,
                       "softcap must be at most 10000 with torch.bfloat16 inputs"),
    "scale-tensor": (lambda: _qkv(), dict(scale=torch.tensor(0.5)), TypeError, "scale must be None or a float"),
    "window-negative": (lambda: _qkv(), dict(window=(-1, 0)), ValueError, "window's left"),
    "window-float": (lambda: _qkv(), dict(window=(4, 2.5)), TypeError, "window's right"),
    "window-not-pair": (lambda: _qkv(), dict(window=5), TypeError, "window must be None or a pair"),
    "causal-align": (lambda: _qkv(), dict(causal_align="bottom-right"), ValueError, "causal_align must be one of"),
    "is-causal-int": (lambda: _qkv(), dict(is_causal=1), TypeError, "is_causal must be a bool"),
    "enable-gqa-int": (lambda: _qkv(), dict(enable_gqa=1), TypeError, "enable_gqa must be a bool"),
    "return-lse-str": (lambda: _qkv(), dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    "plan-type": (lambda: _qkv(), dict(plan={"forward": None}), TypeError, "plan must be an AttentionPlan"),
    "plan-heads-in-tile": (lambda: _qkv(hq=6, hk=2), dict(enable_gqa=True, plan=dataclasses.replace(
        attention_plan(16, 16, torch.float32, 5, 7), heads_in_tile=2)), ValueError, "plan.heads_in_tile"),
    "plan-other-mask": (lambda: _qkv(), dict(is_causal=True, plan=attention_plan(16, 16, torch.float32, 5, 7)),
                        ValueError, "plan's mask bounds"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_name_the_argument(name):
    make, options, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        flash_attention(*make(), **options)


def test_numpy_scalars_are_numbers():
    """A scale, softcap or window side computed with numpy is taken as the Python number it equals."""
    np = pytest.importorskip("numpy")
    q, k, v = (torch.randn(t.shape, device=DEVICE) for t in _qkv())
    as_numpy = flash_attention(q, k, v, scale=np.float32(0.5), softcap=np.float64(3.0), window=(np.int64(2), np.int32(1)))
    as_python = flash_attention(q, k, v, scale=0.5, softcap=3.0, window=(2, 1))
    assert torch.equal(as_numpy, as_python)


def test_numpy_scalars_under_compile_ask_for_a_python_number():
    """torch.compile traces a numpy scalar as an array, which the ops' plain options cannot hold: the
    error, in the exception's chain, says what to pass."""
    np = pytest.importorskip("numpy")
    q, k, v = (torch.randn(t.shape, device=DEVICE) for t in _qkv())
    compiled = torch.compile(lambda q: flash_attention(q, k, v, scale=np.float32(0.5)), backend="eager", fullgraph=True)
    with pytest.raises(Exception) as caught:
        compiled(q)
    chain, error = [], caught.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("scale must be a Python number under torch.compile" in m and "pass float(scale)" in m for m in chain), chain


# ----------------------------------------------------------------------------------------------
# The plan: a pure function of head dims, dtype, lengths and mask
# ----------------------------------------------------------------------------------------------
H100_SHARED_MEMORY = 228 * 1024


def forward_shared_bytes(plan: AttentionPlan, element_size: int) -> int:
    """The forward's operand tiles in shared memory: Q once, K and V per pipeline stage."""
    f = plan.forward
    return (f.block_m * plan.head_dim + f.num_stages * f.block_n * (plan.head_dim + plan.head_dim_v)) * element_size


def test_head_dims_split_into_a_tile_and_a_tail_where_it_pads_less():
    """Every head dim: one power-of-two tile (at least 16) padded past it, or a whole tile and a tail that
    pads less (96 = 64 + 32, 80 = 64 + 16, 40 = 32 + 8 of 16; 112 stays 128: 64 + 64 saves nothing)."""
    for d in range(8, 257, 8):
        dims = attention_head_dims(d, d)
        assert dims["D"] + dims["D_TAIL"] == d and dims["DV"] + dims["DV_TAIL"] == d
        head, tail, whole = dims["HEAD_DIM"], dims["TAIL"], max(16, 1 << (d - 1).bit_length())
        assert head & (head - 1) == 0 and (tail & (tail - 1) == 0)
        if tail:
            assert head == dims["D"] < d and 16 <= tail and dims["D_TAIL"] <= tail and head + tail < whole, (d, dims)
        else:
            assert head == whole and dims["D_TAIL"] == 0, (d, dims)
    assert [attention_head_dims(d, 16)["TAIL"] for d in (40, 80, 96, 112, 160, 192, 200)] == [16, 16, 32, 0, 32, 64, 0]


def test_row_align_is_what_every_row_stride_shares():
    """The general kernels' ROW_ALIGN: the power of two up to 16 that divides every stride but the last (the
    kernels tell the compiler so: rows 88 wide load 8 elements at a time). A fused qkv view, a broadcast
    (stride 0) and a size-1 dim with stride 1 too; strides made symbolic (as a compiled op's body
    sees them) give the same answers."""
    row_align = fused_softmax_matmul._row_align
    t = lambda *shape: torch.empty(shape)  # noqa: E731
    assert row_align((t(2, 4, 9, 64), t(2, 2, 9, 64))) == 16
    assert row_align((t(2, 4, 9, 64), t(2, 2, 9, 88))) == 8
    assert row_align((t(2, 4, 9, 100),)) == 4 and row_align((t(1, 1, 3, 7),)) == 1
    qkv = t(2, 9, 3, 4, 88)  # (batch, n, q/k/v, heads, d) viewed as (batch, heads, n, d): rows 3 x 4 x 88 apart
    assert row_align((qkv[:, :, 0].transpose(1, 2),)) == 8
    assert row_align((t(1, 1, 1, 64).expand(2, 4, 9, 64),)) == 16
    assert row_align((t(2, 4, 1, 64).transpose(2, 3),)) == 1  # rows of stride 1

    for shape, expected in (((3, 88), 8), ((5, 96), 16), ((4, 100), 4), ((2, 7), 1)):
        seen = []
        make_fx(lambda x: seen.append(row_align((x,))), tracing_mode="symbolic")(t(*shape))
        assert seen == [expected], shape


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("d", [8, 24, 64, 80, 96, 128, 192, 256])
def test_plan_pads_head_dims_and_fits_shared_memory(d, dtype):
    plan = attention_plan(d, d, DTYPES[dtype], 4096, 4096)
    assert plan.head_dim == plan.head_dim_v == max(16, 1 << (d - 1).bit_length())
    assert forward_shared_bytes(plan, DTYPES[dtype].itemsize) <= H100_SHARED_MEMORY
    plan.check()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.lo = 0


def test_plan_tiles_at_256_follow_the_tail():
    """16-bit heads padded to 256: d 160 and 192 split into 128 and a tail, and take the tail's tiles (with dv
    narrower too); d 200 and 248 pad whole, as 256 (design notes: tiles at 256)."""
    plan = lambda d, dv=None: attention_plan(d, dv or d, torch.bfloat16, 4096, 4096, is_causal=True)  # noqa: E731
    whole, tailed = plan(256), plan(160)
    assert (whole.forward, whole.dkdv) != (tailed.forward, tailed.dkdv)
    for d, dv in ((192, None), (192, 128), (136, 64)):
        assert plan(d, dv).forward == tailed.forward and plan(d, dv).dkdv == tailed.dkdv, (d, dv)
    for d, dv in ((200, None), (248, 248), (192, 256), (256, 64)):
        assert plan(d, dv).forward == whole.forward and plan(d, dv).dkdv == whole.dkdv, (d, dv)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d,dv", [(40, 40), (64, 64), (32, 64)])
def test_plan_16bit_d64_tiles_do_not_spill(d, dv, dtype):
    """16-bit heads padded to 64 (the wider of d and dv): no kernel's tile passes 64 x 64 a warpgroup,
    where dK/dV's 64 x 128 spilled 3-6x slower (design notes: general attention tiles)."""
    plan = attention_plan(d, dv, DTYPES[dtype], 4096, 4096, is_causal=True, grouped=4)
    for kernel in ("forward", "dq", "dkdv"):
        launch = getattr(plan, kernel)
        assert launch.block_m * launch.block_n <= 64 * 64 * launch.num_warps // 4, kernel


def test_plan_tiles_and_bounds():
    """Short sequences shrink the tiles (a decode step runs 16-query tiles); the mask bounds."""
    decode = attention_plan(128, 128, torch.bfloat16, 1, 32768, is_causal=True, causal_align="bottom_right")
    assert decode.forward.block_m == 16 and decode.forward.block_n > 16
    assert (decode.lo, decode.hi) == (None, 32767)
    assert attention_mask_bounds(10, 10, True) == (None, 0)
    assert attention_mask_bounds(4, 10, True, "bottom_right", (3, 2)) == (3, 6)
    assert attention_mask_bounds(4, 10, False, "top_left", (3, 2)) == (-3, 2)
    assert attention_mask_bounds(4, 10, False, "top_left", (None, 2)) == (None, 2)
    assert attention_visible_pairs(4, 10, None, 0) == 1 + 2 + 3 + 4
    assert attention_visible_pairs(3, 2, None, -1) == 0 + 1 + 2
    assert flash_attention_flops(1, 1, 3, 2, 8, 8, None, -1) == 2 * 16 * 3
    small = attention_plan(ATTENTION_MAX_HEAD_DIM, 16, torch.float16, 8, 8)
    assert small.head_dim == 256 and small.head_dim_v == 16 and small.forward.block_m == 16
    # Splits: a decode step of 2 x 32 heads over 32768 keys fills the GPU only in parts; a prefill
    # of the same heads, or a short key range, takes none.
    assert attention_plan(128, 128, torch.bfloat16, 1, 32768, batch_heads=64).splits > 1
    assert attention_plan(128, 128, torch.bfloat16, 4096, 4096, batch_heads=32).splits == 1
    assert attention_plan(128, 128, torch.bfloat16, 1, 1000, batch_heads=8).splits == 1
    # A group's heads share the forward's tile while their queries fit it (each key tile read once for
    # them), the keys split over the fewer programs; where one head's queries fill it, or a group of 3, one.
    decode = attention_plan(128, 128, torch.bfloat16, 1, 32768, batch_heads=256, grouped=4)
    assert decode.heads_in_tile == 4 and decode.forward.block_m == 16
    assert decode.splits > attention_plan(128, 128, torch.bfloat16, 1, 32768, batch_heads=256).splits
    chunk = attention_plan(128, 128, torch.bfloat16, 16, 8192, batch_heads=128, grouped=8)
    assert (chunk.heads_in_tile, chunk.forward.block_m, chunk.dq.block_m) == (4, 64, 16)
    assert attention_heads_in_tile(8, 1, 16) == 8 and attention_heads_in_tile(8, 1, 4) == 4
    assert attention_heads_in_tile(4, 2, 16) == 4 and attention_heads_in_tile(4, 32, 64) == 2
    assert attention_heads_in_tile(4, 33, 64) == 1 and attention_heads_in_tile(4, 0, 16) == 4
    # Groups of other sizes: every head, padded to a power of two of rows (7 in 8), where they fit.
    assert attention_heads_in_tile(7, 1, 16) == 7 and attention_heads_in_tile(6, 2, 16) == 6
    assert attention_heads_in_tile(6, 4, 16) == 3 and attention_heads_in_tile(7, 4, 16) == 1
    # Splits: a power of two of parts (even parts of 2^k keys), up to two waves of programs, 512 keys a part.
    assert attention_splits(64, 1, 32768, 16) == 4 and attention_splits(8, 1, 8192, 16) == 16
    assert attention_splits(256, 1, 32768, 16) == 1 and attention_splits(128, 1, 768, 16) == 1
    assert attention_splits(0, 1, 32768, 16) == 1 and attention_splits(64, 0, 32768, 16) == 1
    assert attention_plan(128, 128, torch.bfloat16, 4096, 4096, batch_heads=32, grouped=4).heads_in_tile == 1


@pytest.mark.parametrize("q_heads,heads,block_m,splits",
                         [(8, 2, 32, 1), (8, 4, 64, 2), (12, 3, 64, 1), (12, 6, 128, 2)])
def test_given_plan_shares_tiles_between_heads_at_many_queries(q_heads, heads, block_m, splits):
    """A given plan may put a group's heads in one forward tile at any query count (the plan does so while
    their queries fit the tile), 16 queries of each, 3 and 6 heads padded to 4 and 8: each row's sums are
    those of one head a tile, in the same order, so out and lse are the same bits."""
    case = Case(1, q_heads, 2, 24, 70, 16, 16, dict(is_causal=True, causal_align="bottom_right", enable_gqa=True))
    q, k, v, _, _ = make_inputs(case, torch.float32, seed=5)
    base = dataclasses.replace(small_tile_plan(case, torch.float32), splits=splits, heads_in_tile=1)
    want = flash_attention(q, k, v, **case.options, plan=base, return_lse=True)
    shared = dataclasses.replace(base, heads_in_tile=heads, forward=FlashLaunch(block_m, 16, 4, 1))
    got = flash_attention(q, k, v, **case.options, plan=shared, return_lse=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# ----------------------------------------------------------------------------------------------
def _options_step(options, forward=None):
    """(out, lse, dq, dk, dv) of flash_attention with these options; ``forward``: a compiled
    version of ``flash_attention(..., return_lse=True)`` (its backward compiled with it)."""
    forward = forward or (lambda q, k, v: flash_attention(q, k, v, return_lse=True, **options))

    def step(q, k, v, dout, dlse):
        out, lse = forward(q, k, v)
        return out, lse, *torch.autograd.grad(_loss(out, lse, dout, dlse), (q, k, v))
    return step


def _compiled_step(options, **compile_options):
    forward = torch.compile(lambda q, k, v: flash_attention(q, k, v, return_lse=True, **options), fullgraph=True,
                            **compile_options)
    return _options_step(options, forward)


COMPILED_OPTIONS = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True, window=(9, None), softcap=5.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_ops_fakes_match_their_kernels(dtype):
    """torch.library.opcheck: the forward and backward ops' fakes give the kernels' shapes, dtypes and strides
    (lse float32 whatever q's dtype; dk, dv in the key/value heads' shape), which torch.compile traces with."""
    q = randn((1, 4, 19, 24), DTYPES[dtype], seed=81)
    k, v = randn((1, 2, 33, 24), DTYPES[dtype], seed=82), randn((1, 2, 33, 16), DTYPES[dtype], seed=83)
    plan = attention_plan(24, 16, q.dtype, 19, 33, grouped=2, window=(5, None), is_causal=True, softcap=3.0)
    options = _attention_args(24 ** -0.5, 3.0, plan)
    forward, backward = torch.ops.softmax_kernels.attention_forward, torch.ops.softmax_kernels.attention_backward
    torch.library.opcheck(forward, (q, k, v, *options), test_utils=("test_faketensor",))
    out, lse = forward(q, k, v, *options)
    scale, lo, hi, has_lo, has_hi, softcap, launches = options
    torch.library.opcheck(backward, (q, k, v, out, lse, torch.randn_like(out), torch.randn_like(lse), scale, lo, hi,
                                     has_lo, has_hi, softcap, launches[4:8], launches[8:12]),
                          test_utils=("test_faketensor",))


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_compiled_fullgraph_on_gpu compiles with the default backend")
def test_compiles_fullgraph(fresh_compile):
    """torch.compile(fullgraph=True) traces flash_attention and its op pair with no graph break
    (aot_eager on the CPU: the interpreter's kernels sit opaque in the graph), with every option."""
    case = Case(1, 4, 2, 19, 40, 24, 24, COMPILED_OPTIONS)
    q, k, v, dout, dlse = make_inputs(case, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    compiled = _compiled_step(COMPILED_OPTIONS, backend="aot_eager")
    for got, want in zip(compiled(*leaves, dout, dlse), _options_step(COMPILED_OPTIONS)(*leaves, dout, dlse)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


DECODE_OPTIONS = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)
COMPILED_CASES = {"options": Case(2, 8, 2, 300, 500, 96, 96, COMPILED_OPTIONS, 2.0),
                  # one query over many keys: the forward splits the keys and merges them (a second kernel)
                  "decode-split": Case(2, 8, 2, 1, 8192, 128, 128, DECODE_OPTIONS)}


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_fullgraph_on_gpu(fresh_compile, name, dtype):
    """Inductor traces into the Triton launches (triton_op) and re-launches them with its own
    arguments: the same answers as eager, within float64's judge."""
    case = COMPILED_CASES[name]
    q, k, v, dout, dlse = make_inputs(case, DTYPES[dtype])
    if name == "decode-split":
        assert case_plan(case, DTYPES[dtype], batch_heads=case.batch * case.heads).splits > 1
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ours = _compiled_step(case.options)(*leaves, dout, dlse)
    assert_matches_float64([t.detach() for t in ours], q, k, v, dout, dlse, case.options)


@needs_gpu
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_plain_call_compiles_fullgraph_on_the_course_kernels(fresh_compile, grad):
    """A plain call (the course's kernels, which keep eager launches) traces with no graph break: the
    eager call's kept launches and their shelves stay out of the trace."""
    case = Case(2, 4, 4, 256, 256, 64, 64, dict(is_causal=True))
    q, k, v, dout, _ = make_inputs(case, torch.float32)  # float32: the course's Triton kernels, eager and compiled
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: flash_attention(q, k, v, is_causal=True), fullgraph=True)
    got, want = compiled(*leaves), flash_attention(*leaves, is_causal=True)
    # The same kernels both ways; float32's default tolerance only absorbs a launch a trace might plan otherwise.
    torch.testing.assert_close(got, want)
    if grad:
        for g, w in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
            torch.testing.assert_close(g, w)


@needs_gpu
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_cuda_graph_replay_matches_eager(name):
    """Forward and backward captured in one CUDA graph (no host sync, no allocation outside its
    pool), replayed on new inputs copied into the captured ones: the same bits as eager calls."""
    case = dataclasses.replace(COMPILED_CASES[name], d=128, dv=128)
    q, k, v, dout, dlse = make_inputs(case, torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    step = _options_step(case.options)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, autograd sets up
        for _ in range(2):
            step(*leaves, dout, dlse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*leaves, dout, dlse)
    fresh = make_inputs(case, torch.bfloat16, seed=11)
    with torch.no_grad():
        for static, new in zip((*leaves, dout, dlse), fresh):
            static.copy_(new)
    graph.replay()
    eager = step(*(t.detach().clone().requires_grad_() for t in fresh[:3]), *fresh[3:])
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, eager):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa-causal", "decode", "decode-1q", "gemma-window-softcap"])
def test_model_shapes_on_gpu(name, dtype):
    """The benchmark's model shapes at a shorter length, against float64 (the reference holds
    every logit in float64: 1024 x 2048 per head here)."""
    case = {
        "llama-gqa-causal": Case(1, 8, 2, 1024, 1024, 128, 128, dict(is_causal=True, enable_gqa=True)),
        "decode": Case(2, 8, 2, 16, 2048, 128, 128, dict(is_causal=True, causal_align="bottom_right",
                                                         enable_gqa=True)),
        "decode-1q": Case(2, 8, 2, 1, 8192, 128, 128, dict(is_causal=True, causal_align="bottom_right",
                                                           enable_gqa=True)),
        "gemma-window-softcap": Case(1, 4, 2, 1024, 1024, 256, 256, dict(
            is_causal=True, window=(255, 0), softcap=50.0, enable_gqa=True), 4.0),
    }[name]
    q, k, v, dout, dlse = make_inputs(case, DTYPES[dtype])
    assert_matches_float64(run_ours(q, k, v, dout, dlse, case.options), q, k, v, dout, dlse, case.options)


def test_kept_launch_keys_tell_apart_what_the_checks_do(monkeypatch):
    """A kept launch's key holds each option with its type (a window's sides too), so a call the checks
    would refuse never finds an accepted call's launch; options of other types (numpy, a list window)
    get no key and take the checked path."""
    import numpy as np

    # replay_key keys nothing on the CPU (no CUDA tensors): its options part alone, each by option_key
    monkeypatch.setattr(fused_softmax_matmul, "replay_key", lambda tensors, options: tuple(map(option_key, options)))
    q = k = v = torch.zeros(1, 1, 4, 8)

    def key(**options):
        given = dict(is_causal=False, scale=None, enable_gqa=False, causal_align="top_left", window=None,
                     softcap=None, return_lse=False)
        return fused_softmax_matmul._attention_replay_key(q, k, v, **{**given, **options})

    keys = [key(), key(window=(31, 0)), key(window=(31.0, 0)), key(window=(True, 0)), key(window=(31, None)),
            key(scale=1), key(scale=1.0), key(scale=True), key(is_causal=True), key(return_lse=True),
            key(softcap=30), key(softcap=30.0), key(enable_gqa=True)]
    assert None not in keys and len(set(keys)) == len(keys)
    for options in (dict(window=[31, 0]), dict(window=(np.int64(31), 0)), dict(scale=np.float32(0.5)),
                    dict(is_causal=np.bool_(True)), dict(softcap=torch.tensor(30.0))):
        assert key(**options) is None, options


KEPT_CASES = {
    "plain-causal": Case(2, 4, 4, 256, 256, 64, 64, dict(is_causal=True)),  # the course's kernels
    "gqa-causal": Case(1, 8, 2, 300, 300, 128, 128, dict(is_causal=True, enable_gqa=True)),
    "decode-1q": Case(2, 8, 2, 1, 8192, 128, 128, dict(is_causal=True, causal_align="bottom_right",
                                                       enable_gqa=True)),  # keys split, then merged: a chain
    "window-softcap-lse": Case(1, 4, 2, 200, 260, 80, 80, dict(window=(31, 0), softcap=20.0, enable_gqa=True,
                                                               return_lse=True)),
}


@needs_gpu
@pytest.mark.parametrize("name", KEPT_CASES)
def test_kept_launches_replay_the_checked_call(name, monkeypatch):
    """An eager call that records no gradient keeps its launches; a later call of the same shapes,
    strides and options replays them, without checks or plan, and gives the checked call's bits on
    new inputs. A window whose side differs only in type (31.0 for 31) is another call: refused."""
    case = KEPT_CASES[name]
    checks = []
    check = fused_softmax_matmul.check_flash_attention_inputs
    monkeypatch.setattr(fused_softmax_matmul, "check_flash_attention_inputs", lambda *a: checks.append(a) or check(*a))
    forget_kept_launches()
    flash_attention(*make_inputs(case, torch.bfloat16)[:3], **case.options)
    assert len(checks) == 1
    fresh = make_inputs(case, torch.bfloat16, seed=11)[:3]
    kept = flash_attention(*fresh, **case.options)
    assert len(checks) == 1, "the second call was checked again: its launches were not kept"
    forget_kept_launches()
    checked = flash_attention(*fresh, **case.options)
    assert len(checks) == 2
    for got, want in zip(*(t if isinstance(t, tuple) else (t,) for t in (kept, checked))):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if "window" in case.options:
        with pytest.raises(TypeError, match="window's left"):
            flash_attention(*fresh, **{**case.options, "window": (31.0, 0)})
