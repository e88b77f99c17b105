"""Every public op of online_softmax.py as a caller uses it: autograd, double backward,
torch.compile(fullgraph=True), CUDA graphs, and the host-side caches.

Gradients are judged against torch autograd in float64 on the same (rounded) inputs, allowed
PyTorch's own error at the input's precision (``support.assert_close``). In the interpreter the
ops are opaque custom ops, so torch.compile there checks the op's schema, fake implementation
and autograd registration (backend aot_eager: no code generation, cheap); on a GPU the ops are
triton_ops that the default backend traces into, checked by the GPU-only tests.
"""

from __future__ import annotations

import pytest
import torch

import online_softmax as osm
from online_softmax import OnlineSoftmax, online_softmax, online_softmax_backward, row_softmax
from support import DEVICE, DTYPES, ON_GPU, assert_close, needs_gpu, randn

# name -> softmax over the last dimension, and the path it takes at the shapes below.
OPS = {
    "online_softmax 2x8": lambda x: online_softmax(x, 2, 8),  # several row tiles and column steps
    "OnlineSoftmax.apply 4x16": lambda x: OnlineSoftmax.apply(x, 4, 16),  # the course's autograd Function
    "row_softmax": row_softmax,  # one program per row, forward and backward (softmax_row_*_kernel)
    "row_softmax BLOCK_SIZE=8": lambda x: row_softmax(x, 8),  # forced online tiles of 1 x 8
}


def torch_softmax_grad(x, dy, dtype):
    leaf = x.detach().to(dtype).requires_grad_()
    return torch.autograd.grad(torch.softmax(leaf, dim=-1), leaf, dy.to(dtype))[0]


def op_grad(op, x, dy):
    leaf = x.detach().clone().requires_grad_()
    out = op(leaf)
    assert out.grad_fn is not None, "the output carries no history: the gradient would be dropped"
    out.backward(dy)
    assert leaf.grad.dtype == x.dtype and leaf.grad.shape == x.shape
    return leaf.grad


# ----------------------------------------------------------------------------------------------
# First-order gradients against float64
# ----------------------------------------------------------------------------------------------
# Odd shapes of every rank: ragged row tiles and column steps, a 1-D row, leading dims folded.
GRAD_SHAPES = {"3-D 2x5x37": (2, 5, 37), "1-D 19": (19,), "2-D 7x13": (7, 13), "4-D 2x1x3x21": (2, 1, 3, 21)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(GRAD_SHAPES.values()), ids=list(GRAD_SHAPES))
@pytest.mark.parametrize("op", OPS)
def test_gradient_matches_float64(op, shape, dtype):
    x = randn(shape, DTYPES[dtype], seed=len(shape), scale=2.0)
    dy = randn(shape, DTYPES[dtype], seed=30)
    grad = op_grad(OPS[op], x, dy)
    assert_close(grad, torch_softmax_grad(x, dy, torch.float64), torch_softmax_grad(x, dy, x.dtype))


@pytest.mark.parametrize("op", OPS)
def test_gradient_of_a_sum(op):
    """y.sum().backward() hands the backward a stride-0 expansion of a scalar: read through its strides."""
    x = randn((3, 4, 11), torch.float32, seed=31, scale=2.0)
    leaf = x.clone().requires_grad_()
    (OPS[op](leaf) * torch.arange(11, device=DEVICE)).sum().backward()
    dy = torch.arange(11, device=DEVICE, dtype=torch.float32).expand(x.shape)
    assert_close(leaf.grad, torch_softmax_grad(x, dy, torch.float64), torch_softmax_grad(x, dy, torch.float32))


@pytest.mark.parametrize("layout", ["transposed", "every other column"])
@pytest.mark.parametrize("op", OPS)
def test_gradient_of_a_strided_upstream(op, layout):
    """dy of column stride other than 1, as a transposed or sliced upstream gradient is: read through it."""
    x = randn((12, 37), torch.float32, seed=34, scale=2.0)
    dy = (randn((37, 12), torch.float32, seed=35).t() if layout == "transposed"
          else randn((12, 74), torch.float32, seed=35)[:, ::2])
    assert dy.stride(-1) != 1
    assert_close(op_grad(OPS[op], x, dy), torch_softmax_grad(x, dy, torch.float64),
                 torch_softmax_grad(x, dy, torch.float32))


def test_row_softmax_long_row_gradient():
    """17000 columns: the forward holds a row, but two rows (y and dy) no longer fit one program:
    the backward runs in online tiles of 1 x 4096."""
    assert osm._row_backward_launch(2, 17000, -1 if not ON_GPU else 0).kernel == "online"
    x = randn((2, 17000), torch.float32, seed=32, scale=3.0)
    dy = randn((2, 17000), torch.float32, seed=33)
    assert_close(op_grad(row_softmax, x, dy), torch_softmax_grad(x, dy, torch.float64),
                 torch_softmax_grad(x, dy, torch.float32))


def test_online_softmax_backward_any_rank():
    """online_softmax_backward takes y and dy of any one shape, as online_softmax takes x."""
    x = randn((2, 2, 3, 9), torch.float32, seed=34)
    dy = randn(x.shape, torch.float32, seed=35)
    dx = online_softmax_backward(torch.softmax(x, dim=-1), dy, 2, 4)
    assert_close(dx, torch_softmax_grad(x, dy, torch.float64), torch_softmax_grad(x, dy, torch.float32))


# ----------------------------------------------------------------------------------------------
# Double backward: the backward ops are differentiable (d/dy by formula, d/d(dy) by the kernel)
# ----------------------------------------------------------------------------------------------
def second_order(op, x, dy, w, dtype):
    """Gradients of <w, d op(x)/dx . dy> with respect to x and dy: the terms a Hessian-vector
    product or a gradient penalty needs; zeros there would mean a silently dropped term."""
    leaf = x.detach().to(dtype).requires_grad_()
    dy = dy.detach().to(dtype).requires_grad_()
    (gx,) = torch.autograd.grad(op(leaf), leaf, dy, create_graph=True)
    return torch.autograd.grad((gx * w.to(dtype)).sum(), (leaf, dy))


@pytest.mark.parametrize("op", OPS)
def test_double_backward_matches_float64(op):
    shape = (2, 3, 13)
    x, dy, w = (randn(shape, torch.float32, seed=s, scale=2.0) for s in (36, 37, 38))
    got = second_order(OPS[op], x, dy, w, torch.float32)
    ref = second_order(lambda t: torch.softmax(t, dim=-1), x, dy, w, torch.float64)
    ref32 = second_order(lambda t: torch.softmax(t, dim=-1), x, dy, w, torch.float32)
    for name, g, r, r32 in zip(("d/dx", "d/d(dy)"), got, ref, ref32):
        assert g.abs().max() > 0, f"{name}: second-order term is zero"
        assert_close(g, r, r32)


# ----------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): the public ops trace with no graph break, forward and backward
# ----------------------------------------------------------------------------------------------
def softmax_backward_reference(y, dy):
    return y * (dy - (y * dy).sum(dim=-1, keepdim=True))


# name -> (op, its definition in torch ops). The backward op is fed y = dy = x: not a softmax
# output, but the formula holds for any y, so the compiled graph holds the kernel alone.
COMPILE_OPS = dict({name: (op, lambda x: torch.softmax(x, dim=-1)) for name, op in OPS.items()}, **{
    "online_softmax_backward": (lambda x: online_softmax_backward(x, x, 2, 8), lambda x: softmax_backward_reference(x, x)),
})


def compiled_and_grad(fn, x, dy):
    leaf = x.detach().clone().requires_grad_()
    y = fn(leaf)
    y.backward(dy)
    return y.detach(), leaf.grad


@pytest.mark.parametrize("op", COMPILE_OPS)
def test_compiles_fullgraph_with_backward(op):
    """aot_eager in the interpreter (the op stays opaque; no code generation), the default backend
    on a GPU (the triton_op's launches traced into the graph). Output and gradient as accurate as
    torch's against float64."""
    torch._dynamo.reset()
    fn, reference = COMPILE_OPS[op]
    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager", dynamic=False)
    x = randn((2, 3, 21), torch.float32, seed=39, scale=2.0)
    dy = randn(x.shape, torch.float32, seed=40)
    y, grad = compiled_and_grad(compiled, x, dy)
    y64, grad64 = compiled_and_grad(reference, x.double(), dy.double())
    y32, grad32 = compiled_and_grad(reference, x, dy)
    assert_close(y, y64, y32)
    assert_close(grad, grad64, grad32)


def test_no_grad_call_launches_directly():
    """A plain eager call skips the dispatcher (no history); one that autograd records goes through
    the op and carries its backward."""
    x = randn((2, 5), torch.float32, seed=41)
    assert row_softmax(x).grad_fn is None and online_softmax(x, 2, 4).grad_fn is None
    x.requires_grad_()
    assert row_softmax(x).grad_fn is not None and online_softmax(x, 2, 4).grad_fn is not None
    with torch.no_grad():
        assert row_softmax(x).grad_fn is None


# ----------------------------------------------------------------------------------------------
# Host cost: launch choices are cached, not recomputed per call
# ----------------------------------------------------------------------------------------------
def test_row_launch_is_cached():
    """The launch choice is made once per shape: a second call looks it up (in the interpreter) or
    takes the launch kept from the first (compiled), choosing nothing again."""
    x = randn((5, 33), torch.float32, seed=42)
    row_softmax(x)
    before = osm._row_launch.cache_info()
    row_softmax(x)
    after = osm._row_launch.cache_info()
    assert after.misses == before.misses
    if osm.INTERPRET:
        assert after.hits == before.hits + 1
    else:
        assert after.hits == before.hits and osm.replay_key((x,), (None,)) in osm._ROW_REPLAYS


# ----------------------------------------------------------------------------------------------
# On a GPU: compiled graphs, CUDA graphs, the split-row kernel's counters
# ----------------------------------------------------------------------------------------------
# name -> (op, shape): the row_softmax shapes cover the one-pass kernel and the split-row kernel.
GPU_OPS = {
    "online_softmax": (lambda x: online_softmax(x, *osm.online_softmax_tiles(x.shape[-1])), (4, 64, 1000)),
    "OnlineSoftmax.apply": (lambda x: OnlineSoftmax.apply(x, 16, 64), (4, 64, 1000)),
    "row_softmax one-pass": (row_softmax, (512, 1000)),
    "row_softmax split": (row_softmax, (64, 65536)),
    "online_softmax_backward": (lambda x: online_softmax_backward(x, x, 16, 64), (4, 64, 1000)),
}


def gpu_reference(op, x):
    """What GPU_OPS[op] computes, in torch ops: float64 reference and x.dtype's own error."""
    fn = (lambda t: softmax_backward_reference(t, t)) if op == "online_softmax_backward" else (
        lambda t: torch.softmax(t, dim=-1))
    return fn(x.double()), fn(x)


@needs_gpu
@pytest.mark.parametrize("op", GPU_OPS)
def test_cuda_graph_replay_equals_eager(op):
    """Captured once, replayed on new inputs: the same answer as an eager call, every replay (the
    split kernel's cached counters must come back to zero after each launch, or the next hangs)."""
    fn, shape = GPU_OPS[op]
    static_x = randn(shape, torch.float32, seed=43, scale=2.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn(static_x)
    for seed in (44, 45, 46):
        static_x.copy_(randn(shape, torch.float32, seed=seed, scale=2.0))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, fn(static_x.clone())), f"replay with seed {seed}"
    for _, counters in osm._SPLIT_WORKSPACES.values():
        assert (counters == 0).all()


@needs_gpu
@pytest.mark.parametrize("op", GPU_OPS)
def test_reduce_overhead_compile(op):
    """torch.compile(mode="reduce-overhead", fullgraph=True): compiled and replayed from a CUDA graph."""
    torch._dynamo.reset()
    fn, shape = GPU_OPS[op]
    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    for seed in (47, 48, 49):
        x = randn(shape, torch.float32, seed=seed, scale=2.0)
        assert_close(compiled(x).clone(), *gpu_reference(op, x))


@needs_gpu
@pytest.mark.parametrize("op", GPU_OPS)
def test_compile_dynamic_shapes(op):
    """A second shape makes torch.compile mark dimensions dynamic; the ops still trace and agree."""
    torch._dynamo.reset()
    fn, shape = GPU_OPS[op]
    compiled = torch.compile(fn, fullgraph=True)
    for rows in (shape[-2], shape[-2] + 3):
        x = randn(shape[:-2] + (rows, shape[-1]), torch.float32, seed=50, scale=2.0)
        assert_close(compiled(x), *gpu_reference(op, x))


@needs_gpu
def test_split_row_counters_reset_by_the_kernel():
    """The split path allocates no workspace per call: one (stats, counters) pair per (device, stream),
    the counters zero after each launch."""
    x = randn((64, 65536), torch.float32, seed=51)
    assert osm._row_launch(64, 65536, 65536, torch.float32, x.device.index, 0).kernel == "split"
    row_softmax(x)
    buffers = {key: tuple(map(id, w)) for key, w in osm._SPLIT_WORKSPACES.items()}
    for _ in range(3):
        assert_close(row_softmax(x), torch.softmax(x.double(), -1), torch.softmax(x, -1))
    torch.cuda.synchronize()
    assert {key: tuple(map(id, w)) for key, w in osm._SPLIT_WORKSPACES.items()} == buffers, "a new workspace per call"
    assert all((c == 0).all() for _, c in osm._SPLIT_WORKSPACES.values())


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_row_groups_reuse_their_stats_slots_row_after_row(dtype):
    """Every group of the split kernel takes three rows or more, so each program writes each of its
    two (max, sum) slots again: every row against float64, each row shifted and scaled apart, so
    that a pair read from another row would show."""
    n, index = 65536, torch.cuda.current_device()
    most = osm._row_launch(1 << 20, n, n, dtype, index, 0)
    n_groups = most.programs // most.split
    n_rows = 3 * n_groups + 2
    launch = osm._row_launch(n_rows, n, n, dtype, index, 0)
    assert launch.kernel == "split" and launch.programs // launch.split == n_groups
    rows = torch.arange(n_rows, device="cuda", dtype=torch.float32)[:, None]
    x = (randn((n_rows, n), torch.float32, seed=54) * (1 + rows % 5) + rows).to(dtype)
    assert_close(row_softmax(x), torch.softmax(x.double(), -1), torch.softmax(x, -1))


@needs_gpu
def test_split_row_gradient_on_gpu():
    """Long rows: split-row forward, online-tile backward, against float64."""
    x = randn((8, 65536), torch.float32, seed=52, scale=3.0)
    dy = randn(x.shape, torch.float32, seed=53)
    assert_close(op_grad(row_softmax, x, dy), torch_softmax_grad(x, dy, torch.float64),
                 torch_softmax_grad(x, dy, torch.float32))


def _refuse(what):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} called on the hot path")
    return refuse


# Long rows: the split-row kernel on a GPU, online tiles in the interpreter (kept small there).
@pytest.mark.parametrize("shape", [(64, 1000), (64, 65536) if ON_GPU else (2, 40_000)], ids=["one-pass", "long rows"])
def test_hot_path_does_no_setup(monkeypatch, shape):
    """After a first call, a call of the same shape compiles nothing, queries no device property and
    zeroes no counter: those live in caches (the split path's counters in a buffer the kernel resets)."""
    x = randn(shape, torch.float32, seed=54)
    first = row_softmax(x)
    monkeypatch.setattr(osm.softmax_split_row_kernel, "warmup", _refuse("warmup"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", _refuse("get_device_properties"))
    monkeypatch.setattr(torch, "zeros", _refuse("torch.zeros"))
    assert torch.equal(row_softmax(x), first)


# ----------------------------------------------------------------------------------------------
# Eager calls that autograd records: an autograd.Function launching directly (kept launches, no
# dispatcher), with the gradients of the custom op path they stand in for.
# ----------------------------------------------------------------------------------------------
def _eager_cases():
    import fused_softmax_matmul as fsm

    x = randn((6, 37), torch.float32, seed=70)
    yield "row_softmax", "KernelFunction", osm.row_softmax, lambda a: osm._row_softmax_op(a, 0), (x,)
    x3 = randn((2, 6, 37), torch.float32, seed=80)
    yield "online_softmax", "KernelFunction", osm.online_softmax, lambda a: osm._online_softmax_op(a, 16, 16), (x3,)
    yield ("OnlineSoftmax.apply", "OnlineSoftmax", lambda a: OnlineSoftmax.apply(a, 16, 16),
           lambda a: osm._online_softmax_op(a, 16, 16), (x3,))
    xv, v = randn((2, 20, 40), torch.float32, seed=71), randn((2, 40, 24), torch.float32, seed=72)
    yield ("fused_softmax", "KernelFunction", lambda a, b: fsm.fused_softmax(a, b, 16, 16),
           lambda a, b: fsm._fused_softmax_op(a, b, *fsm._plan_call(a, b, 16, 16, None, None).op_args)[0], (xv, v))
    xw, w = randn((20, 48), torch.float32, seed=73), randn((48, 30), torch.float32, seed=74)
    for name in ("matmul_softmax_fused_tiled", "matmul"):
        op = fsm._MATMUL_OPS[name]
        yield name, "KernelFunction", getattr(fsm, name), lambda a, b, op=op: op(a, b, []), (xw, w)
    # x^T as a backward's dW takes it: its K stride divided (X_TRANSPOSED)
    xt = randn((48, 24), torch.float32, seed=75).t()
    yield "matmul, x transposed", "KernelFunction", fsm.matmul, lambda a, b: fsm._MATMUL_OPS["matmul"](a, b, []), (
        xt, randn((48, 40), torch.float32, seed=76))
    # flash_attention's general kernels (grouped-query heads) and linear_cross_entropy, both paths
    q, kv = randn((1, 4, 24, 16), torch.float32, seed=81), randn((1, 2, 40, 16), torch.float32, seed=82)
    plan = fsm.attention_plan(16, 16, torch.float32, 24, 40, is_causal=True, causal_align="bottom_right",
                              batch_heads=4, grouped=True)
    attention_args = fsm._attention_args(16 ** -0.5, None, plan)
    yield ("flash_attention", "KernelFunction",
           lambda a, b, c: fsm.flash_attention(a, b, c, is_causal=True, causal_align="bottom_right", enable_gqa=True),
           lambda a, b, c: torch.ops.softmax_kernels.attention_forward(a, b, c, *attention_args)[0],
           (q, kv, randn((1, 2, 40, 16), torch.float32, seed=83)))
    xl, wl = randn((20, 16), torch.float32, seed=84), randn((30, 16), torch.float32, seed=85)
    target = torch.randint(0, 30, (20,), generator=torch.Generator().manual_seed(86)).to(xl.device)
    for reduction in ("mean", "none"):
        lce_plan = fsm.linear_cross_entropy_plan(20, 16, 30, torch.float32, reduction, grads=(True, True, False))
        yield (f"linear_cross_entropy {reduction}", "KernelFunction",
               lambda a, b, r=reduction: fsm.linear_cross_entropy(a, b, target, reduction=r),
               lambda a, b, p=lce_plan: torch.ops.softmax_kernels.linear_cross_entropy_forward(
                   a, b, target, None, None, *p.args())[0], (xl, wl))


def _node(out):
    """out's grad_fn past the views a wrapper puts on its op's output (a reshape to target's shape)."""
    node = out.grad_fn
    while type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return type(node).__name__


@pytest.mark.parametrize("case", list(_eager_cases()), ids=lambda case: case[0])
def test_eager_autograd_matches_the_op(case):
    _, function, public, through_op, inputs = case
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = public(*leaves)
    assert _node(out) == function + "Backward"
    grad_out = randn(tuple(out.shape), torch.float32, seed=77)
    eager = torch.autograd.grad(out, leaves, grad_out)
    again = public(*leaves)  # on a GPU, the launch kept from the first call
    assert torch.equal(again, out)
    for a, b in zip(torch.autograd.grad(again, leaves, grad_out), eager):
        assert torch.equal(a, b)
    via_op = torch.autograd.grad(through_op(*leaves), leaves, grad_out)
    assert _node(through_op(*leaves)) != function + "Backward"
    for a, b in zip(eager, via_op):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", list(_eager_cases()), ids=lambda case: case[0])
def test_eager_autograd_takes_batched_gradients(case):
    # is_grads_batched (and vectorised jacobians) hand the backward a functorch batch, which has
    # no storage a launch could read: the backward op serves it, as it does through the custom op.
    _, _, public, _, inputs = case
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = public(*leaves)
    grads = randn((3, *out.shape), torch.float32, seed=79)
    batched = torch.autograd.grad(out, leaves, grads, is_grads_batched=True)
    for i in range(3):
        one = torch.autograd.grad(public(*leaves), leaves, grads[i])
        for a, b in zip(batched, one):
            torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-6)


class Tagged(torch.Tensor):
    """A tensor subclass: eager calls on it keep the custom op (the Function takes plain tensors)."""


def test_eager_autograd_leaves_subclasses_to_the_op():
    x = randn((4, 33), torch.float32, seed=78).as_subclass(Tagged).requires_grad_()
    y = osm.row_softmax(x)
    assert "KernelFunction" not in type(y.grad_fn).__name__
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-6)  # rows of a softmax sum to 1


def test_first_argument_by_name():
    """The public ops' device guard takes the first argument by position or by its name."""
    from online_softmax import online_softmax_backward, row_softmax

    x = torch.randn(3, 40, device=DEVICE)
    y = torch.softmax(x, -1)
    dy = torch.randn_like(y)
    torch.testing.assert_close(row_softmax(x=x), y)
    torch.testing.assert_close(online_softmax_backward(y=y, dy=dy), online_softmax_backward(y, dy))


def _doubling_spec(**rules):
    """A spec of y = 2x run by torch's ops: the Function's own plumbing, no kernel."""
    def backward(ctx, dy):
        return (2 * dy,)

    return osm.AutogradSpec("doubling", forward=lambda x: 2 * x, setup=lambda ctx, inputs, output: None,
                            backward=backward, **rules)


def test_kernel_function_runs_its_spec_and_refuses_what_the_spec_lacks():
    """``KernelFunction`` takes an op's ``AutogradSpec``: gradients by its backward, through the
    C apply of an eager call; forward mode and vmap by its rules, and where it has none an error
    naming the op (not torch's request to write a rule)."""
    from torch import func

    x = randn((3, 4), torch.float32, seed=5).requires_grad_()
    y = _doubling_spec().run(x)
    assert type(y.grad_fn).__name__ == "KernelFunctionBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.full_like(x, 2.0))
    with pytest.raises(NotImplementedError, match="doubling: forward-mode AD"):
        func.jvp(_doubling_spec().run, (x.detach(),), (torch.ones_like(x),))
    with pytest.raises(NotImplementedError, match="doubling: torch.func.vmap"):
        func.vmap(_doubling_spec().run)(x.detach())
    spec = _doubling_spec(jvp=lambda ctx, dx: 2 * dx,
                          vmap=lambda info, in_dims, x: (2 * x, in_dims[0]))
    _, tangent = func.jvp(spec.run, (x.detach(),), (torch.ones_like(x),))
    assert torch.equal(tangent, torch.full_like(x, 2.0))
    assert torch.equal(func.vmap(spec.run)(x.detach()), 2 * x.detach())
