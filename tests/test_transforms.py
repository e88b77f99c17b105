"""Forward-mode AD and torch.func transforms over every public op: the tangent, gradient, batch
or Jacobian a caller gets, never one silently dropped. And FakeTensorMode (shape propagation):
shapes and dtypes, never a launch on tensors that have no data.

A direct launch sees only the values: a dual tensor's tangent (``torch.autograd.forward_ad``) or
a transform's wrapper (``torch.func.grad``, ``jvp``, ``vmap``, ...) would be lost there, and a
custom op has no forward-mode formula. Such calls take the ops' autograd Functions, whose
``jvp`` and ``vmap`` rules carry them (``online_softmax.transformed``). Each result is judged
against the same transform of the PyTorch reference in float64, allowed PyTorch's own error in
float32 (``support.assert_close``).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import func

import fused_softmax_matmul as fsm
from fused_softmax_matmul import MatmulLaunch
from online_softmax import OnlineSoftmax, online_softmax, online_softmax_backward, row_softmax
from support import assert_close, randn

SOFTMAX = lambda t: torch.softmax(t, dim=-1)  # noqa: E731 - a table entry

# The fixed operands, drawn once in float32; each case takes them as ``o``, in float32 for the
# op and PyTorch's float32 answer, in float64 for the reference.
_OPERANDS = {"W": randn((37, 30), torch.float32, seed=90), "x": randn((6, 37), torch.float32, seed=91),
             "xv": randn((2, 5, 40), torch.float32, seed=92), "V": randn((2, 40, 24), torch.float32, seed=93)}

# name -> (op of the differentiated tensor t, the PyTorch reference, t's shape). "of W" / "of V"
# differentiate the second operand.
CASES = {
    "row_softmax": (lambda t, o: row_softmax(t), lambda t, o: SOFTMAX(t), (6, 37)),
    "online_softmax 2x8": (lambda t, o: online_softmax(t, 2, 8), lambda t, o: SOFTMAX(t), (2, 3, 37)),
    # the public backward, differentiated in its incoming gradient (its op has no forward mode)
    "online_softmax_backward of dy": (lambda t, o: online_softmax_backward(SOFTMAX(o["x"]), t, 2, 8),
                                      lambda t, o: _softmax_vjp(SOFTMAX(o["x"]), t), (6, 37)),
    "fused_softmax": (lambda t, o: fsm.fused_softmax(t, o["V"], 16, 16), lambda t, o: SOFTMAX(t) @ o["V"], (2, 5, 40)),
    "fused_softmax of V": (lambda t, o: fsm.fused_softmax(o["xv"], t, 16, 16), lambda t, o: SOFTMAX(o["xv"]) @ t,
                           (2, 40, 24)),
    "matmul": (lambda t, o: fsm.matmul(t, o["W"]), lambda t, o: t @ o["W"], (6, 37)),
    "matmul of W": (lambda t, o: fsm.matmul(o["x"], t), lambda t, o: o["x"] @ t, (37, 30)),
    # 16-wide class tiles: two of them, rescaled by the second kernel
    "matmul_softmax_fused_tiled": (lambda t, o: fsm.matmul_softmax_fused_tiled(t, o["W"], MatmulLaunch(16, 16, 16)),
                                   lambda t, o: SOFTMAX(t @ o["W"]), (6, 37)),
    "matmul_softmax_fused_tiled of W": (lambda t, o: fsm.matmul_softmax_fused_tiled(o["x"], t),
                                        lambda t, o: SOFTMAX(o["x"] @ t), (37, 30)),
    "matmul_softmax_fused_simple": (lambda t, o: fsm.matmul_softmax_fused_simple(t, o["W"]),
                                    lambda t, o: SOFTMAX(t @ o["W"]), (6, 37)),
    "matmul_softmax_unfused": (lambda t, o: fsm.matmul_softmax_unfused(t, o["W"]), lambda t, o: SOFTMAX(t @ o["W"]),
                               (6, 37)),
}


def _softmax_vjp(y, dy):
    """torch's own softmax backward: the gradient of x for y = softmax(x) and dy."""
    return torch._softmax_backward_data(dy, y, -1, y.dtype)


def _with(fn, dtype):
    """fn of t alone, the fixed operands in dtype."""
    operands = {name: t.to(dtype) for name, t in _OPERANDS.items()}
    return lambda t: fn(t, operands)


def _case(case):
    """(the op, PyTorch's float32 answer, the float64 reference, t's shape) of a case of CASES."""
    op, reference, shape = CASES[case]
    return _with(op, torch.float32), _with(reference, torch.float32), _with(reference, torch.float64), shape


def _dual_tangent(fn, x, t):
    with forward_ad.dual_level():
        return forward_ad.unpack_dual(fn(forward_ad.make_dual(x, t))).tangent


def _dual_cotangent(fn, x, c):
    """The tangent of x's gradient when the output's gradient c is a dual tensor (c reversed along
    its last dimension as its tangent): a backward that must carry a tangent."""
    leaf = x.detach().requires_grad_()
    out = fn(leaf)
    with forward_ad.dual_level():
        (grad,) = torch.autograd.grad(out, leaf, forward_ad.make_dual(c, c.flip(-1)))
        return forward_ad.unpack_dual(grad).tangent


def _forward_over_reverse(fn, x, t, c):
    """The tangent (along t) of the gradient of sum(fn(x) * c), the backward taken inside the
    dual level: a Hessian-vector product."""
    leaf = x.detach().requires_grad_()
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(leaf, t)
        (grad,) = torch.autograd.grad((fn(dual) * c).sum(), dual)
        return forward_ad.unpack_dual(grad).tangent


# transform -> (x, t, a weight c of the output's shape) -> a function of one op giving one tensor
TRANSFORMS = {
    "forward_ad": lambda x, t, c: lambda fn: _dual_tangent(fn, x, t),
    "func.jvp": lambda x, t, c: lambda fn: func.jvp(fn, (x,), (t,))[1],
    # two forward levels: torch's ops answer (torch gives zeros through a Function's jvp there)
    "func.jvp of func.jvp": lambda x, t, c: lambda fn: func.jvp(lambda a: func.jvp(fn, (a,), (t,))[1], (x,), (t,))[1],
    "forward_ad of a dual gradient": lambda x, t, c: lambda fn: _dual_cotangent(fn, x, c),
    "forward_ad over reverse": lambda x, t, c: lambda fn: _forward_over_reverse(fn, x, t, c),
    "func.grad": lambda x, t, c: lambda fn: func.grad(lambda a: (fn(a) * c).sum())(x),
    "func.vmap": lambda x, t, c: lambda fn: func.vmap(fn)(torch.stack([x, t])),
    "func.vmap, dim 1": lambda x, t, c: lambda fn: func.vmap(fn, in_dims=1)(torch.stack([x, t], dim=1)),
    "func.jacrev": lambda x, t, c: lambda fn: func.jacrev(fn)(x),
    "func.jacfwd": lambda x, t, c: lambda fn: func.jacfwd(fn)(x),
    "func.vmap of func.grad": lambda x, t, c: lambda fn: func.vmap(func.grad(lambda a: (fn(a) * c).sum()))(
        torch.stack([x, t])),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_transform_matches_torch(case, transform):
    op, torch32, torch64, shape = _case(case)
    x = randn(shape, torch.float32, seed=94)
    t = randn(shape, torch.float32, seed=95)
    c = randn(tuple(torch32(x).shape), torch.float32, seed=96)
    op(x)  # on a GPU a plain call keeps its launch: the transformed call below must not replay it
    run = TRANSFORMS[transform](x, t, c)
    out = run(op)
    ref64 = TRANSFORMS[transform](x.double(), t.double(), c.double())(torch64)
    if ref64 is None:  # a gradient that does not depend on the input (a product): no tangent
        assert out is None or not out.any(), f"{transform} of {case}: a tangent where torch has none"
        return
    assert out is not None, f"{transform} of {case} dropped the tangent"
    assert_close(out, ref64, run(torch32))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_online_softmax_function_refuses_transforms(transform):
    """``OnlineSoftmax.apply``, the course's ``forward(ctx, ...)`` Function, has no jvp (torch.compile
    would refuse to trace it) nor the form torch.func takes (its apply would cost more host
    time): torch's error asking for them, never a lost tangent. ``online_softmax`` carries all.
    Its backward carries a dual gradient's tangent like the others'."""
    x, t = randn((2, 3, 37), torch.float32, seed=104), randn((2, 3, 37), torch.float32, seed=105)
    c = randn((2, 3, 37), torch.float32, seed=106)
    run = TRANSFORMS[transform](x, t, c)
    if transform == "forward_ad of a dual gradient":
        run64 = TRANSFORMS[transform](x.double(), t.double(), c.double())
        assert_close(run(OnlineSoftmax.apply), run64(SOFTMAX), run(SOFTMAX))
        return
    with pytest.raises((RuntimeError, NotImplementedError), match="jvp|setup_context"):
        run(OnlineSoftmax.apply)


@pytest.mark.parametrize("case", ["row_softmax", "online_softmax 2x8", "fused_softmax", "matmul_softmax_fused_tiled",
                                  "matmul of W"])
def test_compiled_call_carries_the_tangent(case):
    """torch.compile (guarded on the dual level) runs a call that carries a tangent outside its
    trace; in fullgraph mode it says it cannot, where the op it would trace drops the tangent."""
    op, torch32, torch64, shape = _case(case)
    x, t = randn(shape, torch.float32, seed=106), randn(shape, torch.float32, seed=107)
    torch._dynamo.reset()
    compiled = torch.compile(op, backend="aot_eager")
    assert_close(compiled(x), torch64(x.double()), torch32(x))
    tangent = _dual_tangent(compiled, x, t)
    assert tangent is not None, "the compiled call dropped the tangent"
    assert_close(tangent, _dual_tangent(torch64, x.double(), t.double()), _dual_tangent(torch32, x, t))
    assert_close(compiled(x), torch64(x.double()), torch32(x))  # the plain call's graph again
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        _dual_tangent(torch.compile(op, backend="aot_eager", fullgraph=True), x, t)


@pytest.mark.parametrize("case", ["row_softmax", "online_softmax 2x8", "fused_softmax", "fused_softmax of V",
                                  "matmul_softmax_fused_tiled", "matmul_softmax_fused_tiled of W"])
def test_second_order_forward_over_reverse(case):
    """The Hessian of a weighted sum of the output (jacfwd over jacrev): the jvp of the backward,
    under a batch of tangents."""
    op, torch32, torch64, shape = _case(case)
    x = randn(shape, torch.float32, seed=97)
    c = randn(tuple(torch32(x).shape), torch.float32, seed=98)
    hessian = lambda fn, a: func.hessian(lambda b: (fn(b) * c.to(b.dtype)).sum())(a)  # noqa: E731
    assert_close(hessian(op, x), hessian(torch64, x.double()), hessian(torch32, x))


@pytest.mark.parametrize("case", ["row_softmax", "fused_softmax", "matmul_softmax_fused_tiled of W"])
def test_third_order_forward(case):
    """jacfwd over jacfwd (two forward levels, torch's ops answer), on a few values."""
    op, torch32, torch64, _ = _case(case)
    shape = {"row_softmax": (1, 5), "fused_softmax": (2, 1, 40), "matmul_softmax_fused_tiled of W": (37, 2)}[case]
    x = randn(shape, torch.float32, seed=109)
    twice = lambda fn: func.jacfwd(func.jacfwd(fn))  # noqa: E731
    assert_close(twice(op)(x), twice(torch64)(x.double()), twice(torch32)(x))


def test_bfloat16_tangent():
    """A 16-bit dual tensor: its tangent in its dtype, as accurate as PyTorch's."""
    x, t = randn((6, 300), torch.bfloat16, seed=99), randn((6, 300), torch.bfloat16, seed=100)
    out = _dual_tangent(row_softmax, x, t)
    assert out.dtype == torch.bfloat16
    assert_close(out, _dual_tangent(SOFTMAX, x.double(), t.double()), _dual_tangent(SOFTMAX, x, t))


@pytest.mark.parametrize("transform", ["forward_ad", "func.grad", "func.vmap"])
def test_linear_cross_entropy_refuses_transforms(transform):
    """Its op has no forward-mode formula nor torch.func rules: a clear error, not a lost tangent."""
    x, W = randn((6, 37), torch.float32, seed=101), randn((30, 37), torch.float32, seed=102)
    target = torch.randint(0, 30, (6,), generator=torch.Generator().manual_seed(0)).to(x.device)
    loss = lambda a: fsm.linear_cross_entropy(a, W, target, reduction="none")  # noqa: E731
    with pytest.raises(NotImplementedError, match="must not be dual tensors"):
        TRANSFORMS[transform](x, x, torch.ones(6, device=x.device))(loss)


@pytest.mark.parametrize("transform", ["forward_ad", "func.grad"])
def test_flash_attention_refuses_transforms(transform):
    """The course's Function (forward(ctx, ...)) has no jvp nor torch.func form: torch says so."""
    q = randn((1, 16, 16), torch.float32, seed=103)
    attend = lambda a: fsm.FlashAttentionTriton.apply(a, q, q, False)  # noqa: E731
    with pytest.raises((RuntimeError, NotImplementedError), match="jvp|setup_context"):
        TRANSFORMS[transform](q, q, q)(attend)


@pytest.mark.parametrize("transform", ["forward_ad", "func.vmap"])
@pytest.mark.parametrize("kernel", ["fused_softmax_gluon", "flash_attention_gluon"])
def test_gluon_kernels_refuse_transforms(kernel, transform):
    """The forward-only Gluon entry points refuse a tangent as they refuse a gradient (the check
    comes before any GPU is needed: this runs everywhere)."""
    x = randn((1, 16, 16), torch.bfloat16, seed=108)
    call = {"fused_softmax_gluon": lambda a: fsm.fused_softmax_gluon(a, x),
            "flash_attention_gluon": lambda a: fsm.flash_attention_gluon(a, x, x)[0]}[kernel]
    with pytest.raises(RuntimeError, match=f"{kernel} has no derivative"):
        TRANSFORMS[transform](x, x, None)(call)


def _fake_calls():
    """(name, call of the fake inputs, its input shapes): every public op, and a backward."""
    yield "row_softmax", lambda x: row_softmax(x), [(6, 37)]
    yield "online_softmax", lambda x: online_softmax(x, 2, 8), [(2, 3, 37)]
    yield "fused_softmax", lambda x, v: fsm.fused_softmax(x, v), [(2, 5, 40), (2, 40, 24)]
    yield "matmul", lambda x, w: fsm.matmul(x, w), [(6, 37), (37, 30)]
    for name in ("matmul_softmax_fused_tiled", "matmul_softmax_fused_simple", "matmul_softmax_unfused"):
        yield name, lambda x, w, name=name: getattr(fsm, name)(x, w), [(6, 37), (37, 30)]
    yield ("linear_cross_entropy",  # its bounds check reads the targets back on the CPU: not from a fake
           lambda x, w: fsm.linear_cross_entropy(x, w, torch.zeros(6, dtype=torch.long, device=x.device)),
           [(6, 37), (30, 37)])
    yield "FlashAttentionTriton", lambda q, k, v: fsm.FlashAttentionTriton.apply(q, k, v, True), [(1, 32, 16)] * 3


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("case", list(_fake_calls()), ids=lambda case: case[0])
def test_fake_tensor_mode(case, grad):
    """Under FakeTensorMode a call gives what the real call would in shape, dtype and device
    (through the ops' fakes), forward and backward; before, the direct launch crashed inside torch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, call, shapes = case
    real = [randn(shape, torch.float32, seed=110 + i).requires_grad_(grad) for i, shape in enumerate(shapes)]
    want = call(*real)
    wants = torch.autograd.grad(want.sum(), real) if grad else ()
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t).requires_grad_(grad) for t in real]
        got = call(*fakes)
        gots = torch.autograd.grad(got.sum(), fakes) if grad else ()
    for g, w in zip((got, *gots), (want, *wants)):
        assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)


@pytest.mark.parametrize("name", ["row_softmax", "fused_softmax", "matmul_softmax_fused_tiled"])
def test_a_dead_transform_wrapper_outside_the_transform(name):
    """A tensor that escaped a finished torch.func.grad (a dead wrapper of a tensor that needs
    grad) taken by an op afterwards: KernelFunction's C apply (``eager_apply``) unwraps it as
    torch's apply does, and the gradient reaches the leaf as torch's would. (online_softmax is
    not a case: its reshape to 3-D hands its Function a plain tensor already.)"""
    op, reference, shape = CASES[name]
    leaf = randn(shape, torch.float32, seed=94).requires_grad_()
    escaped = []

    def keep(w):
        escaped.append(leaf * w)
        return w.sum()

    func.grad(keep)(torch.ones(shape[-1], device=leaf.device))
    assert torch._C._functorch.is_functorch_wrapped_tensor(escaped[0])
    g = randn(tuple(reference(leaf.detach(), _OPERANDS).shape), torch.float32, seed=95)
    (op(escaped[0], _OPERANDS) * g).sum().backward()
    grads = []
    for dtype in (torch.float64, torch.float32):  # the reference, and PyTorch's own in float32
        t = leaf.detach().to(dtype).requires_grad_()
        (reference(t, {k: v.to(dtype) for k, v in _OPERANDS.items()}) * g.to(dtype)).sum().backward()
        grads.append(t.grad)
    assert_close(leaf.grad, *grads)
