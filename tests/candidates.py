"""Bring your own kernel: ``--candidate [LABEL=]PATH_OR_MODULE`` checks and times a module of one's own.

The option (repeatable) imports each module (a file path or an importable name) and looks for the
names of this project's public API (``NAMES``). Each name found is adapted to its op's call by
inspecting its signature (``adapt``): a plain function, or a ``torch.autograd.Function`` called
through ``.apply``, whose extra parameters (block sizes) have defaults. Then it joins

- the correctness battery of its op (tests/test_candidates.py): odd and prime sizes, an empty
  batch, each dtype, strided and transposed views, -inf rows and tiles, values at the ends of the
  dtype's range, gradients; every answer against float64 on the same rounded inputs, within twice
  PyTorch's own error at that dtype (``support.assert_close``, the project's own rule);
- the benchmark groups of its op, as implementation ``candidate:LABEL.NAME`` beside torch,
  torch.compile and this project's kernel, in the same JSON, CSVs and plots (the bench files add
  ``candidate_impls(op)`` to their implementations; the harness times them as any other);
- for ``FlashAttentionTriton``, the course leaderboard's case (tests/test_bench_flash_attention.py).

A candidate never stops the run: a module that does not import, a name whose call is ambiguous, a
case it refuses or gets wrong are each recorded with the reason. At the end of the session a
report per candidate and name (cases passed and failed by class, the first failure of each class
with its input, the speed-ups where it ran) is printed and written as ``candidate_report.txt`` and
``candidate_report.json`` into the outputs directory, beside the run's JSON and CSVs
(``outputs/<GPU>/candidates/`` unless ``--outputs-dir`` says otherwise: never the record's own).

Ops join by one ``Op`` entry in ``OPS`` and their names by one entry each in ``NAMES``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import re
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

CLASSES = ("shape", "dtype", "strides", "edge values", "gradient")
IMPL_PREFIX = "candidate:"
CASE_PROPERTY = "softmax_kernels_candidate_case"  # a report's user_properties entry: one case's outcome
REPORT_NAME = "candidate_report"


# ----------------------------------------------------------------------------------------------
# The ops: canonical call, reference, battery, benchmark groups
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One input of an op's battery: ``build()`` returns the canonical (args, kwargs)."""

    cls: str  # one of CLASSES
    label: str  # what the case exercises, for the report
    build: Callable[[], tuple[tuple, dict]]
    grad: bool = False  # also the gradients of every floating input, for a fixed upstream gradient
    gpu_only: str = ""  # why the case runs on a GPU only (empty: everywhere)

    @property
    def id(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", f"{self.cls} {self.label}").strip("-")


@dataclasses.dataclass(frozen=True)
class Op:
    """An op as the suite calls it: ``args`` positional names of the canonical call, ``keywords``
    the canonical keyword arguments with the value a signature without them is taken to use."""

    name: str
    args: tuple[str, ...]
    reference: Callable  # the answer in the inputs' dtype (float64 in, float64 out), differentiable
    cases: Callable[[], list]
    groups: dict  # benchmark group -> the implementations a candidate's speed-up is reported against
    keywords: dict = dataclasses.field(default_factory=dict)
    optional: dict = dataclasses.field(default_factory=dict)  # trailing positional args a signature may lack
    products: bool = False  # has matrix products: float32 is judged under TF32 on a GPU (see ``products_precision``)
    slack: Callable | None = None  # (output name, args64, kwargs) -> relative error the algorithm adds by design


def _support():
    import support  # after conftest.py has chosen the interpreter or the GPU

    return support


def _shapes(cpu: list, gpu: list) -> list:
    return gpu if _support().ON_GPU else cpu


# A candidate's products in bfloat16 cannot be judged in the interpreter.
BF16_DOT = "tl.dot on bfloat16 is wrong in Triton's interpreter (triton issue 11584)"


def product_cases(inputs, *args, **kw) -> list:
    """The dtype and gradient cases of an op with products, on inputs(*args, dtype, **kw)."""
    f32, f16 = torch.float32, torch.float16
    label = ", ".join(f"{k}={v}" for k, v in kw.items())
    return [
        Case("dtype", f"float16 {label}".strip(), inputs(*args, f16, **kw)),
        Case("dtype", f"bfloat16 {label}".strip(), inputs(*args, torch.bfloat16, **kw), gpu_only=BF16_DOT),
        Case("gradient", f"float32 {label}".strip(), inputs(*args, f32, **kw), grad=True),
        Case("gradient", f"float16 {label}".strip(), inputs(*args, f16, **kw), grad=True),
    ]


def softmax_cases() -> list:
    s = _support()
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

    def x(shape, dtype=f32, **kw):
        return lambda: ((s.randn(shape, dtype, seed=sum(shape), **kw),), {})

    def view(make):
        return lambda: ((make(),), {})

    big = _shapes([(3, 17, 131), (1, 2, 1000)], [(4, 257, 4099), (1, 3, 65537)])
    mid = big[0]
    return [
        Case("shape", "one element", x((1, 1, 1))),
        Case("shape", "a few odd sizes", x((2, 3, 5))),
        *(Case("shape", f"prime sizes {shape}", x(shape)) for shape in big),
        Case("shape", "empty batch", x((0, 3, 5))),
        Case("shape", "no rows", x((2, 0, 5))),
        Case("dtype", "float16", x(mid, f16)),
        Case("dtype", "bfloat16", x(mid, bf16)),
        Case("strides", "x transposed (column stride d1)", view(lambda: s.randn((1, mid[2], mid[1]), f32, 1).transpose(1, 2))),
        Case("strides", "every other column of a wider x", view(lambda: s.randn((*mid[:2], 2 * mid[2]), f32, 2)[..., ::2])),
        Case("strides", "every other batch entry", view(lambda: s.randn((2 * mid[0], *mid[1:]), f32, 3)[::2])),
        Case("edge values", "-inf tiles before the first finite logit, an all -inf row (NaN, as torch)",
             view(lambda: s.masked_logits((1, 5, mid[2]), f32))),
        Case("edge values", "+-3e38: x - max overflows to -inf", view(lambda: s.extreme_logits((1, 4, mid[2]), f32))),
        Case("edge values", "float16 +-6e4", view(lambda: s.extreme_logits((1, 4, mid[2]), f16))),
        Case("edge values", "logits of size 1e4 (one-hot rows)", x(mid, f32, scale=1e4)),
        Case("gradient", "float32", x(mid), grad=True),
        Case("gradient", "float16", x(mid, f16), grad=True),
        Case("gradient", "-inf tiles (no NaN gradient but the all -inf row's)", view(lambda: s.masked_logits((1, 5, mid[2]), f32)),
             grad=True),
    ]


def softmax_matmul_cases() -> list:
    s = _support()
    f32 = torch.float32

    def inputs(b, d1, d2, d3, dtype=f32, scale=1.0):
        return lambda: (s.softmax_matmul_inputs(b, d1, d2, d3, dtype, seed=d1 + d2, scale=scale), {})

    def transposed_v(b, d1, d2, d3):
        def build():
            return (s.randn((b, d1, d2), f32, 5), s.randn((b, d3, d2), f32, 6).transpose(1, 2)), {}
        return build

    def masked(b, d1, d2, d3):
        return lambda: ((s.masked_logits((b, d1, d2), f32), s.randn((b, d2, d3), f32, 8)), {})

    big = _shapes([(2, 17, 37, 19), (1, 33, 130, 20)], [(4, 257, 1031, 67), (2, 1000, 4099, 128)])
    mid = big[0]
    return [
        Case("shape", "one element", inputs(1, 1, 1, 1)),
        Case("shape", "a few odd sizes", inputs(2, 3, 5, 7)),
        *(Case("shape", f"prime and ragged sizes {shape}", inputs(*shape)) for shape in big),
        Case("shape", "empty batch", inputs(0, 3, 5, 7)),
        *product_cases(inputs, *mid),
        Case("strides", "V transposed (row stride 1)", transposed_v(*mid)),
        Case("strides", "x every other column", lambda: ((s.randn((mid[0], mid[1], 2 * mid[2]), f32, 4)[..., ::2],
                                                          s.randn((mid[0], mid[2], mid[3]), f32, 5)), {})),
        Case("edge values", "-inf tiles and an all -inf row of x (NaN, as torch)", masked(1, 5, mid[2], mid[3])),
        Case("edge values", "logits of size 30 (a running max that moves)", inputs(*mid, scale=30.0)),
    ]


def matmul_softmax_cases() -> list:
    s = _support()
    f32 = torch.float32

    def inputs(B, K, C, dtype=f32, scale=1.0, layout="contiguous"):
        return lambda: (s.matmul_softmax_inputs(B, K, C, dtype, seed=B + C, scale=scale, layout=layout), {})

    big = _shapes([(5, 7, 11), (33, 17, 130)], [(257, 1031, 4099), (1000, 4096, 32771)])
    mid = big[-1]
    return [
        Case("shape", "one element", inputs(1, 1, 1)),
        *(Case("shape", f"prime and ragged sizes {shape}", inputs(*shape)) for shape in big),
        Case("shape", "no rows", inputs(0, 7, 11)),
        *product_cases(inputs, *mid),
        *(Case("strides", f"layout {layout}", inputs(*mid, layout=layout))
          for layout in ("x_strided", "W_transposed", "x_transposed")),
        Case("edge values", "logits of size 30 (one class dominates)", inputs(*mid, scale=30.0)),
    ]


def linear_cross_entropy_cases() -> list:
    s = _support()
    f32, f16 = torch.float32, torch.float16

    def inputs(BT, H, V, dtype=f32, ignored=0.0, scale=3.0, transposed=False):
        def build():
            x = s.randn((BT, H), dtype, BT + V, scale)
            W = (s.randn((H, V), dtype, H, H ** -0.5).t() if transposed else s.randn((V, H), dtype, H, H ** -0.5))
            target = torch.randint(0, V, (BT,), generator=s.generator(BT), device=s.DEVICE)
            drop = torch.rand((BT,), generator=s.generator(BT + 1), device=s.DEVICE) < ignored
            return (x, W, target.masked_fill(drop, -100)), {}
        return build

    big = _shapes([(5, 7, 11), (21, 32, 101)], [(257, 1031, 4099), (1024, 2048, 32771)])
    mid = big[-1]
    return [
        Case("shape", "one row, one class", inputs(1, 1, 1)),
        *(Case("shape", f"prime and ragged sizes {shape}", inputs(*shape)) for shape in big),
        *product_cases(inputs, *mid),
        Case("strides", "W transposed (a view of a (H, V) tensor)", inputs(*mid, transposed=True)),
        Case("edge values", "a tenth of the targets ignore_index -100", inputs(*mid, ignored=0.1)),
        Case("edge values", "logits of size 100", inputs(*mid, scale=100.0)),
        Case("gradient", "float16, ignored targets", inputs(*mid, f16, ignored=0.1), grad=True),
    ]


def attention_cases() -> list:
    s = _support()
    f32 = torch.float32

    def inputs(b, nq, nk, d, dtype=f32, scale=1.0, causal=False):
        return lambda: ((*s.attention_inputs(b, nq, nk, d, dtype, seed=nq + d, scale=scale), causal), {})

    def transposed(b, n, d, causal):
        def build():
            Q = s.randn((b, d, n), f32, 1).transpose(1, 2)
            K, V = s.randn((b, n, d), f32, 2), s.randn((b, d, n), f32, 3).transpose(1, 2)
            return (Q, K, V, causal), {}
        return build

    big = _shapes([(1, 19, 35, 16), (2, 37, 37, 32)], [(2, 1031, 1031, 64), (1, 257, 4099, 128)])
    mid = big[-1]
    return [
        Case("shape", "one query, one key", inputs(1, 1, 1, 16)),
        *(Case("shape", f"ragged lengths {shape}, {c}", inputs(*shape, causal=c == "causal"))
          for shape in big for c in ("full", "causal")),
        Case("shape", "more queries than keys, causal", inputs(1, mid[2], mid[1] // 2 + 1, mid[3], causal=True)),
        Case("shape", "empty batch", inputs(0, 16, 16, 16)),
        *product_cases(inputs, *mid, causal=True),
        Case("strides", "Q and V transposed views", transposed(mid[0], mid[1], mid[3], True)),
        Case("edge values", "Q times 30: a sharp softmax whose maximum moves", inputs(*mid, scale=30.0, causal=True)),
        Case("gradient", "float32 causal=False", inputs(*mid, causal=False), grad=True),
    ]


def sdpa_cases() -> list:
    s = _support()
    f32, f16 = torch.float32, torch.float16

    def inputs(B, H, Hkv, nq, nk, d, dtype=f32, layout="bhnd", **kw):
        def build():
            if layout == "bnhd":  # a model's (batch, length, heads, d) projections viewed as (B, H, N, d)
                q = s.randn((B, nq, H, d), dtype, 1).transpose(1, 2)
                k, v = (s.randn((B, nk, Hkv, d), dtype, seed).transpose(1, 2) for seed in (2, 3))
            else:
                q = s.randn((B, H, nq, d), dtype, 1)
                k, v = (s.randn((B, Hkv, nk, d), dtype, seed) for seed in (2, 3))
            return (q, k, v), {"enable_gqa": Hkv != H, **kw}
        return build

    n = _shapes([19, 37], [1031, 4099])
    d = 32 if not _support().ON_GPU else 64
    return [
        Case("shape", "one query, one key", inputs(1, 1, 1, 1, 1, 16)),
        *(Case("shape", f"ragged length {m}, {c}", inputs(2, 3, 3, m, m, d, is_causal=c == "causal"))
          for m in n for c in ("full", "causal")),
        Case("shape", "grouped query heads (6 query heads, 2 key/value)", inputs(1, 6, 2, n[0], n[0], d, is_causal=True)),
        Case("shape", "empty batch", inputs(0, 2, 2, 16, 16, 16)),
        *product_cases(inputs, 1, 2, 2, n[-1], n[-1], d, is_causal=True),
        Case("strides", "(batch, length, heads, d) views", inputs(2, 3, 3, n[0], n[0], d, layout="bnhd", is_causal=True)),
        Case("edge values", "scale 1.0 (logits 8x sharper than 1/sqrt(d))", inputs(1, 2, 2, n[0], n[0], d, scale=1.0)),
        Case("gradient", "float16, grouped heads", inputs(1, 4, 2, n[0], n[0], d, f16, enable_gqa=True), grad=True),
    ]


def _softmax(x):
    return torch.softmax(x, dim=-1)


def _softmax_matmul(x, V):
    return torch.softmax(x, dim=-1) @ V


def _matmul_softmax(x, W):
    return torch.softmax(x @ W, dim=-1)


def _linear_cross_entropy(x, W, target):
    """PyTorch at x's precision throughout (the yardstick of tests/test_linear_cross_entropy.py)."""
    return F.cross_entropy(F.linear(x, W), target, ignore_index=-100)


def _attention(Q, K, V, is_causal=False):
    from fused_softmax_matmul import attention_reference

    return attention_reference(Q, K, V, is_causal)


def _sdpa(q, k, v, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _logsumexp64(q, k, is_causal, scale):
    """Each query's log-sum-exp of its logits, in float64 (queries and keys of any leading dims)."""
    from fused_softmax_matmul import causal_mask

    q, k = q.detach().double(), k.detach().double()
    if k.dim() == 4 and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    S = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        S = S.masked_fill(causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)
    return torch.logsumexp(S, dim=-1)


def _attention_slack(output: str, args: tuple, kwargs: dict) -> float:
    """The flash algorithm's own error (tests/test_flash_attention.py's ``algorithm_error``): its
    float32 sums over tiles and, in the backward, P recomputed from a float32 log-sum-exp."""
    from test_flash_attention import algorithm_error

    q, k = args[0], args[1]
    is_causal = kwargs.get("is_causal", args[3] if len(args) > 3 else False)
    name = {"out": "O", "d0": "dQ", "d1": "dK", "d2": "dV"}[output]
    return algorithm_error(name, _logsumexp64(q, k, is_causal, kwargs.get("scale")), q.shape[-2], k.shape[-2])


# The course's names and this project's, by op. A group's baselines: PyTorch, torch.compile and
# this project's kernel, whose best row on each case a candidate's speed-up is reported against.
OPS = {op.name: op for op in (
    Op("softmax", ("x",), _softmax, softmax_cases, {"softmax": ("torch", "compile", "triton_row", "triton_online")}),
    Op("softmax_matmul", ("x", "V"), _softmax_matmul, softmax_matmul_cases,
       {"softmax_matmul": ("torch", "compile", "triton")}, products=True),
    Op("matmul_softmax", ("x", "W"), _matmul_softmax, matmul_softmax_cases,
       {"matmul_softmax": ("torch", "compile", "triton_fused_tiled")}, products=True),
    Op("linear_cross_entropy", ("x", "W", "target"), _linear_cross_entropy, linear_cross_entropy_cases,
       {"linear_cross_entropy": ("torch", "compile", "triton")}, products=True),
    Op("attention", ("Q", "K", "V", "is_causal"), _attention, attention_cases,
       {"flash_attention": ("sdpa", "sdpa_compile", "flash_triton"), "leaderboard": ("sdpa_compile", "flash_triton")},
       optional={"is_causal": False}, products=True, slack=_attention_slack),
    Op("sdpa_attention", ("q", "k", "v"), _sdpa, sdpa_cases, {}, products=True, slack=_attention_slack,
       keywords={"is_causal": False, "scale": None, "enable_gqa": False}),
)}


@dataclasses.dataclass(frozen=True)
class Name:
    """A public name: its op, and for softmax the rank its input takes (the course's x is 3-D)."""

    op: str
    rank: int | None = None
    leaderboard: bool = False  # joins the course leaderboard's case


NAMES = {
    "online_softmax": Name("softmax", rank=3),
    "OnlineSoftmax": Name("softmax", rank=3),
    "row_softmax": Name("softmax", rank=2),
    "fused_softmax": Name("softmax_matmul"),
    "matmul_softmax_fused_tiled": Name("matmul_softmax"),
    "matmul_softmax_unfused": Name("matmul_softmax"),
    "matmul_softmax_fused_simple": Name("matmul_softmax"),
    "linear_cross_entropy": Name("linear_cross_entropy"),
    "FlashAttentionPytorch": Name("attention"),
    "FlashAttentionTriton": Name("attention", leaderboard=True),
    "flash_attention": Name("sdpa_attention"),
}


# ----------------------------------------------------------------------------------------------
# Signatures: how each name is called
# ----------------------------------------------------------------------------------------------
class Refused(Exception):
    """A call the candidate's signature cannot make (an argument it lacks): the case is not run."""


@dataclasses.dataclass
class Adapted:
    name: str
    op: str
    how: str  # how the name is called, for the report
    call: Callable | None = None  # the canonical call of its op; None when refused
    refused: str | None = None


def _function_signature(obj) -> tuple[inspect.Signature, Callable, str]:
    """(the parameters a call fills, the callable, its spelling) of a function or an autograd Function."""
    if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
        sig = inspect.signature(obj.forward)
        params = list(sig.parameters.values())
        # forward(ctx, ...) unless the class has its own setup_context (then forward(...) alone).
        if obj.setup_context is torch.autograd.Function.setup_context and params:
            params = params[1:]
        return sig.replace(parameters=params), obj.apply, f"{obj.__name__}.apply"
    if isinstance(obj, type):
        raise Refused(f"a class that is not a torch.autograd.Function ({obj.__name__}): how to call it is not clear")
    if not callable(obj):
        raise Refused(f"not callable ({type(obj).__name__})")
    return inspect.signature(obj), obj, getattr(obj, "__name__", "fn")


def adapt(name: str, obj) -> Adapted:
    """The canonical call of ``name``'s op made of ``obj``, or the reason it cannot be."""
    entry = NAMES[name]
    op = OPS[entry.op]
    try:
        sig, fn, spelled = _function_signature(obj)
    except (Refused, TypeError, ValueError) as exc:
        return Adapted(name, op.name, "", refused=str(exc) or type(exc).__name__)
    params = list(sig.parameters.values())
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is P.empty]
    var_positional = any(p.kind == P.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind == P.VAR_KEYWORD for p in params)
    keyword_names = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    is_function = spelled.endswith(".apply")
    need = len(op.args) - len(op.optional)
    if len(required) > len(op.args):
        return Adapted(name, op.name, f"{spelled}({_plain(sig)})", refused=(
            f"takes {len(required)} arguments without defaults ({', '.join(p.name for p in required)}) where the op "
            f"gives {len(op.args)} ({', '.join(op.args)}): which is what cannot be told; give the extra ones defaults"))
    missing_kw = [p.name for p in params if p.kind == P.KEYWORD_ONLY and p.default is P.empty and p.name not in op.keywords]
    if missing_kw:
        return Adapted(name, op.name, f"{spelled}({_plain(sig)})", refused=f"keyword-only arguments without defaults: {missing_kw}")
    n_taken = len(op.args) if var_positional else min(len(positional), len(op.args))
    # An optional argument is passed only to a parameter of its name ("causal" for is_causal): the
    # fourth parameter of f(Q, K, V, BLOCK=64) is a block size, not the mask flag.
    while n_taken > need and not var_positional and \
            op.args[n_taken - 1].removeprefix("is_") not in positional[n_taken - 1].name.lower():
        n_taken -= 1
    if n_taken < need:
        return Adapted(name, op.name, f"{spelled}({_plain(sig)})", refused=(
            f"takes {n_taken} positional arguments where the op needs {need} ({', '.join(op.args[:need])})"))
    dropped = op.args[n_taken:]  # optional trailing arguments the signature lacks
    passed_kw = [k for k in op.keywords if not is_function and (k in keyword_names or var_keyword)]
    lacking_kw = [k for k in op.keywords if k not in passed_kw]
    defaults = [f"{p.name}={p.default!r}" for p in positional[n_taken:] if p.default is not P.empty]
    how = f"{spelled}({', '.join([*op.args[:n_taken], *(f'{k}=' for k in passed_kw)])})"
    notes = [f"signature {spelled.removesuffix('.apply')}({_plain(sig)})"]
    if defaults:
        notes.append(f"{', '.join(defaults)} left at their defaults")
    if dropped or lacking_kw:
        notes.append(f"no {', '.join([*dropped, *lacking_kw])}: cases that need another value than "
                     f"{', '.join(f'{k}={v!r}' for k, v in {**op.optional, **op.keywords}.items() if k in (*dropped, *lacking_kw))} are refused")
    rank = entry.rank

    def call(*args, **kwargs):
        for arg_name, value in zip(op.args[n_taken:], args[n_taken:]):
            if value != op.optional.get(arg_name):
                raise Refused(f"the signature takes no {arg_name} (this case needs {arg_name}={value!r})")
        for k in lacking_kw:
            if kwargs.get(k, op.keywords[k]) != op.keywords[k]:
                raise Refused(f"the signature takes no {k} (this case needs {k}={kwargs[k]!r})")
        kw = {k: kwargs[k] for k in passed_kw if k in kwargs}
        args = args[:n_taken]
        if rank is None:
            return fn(*args, **kw)
        x = args[0]
        shaped = _to_rank(x, rank)
        out = fn(shaped, *args[1:], **kw)
        return out.reshape(x.shape) if isinstance(out, torch.Tensor) and out.shape == shaped.shape else out

    if rank is not None:
        notes.append(f"x as a rank-{rank} tensor ({'(batch, d1, d2)' if rank == 3 else '(rows, columns)'})")
    return Adapted(name, op.name, f"{how}; " + "; ".join(notes), call=call)


def _plain(sig: inspect.Signature) -> str:
    """The parameters without their annotations: x, BLOCK_1=16, *, launch=None."""
    return str(sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                           return_annotation=inspect.Signature.empty))[1:-1]


def _to_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    """x with leading dimensions added or folded so it has ``rank`` (a view wherever strides allow)."""
    if x.dim() < rank:
        return x.reshape((1,) * (rank - x.dim()) + tuple(x.shape))
    if x.dim() > rank:
        return x.reshape((-1, *x.shape[x.dim() - rank + 1:]))
    return x


# ----------------------------------------------------------------------------------------------
# Loading: the option's modules
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Candidate:
    label: str
    source: str
    error: str | None = None  # why the module did not import
    names: dict = dataclasses.field(default_factory=dict)  # public name -> Adapted


CANDIDATES: list[Candidate] = []  # this process's, set by pytest_configure


def parse_spec(spec: str) -> tuple[str, str]:
    """``LABEL=PATH_OR_MODULE`` or ``PATH_OR_MODULE`` (label: the file's stem or the module's last part)."""
    label, sep, target = spec.partition("=")
    if not sep:
        label, target = "", spec
    target = target.strip()
    if not target:
        raise pytest.UsageError(f"--candidate {spec!r}: expected [LABEL=]PATH_OR_MODULE")
    if not label:
        label = Path(target).stem if target.endswith(".py") or "/" in target else target.rsplit(".", 1)[-1]
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", label):
        raise pytest.UsageError(f"--candidate {spec!r}: the label {label!r} must be letters, digits, _ or -")
    return label, target


def load(label: str, target: str) -> Candidate:
    """Import the module and adapt every public name it defines; an import error is the candidate's record."""
    cand = Candidate(label, target)
    path = Path(target)
    from_file = target.endswith(".py") or path.is_file()
    # A target that is not there is a mistyped option (refused before any case), not the candidate's record.
    if from_file and not path.is_file():
        raise pytest.UsageError(f"--candidate {target}: no such file")
    spec = importlib.util.spec_from_file_location(f"softmax_kernels_candidate_{label}", path.resolve()) \
        if from_file else None
    if from_file and spec is None:
        raise pytest.UsageError(f"--candidate {target}: not a Python file (.py)")
    if not from_file and not _importable(target):
        raise pytest.UsageError(f"--candidate {target}: no file nor importable module of that name")
    try:
        if from_file:
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Exception as exc:  # noqa: BLE001 - any import failure is the candidate's record, not the run's end
        cand.error = f"{type(exc).__name__}: {exc}"
        return cand
    for name in NAMES:
        if hasattr(module, name):
            cand.names[name] = adapt(name, getattr(module, name))
    return cand


def _importable(name: str) -> bool:
    """Whether a module of that dotted name can be found (a package it sits in that raises on import: yes, the
    import records why)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - a parent package that fails to import: the import itself says why
        return True


def configure(config) -> None:
    CANDIDATES.clear()
    specs = config.getoption("candidate") or []
    labels = set()
    for spec in specs:
        label, target = parse_spec(spec)
        if label in labels:
            raise pytest.UsageError(f"--candidate: label {label!r} given twice (name them LABEL=PATH)")
        labels.add(label)
        CANDIDATES.append(load(label, target))
    if CANDIDATES and config.getoption("outputs_dir") is None:
        from conftest import committed_dir

        # A candidate's rows never land in the project's committed tables.
        config.option.outputs_dir = str(committed_dir() / "candidates")


def impl_name(cand: Candidate, name: str) -> str:
    return f"{IMPL_PREFIX}{cand.label}.{name}"


def _found(op: str | None = None, leaderboard: bool = False):
    for cand in CANDIDATES:
        for name, adapted in cand.names.items():
            if (op is None or adapted.op == op) and (not leaderboard or NAMES[name].leaderboard):
                yield cand, name, adapted


def candidate_impls(op: str, leaderboard: bool = False) -> tuple[str, ...]:
    """The implementations a benchmark group of ``op`` gains: one per candidate name of that op
    (those refused too: their rows stay empty with the reason)."""
    return tuple(impl_name(cand, name) for cand, name, _ in _found(op, leaderboard))


def candidate_call(impl: str) -> Callable:
    """The canonical call of candidate implementation ``impl``; Unavailable (an empty row with the
    reason) where its signature was refused."""
    from conftest import Unavailable

    for cand, name, adapted in _found():
        if impl_name(cand, name) == impl:
            if adapted.call is None:
                raise Unavailable(f"{impl}: {adapted.refused}")
            return _unavailable_on_refusal(adapted.call)
    raise KeyError(f"no candidate implementation {impl!r}")


def _unavailable_on_refusal(call):
    from conftest import Unavailable

    def run(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except Refused as exc:
            raise Unavailable(str(exc)) from None
    return run


# ----------------------------------------------------------------------------------------------
# The battery: one case of one name
# ----------------------------------------------------------------------------------------------
def battery_params() -> list:
    """pytest.params (impl, case) of every adapted candidate name and its op's cases."""
    params = []
    for cand, name, adapted in _found():
        if adapted.call is None:  # one skipped test says why; the report says it once too
            params.append(pytest.param(impl_name(cand, name), None, id=f"{cand.label}.{name}-not-called"))
            continue
        op = OPS[adapted.op]
        for case in op.cases():
            params.append(pytest.param(impl_name(cand, name), case, id=f"{cand.label}.{name}-{case.id}"))
    return params


def describe(args: tuple, kwargs: dict, names: tuple) -> str:
    """The inputs in a line: each tensor's shape and dtype, and its strides where it is not contiguous."""
    parts = []
    for arg_name, v in [*zip(names, args), *kwargs.items()]:
        if isinstance(v, torch.Tensor):
            text = f"{arg_name} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            if not v.is_contiguous():
                text += f" strides {tuple(v.stride())}"
            parts.append(text)
        else:
            parts.append(f"{arg_name}={v!r}")
    return ", ".join(parts)


def products_precision(dtype: torch.dtype):
    """float32 products judged under TF32 on a GPU: a kernel's tl.dot takes TF32 by default, and
    torch under 'high' does too, so both carry TF32's error and the 2x rule compares like with
    like (a kernel in full float32 passes as well). Nothing changes on the CPU."""
    from support import ON_GPU

    if dtype != torch.float32 or not ON_GPU:
        return nullcontext()
    return _Precision("high")


class _Precision:
    def __init__(self, value: str):
        self.value = value

    def __enter__(self):
        self.before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.value)

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.before)


def _upstream(out: torch.Tensor) -> torch.Tensor:
    """A fixed upstream gradient, not 1 (its multiply must show): 0.75 for a scalar."""
    if out.dim() == 0:
        return torch.full_like(out, 0.75)
    return _support().randn(tuple(out.shape), out.dtype, seed=7)


def _outputs(fn, args: tuple, kwargs: dict, grad: bool, dout=None):
    """{"out": result, "d<i>": gradient of floating argument i} of fn on these inputs."""
    if not grad:
        return {"out": fn(*args, **kwargs)}, None
    leaves = {i: a.detach().requires_grad_() for i, a in enumerate(args)
              if isinstance(a, torch.Tensor) and a.is_floating_point()}
    call_args = tuple(leaves.get(i, a) for i, a in enumerate(args))
    out = fn(*call_args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"returned {type(out).__name__}, not a tensor")
    if dout is None:
        dout = _upstream(out.detach())
    grads = torch.autograd.grad(out, list(leaves.values()), dout.to(out.dtype))
    return {"out": out.detach(), **{f"d{i}": g for i, g in zip(leaves, grads)}}, dout


def _cast(args: tuple, kwargs: dict, dtype):
    def to(v):
        return v.detach().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return tuple(to(a) for a in args), {k: to(v) for k, v in kwargs.items()}


def run_case(adapted: Adapted, case: Case) -> dict:
    """One case of one name: {"outcome": passed / failed / not run, "reason", "input"}."""
    from conftest import is_resource_limit
    from support import ON_GPU, assert_close

    op = OPS[adapted.op]
    record = {"class": case.cls, "case": case.label, "input": "", "outcome": "passed", "reason": ""}
    if case.gpu_only and not ON_GPU:
        return {**record, "outcome": "not run", "reason": f"GPU only: {case.gpu_only}"}
    try:
        args, kwargs = case.build()
    except Exception as exc:  # noqa: BLE001 - a builder that fails here (an allocation) is no verdict on the candidate
        return {**record, "outcome": "not run", "reason": f"inputs not built: {type(exc).__name__}: {exc}"}
    record["input"] = describe(args, kwargs, op.args)
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
    with products_precision(dtype) if op.products else nullcontext():
        try:
            got, dout = _outputs(adapted.call, args, kwargs, case.grad)
        except Refused as exc:
            return {**record, "outcome": "not run", "reason": f"refused: {exc}"}
        except Exception as exc:  # noqa: BLE001 - every exception is the case's verdict
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            outcome = "not run" if is_resource_limit(exc) else "failed"
            stage = "gradient" if case.grad and "grad" in f"{type(exc).__name__} {first}".lower() else "call"
            return {**record, "outcome": outcome, "reason": f"{stage} raised {type(exc).__name__}: {first}"[:400]}
        exact, _ = _outputs(op.reference, *_cast(args, kwargs, torch.float64), case.grad, dout)
        yardstick, _ = _outputs(op.reference, *_cast(args, kwargs, dtype), case.grad, dout)
    for key, out in got.items():
        what = "output" if key == "out" else f"gradient of {op.args[int(key[1:])]}"
        ref = exact[key]
        if not isinstance(out, torch.Tensor):
            return {**record, "outcome": "failed", "reason": f"{what}: returned {type(out).__name__}, not a tensor"}
        if out.shape != ref.shape:
            return {**record, "outcome": "failed", "reason": f"{what}: shape {tuple(out.shape)}, want {tuple(ref.shape)}"}
        if out.dtype != yardstick[key].dtype and not (key == "out" and adapted.op == "linear_cross_entropy"):
            return {**record, "outcome": "failed",
                    "reason": f"{what}: dtype {out.dtype}, want {yardstick[key].dtype} (the input's, as torch gives)"}
        slack = op.slack(key, args, kwargs) if op.slack else 0.0
        try:
            assert_close(out, ref, yardstick[key].to(out.dtype), algorithm_error=slack)
        except AssertionError as exc:
            return {**record, "outcome": "failed", "reason": f"{what}: {exc}"[:600]}
    return record


def check_case(node, impl: str, case: Case) -> None:
    """The battery test's body: run, record on the test's report, then pass, skip or fail."""
    adapted = next(a for c, n, a in _found() if impl_name(c, n) == impl)
    if adapted.call is None:
        pytest.skip(f"{impl} not called: {adapted.refused}")
    record = run_case(adapted, case)
    node.user_properties.append((CASE_PROPERTY, json.dumps({"impl": impl, **record})))
    if record["outcome"] == "not run":
        pytest.skip(record["reason"])
    if record["outcome"] == "failed":
        pytest.fail(f"{impl} {case.cls} ({case.label}; {record['input']}): {record['reason']}", pytrace=False)


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------
def collect(config, report) -> None:
    """Every case's record, from this process's tests or an xdist worker's reports."""
    if report.when != "call":
        return
    for key, value in report.user_properties:
        if key == CASE_PROPERTY:
            config.candidate_cases.append(json.loads(value))


def speed_rows(data: dict | None) -> dict:
    """{impl: [(group, case text, candidate ms or None, {baseline: speed-up}, failure)]} from a run's JSON."""
    if not data:
        return {}
    from conftest import _isnan, tables_from_json

    rows: dict = {}
    for group_name, (group, df) in tables_from_json(data).items():
        baselines = next((op.groups[group_name] for op in OPS.values() if group_name in op.groups), ())
        for i, r in df.iterrows():
            impl = r.get("impl")
            if not isinstance(impl, str) or not impl.startswith(IMPL_PREFIX):
                continue
            key = tuple(r[c] for c in group.case)
            same = df[[tuple(v) == key for v in df[list(group.case)].itertuples(index=False, name=None)]]
            ms = None if _isnan(r["forward_ms_mean"]) else float(r["forward_ms_mean"])
            ups = {}
            for base in baselines:
                times = [t for t in same[same["impl"] == base]["forward_ms_mean"] if not _isnan(t)]
                if times and ms:
                    ups[base] = min(times) / ms
            text = " ".join(f"{c}={r[c]}" for c in group.case if not _isnan(r[c]))
            failure = None if _isnan(r["failure"]) else str(r["failure"])
            rows.setdefault(impl, []).append((group_name, text, ms, ups, failure))
    return rows


def build_report(cases: list, data: dict | None) -> dict:
    """The report as JSON data: per candidate and name, its call, its cases by class, its speeds."""
    speeds = speed_rows(data)
    out = {"candidates": []}
    for cand in CANDIDATES:
        entry = {"label": cand.label, "source": cand.source, "import_error": cand.error, "names": {},
                 "not_found": [] if cand.error else [n for n in NAMES if n not in cand.names]}
        for name, adapted in cand.names.items():
            impl = impl_name(cand, name)
            mine = [c for c in cases if c["impl"] == impl]
            by_class = {}
            for cls in CLASSES:
                of = [c for c in mine if c["class"] == cls]
                if not of:
                    continue
                failed = [c for c in of if c["outcome"] == "failed"]
                by_class[cls] = {"passed": sum(c["outcome"] == "passed" for c in of), "failed": len(failed),
                                 "not_run": sum(c["outcome"] == "not run" for c in of),
                                 "first_failure": ({k: failed[0][k] for k in ("case", "input", "reason")} if failed else None),
                                 "first_not_run": next(({k: c[k] for k in ("case", "reason")} for c in of
                                                        if c["outcome"] == "not run"), None)}
            entry["names"][name] = {
                "impl": impl, "op": adapted.op, "called_as": adapted.how, "refused": adapted.refused,
                "passed": sum(c["outcome"] == "passed" for c in mine),
                "failed": sum(c["outcome"] == "failed" for c in mine),
                "not_run": sum(c["outcome"] == "not run" for c in mine),
                "failed_classes": [cls for cls, v in by_class.items() if v["failed"]],
                "classes": by_class,
                "benchmarks": [{"group": g, "case": t, "ms": ms, "speedup": ups, "failure": f}
                               for g, t, ms, ups, f in speeds.get(impl, [])],
            }
        out["candidates"].append(entry)
    return out


def report_text(report: dict) -> list[str]:
    """The report as lines: one screen per candidate and name."""
    lines = []
    for cand in report["candidates"]:
        lines.append(f"candidate {cand['label']} ({cand['source']})")
        if cand["import_error"]:
            lines.append(f"  did not import: {cand['import_error']}")
            continue
        if not cand["names"]:
            lines.append(f"  defines none of the names looked for: {', '.join(NAMES)}")
        for name, r in cand["names"].items():
            lines.append(f"  {name} [{r['op']}] -> {r['impl']}")
            if r["refused"]:
                lines.append(f"    not called: {r['refused']}")
                continue
            lines.append(f"    called as {r['called_as']}")
            total = r["passed"] + r["failed"] + r["not_run"]
            if total:
                verdict = "all passed" if not r["failed"] else f"FAILED {', '.join(r['failed_classes'])}"
                lines.append(f"    correctness: {r['passed']} of {total} cases passed, {r['failed']} failed, "
                             f"{r['not_run']} not run: {verdict}")
                for cls, c in r["classes"].items():
                    counts = f"{c['passed']} passed, {c['failed']} failed" + (f", {c['not_run']} not run" if c["not_run"] else "")
                    lines.append(f"      {cls:<12} {counts}")
                    if c["first_failure"]:
                        f = c["first_failure"]
                        lines.append(f"        first failure: {f['case']} [{f['input']}]: {f['reason'][:300]}")
                    elif c["first_not_run"] and not c["passed"]:
                        lines.append(f"        not run: {c['first_not_run']['reason'][:200]}")
            for b in r["benchmarks"]:
                if b["ms"] is None:
                    lines.append(f"    {b['group']} {b['case']}: no time: {b['failure']}")
                else:
                    ups = ", ".join(f"{v:.3g}x {k}" for k, v in b["speedup"].items())
                    lines.append(f"    {b['group']} {b['case']}: {b['ms']:.4g} ms" + (f" ({ups})" if ups else ""))
    if any(r["benchmarks"] for c in report["candidates"] for r in c["names"].values()):
        lines.append("speed-up: the baseline's best time on the case over the candidate's (above 1: the candidate is faster)")
    return lines


# ----------------------------------------------------------------------------------------------
# Hooks (registered by conftest.py's pytest_plugins)
# ----------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.getgroup("softmax-kernels benchmarks").addoption(
        "--candidate", action="append", default=[], metavar="[LABEL=]PATH_OR_MODULE",
        help="check and time a module of your own: each public name it defines (online_softmax, fused_softmax, "
             "FlashAttentionTriton, ...) joins its op's correctness battery (tests/test_candidates.py) and benchmark "
             "groups as candidate:LABEL.NAME; repeatable. Report: candidate_report.txt in the outputs directory")


_CONFIG: dict = {}  # the session's config, for the report hook (which is given none)


def pytest_configure(config):
    config.candidate_cases = []
    _CONFIG["config"] = config
    configure(config)


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is not None and CANDIDATES:
        collect(config, report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After the harness has written the run's JSON: the report beside it."""
    config = session.config
    if not CANDIDATES or hasattr(config, "workerinput") or config.option.collectonly:
        return
    written = getattr(config, "bench_written", None)
    data = json.loads(written[0].read_text(encoding="utf-8")) if written else None
    report = build_report(config.candidate_cases, data)
    from conftest import outputs_dir

    out = Path(written[0].parent) if written else outputs_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{REPORT_NAME}.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    text = report_text(report)
    (out / f"{REPORT_NAME}.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
    config.candidate_report = (out / f"{REPORT_NAME}.txt", text)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    done = getattr(config, "candidate_report", None)
    if done is None:
        return
    path, text = done
    terminalreporter.write_sep("=", f"candidates -> {path}")
    for line in text:
        terminalreporter.write_line(line)
