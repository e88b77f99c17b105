"""Softmax over the last dimension, in Triton, beside the PyTorch code it must agree with.

Softmax is memory bound: it does a handful of flops per element, so its speed is the number of
bytes it moves over the device's copy bandwidth. The step-by-step PyTorch version below moves
about four times the minimum (it re-reads its intermediates); the Triton kernels read the input
once and write the output once whenever a row fits on chip.

Three Triton kernels, each for a different question:

* ``online_softmax`` (``online_softmax_kernel``): the streaming algorithm. One pass over a row
  keeps a running maximum and a running sum rescaled whenever the maximum grows; a second pass
  writes ``exp(x - max) / sum``. It works for rows of any length with fixed-size tiles of
  ``BLOCK_1`` rows by ``BLOCK_2`` columns. Its backward (``OnlineSoftmax``) is a Triton kernel too.
* ``row_softmax`` (``softmax_row_kernel``): one pass for rows that fit in one program's registers,
  one program a row (or a block of narrow rows). This is the one to set against ``torch.softmax``.
* ``softmax_split_row_kernel``: rows too long for one program are split over several programs
  that are all resident at once; they swap their partial (max, sum) through a small workspace, so
  the input is still read only once. ``row_softmax`` picks it for long rows on a GPU (16-bit
  rows only where it beats the online kernel: see ``_split_suits_16bit``).

All kernels compute in float32 whatever the input dtype and write the input dtype. They give
``torch.softmax``'s answer at the edges: -inf logits weigh 0 (whole tiles of them too), and a
row of only -inf, or holding a NaN or +inf, is NaN.

Every public op is a torch custom op (``kernel_op``): torch.compile(fullgraph=True) traces it,
CUDA graphs capture it, and autograd runs its Triton backward (``dx = y * (dy - sum(y * dy))``
per row), itself differentiable for second-order gradients. A plain eager call launches its
kernels directly and keeps the launch for the next call of the same key (``Replay``); an eager
call autograd records runs the generic autograd Function (``KernelFunction``, configured per op
by an ``AutogradSpec``).

Sections: references and bytes models; the runtime every op shares (this module's and
fused_softmax_matmul.py's: checks, routes, custom ops, autograd, launching, kept launches,
device resources); what the two softmaxes share; the online softmax; the row softmax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import threading
import types
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake


__all__ = [
    "KernelCapacityError", "OnlineSoftmax", "naive_softmax", "naive_softmax_bytes", "online_softmax",
    "online_softmax_backward", "online_softmax_tiles", "row_softmax", "softmax_bytes", "softmax_reference",
]


def interpreter_requested() -> bool:
    """TRITON_INTERPRET as Triton reads it: its knob takes 1, true, yes, on and y in any case.
    A Triton without knobs (before 3.4) read "1" only."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is the mode of this module.
INTERPRET = interpreter_requested()
# Compiled for an NVIDIA GPU, the row kernels take exp as one ex2.approx.ftz (tl.exp is six
# instructions on sm_90, which made long 16-bit rows compute-bound): an exp below 2^-126 of the
# row's largest flushes to 0 instead of a subnormal. Design notes: fast exp.
FAST_EXP = tl.constexpr(not INTERPRET and torch.version.hip is None)
LOG2_E = tl.constexpr(1.4426950408889634)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# References and bytes models
# ----------------------------------------------------------------------------------------------
def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """What every kernel here must equal: ``torch.softmax`` over the last dimension."""
    return torch.softmax(x, dim=-1)


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax in five PyTorch steps; each launches its own kernel and goes through memory.

    For x of M rows and N columns, counted in elements (see ``naive_softmax_bytes``):
    """
    if x.numel() == 0:  # max over no columns raises: torch.softmax's empty answer
        return torch.softmax(x, dim=-1)
    x_max = x.max(dim=-1, keepdim=True).values  # read MN, write M
    z = x - x_max  # read MN + M, write MN
    numerator = torch.exp(z)  # read MN, write MN
    denominator = numerator.sum(dim=-1, keepdim=True)  # read MN, write M
    return numerator / denominator  # read MN + M, write MN


def naive_softmax_bytes(M: int, N: int, element_size: int) -> int:
    """Bytes ``naive_softmax`` moves: reads 5MN + 2M, writes 3MN + 2M elements.

    (The course notes count 5MN + M reads; the division re-reads the M sums, hence 2M here.)
    """
    return (5 * M * N + 2 * M + 3 * M * N + 2 * M) * element_size


def softmax_bytes(M: int, N: int, element_size: int) -> int:
    """The least any softmax can move: read the input once, write the output once."""
    return 2 * M * N * element_size


# ----------------------------------------------------------------------------------------------
# Runtime shared by every op here and in fused_softmax_matmul.py. A public op's call, top-down:
# its checks; its route (``needs_op``): a kept launch, a direct launch, its custom op
# (``kernel_op``) or, where autograd records it, the generic Function (``KernelFunction``); the
# launch (``jit_kernel``); the launch kept for the next call of its key (``Replays``).
# ----------------------------------------------------------------------------------------------


# -- Checks: a wrong input gets an error naming the argument -----------------------------------
class KernelCapacityError(ValueError):
    """A valid input this kernel cannot hold on this device (a size past what fits on chip)."""


# For check_tensor: any number of dimensions from one up (softmax over the last of them).
ANY_RANK = range(1, 1 << 16)


def check_dense(name: str, t: torch.Tensor) -> None:
    """The kernels read memory through strides; a sparse tensor has none to read."""
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}: convert it with .to_dense()")


def check_tensor(name: str, t, ndim: int | tuple[int, ...] | range) -> None:
    """Raise TypeError/ValueError, naming ``name``, unless ``t`` is a usable kernel input."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in ranks:
        if isinstance(ranks, range):
            want = f"at least {ranks.start}" if ranks.stop >= ANY_RANK.stop else f"{ranks.start} to {ranks.stop - 1}"
        else:
            want = " or ".join(map(str, ranks))
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if INTERPRET:
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, but Triton runs in interpreter mode (TRITON_INTERPRET=1): pass CPU tensors")
    elif t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}, but compiled Triton kernels need a CUDA tensor: move it to the GPU, "
                         "or set TRITON_INTERPRET=1 before importing this module to run the kernels on the CPU in "
                         "Triton's interpreter")


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Both tensors must share dtype and device (the kernels do no implicit promotion)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_b} has dtype {b.dtype} but {name_a} has {a.dtype}: they must match")
    if a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}: they must be on one device")


def check_block(name: str, value, minimum: int, maximum: int = 1024) -> None:
    """A tile size must be a power of two in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or value > maximum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two between {minimum} and {maximum}, got {value}")


def check_int(name: str, value, minimum: int, maximum: int) -> None:
    """A launch field that need not be a power of two: an int in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an int from {minimum} to {maximum}, got {value}")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


# -- Routes: which way a call goes (a direct launch, its custom op, or the autograd Function) ---
# Tensors an eager call may hand to its launches directly (a subclass goes through the op).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def needs_op(*tensors) -> bool:
    """Whether a call must go through its custom op rather than launch its kernels directly.

    Under torch.compile the op is what the compiler sees; with autograd recording, the op carries
    the registered backward (eager calls on plain tensors take ``KernelFunction`` instead:
    ``eager_autograd``); a tangent or a transform's wrapper (``transformed``) needs that Function;
    a tensor subclass (a FakeTensor of shape propagation, say) needs the dispatcher, which hands
    the op to the subclass (for a FakeTensor, the op's fake). A plain eager call skips torch's
    dispatcher, whose cost per call is of the order of a kernel launch itself.
    """
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:
        if isinstance(t, torch.Tensor) and (grad and t.requires_grad or type(t) not in PLAIN_TENSORS):
            return True
    return transformed(*tensors)


def eager_autograd(*tensors) -> bool:
    """Whether a call that autograd records (``needs_op``) takes ``KernelFunction``
    (``AutogradSpec.run``), which launches directly, rather than its custom op and the dispatcher:
    not traced, and plain tensors only (None: an absent optional input); or a call that carries a
    tangent or a transform's wrapper (``transformed``), which only the Function carries."""
    return (not torch.compiler.is_compiling() and all(type(t) in PLAIN_TENSORS for t in tensors if t is not None)
            or transformed(*tensors))


def transformed(*tensors) -> bool:
    """Whether a tensor carries what a direct launch would drop without a word: a forward-mode
    tangent (a dual tensor of ``torch.autograd.forward_ad``) or a ``torch.func`` transform's
    wrapper (grad, vjp, jacrev, jvp, jacfwd, vmap). Such calls take ``KernelFunction``, whose
    forward sees plain tensors and whose ``jvp`` and ``vmap`` carry the tangents and the batch. (A custom op has no forward-mode formula: where no input requires grad torch drops
    its tangent without a word, else it raises.)

    Outside any transform and dual level (two flags read, about 0.1 us) no tensor is looked at.
    A trace by torch.compile cannot look at one either: there every call while a dual level is
    open counts, tangent or not (the compiled code is guarded on that level), and its Function
    runs outside the trace (``apply_transforms``: a graph break, which fullgraph mode refuses)."""
    if torch.compiler.is_compiling():
        return _dual_level_open()
    wrapped = torch._C._are_functorch_transforms_active()
    dual = _dual_level_open()
    if not (wrapped or dual):
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and (wrapped and torch._C._functorch.is_functorch_wrapped_tensor(t)
                                            or dual and forward_ad.unpack_dual(t).tangent is not None):
            return True
    return False


def _dual_level_open() -> bool:
    # Without the attribute (another torch) assume a level is open: the tensors are then looked at.
    return getattr(forward_ad, "_current_level", 0) >= 0


def nested_tangents() -> bool:
    """Whether two forward-mode levels are open (torch.func's jvp over jvp, jacfwd over jacfwd or
    over hessian; a dual level around one): torch does not differentiate an autograd Function's
    jvp at the outer level and gives zeros there without a word (pytorch issue 197867), so such
    calls take torch's own ops (``AutogradSpec.reference``). Where torch.func's interpreters
    cannot be listed, assumed."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
        levels = sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        return True
    return levels + _dual_level_open() > 1


def other_device(t) -> int | None:
    """The index of t's CUDA device where that is not the current device, else None (a CPU tensor,
    a tensor subclass, a trace). Triton, the direct launches and the kept ones launch on the
    current device: a call whose tensors live on another must first make theirs current."""
    if type(t) not in PLAIN_TENSORS or torch.compiler.is_compiling():
        return None
    index = t.get_device()
    return None if index < 0 or index == torch._C._cuda_getDevice() else index


def on_input_device(fn):
    """fn run with its first argument's CUDA device current (``other_device``), as torch's own ops
    run: without, tensors on cuda:1 while cuda:0 is current were launched on cuda:0. The current
    device is restored after. The first argument may come by position or by its name."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        index = other_device(args[0] if args else kwargs.get(first))
        if index is None:
            return fn(*args, **kwargs)
        with torch.cuda.device(index):
            return fn(*args, **kwargs)
    return call


# -- Custom ops: how every public op reaches torch.compile, CUDA graphs and autograd -----------
OP_NAMESPACE = "softmax_kernels"


def kernel_op(name: str, fake, mutates_args=(), opaque: bool = False):
    """Decorator: the launch function becomes the torch op ``softmax_kernels::name``.

    Compiled, it is a ``torch.library.triton_op``: torch.compile traces through it to the Triton
    launches (written ``wrap_triton(kernel)[grid](...)``) and can capture them in a CUDA graph. In
    the interpreter it is a ``torch.library.custom_op``: triton_op traces its body with fake
    tensors, which an interpreted kernel cannot take. ``fake`` (the op's signature, returning
    empty outputs of the right shapes, dtypes and devices) is its meta implementation either way.
    Autograd is registered on the returned op (``register_autograd``) by the caller.
    ``opaque`` keeps it opaque when compiled too: torch.compile calls its body as it is. An opaque
    op is defined with ``torch.library.Library`` (``_plain_op``) and returned as its OpOverload.
    The body runs on its inputs' device wherever it runs as it is: called through the dispatcher
    (a tensor subclass, a recorded backward), or opaque in a compiled graph. A triton_op that
    torch.compile traces puts its launches in the graph instead (outputs/README.md).
    """
    def register(fn):
        body = on_input_device(fn)
        if opaque:
            return _plain_op(name, fn, body, fake, mutates_args)
        make = torch.library.custom_op if INTERPRET else torch.library.triton_op
        op = make(f"{OP_NAMESPACE}::{name}", mutates_args=mutates_args)(body)
        op.register_fake(fake)
        return op
    return register


# Each opaque op's Library by name. Kept across a reload of this module (which runs it again in the
# same namespace): the ops another module defined stay. A name defined again drops its old Library,
# and with it the old definition, as custom_op does.
_OPAQUE_LIBRARIES = globals().get("_OPAQUE_LIBRARIES", {})


def _plain_op(name: str, fn, body, fake, mutates_args):
    """``softmax_kernels::name`` with the schema of fn's annotations, fake its FakeTensor kernel,
    body its kernel on every device, called by the dispatcher straight: no custom_op's Python
    layers (autograd wrapper, alias checks), which a compiled step pays on each call (see
    outputs/README.md, design notes: plain opaque ops). So the body returns fresh tensors, never
    an input or its view, unchecked. An op given no autograd refuses inputs that record a
    gradient (torch's fallback would drop it with a warning). The OpOverload."""
    _OPAQUE_LIBRARIES.pop(name, None)
    lib = _OPAQUE_LIBRARIES[name] = torch.library.Library(OP_NAMESPACE, "FRAGMENT")
    lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=(torch.Tag.pt2_compliant_tag,))

    def kernel(*args, **kwargs):
        # Under an op's registered autograd the body runs with grad off (or no input wanting one).
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values())):
            raise RuntimeError(f"{OP_NAMESPACE}::{name} has no derivative of its own and an input requires grad "
                               "(its gradient would be dropped): call the public op it serves, or call it under "
                               "torch.no_grad()")
        return body(*args, **kwargs)

    lib.impl(name, kernel, "CompositeExplicitAutograd")
    op = getattr(getattr(torch.ops, OP_NAMESPACE), name).default
    torch.library.register_fake(op, fake, lib=lib)
    return op


def register_autograd(op, backward, setup_context=None) -> None:
    """``torch.library.register_autograd(op, ...)``; an opaque op's (``_plain_op``) in the Library
    that defines it, so that a reload of its module, which drops that Library, drops the autograd
    with it (registered apart, it outlived the op and a second registration was refused)."""
    namespace, _, name = op.name().partition("::") if isinstance(op, torch._ops.OpOverload) else ("", "", "")
    lib = _OPAQUE_LIBRARIES.get(name) if namespace == OP_NAMESPACE else None
    torch.library.register_autograd(op, backward, setup_context=setup_context, lib=lib)


def no_double_backward(public: str, instead: str = "torch.func, e.g. torch.func.hessian(f)(x) or "
                                                  "torch.func.jacrev(torch.func.jacrev(f))") -> RuntimeError:
    """The error every op without a second derivative raises, naming where to get one (``instead``)."""
    return RuntimeError(f"{public}: double backward (a second backward through a gradient taken with "
                        "create_graph=True) is not supported by its Triton backward (no double backward); for "
                        f"second derivatives use {instead}")


def refuse_second_derivative(op, public: str) -> None:
    """A backward op's own backward, which says so: differentiating ``public``'s gradient (a
    backward with create_graph=True, then another) is not what its Triton backward does. Without
    it torch would tell the user to register a formula, which only this library can."""
    def second(ctx, *grads):  # noqa: ARG001 - autograd's signature
        raise no_double_backward(public)

    register_autograd(op, second)


# -- Autograd: one Function for every op, configured per op ------------------------------------
@dataclass(frozen=True, slots=True)
class AutogradSpec:
    """One op's autograd, which the one Function (``KernelFunction``) runs. Fields:

    name: the public op, for errors.
    forward(*args): the op's eager call; run with grad off on plain tensors (so its kept launch).
    setup(ctx, args, output): saves what backward and jvp read (``ctx.save_for_backward``,
        ``ctx.save_for_forward``; options as ctx attributes).
    backward(ctx, *grads): a gradient (or None) per arg. Where it launches itself it takes its
        backward op under ``backward_through_op`` and torch's ops under ``transformed``.
    non_differentiable: indices of outputs autograd leaves alone (a log-sum-exp, say).
    jvp(ctx, *tangents): the outputs' tangents (forward mode, torch.func.jvp / jacfwd).
    vmap(info, in_dims, *args): (outputs, out_dims): torch.func.vmap's rule.
    reference(*args): forward in torch's ops, for two open forward-mode levels (``nested_tangents``);
        None: the jvp there too.
    An op without jvp or vmap refuses those transforms, naming itself.

    An op's wrapper calls ``spec.run(*args)`` where autograd records an eager call
    (``eager_autograd``), and its custom op otherwise (``needs_op``).
    """

    name: str
    forward: Callable
    setup: Callable
    backward: Callable
    non_differentiable: tuple[int, ...] = ()
    jvp: Callable | None = None
    vmap: Callable | None = None
    reference: Callable | None = None

    def run(self, *args):
        """The op's call that autograd records on plain tensors: by the C apply (``eager_apply``),
        or where it carries a tangent or a transform's wrapper, by ``apply_transforms``."""
        if transformed(*args):
            return apply_transforms(self, *args)
        return eager_apply(KernelFunction, self, *args)

    def apply(self, *args):
        """``KernelFunction.apply`` for this op (torch's apply: what a vmap rule calls again)."""
        return KernelFunction.apply(self, *args)


class KernelFunction(torch.autograd.Function):
    """The autograd Function of every op, ``KernelFunction.apply(spec, *args)``: it runs what the
    op's ``AutogradSpec`` says. In torch.func's form (``setup_context``), so grad, vjp, jacrev,
    jvp, jacfwd and vmap take it; torch.compile never traces it (``apply_transforms``)."""

    @staticmethod
    def forward(spec, *args):
        return spec.forward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec = ctx.spec = inputs[0]
        spec.setup(ctx, inputs[1:], output)
        if spec.non_differentiable:
            ctx.mark_non_differentiable(*(output[i] for i in spec.non_differentiable))

    @staticmethod
    def backward(ctx, *grads):
        return None, *ctx.spec.backward(ctx, *grads)

    @staticmethod
    def jvp(ctx, _, *tangents):
        if ctx.spec.jvp is None:
            raise NotImplementedError(f"{ctx.spec.name}: forward-mode AD (jvp) is not supported")
        return ctx.spec.jvp(ctx, *tangents)

    @staticmethod
    def vmap(info, in_dims, spec, *args):
        if spec.vmap is None:
            raise NotImplementedError(f"{spec.name}: torch.func.vmap is not supported")
        return spec.vmap(info, in_dims[1:], *args)


# The C half of torch.autograd.Function.apply: the Python half binds the arguments to forward's
# signature, which costs more than the rest of an apply (design notes: C apply).
_C_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")


def eager_apply(function, *args):
    """``function.apply(*args)`` where no torch.func transform is active (``eager_autograd``): the
    C apply, each tensor argument unwrapped if it is a dead transform's wrapper as Python's apply
    does. Where a transform is active, or torch has no such C apply, ``function.apply``."""
    if _C_APPLY is None or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    unwrap = torch._C._functorch.unwrap_if_dead
    return _C_APPLY.__get__(None, function)(*[unwrap(a) if isinstance(a, torch.Tensor) else a for a in args])


def apply_transforms(function, *args):
    """``function.apply(*args)`` for a call that carries a tangent or a transform's wrapper
    (``transformed``); ``function`` an ``AutogradSpec`` (or a Function in torch.func's form with
    a ``reference``). In a trace by torch.compile (a dual level open) it runs outside the trace,
    where the jvp carries the tangent that the traced op would drop; with two forward-mode levels
    open, torch's ops (``function.reference``, see ``nested_tangents``)."""
    if torch.compiler.is_compiling():
        return _untraced(apply_transforms, function, *args)
    if function.reference is not None and nested_tangents():
        return function.reference(*args)
    return function.apply(*args)


@torch.compiler.disable
def _untraced(fn, *args):
    return fn(*args)


def backward_through_op(grad: torch.Tensor) -> bool:
    """Whether an eager Function's backward must call its backward op instead of launching: when
    it records a graph (create_graph), is traced, or gets a gradient that holds no plain storage
    (a batch of gradients from ``is_grads_batched`` or a vectorised jacobian: functorch's
    wrappers, which the op's batching rule serves)."""
    return (torch.is_grad_enabled() or torch.compiler.is_compiling() or type(grad) not in PLAIN_TENSORS
            or torch._C._functorch.is_legacy_batchedtensor(grad)
            or torch._C._functorch.is_functorch_wrapped_tensor(grad))


def softmax_tangent(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """y * (t - rowsum(y * t)): softmax's Jacobian (symmetric) applied to t, for y = softmax(x)
    over the last dimension. The tangent of y for a tangent t of x, and the gradient of x for a
    gradient t of y. In torch's ops, so that the transforms see through it (a batch of tangents, a
    reverse pass over it, a tangent of a gradient); the forward-mode and torch.func paths use it,
    where the kernels' speed matters less than their reach. In float64 whatever the dtype: t -
    rowsum(y * t) cancels, and in float32 that cancellation alone cost softmax(x @ W)'s tangent
    up to 3x PyTorch's own error (tests/test_transforms.py)."""
    yf, tf = y.double(), t.double()
    return (yf * (tf - (yf * tf).sum(-1, keepdim=True))).to(y.dtype)


def batch_first(t: torch.Tensor, dim: int | None, size: int | None = None) -> torch.Tensor:
    """A vmap rule's operand with its batch dimension (dim, None where unbatched) first: for a
    softmax over the last dimension, rows like any others. With ``size``, an unbatched operand
    is repeated (a view) along a new first dimension of that size."""
    if dim is None:
        return t if size is None else t.expand(size, *t.shape)
    return t.movedim(dim, 0)


# -- Launching: grids, and the kernel as launched ----------------------------------------------
# CUDA's limit on grid axis 0. Every kernel here loops over its work items with a stride of the
# grid, so a grid capped at this limit still covers any number of rows or tiles.
GRID_0_LIMIT = 2**31 - 1


def one_axis_grid(programs: int, what: str) -> tuple[int]:
    """The grid of a kernel that needs one program per work item (axes 1 and 2 take only 65535):
    KernelCapacityError, naming ``what`` needs them, past CUDA's limit on axis 0."""
    if programs > GRID_0_LIMIT:
        raise KernelCapacityError(f"{what} would need {programs} programs, past CUDA's grid limit of {GRID_0_LIMIT}")
    return (programs,)


# Integer forms of triton.cdiv and triton.next_power_of_2 for host code: those are constexpr
# functions, about 2 us a call, and a wrapper's launch choice calls several.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for 0, as triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def jit_kernel(kernel, traced: bool):
    """The kernel as launched: seen by torch.compile inside an op body, called directly otherwise.

    ``wrap_triton`` is what lets a triton_op's trace see the launch; outside a trace it only adds
    host time, and the interpreter's kernels are not JIT functions it accepts. A compiled eager
    launch goes through the kernel's ``DirectLauncher``.
    """
    if INTERPRET:
        quiet = _QUIET.get(kernel)
        if quiet is None:
            quiet = _QUIET[kernel] = QuietInterpreted(kernel)
        return quiet
    if traced:
        return torch.library.wrap_triton(kernel)
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = DirectLauncher(kernel) if direct_launches_supported() else kernel
    return launcher


# The direct launch calls Triton's private launch internals (the compiled kernel's launcher, and
# its C function), whose arguments change between versions: it runs on the version it was
# measured on; any other launches by ``kernel[grid](...)``, Triton's public path.
DIRECT_LAUNCH_TRITON = "3.6."


def direct_launches_supported() -> bool:
    """Whether this Triton is the one the direct launch was written and measured for."""
    return triton.__version__.startswith(DIRECT_LAUNCH_TRITON)


_LAUNCHERS: dict = {}


_QUIET: dict = {}


class QuietInterpreted:
    """An interpreted kernel, launched with numpy's floating-point warnings off. The interpreter
    computes every lane with numpy, masked ones too: a tile of only -inf gives -inf - -inf and
    0 / 0 there, values the kernels discard by design. A user's ``-W error::RuntimeWarning``
    would otherwise turn an ordinary call into an error."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            import numpy as np

            with np.errstate(all="ignore"):
                return launch(*args, **kwargs)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def launch_kept(kernel, grid, args: tuple, options: dict, n_tensors: int, descriptors: tuple = (),
                keep: bool = True) -> Replay | DescriptorReplay | None:
    """``kernel[grid](*args, **options)``, then, with ``keep``, the launch kept: its ``Replay``
    (``DirectLauncher.replay``) of the first ``n_tensors`` arguments, a ``DescriptorReplay`` where
    they start with TMA ``descriptors``. None without ``keep``, where the kernel is not a
    DirectLauncher, or where its launch cannot be kept."""
    kernel[grid](*args, **options)
    if not keep or not isinstance(kernel, DirectLauncher):
        return None
    replay = kernel.replay(grid, args, options, n_tensors)
    return DescriptorReplay(replay, descriptors) if replay is not None and descriptors else replay


def launch_and_keep(kernel, grid, args: tuple, options: dict, keep=None, n_tensors: int = 0) -> None:
    """``launch_kept``, with ``keep(replay)`` where ``keep`` is given and the launch was kept."""
    replay = launch_kept(kernel, grid, args, options, n_tensors, keep=keep is not None)
    if replay is not None:
        keep(replay)


def _launch_hooks() -> bool:
    """Whether Triton's launch hooks are set (a profiler's): a plain function or a non-empty chain."""
    runtime = triton.knobs.runtime
    return any(hook is not None and getattr(hook, "calls", True) for hook in
               (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _arg_classes(args: tuple) -> tuple:
    """What Triton specialises each kernel argument on: a tensor's dtype and 16-byte alignment; an
    int's being 1 (a constant), a multiple of 16, and its width (i32, i64, u64); a float's or a
    bool's type; a host-side tensor descriptor's type, block, layout and padding, and the classes
    of its base, sizes and strides (more than Triton keys on: never less). Anything else stands
    for itself. Equal classes run the same compiled kernel. One loop over the arguments, its
    branches inline: a function call each would double a launch key's host time (design notes:
    direct launch)."""
    classes = []
    add = classes.append
    for a in args:
        kind = type(a)
        if kind is int:
            add((a == 1, a & 15 == 0, -0x80000000 <= a < 0x80000000, a < 0x8000000000000000))
        elif isinstance(a, torch.Tensor):
            add((a.dtype, a.data_ptr() & 15 == 0))
        elif kind is float or kind is bool:
            add(kind)
        elif hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor):
            add((kind, _arg_class(a.base), tuple(a.block_shape), getattr(a, "layout", None),
                 getattr(a, "padding", None), _arg_classes(a.shape), _arg_classes(a.strides)))
        else:
            add(a)
    return tuple(classes)


def _arg_class(a):
    """One argument's class (``_arg_classes``)."""
    return _arg_classes((a,))[0]


class DirectLauncher:
    """``launcher[grid](*args, **constexprs)`` as ``kernel[grid](...)``, with less host time.

    Triton's own launch re-derives, on every call, what the compiled kernel is specialised on,
    looks it up and wraps the launch in hooks and checks, several times the host time of calling
    the compiled kernel's launcher (see outputs/README.md, design notes: direct launch). Here the
    first call of each argument
    class (``_arg_class``: what Triton specialises on) goes through Triton, which compiles and
    returns the kernel; later calls of that class launch it directly on torch's current stream.
    Launch hooks (profilers), pre-run hooks, grids given as functions and constexprs passed by
    position take Triton's path, and so does every call if a direct launch is ever refused (a
    launcher signature of another Triton version).
    """

    __slots__ = ("kernel", "names", "defaults", "first_constexpr", "compiled", "usable")

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}
        # Another Triton: every launch is Triton's own (``direct_launches_supported``).
        self.usable = direct_launches_supported()
        params = getattr(kernel, "params", ()) if self.usable else ()
        self.names = tuple(p.name for p in params)
        self.defaults = {p.name: p.default for p in params if p.has_default}
        # Constexprs are keyed by value, by keyword only: positional arguments are keyed by class.
        self.first_constexpr = min((i for i, p in enumerate(params) if p.is_constexpr), default=len(self.names))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def direct(self, grid, args) -> bool:
        """Whether this call may skip Triton's launch: ones that cannot are launched by Triton."""
        return not (not self.usable or type(grid) is not tuple or len(args) > self.first_constexpr
                    or getattr(self.kernel, "pre_run_hooks", None) or _launch_hooks())

    def key(self, device, args, kwargs):
        # A keyword's type too: 1, 1.0 and True are equal keys but not equal constexprs.
        return device, _arg_classes(args), tuple((k, type(v), v) for k, v in kwargs.items())

    def launch(self, grid, args, kwargs):
        if not self.direct(grid, args):
            return self.kernel[grid](*args, **kwargs)
        device = torch._C._cuda_getDevice()
        try:
            key = self.key(device, args, kwargs)
            entry = self.compiled.get(key)
        except TypeError:  # an unhashable argument: nothing to key on
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            # Tensors by keyword are not in the key; a cache hook may return no kernel.
            if compiled is not None and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                self.compiled[key] = (compiled, tuple(kwargs[n] if n in kwargs else self.defaults[n]
                                                      for n in self.names[len(args):]), _launch_entry(compiled))
            return compiled
        compiled, rest, how = entry
        try:
            how.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                    torch._C._cuda_getCurrentRawStream(device), compiled.function, *how.head, *args, *rest)
        except TypeError:  # a launcher of another signature: it parses its arguments before launching
            self.usable = False
            return self.kernel[grid](*args, **kwargs)
        return compiled

    def replay(self, grid, args, kwargs, n_tensors: int) -> Replay | None:
        """The launch just made with these arguments, kept for a wrapper's own cache: later calls
        pass only the first ``n_tensors`` arguments (tensors of the same classes), the rest fixed.
        None where this call could not launch directly (``direct``) or left no compiled kernel of
        its class; a launch Triton made (the one that compiled) is kept too."""
        if not self.direct(grid, args):
            return None
        device = torch._C._cuda_getDevice()
        try:
            entry = self.compiled.get(self.key(device, args, kwargs))
        except TypeError:
            return None
        if entry is None:
            return None
        compiled, rest, _ = entry
        dims = tuple(grid) + (1,) * (3 - len(grid))
        return Replay(self, compiled, dims, device, tuple(args[n_tensors:]) + rest,
                      all_tensors=all(isinstance(a, torch.Tensor) for a in args[:n_tensors]))


class LaunchEntry(NamedTuple):
    """How a direct launch calls a compiled kernel (``_launch_entry``)."""

    run: object  # the function called: _c_launch's C function where it applies, else the compiled launcher
    head: tuple  # what it takes between the kernel's function and the kernel's arguments
    direct: bool  # whether ``run`` is the C function (which takes tensors' addresses)


def _launch_entry(compiled) -> LaunchEntry:
    """The ``LaunchEntry`` of a compiled kernel: the packed metadata, with no launch metadata and
    no hooks (``Replay.ready``), after whatever the C function takes first."""
    tail = (compiled.packed_metadata, None, None, None)
    direct = _c_launch(compiled.run)
    return LaunchEntry(compiled.run, tail, False) if direct is None else LaunchEntry(direct[0], direct[1] + tail, True)


def _c_launch(run):
    """A compiled kernel's launcher (``CompiledKernel.run``) as its C function and the arguments
    that function takes before the kernel's metadata: where that is known to be what the Python
    launcher calls, triton 3.6's CUDA launcher, and the kernel asks for no scratch memory (all
    the Python layer adds then is a frame and two tests). None elsewhere (another Triton, a kernel
    with tensor descriptors, whose C function is wrapped): the launcher is called as it is.

    Called so, a kept launch may pass its tensors' addresses: given a tensor, the C function calls
    its ``data_ptr`` and asks the driver whether the address is a device's
    (cuPointerGetAttribute), once a pointer a launch. A kept launch's tensors are CUDA tensors on
    the device it was kept for, which its key (``replay_key``) holds."""
    launch = getattr(run, "launch", None)
    if (not direct_launches_supported() or type(run).__name__ != "CudaLauncher"
            or not isinstance(launch, types.BuiltinFunctionType)
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)):
        return None
    return launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)


# -- Kept launches: one cache, a namespace per op ----------------------------------------------
class Replay:
    """One compiled launch with everything but its leading tensors fixed (``DirectLauncher.replay``).

    A wrapper keys these on all that decides its launch (shapes, strides, dtypes, alignment,
    device, options) and, on a hit, skips its checks and launch choice: the per-call host work
    left is the key, the output's allocation and the launch itself. Calling it returns False,
    launching nothing, when a direct launch is no longer allowed (launch hooks or pre-run hooks
    were set since, or the compiled launcher refused its arguments), and the wrapper takes its
    checked path.
    """

    __slots__ = ("launcher", "run", "head", "pointers", "function", "grid", "device", "fixed")

    def __init__(self, launcher, compiled, grid, device, fixed, all_tensors: bool = False):
        self.launcher, self.grid, self.device, self.fixed = launcher, grid, device, fixed
        self.function = compiled.function
        how = _launch_entry(compiled)
        self.run, self.head = how.run, how.head
        # ``all_tensors``: the leading arguments are all tensors, whose addresses the C function can take.
        self.pointers = all_tensors and how.direct

    def __call__(self, *tensors) -> bool:
        return self.ready() and self.launch(*tensors)

    def ready(self) -> bool:
        """Whether a direct launch is still allowed (no launch or pre-run hook set since, the
        launcher not refused)."""
        launcher = self.launcher
        return launcher.usable and not _launch_hooks() and not getattr(launcher.kernel, "pre_run_hooks", None)

    def launch(self, *tensors) -> bool:
        """The launch, once ``ready``; False (nothing launched) if the launcher refuses it."""
        g0, g1, g2 = self.grid
        if self.pointers:
            tensors = [t.data_ptr() for t in tensors]
        try:
            self.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(self.device), self.function, *self.head,
                     *tensors, *self.fixed)
        except TypeError:  # a launcher of another signature (see DirectLauncher.launch): nothing launched
            self.launcher.usable = False
            return False
        return True


class DescriptorReplay:
    """A ``Replay`` whose first arguments are host-side TMA tensor descriptors (Gluon kernels),
    called with the tensors those descriptors read, then the replay's own leading tensors.

    A descriptor's class checks its tensor on construction (some us each). Here each call makes
    its descriptors from the ones of the call that was kept, with only the tensor replaced: the
    wrapper's ``replay_key`` already holds each tensor's shape, strides, dtype and alignment,
    all that those checks read. Launching one still encodes its tensor map (in Triton's launcher).
    """

    __slots__ = ("replay", "kind", "fields")

    def __init__(self, replay: Replay, descriptors: tuple):
        self.replay, self.kind = replay, type(descriptors[0])
        self.fields = tuple({k: v for k, v in vars(d).items() if k != "base"} for d in descriptors)

    def __call__(self, *tensors) -> bool:
        return self.ready() and self.launch(*tensors)

    def ready(self) -> bool:
        return self.replay.ready()

    def launch(self, *tensors) -> bool:
        n = len(self.fields)
        descriptors = []
        for base, fields in zip(tensors[:n], self.fields):
            descriptor = object.__new__(self.kind)  # skips the class's checks: see above
            vars(descriptor).update(fields, base=base)
            descriptors.append(descriptor)
        return self.replay.launch(*descriptors, *tensors[n:])


class ReplayChain:
    """Kept launches replayed in order, over the call's tensors and the buffers each call makes.

    ``buffers``: functions of the call's tensors, each returning one buffer (a fresh workspace,
    or a cached counter buffer where the call may use one); ``steps``: (Replay or ReplayChain,
    the indices of its tensors among the call's tensors followed by the buffers). Calling it returns False when
    any step is not ``ready`` (nothing launched), or when a launcher refuses its step: the
    wrapper's checked path then computes the whole result again (every step writes only the
    call's own output and buffers, and leaves counters as it found them).
    """

    __slots__ = ("buffers", "steps")

    def __init__(self, buffers: tuple, steps: tuple):
        self.buffers, self.steps = buffers, steps

    def __call__(self, *tensors) -> bool:
        return self.ready() and self.launch(*tensors)

    def ready(self) -> bool:
        """Whether every step may launch (``Replay.ready``); a chain may itself be a step."""
        return all(replay.ready() for replay, _ in self.steps)

    def launch(self, *tensors) -> bool:
        """The steps in order, once ``ready``; False where a launcher refused one."""
        slots = tensors + tuple(make(*tensors) for make in self.buffers)
        return all(replay.launch(*[slots[i] for i in indices]) for replay, indices in self.steps)


def replay_key(tensors: tuple, options: tuple):
    """The key a wrapper's replays are kept under for its input ``tensors``: all that decides its
    launch (each one's shape, strides, dtype, device and 16-byte alignment; the current CUDA
    device) and the call's ``options``, each keyed by ``option_key``. None where no replay may
    serve the call: interpreter mode, a trace by torch.compile (checked first: the trace must not
    reach the keys), anything but plain CUDA tensors (or parameters), or a tensor autograd must
    record."""
    if INTERPRET or torch.compiler.is_compiling():
        return None
    # Each step below is some 0.1 us of a call that may take 15 in all: plain options are keyed
    # inline, and ``transformed`` is called only where a transform or a dual level is active.
    options = tuple((type(v), v) if v is None or type(v) in _PLAIN_OPTIONS else option_key(v) for v in options)
    try:
        hash(options)
    except TypeError:  # an option nothing can be kept under (the checks name a wrong one)
        return None
    if (torch._C._are_functorch_transforms_active() or _dual_level_open()) and transformed(*tensors):
        return None  # a tangent or a transform's wrapper: the launch alone would drop it
    key = [options]
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) not in PLAIN_TENSORS or not t.is_cuda or (grad and t.requires_grad):
            return None
        try:
            key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
        except RuntimeError:  # a layout without strides (sparse): the checks name it
            return None
    key.append(torch._C._cuda_getDevice())  # the kept launch's stream is this device's
    return tuple(key)


_PLAIN_OPTIONS = frozenset((int, float, bool, str))


def option_key(value):
    """An option as a key part that tells apart what the checks tell apart: a value with its type
    (1, 1.0 and True are equal and hash alike), a tuple (a window) item by item, a dataclass (a launch
    override) field by field."""
    if value is None or type(value) in _PLAIN_OPTIONS:  # most calls' options: skips is_dataclass's ~0.6 us
        return type(value), value
    if type(value) is tuple:
        return tuple, tuple(map(option_key, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), tuple(option_key(getattr(value, f.name)) for f in dataclasses.fields(value))
    return type(value), value


# Launches kept before the store is emptied: bounds a process that meets ever new shapes; a
# model's steps meet a few dozen keys.
KEPT_LAUNCH_LIMIT = 16384
# The one store of kept launches: op name -> its shelf (a ``Replays``), each by ``replay_key``.
KEPT_LAUNCHES: dict = {}


class Replays(dict):
    """Op ``name``'s shelf in the one store of kept launches (``KEPT_LAUNCHES``): a dict by
    ``replay_key``, so a call's lookup stays one dict lookup. ``Replays(name)`` gives the same
    shelf every time. One size policy for all shelves (``KEPT_LAUNCH_LIMIT``), one place to
    empty them (``forget_kept_launches``)."""

    def __new__(cls, name: str):
        shelf = KEPT_LAUNCHES.get(name)
        if shelf is None:
            shelf = KEPT_LAUNCHES[name] = super().__new__(cls)
        return shelf

    def __init__(self, name: str):  # noqa: ARG002 - the shelf is kept, not emptied
        pass

    def keeper(self, key):
        """A function that keeps its one argument, a Replay or ReplayChain, under ``key``."""
        def keep(replay):
            if sum(map(len, KEPT_LAUNCHES.values())) >= KEPT_LAUNCH_LIMIT:
                forget_kept_launches()
            self[key] = replay
        return keep


def forget_kept_launches() -> None:
    """Empty every op's shelf of kept launches: the next call of each key chooses afresh."""
    for shelf in KEPT_LAUNCHES.values():
        shelf.clear()


def empty_like_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uninitialised tensor of t's shape, dtype and device: torch.empty_like, which
    every call of every op pays, costs a fraction of torch.empty(shape, ...) (design notes: empty_like)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# -- Device resources: occupancy, workspaces, vectorised strides -------------------------------
@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _device_index(t: torch.Tensor) -> int:
    return -1 if t.device.type != "cuda" else (t.device.index if t.device.index is not None else 0)


def kernel_registers(compiled) -> int:
    """Registers a thread of a compiled kernel."""
    if getattr(compiled, "n_regs", None) is None:
        compiled._init_handles()  # triton 3.6 loads the binary (and learns n_regs) lazily
    return compiled.n_regs


def launch_options(warps: int, maxnreg: int | None) -> dict:
    """A launch's num_warps, and its register cap where it has one."""
    return dict(num_warps=warps) if maxnreg is None else dict(num_warps=warps, maxnreg=maxnreg)


def resident_programs(compiled, num_warps: int, props) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers, shared memory, threads)."""
    threads = num_warps * 32
    # Registers go to warps in units of 256 (CUDA's occupancy calculator): 50 a thread hold 56.
    warp_regs = cdiv(max(1, kernel_registers(compiled)) * 32, 256) * 256
    by_regs = props.regs_per_multiprocessor // warp_regs // num_warps
    shared = compiled.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else by_regs
    by_threads = props.max_threads_per_multi_processor // threads
    return max(0, min(by_regs, by_smem, by_threads))


def fresh_counters(t: torch.Tensor) -> bool:
    """Whether a kernel's zeroed counters (and any workspace cached beside them) must be made
    for this call, not taken from a cache: torch.compile is tracing (t is fake: a cached buffer
    would enter the graph as a constant the kernel mutates), a CUDA graph is being captured (the
    zero fill then becomes part of the graph, which replays it), or an opaque op's body runs
    (``no_cached_buffers``)."""
    return is_fake(t) or buffers_per_call(t)


def buffers_per_call(t: torch.Tensor) -> bool:
    """``fresh_counters`` for a tensor known not to be fake: inside ``no_cached_buffers``, or
    while a CUDA graph is being captured."""
    return _NO_CACHED_BUFFERS.depth > 0 or (t.is_cuda and torch.cuda.is_current_stream_capturing())


class _Depth(threading.local):
    depth = 0


_NO_CACHED_BUFFERS = _Depth()


@contextlib.contextmanager
def no_cached_buffers():
    """Inside: counters and workspaces are made per call. For the body of an op that
    torch.compile calls as one opaque unit: under mode="reduce-overhead" its first runs allocate
    from the CUDA graph's memory pool, which refuses to be captured while a buffer made there
    outlives the call."""
    _NO_CACHED_BUFFERS.depth += 1
    try:
        yield
    finally:
        _NO_CACHED_BUFFERS.depth -= 1


def vector_align(strides, itemsize: int) -> int:
    """The largest power of two of elements, up to 16 bytes, that divides every stride; 1 where
    Triton knows as much already (every stride a multiple of 16 elements: what it specialises
    on, so the compiled kernel stays the one it always was) or where any stride is 2^31 or more
    (passed as a 64-bit int; divided, it would come as a 32-bit one and overflow when the
    kernel multiplies it back)."""
    if any(v >= 2**31 for v in strides) or not any(v % 16 for v in strides):
        return 1
    align = 16 // itemsize
    while align > 1 and any(v % align for v in strides):
        align //= 2
    return align


def vector_strides(t: torch.Tensor, dims: tuple[int, ...] = (0, 1)) -> tuple[tuple[int, ...], int]:
    """t's strides with those of ``dims`` divided by ``align`` (``vector_align`` of them), and
    ``align``: for a kernel that multiplies them back by ``align`` as a constant. Compiled,
    Triton only knows whether an int argument divides by 16; a row stride such as 1000 would
    read as unaligned, and every row be loaded one element at a time and staged without
    asynchronous copies (design notes: vector strides)."""
    strides = tuple(t.stride())  # symbolic under torch.compile: no int(), which would pin the shape
    align = vector_align([strides[d] for d in dims], t.element_size())
    return tuple(v // align if d in dims else v for d, v in enumerate(strides)), align


# ----------------------------------------------------------------------------------------------
# Softmax over rows: what the online and the row kernels share
# ----------------------------------------------------------------------------------------------


def softmax_spec(name: str, softmax, backward) -> AutogradSpec:
    """The ``AutogradSpec`` of a public softmax over the last dimension, ``softmax(x, *options)``:
    its forward and its vmap (the batch as more rows) are that call, ``backward(ctx, dy)`` its
    gradient (``softmax_backward``); its jvp and reference are softmax's own, in torch's ops."""
    def vmap(info, in_dims, x, *options):  # noqa: ARG001 - torch.func's signature
        return softmax(batch_first(x, in_dims[0]), *options), 0

    return AutogradSpec(name, forward=softmax, setup=_save_softmax_output, backward=backward, jvp=_softmax_jvp,
                        vmap=vmap, reference=_torch_softmax)


def _save_softmax_output(ctx, inputs, output):
    """A softmax spec's setup: y for the backward (and for the jvp where a tangent may come), the
    options for the backward. Inline: every eager call that autograd records runs it."""
    ctx.save_for_backward(output)
    ctx.blocks = inputs[1:]
    if torch._C._are_functorch_transforms_active() or getattr(forward_ad, "_current_level", 0) >= 0:
        ctx.save_for_forward(output)


def _softmax_jvp(ctx, dx, *_):
    return softmax_tangent(ctx.saved_tensors[0], dx)


def _torch_softmax(x, *options):  # noqa: ARG001 - a spec's reference takes the op's arguments
    return torch.softmax(x, dim=-1)


def softmax_backward(y, dy, options: tuple, backward_op, launch, replays: Replays) -> torch.Tensor:
    """dx for y = softmax(x) and its gradient dy (one shape), as an eager softmax's autograd
    computes it: torch's ops for a transform's gradient or one with a tangent (``softmax_tangent``);
    ``backward_op(y, dy, *options)`` where a graph is recorded, in a trace or for a batch of
    gradients (``backward_through_op``: differentiable again); else the launch kept in
    ``replays``, or ``launch(y, dy, *options, traced=False, keep=...)``. No input checks:
    autograd hands dy in y's shape, dtype and device."""
    if transformed(y, dy):
        return softmax_tangent(y, dy)
    if backward_through_op(dy):
        return backward_op(y, dy, *options)
    return _eager_backward(replays, y, dy, options, lambda keep: launch(y, dy, *options, traced=False, keep=keep))


def _softmax_double_backward(y, dy, ddx, backward):
    """Gradients of dx = y * (dy - sum(y * dy)) (the softmax backward) given ddx, the gradient of dx.

    dx is linear in dy with softmax's symmetric Jacobian, so d/d(dy) is the same backward
    applied to ddx (``backward``, the Triton op, differentiable in turn); d/dy is
    ddx * (dy - sum(y * dy)) - dy * sum(y * ddx), in float32 whatever the dtype.
    """
    # The op would drop a tangent of ddx (a dual gradient of the gradient): torch's ops then.
    grad_dy = softmax_tangent(y, ddx) if transformed(y, ddx) else backward(y, ddx)
    yf, dyf, ddxf = y.float(), dy.float(), ddx.float()
    grad_y = ddxf * (dyf - (yf * dyf).sum(-1, keepdim=True)) - dyf * (yf * ddxf).sum(-1, keepdim=True)
    return grad_y.to(y.dtype), grad_dy


def _save_output_and_blocks(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.blocks = tuple(inputs[1:])


def _save_backward_inputs(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.blocks = tuple(inputs[2:])


def _kept_softmax(replays: Replays, key, *inputs: torch.Tensor) -> torch.Tensor | None:
    """The softmax of x (or with inputs (y, dy) its gradient) by the launch kept in ``replays``
    under ``key`` (``replay_key``; None: no key), into a new contiguous output of the first
    input's shape; None where none is kept or it cannot launch (the caller then takes its checked
    path)."""
    replay = None if key is None else replays.get(key)
    if replay is None:
        return None
    out = empty_like_contiguous(inputs[0])
    return out if replay(*inputs, out) else None


def _eager_backward(replays: Replays, y: torch.Tensor, dy: torch.Tensor, options: tuple, launch):
    """dx of an eager softmax backward (``backward_through_op`` False): the launch kept in
    ``replays`` for (y, dy)'s key (``replay_key`` of them and ``options``), else ``launch(keep)``,
    which computes dx and hands ``keep`` its launch as a Replay of (y, dy, dx). Kept, a training
    step's backward skips the launch choice and Triton's argument keys (a few us of host time)."""
    key = replay_key((y, dy), options)
    dx = _kept_softmax(replays, key, y, dy)
    if dx is not None:
        return dx
    return launch(None if key is None else replays.keeper(key))


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """(batch, d1, d2) view of x: leading dimensions folded into batch; 1-D and 2-D get batch 1."""
    if x.dim() == 1:
        return x.reshape(1, 1, x.shape[0])
    return x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])


# ----------------------------------------------------------------------------------------------
# Online softmax: BLOCK_1 rows x BLOCK_2 columns per step, any row length
# ----------------------------------------------------------------------------------------------


def online_softmax_tiles(n_cols: int, BLOCK_2: int | None = None) -> tuple[int, int]:
    """Tiles for ``online_softmax`` on rows of n_cols: about 4096 elements per step.

    Wide steps along the row keep loads long and contiguous; short rows take several rows per
    step instead, so each program still moves enough bytes to hide memory latency.
    """
    block_2 = BLOCK_2 or min(next_power_of_2(n_cols), 4096)
    return max(1, 4096 // block_2), block_2


def check_tiles(BLOCK_1, BLOCK_2) -> None:
    """online_softmax's tiles: powers of two, BLOCK_2 up to 4096, and a tile Triton can hold."""
    check_block("BLOCK_1", BLOCK_1, 1)
    check_block("BLOCK_2", BLOCK_2, 1, 4096)
    if BLOCK_1 * BLOCK_2 > tl.TRITON_MAX_TENSOR_NUMEL:
        raise ValueError(f"BLOCK_1 * BLOCK_2 must be at most {tl.TRITON_MAX_TENSOR_NUMEL} elements (Triton's largest "
                         f"block), got {BLOCK_1} * {BLOCK_2} = {BLOCK_1 * BLOCK_2}")


@triton.jit
def _row_tile(t, n_row_tiles, d1, BLOCK_1: tl.constexpr):
    """Tile t of the online kernels: its batch element, its rows (a column, int64 for the
    offsets) and which of them exist."""
    batch = (t // n_row_tiles).to(tl.int64)
    rows = (t % n_row_tiles) * BLOCK_1 + tl.arange(0, BLOCK_1)
    return batch, rows[:, None].to(tl.int64), rows < d1


@triton.jit
def online_softmax_kernel(
    x_ptr, y_ptr,
    d1, d2, n_row_tiles, n_tiles,
    stride_xb, stride_x1, stride_x2,
    stride_yb, stride_y1, stride_y2,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr,
):
    """Softmax over d2 for BLOCK_1-row tiles; tile t is rows (t % n_row_tiles) of batch element t // n_row_tiles.

    The batch is folded into grid axis 0 (axis 1 stops at 65535), and each program takes tiles
    pid, pid + grid, ... so a grid capped at CUDA's limit covers any number of tiles.
    """
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        batch, rows, row_ok = _row_tile(t, n_row_tiles, d1, BLOCK_1)
        x_rows = x_ptr + batch * stride_xb + rows * stride_x1
        y_rows = y_ptr + batch * stride_yb + rows * stride_y1

        # Pass 1: running max m and running sum l of exp(x - m), rescaled when m grows.
        m = tl.full((BLOCK_1,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_1,), tl.float32)
        for start in range(0, d2, BLOCK_2):
            cols = start + tl.arange(0, BLOCK_2)
            mask = row_ok[:, None] & (cols[None, :] < d2)
            x = tl.load(x_rows + cols[None, :] * stride_x2, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # A -inf logit weighs 0 whatever the max, also while a row has seen only -inf (then
            # exp(-inf - -inf) would be NaN, in this tile or in the rescale). NaN and +inf logits
            # still reach l as NaN, so their row comes out NaN, as torch's does.
            alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_new))
            p = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new[:, None]))
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new

        # Pass 2: normalise. A row of only -inf keeps m = -inf and l = 0: exp(x - m) is NaN, torch's answer.
        inv_l = 1.0 / l
        for start in range(0, d2, BLOCK_2):
            cols = start + tl.arange(0, BLOCK_2)
            mask = row_ok[:, None] & (cols[None, :] < d2)
            x = tl.load(x_rows + cols[None, :] * stride_x2, mask=mask, other=float("-inf")).to(tl.float32)
            y = tl.exp(x - m[:, None]) * inv_l[:, None]
            tl.store(y_rows + cols[None, :] * stride_y2, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def online_softmax_backward_kernel(
    y_ptr, dy_ptr, dx_ptr,
    d1, d2, n_row_tiles, n_tiles,
    stride_yb, stride_y1, stride_y2,
    stride_gb, stride_g1, stride_g2,
    stride_db, stride_d1, stride_d2,
    BLOCK_1: tl.constexpr, BLOCK_2: tl.constexpr,
):
    """dx = y * (dy - sum(dy * y)) per row, over the same tiles as the forward."""
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        batch, rows, row_ok = _row_tile(t, n_row_tiles, d1, BLOCK_1)
        y_rows = y_ptr + batch * stride_yb + rows * stride_y1
        g_rows = dy_ptr + batch * stride_gb + rows * stride_g1
        d_rows = dx_ptr + batch * stride_db + rows * stride_d1

        dot = tl.zeros((BLOCK_1,), tl.float32)
        for start in range(0, d2, BLOCK_2):
            cols = start + tl.arange(0, BLOCK_2)
            mask = row_ok[:, None] & (cols[None, :] < d2)
            y = tl.load(y_rows + cols[None, :] * stride_y2, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_rows + cols[None, :] * stride_g2, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(y * g, axis=1)
        for start in range(0, d2, BLOCK_2):
            cols = start + tl.arange(0, BLOCK_2)
            mask = row_ok[:, None] & (cols[None, :] < d2)
            y = tl.load(y_rows + cols[None, :] * stride_y2, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_rows + cols[None, :] * stride_g2, mask=mask, other=0.0).to(tl.float32)
            dx = y * (g - dot[:, None])
            tl.store(d_rows + cols[None, :] * stride_d2, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _warps_for_tile(elements: int) -> int:
    # About 8 to 16 fp32 values per thread keeps loads wide without spilling.
    return max(1, min(16, elements // 256))


def _online_grid(batch: int, d1: int, BLOCK_1: int) -> tuple[int, int, tuple[int]]:
    # A few integer operations: cheaper to redo per call than to look up in a cache.
    n_row_tiles = cdiv(d1, BLOCK_1)
    n_tiles = batch * n_row_tiles
    return n_row_tiles, n_tiles, (min(n_tiles, GRID_0_LIMIT),)


def _online_launch(kernel, inputs, BLOCK_1: int, BLOCK_2: int, traced: bool, keep=None) -> torch.Tensor:
    """Launch an online kernel (forward or backward) on 3-D inputs of one shape, validated by the
    caller; each is read through its strides (autograd's gradient of a sum is a stride-0
    expansion). Returns the contiguous output, allocated here; ``keep`` receives the launch as
    a ``Replay`` of (*inputs, output)."""
    out = empty_like_contiguous(inputs[0])
    if out.numel() == 0:
        return out
    batch, d1, d2 = out.shape
    n_row_tiles, n_tiles, grid = _online_grid(batch, d1, BLOCK_1)
    strides = [s for t in (*inputs, out) for s in t.stride()]
    launch_and_keep(jit_kernel(kernel, traced), grid, (*inputs, out, d1, d2, n_row_tiles, n_tiles, *strides),
                    dict(BLOCK_1=BLOCK_1, BLOCK_2=BLOCK_2, num_warps=_warps_for_tile(BLOCK_1 * BLOCK_2)),
                    keep, len(inputs) + 1)
    return out


def _online_forward(x: torch.Tensor, BLOCK_1: int, BLOCK_2: int, traced: bool, keep=None) -> torch.Tensor:
    return _online_launch(online_softmax_kernel, (x,), BLOCK_1, BLOCK_2, traced, keep)


def _online_backward(y: torch.Tensor, dy: torch.Tensor, BLOCK_1: int, BLOCK_2: int, traced: bool,
                     keep=None) -> torch.Tensor:
    return _online_launch(online_softmax_backward_kernel, (y, dy), BLOCK_1, BLOCK_2, traced, keep)


def _online_fake(x, BLOCK_1, BLOCK_2):
    return empty_like_contiguous(x)


@kernel_op("online_softmax", _online_fake)
def _online_softmax_op(x: torch.Tensor, BLOCK_1: int, BLOCK_2: int) -> torch.Tensor:
    return _online_forward(x, BLOCK_1, BLOCK_2, traced=True)


def _online_backward_fake(y, dy, BLOCK_1, BLOCK_2):
    return empty_like_contiguous(y)


@kernel_op("online_softmax_backward", _online_backward_fake)
def _online_softmax_backward_op(y: torch.Tensor, dy: torch.Tensor, BLOCK_1: int, BLOCK_2: int) -> torch.Tensor:
    return _online_backward(y, dy, BLOCK_1, BLOCK_2, traced=True)


# The autograd formulas always call the ops: torch.compile traces a backward with fake tensors
# outside Dynamo, where needs_op cannot tell, and only an op's launch is traceable there.
def _online_softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return _online_softmax_backward_op(y, dy, *ctx.blocks), None, None


def _online_softmax_backward_grad(ctx, ddx):
    y, dy = ctx.saved_tensors
    grad_y, grad_dy = _softmax_double_backward(y, dy, ddx, lambda y, g: _online_softmax_backward_op(y, g, *ctx.blocks))
    return grad_y, grad_dy, None, None


register_autograd(_online_softmax_op, _online_softmax_grad,
                  setup_context=_save_output_and_blocks)


register_autograd(_online_softmax_backward_op, _online_softmax_backward_grad,
                  setup_context=_save_backward_inputs)


def _online_backward_3d(y: torch.Tensor, dy: torch.Tensor, BLOCK_1: int, BLOCK_2: int) -> torch.Tensor:
    if transformed(y, dy):  # the op would drop a tangent (see ``transformed``)
        return softmax_tangent(y, dy)
    if needs_op(y, dy):
        return _online_softmax_backward_op(y, dy, BLOCK_1, BLOCK_2)
    return _online_backward(y, dy, BLOCK_1, BLOCK_2, traced=False)


@on_input_device
def online_softmax(x: torch.Tensor, BLOCK_1: int = 16, BLOCK_2: int = 16) -> torch.Tensor:
    """Softmax over the last dimension of x, by the online algorithm.

    x: (batch, d1, d2), or any rank >= 1 (dimensions before the last two fold into batch).
    BLOCK_1 rows by BLOCK_2 columns per step (powers of two; BLOCK_2 up to 4096, the tile at most
    Triton's largest block). Strided inputs are read in place; the output is contiguous, in x's
    dtype. Differentiable (Triton backward, and twice; forward-mode AD and torch.func's transforms
    too), and traceable by torch.compile. A repeated eager call replays the launch kept from the
    first (``Replay``), as ``row_softmax`` does.
    """
    key = replay_key((x,), (BLOCK_1, BLOCK_2))
    y = _kept_softmax(_ONLINE_REPLAYS, key, x)
    if y is not None:
        return y
    check_tensor("x", x, ANY_RANK)
    check_tiles(BLOCK_1, BLOCK_2)
    x3 = _as_3d(x)
    if needs_op(x3):
        y = _ONLINE_AUTOGRAD.run(x3, BLOCK_1, BLOCK_2) if eager_autograd(x3) else _online_softmax_op(x3, BLOCK_1, BLOCK_2)
    else:
        # Kept where the launch reads x itself: x3 a view of it (a reshape that copies is not).
        keep = None if key is None or x3.data_ptr() != x.data_ptr() else _ONLINE_REPLAYS.keeper(key)
        y = _online_forward(x3, BLOCK_1, BLOCK_2, traced=False, keep=keep)
    return y if y.shape == x.shape else y.reshape(x.shape)


_ONLINE_REPLAYS = Replays("online_softmax")


_ONLINE_BACKWARD_REPLAYS = Replays("online_softmax_backward")


@on_input_device
def online_softmax_backward(y: torch.Tensor, dy: torch.Tensor, BLOCK_1: int = 16, BLOCK_2: int = 16) -> torch.Tensor:
    """Gradient of softmax given its output y and the incoming gradient dy, both of one shape (rank >= 1)."""
    check_tensor("y", y, ANY_RANK)
    check_tensor("dy", dy, ANY_RANK)
    check_same("y", y, "dy", dy)
    if dy.shape != y.shape:
        raise ValueError(f"dy must have the shape of y {tuple(y.shape)}, got {tuple(dy.shape)}")
    check_tiles(BLOCK_1, BLOCK_2)
    return _online_backward_3d(_as_3d(y), _as_3d(dy), BLOCK_1, BLOCK_2).reshape(y.shape)


def _online_grad(ctx, dy):
    """The backward of ``online_softmax`` and of ``OnlineSoftmax`` (whose y may have any rank)."""
    (y,) = ctx.saved_tensors
    dx = softmax_backward(_as_3d(y), _as_3d(dy), ctx.blocks, _online_softmax_backward_op, _online_backward,
                          _ONLINE_BACKWARD_REPLAYS)
    return dx.reshape(y.shape), None, None


_ONLINE_AUTOGRAD = softmax_spec("online_softmax", online_softmax, _online_grad)


class OnlineSoftmax(torch.autograd.Function):
    """``OnlineSoftmax.apply(x, BLOCK_1, BLOCK_2)``: online softmax with a Triton backward.

    The backward is differentiable itself (``create_graph=True`` gives correct second-order terms).
    ``online_softmax`` runs the same backward through ``KernelFunction`` (``_ONLINE_AUTOGRAD``).
    """

    @staticmethod
    def forward(ctx, x, BLOCK_1=16, BLOCK_2=16):
        y = online_softmax(x, BLOCK_1, BLOCK_2)
        ctx.save_for_backward(y)
        ctx.blocks = (BLOCK_1, BLOCK_2)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _online_grad(ctx, dy)


# ----------------------------------------------------------------------------------------------
# Row softmax: one read, one write; rows that fit in one program, or split over resident programs
# (float32, and 16-bit rows that fill its chunks; other long 16-bit rows are read twice, in online tiles)
# ----------------------------------------------------------------------------------------------


# Past this many bytes a row no longer fits in one program's registers without spilling
# (32 warps x 32 threads x 32 fp32 values = 128 KiB of fp32 values).
ROW_BYTES_ON_CHIP = 128 * 1024


# The split kernel's columns a program: SPLIT_SHORT_COLUMNS while a row takes at most
# SPLIT_SHORT_PROGRAMS programs of them, else SPLIT_LONG_COLUMNS (32 values a thread): narrow
# chunks of wide rows make each row's wait span many programs, wide chunks of shorter rows leave
# few programs to spread (see outputs/README.md, design notes: split chunk sizes).
SPLIT_SHORT_COLUMNS = 4096
SPLIT_LONG_COLUMNS = 8192
SPLIT_SHORT_PROGRAMS = 16
# Rows of the split kernel laid from boundaries of this many bytes (``_split_frame``).
SPLIT_FRAME_BYTES = 128


# The split kernel's register cap (``split_registers``).
SPLIT_REGISTER_CAP = 64
SPLIT_REGISTER_SLACK = 8


# 16-bit rows read element by element (x's and y's rows off 16 bytes by different amounts) take
# the online kernel in tiles of 8192 columns. It reads x twice (about 2/3 of copy, unless the
# second read hits L2).
LONG_16BIT_TILE = 8192


def _row_warps(block: int) -> int:
    # 16 to 32 values per thread: enough bytes in flight per SM, few enough to stay in registers.
    return max(4, min(32, block // 512))


@dataclass(frozen=True)
class RowLaunch:
    """How row_softmax (or its backward) runs on one shape.

    kernel: "row" (a whole row per program, ``block`` columns), "online" (tiles of one row by
    ``block`` columns) or "split" (``split`` programs of ``block`` columns per row, ``programs``
    of them in all, resident at once; ``vec`` > 1: chunks laid from 16-byte boundaries, for rows
    that do not start on one: see ``softmax_split_row_kernel``; ``prefetch``: its programs bring
    their chunk of the next row into L2 before each wait, ``split_prefetch``; ``maxnreg``: its
    register cap, ``split_registers``; ``frame`` > 1: rows laid from 128-byte boundaries,
    ``_split_frame``). ``rows``: rows a
    block of the "row" kernel (its programs loop over blocks where ``programs`` holds fewer);
    ``ahead``: its programs bring the row that many on into L2 before storing, ``row_prefetch``.
    """

    kernel: str
    block: int
    warps: int
    programs: int
    split: int = 1
    vec: int = 1
    rows: int = 1
    prefetch: bool = False
    maxnreg: int | None = None
    ahead: int = 0
    frame: int = 1

    def check(self) -> RowLaunch:
        if self.kernel not in ("row", "online", "split"):
            raise ValueError(f"RowLaunch.kernel must be 'row', 'online' or 'split', got {self.kernel!r}")
        check_block("RowLaunch.block", self.block, 1, 1 << 20)
        check_block("RowLaunch.warps", self.warps, 1, 32)
        check_int("RowLaunch.split", self.split, 1, 1 << 20)
        check_block("RowLaunch.vec", self.vec, 1, 16)
        check_block("RowLaunch.rows", self.rows, 1, ROW_BLOCK_VALUES)
        check_flag("RowLaunch.prefetch", self.prefetch)
        if self.maxnreg is not None:
            check_int("RowLaunch.maxnreg", self.maxnreg, 16, 255)
        check_int("RowLaunch.ahead", self.ahead, 0, GRID_0_LIMIT)
        check_block("RowLaunch.frame", self.frame, 1, 128)
        check_int("RowLaunch.programs", self.programs, 1, GRID_0_LIMIT)
        return self


# The one-pass kernel holds at least this many values a program: rows narrower than half of it
# go ROWS to a program (ROWS x BLOCK_SIZE values).
ROW_BLOCK_VALUES = 2048


def _row_grid(n_rows: int, rows: int = 1) -> int:
    """Programs for the one-pass kernels: one a block of ``rows`` rows, which beat a persistent
    grid at every width measured: the hardware fills each SM as programs finish (design notes:
    one block a program). In the interpreter a few programs loop over the rows instead."""
    blocks = cdiv(n_rows, rows)
    return min(blocks, 4) if INTERPRET else min(blocks, GRID_0_LIMIT)


@functools.lru_cache(maxsize=4096)
def _row_launch(n_rows: int, n_cols: int, stride_x: int, dtype: torch.dtype, device_index: int,
                BLOCK_SIZE: int) -> RowLaunch:
    """row_softmax's forward launch for one shape, dtype and device (BLOCK_SIZE 0: the wrapper's choice)."""
    full = next_power_of_2(n_cols)
    if BLOCK_SIZE and BLOCK_SIZE < full:
        return RowLaunch("online", BLOCK_SIZE, _warps_for_tile(BLOCK_SIZE), n_rows).check()
    if not BLOCK_SIZE and full * 4 > ROW_BYTES_ON_CHIP:
        if INTERPRET:  # programs run one after another there and cannot wait for each other
            return _long_row_launch(n_rows, n_cols)
        if dtype.itemsize < 4 and not _split_suits_16bit(n_cols, stride_x, dtype):
            return _long_16bit_launch(n_rows)
        try:
            return _split_launch(n_rows, n_cols, stride_x, dtype, device_index)
        except KernelCapacityError:
            # A row needing more split programs than the device holds at once: the online
            # tiles, which take rows of any length.
            return _long_16bit_launch(n_rows) if dtype.itemsize < 4 else _long_row_launch(n_rows, n_cols)
    if not BLOCK_SIZE and not INTERPRET and _fills_poorly(n_cols, dtype) and _split_suits_16bit(n_cols, stride_x, dtype):
        try:
            return _split_launch(n_rows, n_cols, stride_x, dtype, device_index)
        except KernelCapacityError:
            pass
    return _one_pass_launch(n_rows, n_cols, stride_x, dtype, device_index, max(full, BLOCK_SIZE))


def _fills_poorly(n_cols: int, dtype: torch.dtype) -> bool:
    """A 16-bit row in the one-pass kernel's widest block (ROW_BYTES_ON_CHIP of float32: 32768
    columns over 32 warps, one program a SM) that fills less than 15/16 of it: the split kernel
    reads those faster; narrower blocks leave two or more programs a SM, and there one pass wins,
    as for float32 rows (design notes: poorly filled blocks)."""
    full = next_power_of_2(n_cols)
    return dtype.itemsize < 4 and full * 4 == ROW_BYTES_ON_CHIP and n_cols * 16 < full * 15


@functools.lru_cache(maxsize=4096)
def _one_pass_launch(n_rows: int, n_cols: int, stride_x: int, dtype: torch.dtype, device_index: int,
                     block: int) -> RowLaunch:
    """The one-pass kernel's launch: ``block`` columns a row, ``_row_block_rows`` rows a program."""
    rows = _row_block_rows(n_rows, block, device_index)
    warps = _row_warps(block)
    ahead = 0
    if not INTERPRET and rows == 1 and split_prefetch(dtype, _device_properties(device_index)):
        ahead = row_prefetch(n_rows, n_cols, stride_x, dtype, device_index, block, warps)
    return RowLaunch("row", block, warps, _row_grid(n_rows, rows), rows=rows, ahead=ahead).check()


def forget_row_launches() -> None:
    """Drop row_softmax's cached launch choices (``_row_launch``, ``_one_pass_launch``) and the
    launches its eager calls keep (``_ROW_REPLAYS``, ``_ROW_BACKWARD_REPLAYS``): after changing a
    rule they read (a probe or a test patching ``split_prefetch``, say), the next call chooses afresh."""
    _row_launch.cache_clear()
    _one_pass_launch.cache_clear()
    _ROW_REPLAYS.clear()
    _ROW_BACKWARD_REPLAYS.clear()


def row_prefetch(n_rows: int, n_cols: int, stride_x: int, dtype: torch.dtype, device_index: int, block: int,
                 warps: int) -> int:
    """The one-pass kernel's AHEAD for rows a program (16-bit rows on Hopper, as ``split_prefetch``):
    the programs the device holds at once, the compiled kernel's residency times the SMs. A
    program asks L2 for the row that many on before it stores its own; the hardware starts the
    program for that row about when this one ends, and finds it in L2. Fewer rows ahead gain
    less; more bring rows in too early, which leave L2 before use (design notes: row prefetch)."""
    vec = vector_align((n_cols, stride_x, n_cols), dtype.itemsize)
    ints = (n_rows, n_cols // vec, stride_x // vec, n_cols // vec)
    compiled = softmax_row_kernel.warmup(dtype, dtype, *map(_int_stand_in, ints), BLOCK_SIZE=block, VEC=vec, ROWS=1,
                                         num_warps=warps, grid=(1,))
    props = _device_properties(device_index)
    return resident_programs(compiled, warps, props) * props.multi_processor_count


def _row_block_rows(n_rows: int, block: int, device_index: int) -> int:
    """Rows a program of the one-pass kernel: up to ROW_BLOCK_VALUES values, but on a GPU no
    fewer programs than SMs where the rows allow (a power of two): packing narrow rows into a few
    programs left SMs idle (design notes: rows a program)."""
    rows = min(ROW_BLOCK_VALUES // block, next_power_of_2(n_rows))
    if not INTERPRET:
        rows = min(rows, cdiv(n_rows, _device_properties(device_index).multi_processor_count))
    return 1 << (max(1, rows).bit_length() - 1)


def _long_16bit_launch(n_rows: int) -> RowLaunch:
    """Long 16-bit rows off the split kernel: the online kernel in tiles of LONG_16BIT_TILE columns."""
    return RowLaunch("online", LONG_16BIT_TILE, _warps_for_tile(LONG_16BIT_TILE), n_rows).check()


def _long_row_launch(n_rows: int, n_cols: int) -> RowLaunch:
    """Rows too long for one program: the online kernels, in online_softmax_tiles' tiles (1 row)."""
    block = online_softmax_tiles(n_cols)[1]
    return RowLaunch("online", block, _warps_for_tile(block), n_rows).check()


@functools.lru_cache(maxsize=4096)
def _row_backward_launch(n_rows: int, n_cols: int, device_index: int) -> RowLaunch:
    """The backward holds two rows (y and dy): one program per row while both fit, else online tiles."""
    full = next_power_of_2(n_cols)
    if 2 * full * 4 > ROW_BYTES_ON_CHIP:
        return _long_row_launch(n_rows, n_cols)
    warps = _row_warps(full)
    return RowLaunch("row", full, warps, _row_grid(n_rows)).check()


def _int_stand_in(v: int) -> int:
    # Triton compiles one variant per (value == 1, value % 16 == 0) of each int argument; a
    # stand-in with the same two answers compiles the variant the launch will run.
    return 1 if v == 1 else 16 if v % 16 == 0 else 3


def _split_shape(n_cols: int, chunk_bytes: int, dtype: torch.dtype) -> tuple[int, int]:
    """(split, chunk): programs per row and columns per program (a power of two, at most
    chunk_bytes). 16-bit rows take as few programs as cover the row. float32 rows take a power
    of two of them where that leaves at most a quarter idle, else as few as cover the row:
    compiled for sm_90, a count that is no power of two costs the float32 kernel 8 to 10
    registers a thread (fewer programs resident), less than many idle programs cost (design
    notes: split count)."""
    chunk = chunk_bytes // dtype.itemsize
    split = cdiv(n_cols, chunk)
    if dtype.itemsize >= 4 and next_power_of_2(split) * 3 <= split * 4:
        split = next_power_of_2(split)
    return split, next_power_of_2(cdiv(n_cols, split))


def _split_chunk_bytes(n_cols: int, dtype: torch.dtype) -> int:
    """Bytes of a row per split program (see SPLIT_SHORT_COLUMNS)."""
    if cdiv(n_cols, SPLIT_SHORT_COLUMNS) <= SPLIT_SHORT_PROGRAMS:
        return SPLIT_SHORT_COLUMNS * dtype.itemsize
    return SPLIT_LONG_COLUMNS * dtype.itemsize


def _split_vec(n_cols: int, stride_x: int, dtype: torch.dtype) -> int | None:
    """The split kernel's VEC for rows of n_cols columns stride_x apart (y's rows: n_cols apart),
    x's data on 16 bytes: 1 where the width and the stride are multiples of 16 values (all that
    Triton learns of an int: then it knows every row starts, and ends, on a vector); the
    elements in 16 bytes where not, but x's and y's rows start equally far past a 16-byte
    boundary (so one layout of chunks suits both; rows laid from the vector before them, their
    masks hold whole vectors); None where neither (their loads or stores go element by element).
    A width on 16 bytes but no multiple of 16 values takes vectors too: with VEC 1 half the
    programs read it value by value (design notes: split VEC)."""
    vector = 16 // dtype.itemsize
    if n_cols % 16 == 0 and stride_x % 16 == 0:
        return 1
    return vector if (stride_x - n_cols) % vector == 0 else None


def _split_suits_16bit(n_cols: int, stride_x: int, dtype: torch.dtype) -> bool:
    """A long 16-bit row the split kernel reads faster than the online tiles (see
    SPLIT_SHORT_COLUMNS): one read in whole vectors (``_split_vec``)."""
    return _split_vec(n_cols, stride_x, dtype) is not None


def split_prefetch(dtype: torch.dtype, props) -> bool:
    """Whether the split kernel's programs ask L2 for their chunk of the next row before each wait
    (PREFETCH): 16-bit rows on NVIDIA GPUs of compute capability 9 and later (the bulk prefetch
    is sm_90's): the chunks are then read from L2 after the wait. float32 rows, whose chunks hold
    twice the bytes already, went either way and do without (design notes: split prefetch)."""
    return dtype.itemsize < 4 and torch.version.hip is None and props.major >= 9


def split_registers(n_regs: int) -> int | None:
    """The split kernel's register cap (``maxnreg``) for a variant ptxas compiles to n_regs a
    thread uncapped: SPLIT_REGISTER_CAP where that is up to SPLIT_REGISTER_SLACK fewer, else
    None: a few spilled values for a program more a SM. A cap below what ptxas picks on its own
    can raise its count, so none is set there (design notes: split register cap)."""
    if SPLIT_REGISTER_CAP < n_regs <= SPLIT_REGISTER_CAP + SPLIT_REGISTER_SLACK:
        return SPLIT_REGISTER_CAP
    return None


def _split_frame(n_cols: int, stride_x: int, dtype: torch.dtype) -> int:
    """The split kernel's FRAME for rows of n_cols columns stride_x apart (y's: n_cols apart):
    the values in SPLIT_FRAME_BYTES where rows do not all start on such a boundary and x's and
    y's rows start equally far past one, else 1 (frames of a vector at most, ``_split_vec``).
    Framed so, a warp's 512 bytes of a row span four 128-byte lines, not five, and a row whose
    width is no multiple of 16 values is read in vectors even where it starts on 16 bytes (laid
    from its own start, VEC 1, Triton cannot tell that its end falls on a vector, and loads it
    value by value; design notes: split frames). Frames are laid from x's data pointer, which the launch is not keyed on: x's data on 16 bytes but not 128 puts them off
    the lines, which costs time, not values (the masks hold offsets from each row's start).
    """
    frame = SPLIT_FRAME_BYTES // dtype.itemsize
    if (stride_x * dtype.itemsize) % SPLIT_FRAME_BYTES == 0 or (stride_x - n_cols) % frame:
        return 1
    return frame


def _split_launch(n_rows: int, n_cols: int, stride_x: int, dtype: torch.dtype, device_index: int) -> RowLaunch:
    """The split kernel's launch: chunks (``_split_shape``), its frames (``_split_vec``,
    ``_split_frame``), prefetch and register cap, and as many groups as the device holds."""
    frame = _split_frame(n_cols, stride_x, dtype)
    vec = 16 // dtype.itemsize if frame > 1 else (_split_vec(n_cols, stride_x, dtype) or 1)
    # VEC > 1 lays the chunks from the boundary of FRAME (or VEC) values at or before each row:
    # they must cover the last whole vector of a row that starts up to FRAME - 1 values past it,
    # which SPLIT x CHUNK (a multiple of VEC) does once it reaches n_cols + FRAME - VEC; for
    # frames of a vector, n_cols (see softmax_split_row_kernel).
    cover = n_cols + frame - vec if frame > vec else n_cols
    split, chunk = _split_shape(cover, _split_chunk_bytes(n_cols, dtype), dtype)
    warps = max(1, min(32, chunk // 1024))
    props = _device_properties(device_index)
    prefetch = split_prefetch(dtype, props)

    def compiled(n_groups: int, registers: int | None):
        ints = (n_rows, n_cols, stride_x, n_cols, n_groups)  # y's row stride is n_cols
        return softmax_split_row_kernel.warmup(
            dtype, dtype, torch.float32, torch.int32, *map(_int_stand_in, ints),
            CHUNK=chunk, SPLIT=split, PARTS=next_power_of_2(split), VEC=vec, PREFETCH=prefetch, FRAME=frame,
            grid=(1,), **launch_options(warps, registers))

    registers = split_registers(kernel_registers(compiled(n_rows, None)))

    def capacity(n_groups: int) -> int:
        return resident_programs(compiled(n_groups, registers), warps, props) * props.multi_processor_count

    most = capacity(n_rows)
    if most < split:  # a group that cannot all be resident at once would wait forever
        raise KernelCapacityError(f"x: rows of {n_cols} columns need {split} programs of softmax_split_row_kernel "
                                  f"resident at once, but the device holds {most}")
    n_groups = min(n_rows, most // split)
    if _int_stand_in(n_groups) != _int_stand_in(n_rows):  # another compiled variant: check it too
        n_groups = min(n_groups, capacity(n_groups) // split)
    if n_groups < 1:
        raise KernelCapacityError(f"x: rows of {n_cols} columns need {split} programs of softmax_split_row_kernel "
                                  f"resident at once, and the device cannot hold them")
    return RowLaunch("split", chunk, warps, n_groups * split, split, vec, prefetch=prefetch, maxnreg=registers,
                     frame=frame).check()


# The split-row kernel's workspace: its (max, sum) slots (four float32 a program) and its arrival
# counters (two int32 a group, zero between launches: the kernel resets them). One pair of
# buffers per (device, stream): launches on one stream run one after another, so they never share
# them at the same time; two streams get two. Nothing is cached while a CUDA graph is being
# captured (``fresh_counters``): such a buffer would live in that graph's memory pool, zeroed only
# when that graph first replays, and another graph captured on the same stream would share it.
# torch.compile's graphs make a workspace of their own per call too.
_SPLIT_WORKSPACES: dict = {}


def _split_workspace(x: torch.Tensor, n_programs: int, n_groups: int, index: int,
                     plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's (stats, counters) for a launch of n_programs programs in n_groups
    groups on x: made for this call (counters zero) where cached buffers must not be used
    (``fresh_counters``), else the cached pair. ``plain``: x is known to be a real CUDA tensor
    (a kept launch's key says so), which skips the fake-tensor test, the costliest part."""
    if (buffers_per_call(x) if plain else fresh_counters(x)):
        return (torch.empty(4 * n_programs, dtype=torch.float32, device=x.device),
                torch.zeros(2 * n_groups, dtype=torch.int32, device=x.device))
    workspace = _SPLIT_WORKSPACES.get((index, torch._C._cuda_getCurrentRawStream(index)))
    return _split_workspace_made(x.device, index) if workspace is None else workspace


def _split_workspace_made(device: torch.device, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached workspace of this device's current stream (torch.cuda.current_stream costs ~9 us),
    made large enough for any launch: at most one program (one group) per resident warp."""
    props = _device_properties(index)
    most_programs = props.multi_processor_count * (props.max_threads_per_multi_processor // 32)
    workspace = (torch.empty(4 * most_programs, dtype=torch.float32, device=device),
                 torch.zeros(2 * most_programs, dtype=torch.int32, device=device))
    _SPLIT_WORKSPACES[(index, torch._C._cuda_getCurrentRawStream(index))] = workspace
    return workspace


class SplitRowReplay:
    """The split kernel's kept launch (a ``Replay`` of (x, y, stats, counters)), called with (x, y):
    it takes the workspace (``_split_workspace``) and launches."""

    __slots__ = ("replay", "n_programs", "n_groups", "index")

    def __init__(self, replay: Replay, n_programs: int, n_groups: int, index: int):
        self.replay, self.n_programs, self.n_groups, self.index = replay, n_programs, n_groups, index

    def __call__(self, x, y) -> bool:
        return self.replay.ready() and self.launch(x, y)

    def ready(self) -> bool:
        return self.replay.ready()

    def launch(self, x, y) -> bool:
        return self.replay.launch(x, y, *_split_workspace(x, self.n_programs, self.n_groups, self.index, plain=True))


def _aligned(t: torch.Tensor) -> bool:
    """Whether t's data starts on 16 bytes, as the split kernel's capacity check compiled it for
    (a fake tensor under torch.compile has no address: the compiler's inputs are aligned)."""
    return is_fake(t) or t.data_ptr() % 16 == 0


@triton.jit
def fast_exp(x):
    """exp of float32 x elementwise: one ex2.approx.ftz where FAST_EXP holds, else tl.exp."""
    if FAST_EXP:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2_E], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def softmax_row_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y,
    BLOCK_SIZE: tl.constexpr, VEC: tl.constexpr, ROWS: tl.constexpr, AHEAD: tl.constexpr = 0,
):
    """Each program walks blocks of ROWS rows: pid, pid + grid, ...; whole rows sit in registers.

    A row of only -inf has max -inf and gives NaN, as torch; a NaN or +inf logit makes the sum NaN.
    n_cols and the row strides come divided by VEC (``vector_align``). Rows past n_rows in the
    last block read -inf and are not stored. AHEAD > 0 (ROWS 1, compiled Hopper GPUs: inline
    PTX): before storing, each program asks L2 for the row AHEAD rows on, which the program
    taking its place will read (``row_prefetch``).
    """
    n_cols = n_cols * VEC
    stride_x = stride_x * VEC
    stride_y = stride_y * VEC
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    # (n_rows - 1) // ROWS + 1 blocks, and rows in int64: n_rows + ROWS - 1 may pass 2^31.
    for block in range(tl.program_id(0), (n_rows - 1) // ROWS + 1, tl.num_programs(0)):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        ok = (rows < n_rows)[:, None] & mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        p = fast_exp(x - tl.max(x, axis=1)[:, None])
        y = p / tl.sum(p, axis=1)[:, None]
        if AHEAD > 0:
            later = tl.cast(block, tl.int64) * ROWS + AHEAD
            if later < n_rows:
                _l2_prefetch(x_ptr + later * stride_x, n_cols * (x_ptr.dtype.element_ty.primitive_bitwidth // 8))
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def softmax_row_backward_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, stride_y, stride_g, stride_gc, stride_d,
    BLOCK_SIZE: tl.constexpr,
):
    """dx = y * (dy - sum(y * dy)) with a whole row of y and dy in registers, rows as the forward."""
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r = tl.cast(row, tl.int64)
        y = tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + r * stride_g + cols * stride_gc, mask=mask, other=0.0).to(tl.float32)
        dx = y * (g - tl.sum(y * g, axis=0))
        tl.store(dx_ptr + r * stride_d + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_chunk(x_ptr, row, n_rows, n_cols, stride_x, part, CHUNK: tl.constexpr, VEC: tl.constexpr,
                    SPAN: tl.constexpr):
    """Ask L2 for the chunk this program of the split kernel reads of ``row`` (nothing past
    n_rows): one thread issues one ``cp.async.bulk.prefetch.L2`` (sm_90, ``_l2_prefetch``) of
    the chunk's part of the frame the loads use, up to the row's last whole vector: the first
    program's may start up to a frame before the row (the row before it, in x), and the row's
    last partial vector, which that program loads apart, is left out."""
    if row < n_rows:
        start = tl.cast(row, tl.int64) * stride_x
        end = n_cols
        if VEC > 1:
            shift = (start % SPAN).to(tl.int32)
            start -= shift
            end = (n_cols + shift) // VEC * VEC
        first = part * CHUNK
        nbytes = tl.minimum(end - first, CHUNK) * (x_ptr.dtype.element_ty.primitive_bitwidth // 8)
        _l2_prefetch(x_ptr + start + first, nbytes)


@triton.jit
def _l2_prefetch(ptr, nbytes):
    """Thread 0 of the program asks L2 for the bytes [ptr, ptr + nbytes) (``cp.async.bulk.prefetch``,
    sm_90), both ends rounded down to 16 bytes as the instruction needs: up to 15 bytes before ptr
    (its own 16-byte granule, so mapped memory) and up to 15 short of the end. Nothing where that
    leaves no bytes (nbytes 0 or less: a chunk past its row's end). Issued and left: it holds no
    registers and waits for nothing."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .b32 t, n; .reg .b64 a, e; "
        "mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "and.b64 a, $1, -16; cvt.s64.s32 e, $2; add.s64 e, $1, e; and.b64 e, e, -16; sub.u64 e, e, a; "
        "cvt.u32.u64 n, e; setp.gt.and.s32 q, n, 0, p; "
        "@q cp.async.bulk.prefetch.L2.global [a], n; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def softmax_split_row_kernel(
    x_ptr, y_ptr, stats_ptr, counters_ptr, n_rows, n_cols, stride_x, stride_y, n_groups,
    CHUNK: tl.constexpr, SPLIT: tl.constexpr, PARTS: tl.constexpr, VEC: tl.constexpr = 1,
    PREFETCH: tl.constexpr = False, FRAME: tl.constexpr = 1,
):
    """SPLIT programs (a group) share a row, each holding CHUNK columns in registers.

    VEC > 1 is for rows that do not start on 16-byte boundaries (an odd width), or with FRAME
    (a multiple of VEC) on 128-byte ones: the chunks are laid from the boundary of SPAN (VEC, or
    FRAME) values at or before each row's start (``shift`` = the row's offset mod SPAN), and
    they load and store the row's whole vectors only, masked by vector; the frame's vectors
    before the row's are masked off, and the values of the vector the row starts in and of
    the one it ends in (up to VEC each) are the group's first program's, one small masked
    load and store. No chunk tests its values one by one, which halved its speed (design notes:
    whole-vector masks). The wrapper passes VEC only where x's and y's
    rows share their offset mod SPAN. The whole vectors end at ``last``, a multiple of VEC at
    most n_cols + shift < n_cols + SPAN, so at most the first multiple of VEC from
    n_cols + SPAN - VEC on, which SPLIT x CHUNK (a multiple of VEC) must reach: n_cols for
    frames of a vector, more for FRAME (``_split_launch``).

    Each publishes its chunk's (max, sum), counts itself in its group's ``arrived`` counter and
    waits until all SPLIT have arrived for this row (the counter reaches SPLIT times the rows
    done); then each combines the SPLIT pairs and writes its chunk. A program's pair goes to one
    of two slots of its own (``stats``: four float32 a program), alternating row by row: it
    writes a slot again two rows later, after the wait of the row between, which every program
    of its group reaches only once it has read the pairs of the row before. So the workspace is
    one fixed buffer, whatever the number of rows. Programs only wait on their
    own group, and the wrapper launches no more programs than fit on the device at once, so
    every wait ends. The counters start at zero and the kernel leaves them at zero, so one
    cached buffer serves every launch, a CUDA graph's replays included. PREFETCH (compiled
    Hopper GPUs only: inline PTX): before waiting, each program asks L2 for its chunk of the
    next row it takes (``_prefetch_chunk``).
    """
    # Rows are laid in frames of SPAN values from a boundary at or before their start: the vector
    # (VEC), or FRAME values (128 bytes) where given, so that a warp's loads cover whole cache lines.
    SPAN: tl.constexpr = FRAME if FRAME > VEC else VEC
    pid = tl.program_id(0)
    group = pid // SPLIT
    part = pid % SPLIT
    arrived = counters_ptr + 2 * group
    departed = arrived + 1
    cols = part * CHUNK + tl.arange(0, CHUNK)
    parts = tl.arange(0, PARTS)  # PARTS: SPLIT rounded up to a power of two (tl.arange's sizes)
    lanes = tl.arange(0, 2 * VEC)  # VEC > 1: the row's first partial vector, then its last
    target = 0
    for row in range(group, n_rows, n_groups):
        target += SPLIT
        parity = (target // SPLIT) % 2  # which of its two stats slots a program writes for this row
        x_row = tl.cast(row, tl.int64) * stride_x
        y_row = tl.cast(row, tl.int64) * stride_y
        if VEC > 1:
            shift = (x_row % SPAN).to(tl.int32)
            x_row = tl.multiple_of(x_row - shift, SPAN)
            y_row = tl.multiple_of(y_row - shift, SPAN)
            lead = shift // VEC * VEC  # the frame's vectors before the one the row starts in
            end = n_cols + shift
            last = end // VEC * VEC  # a multiple of VEC: the mask below holds whole vectors
            # The row's whole vectors: [lead + VEC, last) of the frame. Its first and last partial
            # ones (up to VEC - 1 values each; the first may be whole) go apart, to the group's
            # first program, in ``edge``. A row ending in its first vector (end < lead + VEC; a
            # direct call only) has last <= lead: the first vector stops at end, the last is empty.
            body = (cols >= lead + VEC) & (cols < last)
            edge_cols = tl.where(lanes < VEC, lead + lanes, last + lanes - VEC)
            first = (lanes < VEC) & (edge_cols >= shift) & (edge_cols < end)
            after = (lanes >= VEC) & (edge_cols >= lead + VEC) & (edge_cols < end)
            edge_ok = (first | after) & (tl.full((2 * VEC,), part, tl.int32) == 0)
        else:
            body = cols < n_cols
        x = tl.load(x_ptr + x_row + cols, mask=body, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        if VEC > 1:
            edge = tl.load(x_ptr + x_row + edge_cols, mask=edge_ok, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(edge, axis=0))
        # -inf logits weigh 0: a chunk of only -inf (masked past the row's end, or in the data)
        # has max -inf and is shifted by 0 instead, so it contributes sum 0 and no NaN, while a
        # NaN or +inf logit still makes the sum NaN, so its whole row comes out NaN as torch's
        # does. One test per chunk: per value, the compiler kept each 16-bit value beside its
        # float32 copy (design notes: whole-vector masks). The exponentials stay in registers
        # until the row's max and sum are known, then one multiply per value rescales them.
        x = fast_exp(x - tl.where(m == float("-inf"), 0.0, m))
        s = tl.sum(x, axis=0)
        if VEC > 1:
            edge = fast_exp(edge - tl.where(m == float("-inf"), 0.0, m))
            s += tl.sum(edge, axis=0)
        # This program's slot of the two it alternates between (``parity``): [group, part, parity]
        # of the workspace, with the group written as row % n_groups (the same number), worked out
        # again each row: an address fixed for the whole loop holds registers through it (design
        # notes: split prefetch).
        home = row % n_groups
        slot = stats_ptr + ((home * SPLIT + part) * 2 + parity) * 2
        tl.store(slot, m)
        tl.store(slot + 1, s)
        # Every thread's stores are done before the release below publishes them.
        tl.debug_barrier()
        tl.atomic_add(arrived, 1, sem="release")
        # Through the wait, bringing the next row's chunk into L2 (PREFETCH) keeps memory busy
        # and holds no registers, as loading it into registers would (design notes: split prefetch).
        if PREFETCH:
            _prefetch_chunk(x_ptr, row + n_groups, n_rows, n_cols, stride_x, part, CHUNK, VEC, SPAN)
        while tl.atomic_add(arrived, 0, sem="acquire") < target:
            pass
        tl.debug_barrier()
        # .cg reads from L2, never from this SM's L1, which other programs' stores don't update.
        table = stats_ptr + ((home * SPLIT + parts) * 2 + parity) * 2
        ms = tl.load(table, mask=parts < SPLIT, other=float("-inf"), cache_modifier=".cg")
        ss = tl.load(table + 1, mask=parts < SPLIT, other=0.0, cache_modifier=".cg")
        row_max = tl.max(ms, axis=0)
        # A row of only -inf: row_max = -inf, exp(-inf - -inf) = NaN, and the row is NaN as torch's.
        row_sum = tl.sum(ss * tl.exp(ms - row_max), axis=0)
        # exp(x - row_max) / row_sum = exp(x - m) * scale. A chunk of only -inf (m = -inf) holds
        # zeros and scales by exp(-inf - row_max) = 0 (not by exp(0 - row_max), which overflows
        # for a row of very negative logits and would make 0 x inf = NaN); NaN where row_max is.
        scale = tl.exp(m - row_max) / row_sum
        tl.store(y_ptr + y_row + cols, (x * scale).to(y_ptr.dtype.element_ty), mask=body)
        if VEC > 1:
            tl.store(y_ptr + y_row + edge_cols, (edge * scale).to(y_ptr.dtype.element_ty), mask=edge_ok)
    # Reset the group's counters for the next launch. The last program of the group to get here
    # does it: every other one has passed its last wait, so none still reads ``arrived``.
    tl.debug_barrier()
    if tl.atomic_add(departed, 1, sem="acq_rel") == SPLIT - 1:
        tl.atomic_xchg(arrived, 0, sem="relaxed")
        tl.atomic_xchg(departed, 0, sem="relaxed")


def row_forward(x2: torch.Tensor, BLOCK_SIZE: int, traced: bool, keep=None) -> torch.Tensor:
    """Softmax of each row of a 2-D x2 whose column stride is 1; BLOCK_SIZE 0 lets the launch choose.

    ``keep``, if given, receives the launch as a function of (x2, y) that replays it (a
    ``Replay``, or for the split kernel a ``SplitRowReplay`` that takes its workspace).
    """
    y = empty_like_contiguous(x2)
    if y.numel() == 0:
        return y
    # int(): under torch.compile with dynamic shapes these are symbols; the launch is chosen for
    # (and the compiled graph guarded on) the concrete shape, as the cache needs plain ints.
    n_rows, n_cols = int(x2.shape[0]), int(x2.shape[1])
    launch = _row_launch(n_rows, n_cols, int(x2.stride(0)), x2.dtype, _device_index(x2), BLOCK_SIZE)
    if launch.kernel == "split" and not _aligned(x2) and x2.element_size() < 4:
        # A 16-bit row takes the split kernel only where that beats the online tiles (or a poorly
        # filled one-pass block, ``_fills_poorly``); copied first (four passes over x) it would not.
        block = next_power_of_2(n_cols)
        launch = (_long_16bit_launch(n_rows) if block * 4 > ROW_BYTES_ON_CHIP else
                  _one_pass_launch(n_rows, n_cols, int(x2.stride(0)), x2.dtype, _device_index(x2), block))
    if launch.kernel == "online":
        return _online_forward(x2.unsqueeze(0), 1, launch.block, traced, keep).squeeze(0)
    if launch.kernel == "split":
        if not _aligned(x2):
            x2 = x2.clone()  # the capacity check compiled the aligned variant of the kernel
            launch = _row_launch(n_rows, n_cols, int(x2.stride(0)), x2.dtype, _device_index(x2), BLOCK_SIZE)
            keep = None  # the launch reads the copy, not x2
            if launch.kernel != "split":  # the copy's variant may hold fewer programs: online tiles
                return _online_forward(x2.unsqueeze(0), 1, launch.block, traced, None).squeeze(0)
        n_groups = launch.programs // launch.split
        index = _device_index(x2)
        stats, counters = _split_workspace(x2, launch.programs, n_groups, index)
        kept = []
        launch_and_keep(jit_kernel(softmax_split_row_kernel, traced), (launch.programs,),
                        (x2, y, stats, counters, n_rows, n_cols, x2.stride(0), y.stride(0), n_groups),
                        dict(CHUNK=launch.block, SPLIT=launch.split, PARTS=next_power_of_2(launch.split), VEC=launch.vec,
                             PREFETCH=launch.prefetch, FRAME=launch.frame, **launch_options(launch.warps, launch.maxnreg)),
                        None if keep is None else kept.append, 4)
        if kept:
            keep(SplitRowReplay(kept[0], launch.programs, n_groups, index))
        return y
    # The row strides and the width go divided by VEC, which the kernel multiplies back: its loads
    # are then whole vectors (the width too, or the mask splits them: design notes: vector strides).
    vec = vector_align((n_cols, x2.stride(0), y.stride(0)), x2.element_size())
    launch_and_keep(jit_kernel(softmax_row_kernel, traced), (launch.programs,),
                    (x2, y, n_rows, n_cols // vec, x2.stride(0) // vec, y.stride(0) // vec),
                    dict(BLOCK_SIZE=launch.block, VEC=vec, ROWS=launch.rows, AHEAD=launch.ahead, num_warps=launch.warps),
                    keep, 2)
    return y


def _row_backward(y2: torch.Tensor, dy2: torch.Tensor, traced: bool, keep=None) -> torch.Tensor:
    """dx for 2-D y2 (contiguous, row_softmax's output) and dy2 of its shape, any strides;
    ``keep``, if given, receives the launch as a ``Replay`` of (y2, dy2, dx)."""
    dx = empty_like_contiguous(y2)
    if dx.numel() == 0:
        return dx
    n_rows, n_cols = int(y2.shape[0]), int(y2.shape[1])  # plain ints for the cache (see row_forward)
    launch = _row_backward_launch(n_rows, n_cols, _device_index(y2))
    if launch.kernel == "online":
        # Its views of y2 and dy2 start where they do, with their strides: a replay of (y2, dy2, dx) launches the same.
        return _online_backward(y2.unsqueeze(0), dy2.unsqueeze(0), 1, launch.block, traced, keep).squeeze(0)
    launch_and_keep(jit_kernel(softmax_row_backward_kernel, traced), (launch.programs,),
                    (y2, dy2, dx, n_rows, n_cols, y2.stride(0), dy2.stride(0), dy2.stride(1), dx.stride(0)),
                    dict(BLOCK_SIZE=launch.block, num_warps=launch.warps), keep, 3)
    return dx


def _row_fake(x2, BLOCK_SIZE):
    return empty_like_contiguous(x2)


@kernel_op("row_softmax", _row_fake)
def _row_softmax_op(x2: torch.Tensor, BLOCK_SIZE: int) -> torch.Tensor:
    return row_forward(x2, BLOCK_SIZE, traced=True)


def _row_backward_fake(y2, dy2):
    return empty_like_contiguous(y2)


@kernel_op("row_softmax_backward", _row_backward_fake)
def _row_softmax_backward_op(y2: torch.Tensor, dy2: torch.Tensor) -> torch.Tensor:
    return _row_backward(y2, dy2, traced=True)


def _row_softmax_grad(ctx, dy2):
    (y2,) = ctx.saved_tensors
    return _row_softmax_backward_op(y2, dy2), None


def _row_softmax_backward_grad(ctx, ddx):
    y2, dy2 = ctx.saved_tensors
    return _softmax_double_backward(y2, dy2, ddx, _row_softmax_backward_op)


register_autograd(_row_softmax_op, _row_softmax_grad, setup_context=_save_output_and_blocks)


register_autograd(_row_softmax_backward_op, _row_softmax_backward_grad,
                  setup_context=_save_backward_inputs)


_ROW_REPLAYS = Replays("row_softmax")


# Eager backwards' kept launches, by ``replay_key`` of (y, dy) and the tiles.
_ROW_BACKWARD_REPLAYS = Replays("row_softmax_backward")


@on_input_device
def row_softmax(x: torch.Tensor, BLOCK_SIZE: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of x (any rank >= 1).

    BLOCK_SIZE=None lets the wrapper choose: the whole row in one program when it fits
    (``softmax_row_kernel``, reading x once), else for float32 the row split over resident
    programs (``softmax_split_row_kernel``, reading x once; 16-bit rows only where that is faster,
    else the online kernel in tiles of ``LONG_16BIT_TILE`` columns: see ``_split_suits_16bit``); in
    interpreter mode, where programs run one after another and cannot wait for each other, long
    rows take the online kernel too. A repeated eager call replays the launch kept from the
    first (``Replay``; with its workspace, ``SplitRowReplay``). A given BLOCK_SIZE (a power of two)
    forces the online kernel with tiles of one row by BLOCK_SIZE columns when it is smaller than
    the row, and the one-pass kernel otherwise. Differentiable (Triton backward, and twice;
    forward-mode AD and torch.func's transforms too), and traceable by torch.compile.
    """
    key = replay_key((x,), (BLOCK_SIZE,))
    y = _kept_softmax(_ROW_REPLAYS, key, x)
    if y is not None:
        return y
    check_tensor("x", x, ANY_RANK)
    if BLOCK_SIZE is not None:
        check_block("BLOCK_SIZE", BLOCK_SIZE, 8, 1 << 17)
    flat = x.dim() != 2  # a reshape costs host time even when it changes nothing
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if flat else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()  # the row kernels assume unit column stride for wide vector loads
    if needs_op(x2):
        y = _ROW_AUTOGRAD.run(x2, BLOCK_SIZE) if eager_autograd(x2) else _row_softmax_op(x2, BLOCK_SIZE or 0)
    else:
        # The launch takes x itself when x2 is x or a view of contiguous x with its row stride.
        keep = None if key is None or not (x2 is x or x.is_contiguous()) else _ROW_REPLAYS.keeper(key)
        y = row_forward(x2, BLOCK_SIZE or 0, traced=False, keep=keep)
    return y.reshape(x.shape) if flat else y


def _row_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_backward(y, dy, (), _row_softmax_backward_op, _row_backward, _ROW_BACKWARD_REPLAYS), None


_ROW_AUTOGRAD = softmax_spec("row_softmax", row_softmax, _row_grad)
