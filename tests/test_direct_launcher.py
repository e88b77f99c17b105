"""The eager launch path (``online_softmax.DirectLauncher``): a compiled kernel is reused only for
arguments Triton would run with that same kernel, and Triton's own launch takes over where the
direct one cannot go.

On the CPU a stand-in kernel records what Triton would have been asked; on a GPU the public ops,
which launch through it, must equal Triton's own launches on aligned and unaligned inputs.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
import triton

import online_softmax as osm
from support import assert_close, needs_gpu, randn


class Compiled:
    """A compiled kernel's launch entry: records each direct launch."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log, refuse=False):
        self.log, self.refuse = log, refuse

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_hook, *args):
        if self.refuse:
            raise TypeError("function takes exactly 35 arguments")
        self.log.append(("direct", (g0, g1, g2), args, stream))


class StandIn:
    """What DirectLauncher reads of a JIT function: parameter names and defaults, and ``[grid](...)``."""

    def __init__(self, refuse=False, compiles=True):
        def kernel(x_ptr, n, stride, scale, BLOCK, FLAG=False):
            pass
        self.params = [Param(p, p.name in ("BLOCK", "FLAG")) for p in inspect.signature(kernel).parameters.values()]
        self.arg_names = [p.name for p in self.params]
        self.log, self.refuse, self.compiles = [], refuse, compiles
        self.pre_run_hooks = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return Compiled(self.log, self.refuse) if self.compiles else None
        return launch


class Param:
    def __init__(self, p, is_constexpr):
        self.name, self.default, self.has_default = p.name, p.default, p.default is not inspect.Parameter.empty
        self.is_constexpr = is_constexpr


DEVICE = {"index": 0}


@pytest.fixture
def cuda_state(monkeypatch):
    """The two CUDA queries the launcher makes, answered on a machine without CUDA: the current
    device (DEVICE["index"]) and its raw stream (100 + the device); and Triton's version, the
    one direct launches are made for (``direct_launches_supported``)."""
    DEVICE["index"] = 0
    monkeypatch.setattr(triton, "__version__", "3.6.0")  # the Triton direct launches are made for
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: DEVICE["index"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 100 + device, raising=False)


def kinds(log):
    return [entry[0] for entry in log]


@pytest.mark.usefixtures("cuda_state")
def test_one_compile_per_argument_class_then_direct_launches_with_constexprs_in_order():
    kernel = StandIn()
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    launcher[(4,)](x, 17, 32, 0.5, BLOCK=128)
    launcher[(8, 2)](x, 33, 48, 0.25, BLOCK=128)  # 17 -> 33 and 32 -> 48: same classes
    assert kinds(kernel.log) == ["triton", "direct"]
    assert kernel.log[1][1:] == ((8, 2, 1), (x, 33, 48, 0.25, 128, False), 100)  # FLAG's default; device 0's stream


@pytest.mark.usefixtures("cuda_state")
@pytest.mark.parametrize("change", ["unaligned tensor", "dtype", "int becomes 1", "int becomes a multiple of 16",
                                    "int past 32 bits", "int past 63 bits", "constexpr", "constexpr's type",
                                    "float becomes int", "float becomes bool", "another device"])
def test_any_change_triton_specialises_on_compiles_again(change):
    kernel = StandIn()
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    base = dict(args=(x, 17, 32, 0.5), kwargs=dict(BLOCK=128))
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "unaligned tensor":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.half()
    elif change == "int becomes 1":
        args[1] = 1
    elif change == "int becomes a multiple of 16":
        args[1] = 16
    elif change == "int past 32 bits":
        args[1] = 2**31 + 1
    elif change == "int past 63 bits":
        args[1] = 2**63 + 1
    elif change == "constexpr":
        kwargs["BLOCK"] = 256
    elif change == "constexpr's type":
        kwargs["BLOCK"] = 128.0
    elif change == "float becomes int":
        args[3] = 2
    elif change == "float becomes bool":
        args[3] = True
    launcher[(1,)](*base["args"], **base["kwargs"])
    if change == "another device":
        DEVICE["index"] = 1
    if change in ("int past 63 bits",):  # from the i64 class of 2**31 + 1, not only from i32
        launcher[(1,)](x, 2**31 + 1, 32, 0.5, BLOCK=128)
        kernel.log.pop()
    launcher[(1,)](*args, **kwargs)
    launcher[(1,)](*args, **kwargs)
    assert kinds(kernel.log) == ["triton", "triton", "direct"]
    if change == "another device":
        assert kernel.log[-1][-1] == 101


@pytest.mark.usefixtures("cuda_state")
def test_another_triton_takes_the_public_launch_path(monkeypatch):
    """Direct launches call Triton's private launch internals: on any version but the one they
    are made for, every launch is ``kernel[grid](...)`` and nothing is kept; a kernel an eager
    call launches (``jit_kernel``) is then the JIT function itself."""
    monkeypatch.setattr(osm, "INTERPRET", False)  # as compiled: the gate itself
    monkeypatch.setattr(osm, "_LAUNCHERS", {})
    kernel = StandIn()
    assert osm.direct_launches_supported() and isinstance(osm.jit_kernel(kernel, traced=False), osm.DirectLauncher)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    monkeypatch.setattr(osm, "_LAUNCHERS", {})
    assert not osm.direct_launches_supported() and osm.jit_kernel(kernel, traced=False) is kernel
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    for _ in range(3):
        launcher[(1,)](x, 17, 32, 0.5, BLOCK=128)
    assert kinds(kernel.log) == ["triton", "triton", "triton"] and not launcher.usable
    assert launcher.replay((1,), (x, 17, 32, 0.5), dict(BLOCK=128), 1) is None


def test_the_public_launch_path_runs_the_kernel(monkeypatch):
    """A DirectLauncher on another Triton launches the real kernel through Triton (in the
    interpreter on a CPU): the softmax of each row, as torch's."""
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    launcher = osm.DirectLauncher(osm.softmax_row_kernel)
    x = randn((5, 24), torch.float32, seed=2)
    y = torch.empty_like(x)
    launcher[(5,)](x, y, 5, 24, 24, 24, BLOCK_SIZE=32, VEC=1, ROWS=1, num_warps=1)
    assert not launcher.usable
    torch.testing.assert_close(y, torch.softmax(x, -1))


def test_arguments_are_classed_inline_as_one_by_one():
    """A launch's classes, argument by argument, tell apart what Triton specialises on and nothing
    else: ints at each class's edges, bools beside the ints they equal, tensors aligned or not and
    a Parameter, floats, numpy ints (themselves), None and a string."""
    import numpy as np

    base = torch.zeros(64)
    args = (0, 1, 2, 16, 17, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, 2**64, True, False,
            1.0, 0.5, base, base[1:], base[4:], torch.nn.Parameter(base), np.int64(16), None, "ieee")
    assert osm._arg_classes(args) == tuple(map(osm._arg_class, args))
    assert osm._arg_classes((1,)) != osm._arg_classes((True,)) != osm._arg_classes((1.0,))
    c = osm._arg_class
    assert c(2) == c(3) == c(-1) and c(16) == c(32) == c(0) and c(0.5) == c(1.0) and c(True) == c(False)
    for a, b in ((1, 2), (16, 17), (2**31 - 1, 2**31), (-2**31, -2**31 - 1), (2**63 - 1, 2**63),
                 (np.int64(16), np.int64(32))):
        assert c(a) != c(b), (a, b)
    assert c(base) == c(base[4:]) == c(torch.nn.Parameter(base)) != c(base[1:])
    assert c(base) != c(base.half())


def test_tensor_descriptors_are_keyed_by_what_their_kernel_depends_on():
    """A host-side tensor descriptor (the Gluon attention's Q, K, V) keys on its type, block,
    padding, and the classes of its base, sizes and strides: equal for another tensor of the same
    classes, different where any of them changes, hashable throughout."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t, block=(16, 32)):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))

    a, b = torch.zeros(64, 32), torch.ones(64, 32)
    key = osm._arg_class(desc(a))
    hash(key)
    assert key == osm._arg_class(desc(b))
    assert key != osm._arg_class(desc(a, (32, 32)))
    assert key != osm._arg_class(desc(a.half()))
    assert key != osm._arg_class(desc(torch.zeros(1, 32)))  # a size of 1 Triton may treat as a constant
    assert key != osm._arg_class(desc(torch.zeros(64, 40)))  # a row stride no multiple of 16 elements


@pytest.mark.usefixtures("cuda_state")
def test_a_refused_direct_launch_falls_back_to_triton_for_good():
    kernel = StandIn(refuse=True)
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    for _ in range(3):
        launcher[(1,)](x, 17, 32, 0.5, BLOCK=128)
    assert kinds(kernel.log) == ["triton", "triton", "triton"] and not launcher.usable


@pytest.mark.usefixtures("cuda_state")
def test_launch_hooks_and_grid_functions_take_tritons_path(monkeypatch):
    kernel = StandIn()
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    launcher[(1,)](x, 17, 32, 0.5, BLOCK=128)
    launcher[lambda meta: (1,)](x, 17, 32, 0.5, BLOCK=128)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher[(1,)](x, 17, 32, 0.5, BLOCK=128)
    assert kinds(kernel.log) == ["triton", "triton", "triton"]


@pytest.mark.usefixtures("cuda_state")
@pytest.mark.parametrize("case", ["constexpr by position", "tensor by keyword", "no kernel returned", "pre-run hook",
                                  "hook chain"])
def test_what_the_key_cannot_hold_goes_through_triton_every_time(monkeypatch, case):
    kernel = StandIn(compiles=case != "no kernel returned")
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    args, kwargs = (x, 17, 32, 0.5), dict(BLOCK=128)
    if case == "constexpr by position":
        args, kwargs = (x, 17, 32, 0.5, 128), {}
    elif case == "tensor by keyword":
        args, kwargs = (), dict(x_ptr=x, n=17, stride=32, scale=0.5, BLOCK=128)
    elif case == "pre-run hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    elif case == "hook chain":
        chain = type("Chain", (), {"calls": [print], "__call__": lambda self, *a: None})()
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    for _ in range(3):
        launcher[(1,)](*args, **kwargs)
    assert kinds(kernel.log) == ["triton", "triton", "triton"]


@needs_gpu
def test_direct_launches_equal_tritons_own():
    """row_softmax on rows whose start is aligned and not, and widths of each class: the launches
    the public op makes directly give what Triton's own launches give, bit for bit."""
    x = randn((70, 1000 + 3), torch.float32, seed=5)
    cases = [x[:, :1000], x[:, 1:1001], x[:, 3:19], x[:, 2:3], x[:3, :1000]]
    osm.row_softmax(cases[0])
    launcher = osm._LAUNCHERS[osm.softmax_row_kernel]
    launcher.compiled.clear()
    direct = [osm.row_softmax(c) for c in cases]
    assert launcher.usable and len(launcher.compiled) >= 3
    launcher.usable = False
    try:
        for got, c in zip(direct, cases):
            assert torch.equal(got, osm.row_softmax(c))
    finally:
        launcher.usable = True


def kept(kernel, grid=(1,)):
    """(launcher, replay): a DirectLauncher of ``kernel`` after one launch, and that launch kept."""
    launcher = osm.DirectLauncher(kernel)
    args, options = (torch.zeros(64), 17, 32, 0.5), dict(BLOCK=128)
    launcher[grid](*args, **options)
    return launcher, launcher.replay(grid, args, options, 1)


@pytest.mark.usefixtures("cuda_state")
def test_a_replay_launches_the_kept_kernel_with_new_tensors_and_the_call_s_other_arguments():
    kernel = StandIn()
    _, replay = kept(kernel, (4, 2))
    x_next = torch.ones(64)
    DEVICE["index"] = 1  # the replay launches on the stream of the device it was kept on
    assert replay(x_next) is True
    assert kernel.log[-1] == ("direct", (4, 2, 1), (x_next, 17, 32, 0.5, 128, False), 100)


@pytest.mark.usefixtures("cuda_state")
@pytest.mark.parametrize("case", ["not launched yet", "pre-run hook", "no kernel returned"])
def test_no_replay_where_the_launch_was_not_direct(case):
    kernel = StandIn(compiles=case != "no kernel returned")
    launcher = osm.DirectLauncher(kernel)
    x = torch.zeros(64)
    if case == "pre-run hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    if case != "not launched yet":
        launcher[(1,)](x, 17, 32, 0.5, BLOCK=128)
    assert launcher.replay((1,), (x, 17, 32, 0.5), dict(BLOCK=128), 1) is None


@pytest.mark.usefixtures("cuda_state")
@pytest.mark.parametrize("hook", ["launch hook", "pre-run hook"])
def test_a_replay_declines_once_a_hook_is_set(monkeypatch, hook):
    kernel = StandIn()
    _, replay = kept(kernel)
    if hook == "launch hook":
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    else:
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    assert replay(torch.zeros(64)) is False
    assert kinds(kernel.log) == ["triton"]


class Step:
    """A kept launch's stand-in: records the tensors each launch gets."""

    def __init__(self, log, name, ready=True, refuse=False):
        self.log, self.name, self.is_ready, self.refuse = log, name, ready, refuse

    def ready(self):
        return self.is_ready

    def launch(self, *tensors):
        if self.refuse:
            return False
        self.log.append((self.name, tensors))
        return True


def test_a_chain_makes_its_buffers_each_call_and_launches_its_steps_in_order_over_their_slots():
    log, made = [], []

    def workspace(x, out):
        made.append(torch.empty(4))
        return made[-1]

    chain = osm.ReplayChain((workspace,), ((Step(log, "first"), (0, 1, 2)), (Step(log, "second"), (1, 2))))
    x, out = torch.zeros(3), torch.zeros(3)
    for _ in range(2):
        assert chain(x, out) is True
    assert len(made) == 2 and made[0] is not made[1]
    assert [name for name, _ in log] == ["first", "second"] * 2
    first, second = log[2][1], log[3][1]
    assert first[0] is x and first[1] is out and first[2] is made[1] and second == (out, made[1])


def test_a_chain_may_be_a_step_of_another_over_the_outer_chain_s_slots():
    """softmax(x @ W) unfused keeps the matmul's launch and the row softmax's (itself a chain for
    long rows) as one chain over (x, W, out) with the logits as its buffer."""
    log = []
    inner = osm.ReplayChain((lambda x, y: torch.empty(2),), ((Step(log, "split"), (0, 1, 2)),))
    outer = osm.ReplayChain((lambda x, W, out: torch.empty(5),), ((Step(log, "matmul"), (0, 1, 3)), (inner, (3, 2))))
    x, W, out = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert outer(x, W, out) is True
    assert [name for name, _ in log] == ["matmul", "split"]
    logits = log[0][1][2]
    assert log[0][1][:2] == (x, W) and log[1][1][0] is logits and log[1][1][1] is out and logits.shape == (5,)
    log.clear()
    stalled = osm.ReplayChain((), ((Step(log, "matmul"), (0, 1, 2)), (osm.ReplayChain((), ((Step(log, "row", ready=False), (0,)),)), (2,))))
    assert stalled(x, W, out) is False and log == []  # a step of the inner chain not ready: nothing launched


@pytest.mark.parametrize("case", ["a step not ready", "a step refused"])
def test_a_chain_that_cannot_run_whole_says_so(case):
    """Not ready: nothing launched, nothing allocated. Refused (the launcher of another Triton):
    False, so the wrapper's checked path computes the whole result again."""
    log, made = [], []
    steps = ((Step(log, "first"), (0,)), (Step(log, "second", ready=case != "a step not ready",
                                                 refuse=case == "a step refused"), (0,)))
    chain = osm.ReplayChain((lambda x: made.append(1) or torch.empty(1),), steps)
    assert chain(torch.zeros(1)) is False
    if case == "a step not ready":
        assert log == [] and made == []


def test_a_descriptor_replay_makes_each_call_s_descriptors_from_the_kept_ones_over_the_new_tensors():
    """The Gluon attention's kept launch: each call's Q, K, V get descriptors equal to the kept
    call's in all but their tensor (made without the class's checks), fresh objects each call,
    passed before the replay's own tensors; not ready or refused, it says so."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 32])

    log = []
    kept = [desc(torch.zeros(64, 32)), desc(torch.zeros(64, 32))]
    replay = osm.DescriptorReplay(Step(log, "gluon"), tuple(kept))
    q, k, out = torch.ones(64, 32), torch.full((64, 32), 2.0), torch.zeros(64)
    for _ in range(2):
        assert replay(q, k, out) is True
    (_, (dq, dk, got_out)), (_, (dq_again, _, _)) = log
    assert dq.base is q and dk.base is k and got_out is out and dq is not dq_again
    for made, was in ((dq, kept[0]), (dk, kept[1])):
        assert type(made) is TensorDescriptor and made is not was
        assert {**vars(was), "base": made.base} == vars(made)
    assert kept[0].base is not q  # the kept descriptors are left as they were
    assert osm.DescriptorReplay(Step(log, "gluon", ready=False), tuple(kept))(q, k, out) is False
    assert osm.DescriptorReplay(Step(log, "gluon", refuse=True), tuple(kept))(q, k, out) is False
    assert len(log) == 2


def test_kept_launches_are_one_store_emptied_when_full(monkeypatch):
    """Every op's shelf lives in one store (``KEPT_LAUNCHES``): one name gives one shelf, and the
    size limit counts the launches of all shelves; past it every shelf is emptied."""
    monkeypatch.setattr(osm, "KEPT_LAUNCHES", {})
    monkeypatch.setattr(osm, "KEPT_LAUNCH_LIMIT", 3)
    first, other = osm.Replays("first"), osm.Replays("other")
    assert osm.Replays("first") is first and osm.Replays("other") is not first
    first.keeper("a")("A")
    assert osm.Replays("first") == {"a": "A"}  # asked again, the shelf keeps what it holds
    other.keeper("a")("B")
    first.keeper("b")("C")
    assert (first, other) == ({"a": "A", "b": "C"}, {"a": "B"})
    other.keeper("c")("D")  # a fourth launch: the store was full
    assert (first, other) == ({}, {"c": "D"})
    first.keeper("a")("A")
    osm.forget_kept_launches()
    assert all(not shelf for shelf in osm.KEPT_LAUNCHES.values())


@pytest.mark.usefixtures("cuda_state")
def test_a_replay_refused_by_the_launcher_launches_nothing_and_turns_direct_launches_off():
    """The kept launch is the compiling call's, which Triton made: its first direct launch can
    still meet a launcher of another signature. Then the wrapper must take its checked path."""
    kernel = StandIn(refuse=True)
    launcher, replay = kept(kernel)
    assert replay(torch.zeros(64)) is False and not launcher.usable
    assert kinds(kernel.log) == ["triton"]


def test_option_keys_tell_apart_what_the_checks_tell_apart():
    """1, 1.0 and True are equal and hash alike, and so are dataclasses with such fields: a
    kept launch for one must not serve the other, which the checks would refuse."""
    assert len({osm.option_key(v) for v in (1, 1.0, True, None)}) == 4
    from fused_softmax_matmul import FusedLaunch
    assert FusedLaunch(128, 4, 2, lazy_rescale=True) == FusedLaunch(128, 4, 2, lazy_rescale=1)
    assert osm.option_key(FusedLaunch(128, 4, 2, lazy_rescale=True)) != osm.option_key(FusedLaunch(128, 4, 2, lazy_rescale=1))
    assert osm.option_key(FusedLaunch(128, 4, 2)) == osm.option_key(FusedLaunch(128, 4, 2))


def test_no_replay_key_for_what_a_replay_cannot_serve(monkeypatch):
    x = torch.zeros(3)
    assert osm.replay_key((x,), ()) is None  # interpreter mode (CI), or no GPU
    monkeypatch.setattr(osm, "INTERPRET", False)  # as compiled: the filters themselves
    assert osm.replay_key((x,), ()) is None  # a CPU tensor
    assert osm.replay_key(([1.0, 2.0],), ()) is None  # not a tensor
    assert osm.replay_key((x.to_sparse(),), ()) is None
    assert osm.replay_key((x,), ([1],)) is None  # an unhashable option


def test_kept_launches_call_the_c_launcher_only_where_known(monkeypatch):
    """``_c_launch``: a kept launch calls the compiled launcher's C function directly only for
    triton 3.6's CUDA launcher of a kernel with no scratch memory and an unwrapped C function;
    anything else (another Triton, scratch, tensor descriptors' wrapper) keeps the launcher."""

    def launcher(name="CudaLauncher", launch=len, scratch=0, profile=0):
        kind = type(name, (), {"launch": staticmethod(launch), "global_scratch_size": scratch,
                               "profile_scratch_size": profile, "launch_cooperative_grid": False,
                               "launch_pdl": True})
        return kind()

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert osm._c_launch(launcher()) == (len, (False, True, None, None))
    assert osm._c_launch(launcher(scratch=64)) is None
    assert osm._c_launch(launcher(profile=64)) is None
    assert osm._c_launch(launcher(launch=lambda *args: None)) is None  # a wrapper (tensor descriptors)
    assert osm._c_launch(launcher(name="HIPLauncher")) is None
    assert osm._c_launch(Compiled([]).run) is None
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert osm._c_launch(launcher()) is None


@needs_gpu
def test_kept_launch_passes_addresses_to_the_c_launcher():
    """On triton 3.6 a kept row_softmax launch calls the C function with its tensors' addresses
    (``_c_launch``), and gives the checked path's answer bit for bit, for inputs at other addresses."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the C launcher is called directly on triton 3.6 only")
    x, x_next = randn((64, 1000), torch.float32, seed=3), randn((64, 1000), torch.float32, seed=4)
    osm._ROW_REPLAYS.clear()
    osm.row_softmax(x)
    kept = osm._ROW_REPLAYS[osm.replay_key((x,), (None,))]
    assert isinstance(kept, osm.Replay) and kept.pointers and isinstance(kept.run, types.BuiltinFunctionType)
    again = osm.row_softmax(x_next)  # the kept launch, at x_next's address
    osm._ROW_REPLAYS.clear()
    assert torch.equal(again, osm.row_softmax(x_next))


@needs_gpu
def test_row_softmax_replays_equal_the_checked_path():
    """A call with an input of a kept key (another tensor) takes the kept launch: the checked
    path's answer bit for bit, for contiguous input of any rank and a row-strided view; a
    non-contiguous N-D input is not kept; an input that needs grad never takes a kept launch."""
    wide = randn((64, 1003), torch.float32, seed=6)
    other = randn((64, 1003), torch.float32, seed=16)
    cases = [(randn((64, 1000), torch.float32, seed=7), randn((64, 1000), torch.float32, seed=17)),
             (randn((4, 16, 300), torch.bfloat16, seed=8), randn((4, 16, 300), torch.bfloat16, seed=18)),
             (wide[:, :1000], other[:, :1000])]  # a row-strided view, then another of the same key
    for x, x_next in cases:
        osm._ROW_REPLAYS.clear()
        osm.row_softmax(x)
        key = osm.replay_key((x,), (None,))
        assert key in osm._ROW_REPLAYS and osm.replay_key((x_next,), (None,)) == key
        again = osm.row_softmax(x_next)  # the kept launch
        osm._ROW_REPLAYS.clear()
        assert torch.equal(again, osm.row_softmax(x_next))  # the checked path's answer, bit for bit
        torch.testing.assert_close(again, torch.softmax(x_next.float(), -1).to(x.dtype))
    # Not kept: a non-contiguous N-D input (its reshape copies) still gives torch's answer.
    t = randn((4, 300, 16), torch.float32, seed=19).transpose(1, 2)
    osm._ROW_REPLAYS.clear()
    for _ in range(2):
        torch.testing.assert_close(osm.row_softmax(t), torch.softmax(t, -1))
    assert not osm._ROW_REPLAYS
    x = cases[0][0].clone().requires_grad_()
    assert osm.replay_key((x,), (None,)) is None
    assert osm.row_softmax(x).grad_fn is not None


@needs_gpu
def test_eager_backwards_replay_their_kept_launch():
    """An eager backward of row_softmax or online_softmax keeps its launch under (y, dy)'s key
    (``_eager_backward``): a dense gradient and a broadcast one (row stride 0) are two keys. A
    backward of each key with other tensors (fresh x and gradient) runs that key's kept entry
    once (counted) and gives the checked path's dx bit for bit, and torch's within its error.
    The third row_softmax shape takes the backward's online tiles (two rows past the chip)."""
    cases = ((osm.row_softmax, osm._ROW_BACKWARD_REPLAYS, ((64, 1000), (4, 16, 300), (3, 40000))),
             (lambda t: osm.online_softmax(t, 16, 16), osm._ONLINE_BACKWARD_REPLAYS, ((64, 1000), (4, 16, 300))))
    for fn, replays, shapes in cases:
        for shape in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                x = randn(shape, dtype, seed=21).requires_grad_()
                grads = (randn(shape, dtype, seed=22), randn(shape[-1:], dtype, seed=23).expand(shape))
                replays.clear()
                for g in grads:
                    torch.autograd.grad(fn(x), x, g)
                assert len(replays) == 2, (shape, dtype)  # the two gradients' layouts: two keys
                uses = [counting(replays, key)[1] for key in list(replays)]
                # Other tensors at other addresses, of the same keys.
                x2 = (x.detach() * 1.5).requires_grad_()
                grads2 = (grads[0] * -0.5, randn(shape[-1:], dtype, seed=24).expand(shape))  # the same strides
                kept = [torch.autograd.grad(fn(x2), x2, g)[0] for g in grads2]
                assert uses == [[True], [True]], (shape, dtype)  # each key's entry ran once and launched
                replays.clear()
                for g, dx in zip(grads2, kept):
                    (checked,) = torch.autograd.grad(fn(x2), x2, g)
                    assert torch.equal(dx, checked), (shape, dtype)
                    x64 = x2.detach().double().requires_grad_()
                    (want,) = torch.autograd.grad(torch.softmax(x64, -1), x64, g.double())
                    (theirs,) = torch.autograd.grad(torch.softmax(x2, -1), x2, g)
                    assert_close(dx, want, theirs)


@needs_gpu
def test_online_softmax_replays_equal_the_checked_path():
    """online_softmax keeps its launch as row_softmax does: a second call of a kept key (another
    tensor) runs the kept launch (counted) and gives the checked path's answer bit for bit, for
    3-D, 1-D and a row-strided view; another tile size does not take it; a 4-D input whose batch
    dimensions do not fold into one (its reshape copies) is not kept; an input that needs grad
    has no key, and takes the autograd Function, whose forward (grad off) replays the kept
    launch: its output has a history and torch's gradient."""
    wide, other = randn((2, 64, 1003), torch.float32, seed=26), randn((2, 64, 1003), torch.float32, seed=27)
    cases = [(randn((4, 16, 300), torch.bfloat16, seed=28), randn((4, 16, 300), torch.bfloat16, seed=29), (16, 16)),
             (randn((4, 16, 300), torch.bfloat16, seed=28), randn((4, 16, 300), torch.bfloat16, seed=29), (4, 128)),
             (randn((777,), torch.float32, seed=30), randn((777,), torch.float32, seed=31), (16, 16)),
             (wide[..., :1000], other[..., :1000], (8, 64))]
    for x, x_next, blocks in cases:
        osm._ONLINE_REPLAYS.clear()
        osm.online_softmax(x, *blocks)
        key = osm.replay_key((x,), blocks)
        assert osm.replay_key((x_next,), blocks) == key
        kept, uses = counting(osm._ONLINE_REPLAYS, key)
        assert isinstance(kept, osm.Replay), x.shape
        again = osm.online_softmax(x_next, *blocks)
        assert uses == [True], x.shape
        osm._ONLINE_REPLAYS.clear()
        assert torch.equal(again, osm.online_softmax(x_next, *blocks)), x.shape
        torch.testing.assert_close(again, torch.softmax(x_next.float(), -1).to(x.dtype))
    t = randn((4, 2, 16, 300), torch.float32, seed=32).transpose(0, 1)  # batch dims that do not fold
    assert osm._as_3d(t).data_ptr() != t.data_ptr()
    osm._ONLINE_REPLAYS.clear()
    for _ in range(2):
        torch.testing.assert_close(osm.online_softmax(t), torch.softmax(t, -1))
    assert not osm._ONLINE_REPLAYS
    x, x_next = randn((4, 16, 300), torch.float32, seed=33), randn((4, 16, 300), torch.float32, seed=34)
    osm.online_softmax(x)
    kept, uses = counting(osm._ONLINE_REPLAYS, osm.replay_key((x,), (16, 16)))
    osm.online_softmax(x_next, 4, 128)  # another tile size: a launch and a key of its own
    assert uses == [] and len(osm._ONLINE_REPLAYS) == 2
    leaf = x_next.clone().requires_grad_()
    assert osm.replay_key((leaf,), (16, 16)) is None
    out = osm.online_softmax(leaf)
    assert uses == [True] and out.grad_fn is not None
    dy = randn(x.shape, torch.float32, seed=35)
    out.backward(dy)
    ref = x_next.clone().requires_grad_()
    torch.softmax(ref, -1).backward(dy)
    torch.testing.assert_close(leaf.grad, ref.grad)


@needs_gpu
def test_fused_softmax_and_matmul_replays_equal_the_checked_path():
    """softmax(x) @ V and the one-launch softmax(x @ W) calls: the kept launch of a second call
    gives what the first, checked, call gave."""
    import fused_softmax_matmul as fsm
    x, V = randn((2, 64, 300), torch.float32, seed=9), randn((2, 300, 64), torch.float32, seed=10)
    fsm._FUSED_REPLAYS.clear()
    first = fsm.fused_softmax(x, V)
    assert len(fsm._FUSED_REPLAYS) == 1
    assert torch.equal(first, fsm.fused_softmax(x.clone(), V.clone()))
    # The float32 matmul setting is part of the key: TF32 products are a launch of their own.
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        tf32 = fsm.fused_softmax(x, V)
    finally:
        torch.set_float32_matmul_precision(before)
    assert len(fsm._FUSED_REPLAYS) == 2 and tf32.shape == first.shape
    # A launch override is an option too.
    override = fsm.FusedLaunch(32, 4, 2)
    with_override = fsm.fused_softmax(x, V, 32, 32, launch=override)
    assert len(fsm._FUSED_REPLAYS) == 3
    assert torch.equal(with_override, fsm.fused_softmax(x.clone(), V.clone(), 32, 32, launch=override))
    xm, Wm = randn((64, 128), torch.bfloat16, seed=11), randn((128, 10), torch.bfloat16, seed=12)
    for name in ("matmul", "matmul_softmax_fused_simple", "matmul_softmax_fused_tiled"):
        fsm._MATMUL_REPLAYS.clear()
        op = getattr(fsm, name)
        first = op(xm, Wm)
        assert len(fsm._MATMUL_REPLAYS) == 1, name
        assert torch.equal(first, op(xm.clone(), Wm.clone())), name


def counting(replays, key):
    """Wrap the kept entry under key so that each use is recorded: the list of what it returned."""
    kept, uses = replays[key], []
    replays[key] = lambda *tensors: uses.append(kept(*tensors)) or uses[-1]
    return kept, uses


@needs_gpu
def test_kept_chains_and_online_launches_equal_the_checked_path():
    """Launches kept with their workspace or in tiles: the split-row kernel (float32 rows past the
    on-chip size; bf16 rows of an odd width), the online tiles (16-bit rows off 16 bytes by a
    stride one more than their width), the tiled softmax(x @ W) over several class tiles, with
    K split, and both. A call with another input of a kept key runs the kept entry (counted) and gives the
    checked path's answer bit for bit (the split-K reduction's order is fixed)."""
    import fused_softmax_matmul as fsm
    for shape, stride, dtype, kind in (((8, 65536), 65536, torch.float32, osm.SplitRowReplay),
                                       ((8, 50257), 50257, torch.bfloat16, osm.SplitRowReplay),
                                       ((8, 50257), 50258, torch.bfloat16, osm.Replay)):
        x, x_next = (randn((shape[0], stride), dtype, seed=seed)[:, :shape[1]] for seed in (20, 21))
        osm._ROW_REPLAYS.clear()
        osm.row_softmax(x)
        key = osm.replay_key((x,), (None,))
        kept, uses = counting(osm._ROW_REPLAYS, key)
        assert isinstance(kept, kind), shape
        again = osm.row_softmax(x_next)
        assert uses == [True], shape
        osm._ROW_REPLAYS.clear()
        assert torch.equal(again, osm.row_softmax(x_next)), shape
    W = randn((512, 1000), torch.float32, seed=23)
    device = torch.device("cuda", torch.cuda.current_device())
    assert fsm.tiled_launch(64, 1000, torch.float32, device, K=128).split_k == 1  # several class tiles
    assert fsm.tiled_launch(256, 50, torch.float32, device, K=512).split_k > 1  # K split
    assert fsm.tiled_launch(16, 1000, torch.float32, device, K=512).split_k > 1  # K split over class tiles
    for B, K, C in ((64, 128, 1000), (256, 512, 50), (16, 512, 1000)):
        x, x_next, Wc = randn((B, K), torch.float32, seed=22), randn((B, K), torch.float32, seed=24), W[:K, :C]
        fsm._MATMUL_REPLAYS.clear()
        fsm.matmul_softmax_fused_tiled(x, Wc)
        (key,) = fsm._MATMUL_REPLAYS
        kept, uses = counting(fsm._MATMUL_REPLAYS, key)
        assert isinstance(kept, osm.ReplayChain), (B, K, C)
        again = fsm.matmul_softmax_fused_tiled(x_next, Wc)
        assert uses == [True], (B, K, C)
        fsm._MATMUL_REPLAYS.clear()
        assert torch.equal(again, fsm.matmul_softmax_fused_tiled(x_next, Wc)), (B, K, C)


@needs_gpu
def test_unfused_softmax_of_logits_keeps_one_chain_of_both_launches():
    """matmul_softmax_unfused: the matmul's launch and the row softmax's (one launch, or the
    split-row launch with its workspace for long float32 rows) kept as one chain; a second call runs it and gives the
    checked path's answer bit for bit."""
    import fused_softmax_matmul as fsm
    for B, K, C in ((64, 128, 1000), (16, 64, 65536)):
        x, x_next, W = (randn(shape, torch.float32, seed=seed) for shape, seed in (((B, K), 30), ((B, K), 31), ((K, C), 32)))
        fsm._MATMUL_REPLAYS.clear()
        fsm.matmul_softmax_unfused(x, W)
        (key,) = fsm._MATMUL_REPLAYS
        kept, uses = counting(fsm._MATMUL_REPLAYS, key)
        assert isinstance(kept, osm.ReplayChain) and len(kept.steps) == 2, C
        again = fsm.matmul_softmax_unfused(x_next, W)
        assert uses == [True], C
        fsm._MATMUL_REPLAYS.clear()
        assert torch.equal(again, fsm.matmul_softmax_unfused(x_next, W)), C


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_function_replays_equal_the_checked_path(dtype):
    """FlashAttentionTriton.apply: a second call of the same key replays the forward's kept launch
    and the backward's kept chain (counted) and gives the checked path's O, dQ, dK, dV bit for
    bit; a call with a launch override keeps nothing; a strided view is a key of its own."""
    import fused_softmax_matmul as fsm

    def run(Q, K, V, launches=None):
        leaves = [t.detach().requires_grad_() for t in (Q, K, V)]  # their strides kept
        O = fsm.FlashAttentionTriton.apply(*leaves, True, launches)
        return [O.detach(), *torch.autograd.grad(O, leaves, torch.ones_like(O))]  # dO expanded: copied

    first = [randn((2, 300, 64), dtype, seed=s) for s in (40, 41, 42)]
    second = [randn((2, 300, 64), dtype, seed=s) for s in (43, 44, 45)]
    kept = fsm._FLASH_REPLAYS
    kept.clear()
    run(*first)
    (fkey,), (bkey,) = _flash_keys(kept)
    forward, forward_uses = kept[fkey][0], []
    kept[fkey] = ((lambda *t: forward_uses.append(forward(*t)) or forward_uses[-1]), *kept[fkey][1:])
    _, backward_uses = counting(kept, bkey)
    again = run(*second)
    assert forward_uses == [True] and backward_uses == [True]
    kept.clear()
    checked = run(*second)
    for name, got, want in zip(("O", "dQ", "dK", "dV"), again, checked):
        assert torch.equal(got, want), name
    kept.clear()
    run(*first, launches={"dq": fsm.flash_launches(64, dtype)["dq"]})
    assert not kept
    run(*first)
    strided = [randn((2, 600, 64), dtype, seed=s)[:, ::2] for s in (46, 47, 48)]  # row stride 128: another key
    run(*strided)
    assert [len(keys) for keys in _flash_keys(kept)] == [2, 2]


def _flash_keys(kept) -> tuple[list, list]:
    """FlashAttentionTriton's kept keys: the forwards' (entries (Replay, is_causal)), the backwards' (chains)."""
    return [k for k, v in kept.items() if isinstance(v, tuple)], [k for k, v in kept.items() if not isinstance(v, tuple)]


@needs_gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_gluon_forward_replays_equal_the_checked_path(monkeypatch, is_causal):
    """The Gluon forward (Hopper) is kept as a DescriptorReplay, and so is the Gluon dK/dV launch
    in the backward's chain: a second call of the same key replays them (the forward counted) and
    gives the checked path's O, and the backward's gradients, bit for bit."""
    import fused_softmax_matmul as fsm
    probe = torch.empty((1, 8, 128), dtype=torch.bfloat16, device="cuda")
    if fsm.gluon_flash_unsupported(probe, probe, probe) is not None:
        pytest.skip(fsm.gluon_flash_unsupported(probe, probe, probe))
    faster = fsm._gluon_faster
    monkeypatch.setattr(fsm, "_gluon_faster", lambda *args: tuple({"forward", *faster(*args)}))

    def run(Q, K, V):
        leaves = [t.detach().requires_grad_() for t in (Q, K, V)]
        O = fsm.FlashAttentionTriton.apply(*leaves, is_causal)
        return [O.detach(), *torch.autograd.grad(O, leaves, torch.ones_like(O))]

    first = [randn((2, 300, 128), torch.bfloat16, seed=s) for s in (50, 51, 52)]
    second = [randn((2, 300, 128), torch.bfloat16, seed=s) for s in (53, 54, 55)]
    kept = fsm._FLASH_REPLAYS
    kept.clear()
    run(*first)
    (fkey,), (bkey,) = _flash_keys(kept)
    forward = kept[fkey][0]
    assert isinstance(forward, osm.DescriptorReplay)
    uses = []
    kept[fkey] = ((lambda *t: uses.append(forward(*t)) or uses[-1]), *kept[fkey][1:])
    dkdv = kept[bkey].steps[1][0]
    assert isinstance(dkdv, osm.DescriptorReplay), "dK and dV by the Gluon kernel at d = 128, kept as such"
    again = run(*second)
    assert uses == [True]
    kept.clear()
    checked = run(*second)
    for name, got, want in zip(("O", "dQ", "dK", "dV"), again, checked):
        assert torch.equal(got, want), name


@needs_gpu
def test_a_kept_split_row_launch_captured_in_a_cuda_graph_makes_its_workspace_in_the_graph(monkeypatch):
    """Kept outside a capture, replayed inside one: the workspace is made in the graph (counters
    zero; a cached buffer would enter it): none of the cached buffers is handed to the launch,
    none is cached for the capture's stream (a pooled stream may reuse a handle an earlier
    test cached under), and the graph's replays give the eager answer."""
    static_x = randn((8, 65536), torch.float32, seed=25)
    osm._ROW_REPLAYS.clear()
    osm.row_softmax(static_x)
    key = osm.replay_key((static_x,), (None,))
    kept, uses = counting(osm._ROW_REPLAYS, key)
    before = set(osm._SPLIT_WORKSPACES)
    cached = {id(t) for pair in osm._SPLIT_WORKSPACES.values() for t in pair}
    handed, workspace = [], osm._split_workspace
    monkeypatch.setattr(osm, "_split_workspace", lambda *a, **k: handed.append(workspace(*a, **k)) or handed[-1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            static_y = osm.row_softmax(static_x)
    torch.cuda.current_stream().wait_stream(side)
    assert uses == [True] and set(osm._SPLIT_WORKSPACES) == before
    assert handed and not cached & {id(t) for pair in handed for t in pair}, "a cached workspace entered the graph"
    for seed in (26, 27):
        static_x.copy_(randn((8, 65536), torch.float32, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, osm.row_softmax(static_x.clone()))
