"""Benchmark group model_step: one training step of a decoder-only transformer (tests/models.py)
with PyTorch's attention and loss or the project's, eager and under ``torch.compile(model)``.

A timed call is one step: forward under bfloat16 autocast, backward, fused AdamW's step, gradients
set to None. Every case starts from the same initialisation and trains on the same batch; before
its timing it trains ``TRACE_STEPS`` steps and compares its losses with PyTorch's eager ones at the
same steps (max_loss_diff). loss_noise is bfloat16's own share of that: PyTorch's eager bfloat16
losses against its float32 ones. On the GPU a project case fails when its losses are further from
the float32 ones than twice PyTorch's eager bfloat16 losses are (the project's accuracy rule).
step_ms is the GPU's time a step (the harness keeps the GPU busy while the host enqueues);
wall_ms is a training loop's: steps back to back, timed until the GPU has run them, the host's
enqueueing included, where a host-bound step is slower than its step_ms. host_us is the host's
time to enqueue one step while the GPU is kept busy; empty for a step that reads a value back: it
waits for the GPU there, and the host's own time cannot be told apart.

    pytest --benchmark-only -p no:xdist tests/test_bench_model_step.py

``test_profile_compiled_step`` (a GPU and SOFTMAX_KERNELS_PROFILE=1) profiles the compiled steps
of both implementations and writes model_step_profile.txt / .json beside the group's CSV:

    SOFTMAX_KERNELS_PROFILE=1 pytest -p no:xdist tests/test_bench_model_step.py -k profile
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import BenchGroup, outputs_dir
from models import CONFIGS, IMPLS, Transformer, make_optimizer, token_batch, train_step
from support import DEVICE, ON_GPU, UNIT_ROUNDOFF, needs_gpu

GROUP = BenchGroup(
    name="model_step",
    csv="model_step_benchmark.csv",
    columns=("config", "impl", "compiled", "step_ms", "speedup_vs_torch", "wall_ms", "tokens_per_s", "peak_MiB",
             "loss_first", "loss_last", "max_loss_diff", "loss_noise", "loss_error"),
    case=("config", "compiled"),
    impls=IMPLS,
    speedups={"speedup_vs_torch": "torch"},
    aliases={"step_ms": "forward_ms_mean", "peak_MiB": "forward_peak_MiB"},
    per_second={"tokens_per_s": "tokens"},
    plot=("bar", "speedup_vs_torch"),
    # A step is 20-200 ms and the case has trained TRACE_STEPS steps already: a few warm-up
    # steps and 20 rounds keep the group (compiles included) within minutes.
    warmup=3,
    rounds=20,
)

if ON_GPU:
    CONFIG_NAMES = ("gpt2", "llama")
    MODES = ("eager", "compile")
    AUTOCAST = torch.bfloat16
    TRACE_STEPS = 10
else:
    # A smoke test: the interpreter runs every kernel program one after another, and Inductor
    # on the CPU compiles C++ for tens of seconds; bfloat16 products are wrong in the interpreter.
    CONFIG_NAMES = ("tiny-llama",)
    MODES = ("eager",)
    AUTOCAST = None
    TRACE_STEPS = 2

# wall_ms: the median over WALL_ROUNDS of a step's share of WALL_STEPS steps back to back (a round
# fills and drains the GPU's queue once: over 20 steps, a few % of a step at most).
WALL_STEPS, WALL_ROUNDS = (20, 5) if ON_GPU else (1, 1)

# PyTorch's eager losses per (config, autocast dtype), from the case that made them.
_TRACES: dict = {}


def build_model(name: str, impl: str, mode: str):
    """(model, optimizer, the callable a step calls): the shared initialisation on the device."""
    with torch.device(DEVICE):
        model = Transformer(CONFIGS[name], impl=impl, seed=0)
    optimizer = make_optimizer(model)
    # Not conftest's ``compiled``: its cache would keep every model (tens of GB) alive.
    return model, optimizer, torch.compile(model, dynamic=False) if mode == "compile" else model


def loss_trace(state: dict, name: str, steps: int, autocast) -> list[float]:
    """Train state's model ``steps`` steps on the shared batch; the losses, read back once."""
    inputs, targets = token_batch(CONFIGS[name], DEVICE, seed=0)
    losses = [train_step(state["call"], state["optimizer"], inputs, targets, autocast) for _ in range(steps)]
    return torch.stack(losses).tolist()


def torch_trace(name: str, autocast) -> list[float]:
    """PyTorch's eager losses over TRACE_STEPS steps at this precision, made once per config."""
    key = (name, autocast)
    if key not in _TRACES:
        state = dict(zip(("model", "optimizer", "call"), build_model(name, "torch", "eager")))
        try:
            _TRACES[key] = loss_trace(state, name, TRACE_STEPS, autocast)
        finally:
            release(state)
    return _TRACES[key]


def release(state: dict) -> None:
    state.clear()
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def loop_ms(step, steps: int, rounds: int) -> float:
    """A training loop's time a step (ms): the median over ``rounds`` of ``steps`` steps run back to
    back, from the first one's call until the GPU has run the last."""
    times = []
    collecting = gc.isenabled()
    gc.disable()  # as the harness's timed rounds: no collection inside a round
    try:
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            times.append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        if collecting:
            gc.enable()
    return statistics.median(times)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


CASES = [(name, mode, impl) for name in CONFIG_NAMES for mode in MODES for impl in IMPLS]


@pytest.mark.parametrize("config,compiled,impl", CASES)
def test_model_step(bench, config, compiled, impl):
    state: dict = {}  # the model lives here only, so release() frees it whatever holds the step
    found: dict = {}

    def build():
        # The references first, each freed before this case's model is built.
        reference = None if (impl, compiled) == ("torch", "eager") else torch_trace(config, AUTOCAST)
        float32 = torch_trace(config, None) if AUTOCAST is not None else None
        state.update(zip(("model", "optimizer", "call"), build_model(config, impl, compiled)))
        losses = loss_trace(state, config, TRACE_STEPS, AUTOCAST)
        if reference is None:
            _TRACES[(config, AUTOCAST)] = reference = losses
        found.update(losses=losses, float32=float32, reference=reference)
        inputs, targets = token_batch(CONFIGS[config], DEVICE, seed=0)

        def step():
            return train_step(state["call"], state["optimizer"], inputs, targets, AUTOCAST)

        found["step"] = step
        return step, None

    def trace_columns(_out, _inputs) -> dict:
        losses, float32 = found["losses"], found["float32"]
        columns = {"loss_first": losses[0], "loss_last": losses[-1],
                   "max_loss_diff": max_abs_diff(losses, found["reference"]),
                   "wall_ms": loop_ms(found["step"], WALL_STEPS, WALL_ROUNDS)}
        if float32 is not None:
            columns.update(loss_noise=max_abs_diff(_TRACES[(config, AUTOCAST)], float32),
                           loss_error=max_abs_diff(losses, float32))
        return columns

    def trace_bounds(_inputs) -> dict:
        # The row is judged by its losses against float32's (loss_error) where there is a float32
        # trace: at most twice PyTorch's own bfloat16 error (loss_noise), with a floor of a few
        # float32 roundings of the loss for steps where PyTorch's error happens to vanish. The
        # other columns are the record's, bounded only by being numbers.
        bounds = dict.fromkeys(("loss_first", "loss_last", "max_loss_diff", "wall_ms"), math.inf)
        float32 = found["float32"]
        if float32 is not None:
            floor = 4 * UNIT_ROUNDOFF[torch.float32] * max(map(abs, float32))
            bounds.update(loss_noise=math.inf,
                          loss_error=2 * max_abs_diff(_TRACES[(config, AUTOCAST)], float32) + floor)
        return bounds

    cfg = CONFIGS[config]
    try:
        bench(GROUP, dict(config=config, impl=impl, compiled=compiled, tokens=cfg.tokens), build,
              error=trace_columns, bound=trace_bounds)
    finally:
        release(state)
        if compiled == "compile":
            torch._dynamo.reset()  # its graphs and guards of this model go with it


def test_model_step_table_columns():
    """The group's named columns come from the harness's: step_ms, peak_MiB, tokens_per_s."""
    import pandas as pd

    from conftest import group_table

    rows = [dict(config="c", impl="torch", compiled="eager", tokens=1000, forward_ms_mean=4.0, forward_peak_MiB=10.0),
            dict(config="c", impl="project", compiled="eager", tokens=1000, forward_ms_mean=2.0, forward_peak_MiB=5.0),
            dict(config="c", impl="project", compiled="compile", tokens=1000, forward_ms_mean=None)]
    df = group_table(GROUP, rows).set_index(["impl", "compiled"])
    assert df.loc[("project", "eager"), "step_ms"] == 2.0 and df.loc[("project", "eager"), "peak_MiB"] == 5.0
    assert df.loc[("project", "eager"), "tokens_per_s"] == 500_000.0
    assert df.loc[("torch", "eager"), "tokens_per_s"] == 250_000.0
    assert df.loc[("project", "eager"), "speedup_vs_torch"] == 2.0
    assert pd.isna(df.loc[("project", "compile"), "tokens_per_s"])


# ----------------------------------------------------------------------------------------------
# Where the compiled step's time goes: torch.profiler over a few compiled steps of each impl
# ----------------------------------------------------------------------------------------------
PROFILE_STEPS = 5
PROFILE_WARMUP = 3  # the first compiles, the next two settle the allocator and any recompile
TOP = 15


def _table(rows: list[tuple], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), *map(line, rows)])


def device_work(events) -> list:
    """A profile's GPU work (kernels, copies, memsets), longest first: not the ranges record_function
    marks on the GPU's timeline too (the step's own, the optimizer's), which span that work (so
    torch's own tables leave them out of device time)."""
    device = torch.autograd.DeviceType.CUDA
    return sorted((e for e in events if e.device_type == device and e.self_device_time_total > 0
                   and not getattr(e, "is_user_annotation", False)),
                  key=lambda e: e.self_device_time_total, reverse=True)


def test_profile_counts_device_work_only():
    """The step's and the optimizer's ranges on the GPU's timeline are not kernels: counted, the GPU's
    time a step passed its wall time (a negative idle time)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    event = lambda key, device, us, annotation=False: SimpleNamespace(  # noqa: E731
        key=key, device_type=device, self_device_time_total=us, is_user_annotation=annotation)
    events = [event("model_step", cuda, 900.0, True), event("gemm", cuda, 300.0),
              event("Optimizer.step", cuda, 50.0, True), event("softmax", cuda, 400.0), event("aten::mm", cpu, 0.0),
              event("idle", cuda, 0.0)]
    assert [e.key for e in device_work(events)] == ["softmax", "gemm"]


def profile_compiled_step(name: str, impl: str) -> dict:
    """Compile, warm up, then profile PROFILE_STEPS steps: kernels and host ops by time, Dynamo's
    and Inductor's counts. Compiled from scratch: a graph from Inductor's on-disk cache would
    skip the passes whose counts are read here."""
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import ReinplaceCounters, counters

    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    state = dict(zip(("model", "optimizer", "call"), build_model(name, impl, "compile")))
    inputs, targets = token_batch(CONFIGS[name], DEVICE, seed=0)

    def step():
        return train_step(state["call"], state["optimizer"], inputs, targets, AUTOCAST)

    def steps_timed():
        """(host seconds to enqueue PROFILE_STEPS steps, seconds until the GPU has run them)."""
        t0 = time.perf_counter()
        for _ in range(PROFILE_STEPS):
            with torch.profiler.record_function("model_step"):
                step()
        host_s = time.perf_counter() - t0
        sync()
        return host_s, time.perf_counter() - t0

    fresh = (torch._inductor.config.patch(fx_graph_cache=False),
             torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        with fresh[0], fresh[1]:
            t0 = time.perf_counter()
            step()
            sync()
            compile_s = time.perf_counter() - t0
            for _ in range(PROFILE_WARMUP - 1):
                step()
            sync()
        dynamo = {"graph_breaks": sum(counters["graph_break"].values()),
                  "graph_break_reasons": dict(counters["graph_break"]),
                  "frames_compiled": counters["frames"]["ok"], "unique_graphs": counters["stats"]["unique_graphs"],
                  # Mutated arguments of Triton kernels and custom ops that Inductor copied instead
                  # of writing in place (a copy per call, in every step).
                  "not_reinplaced": dict(getattr(ReinplaceCounters, "_values", {}))}
        # Unprofiled first (the profiler's own host cost is in the second figures), both after
        # the warm-up: a frame compiled during them is a recompile, counted below.
        plain_host_s, plain_wall_s = steps_timed()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if ON_GPU else [])
        with torch.profiler.profile(activities=activities) as prof:
            host_s, wall_s = steps_timed()
        dynamo["recompiled_while_timed"] = counters["frames"]["ok"] - dynamo["frames_compiled"]
    finally:
        release(state)
        torch._dynamo.reset()
    events = prof.key_averages()
    device = torch.autograd.DeviceType.CUDA
    kernels = device_work(events)
    host_ops = sorted((e for e in events if e.device_type != device and e.key != "model_step"),
                      key=lambda e: e.self_cpu_time_total, reverse=True)
    gpu_us = sum(e.self_device_time_total for e in kernels)
    steps = PROFILE_STEPS
    return {
        "config": name, "impl": impl, "compile_s": compile_s, **dynamo,
        "host_ms_per_step": 1e3 * plain_host_s / steps, "wall_ms_per_step": 1e3 * plain_wall_s / steps,
        "profiled_host_ms_per_step": 1e3 * host_s / steps, "profiled_wall_ms_per_step": 1e3 * wall_s / steps,
        "gpu_ms_per_step": gpu_us / 1e3 / steps,
        # The GPU's idle time between kernels: a host-bound step's excess over its kernels.
        "gpu_idle_ms_per_step": 1e3 * wall_s / steps - gpu_us / 1e3 / steps,
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "top_kernels": [(e.key[:110], round(e.self_device_time_total / 1e3 / steps, 3), round(e.count / steps, 1))
                        for e in kernels[:TOP]],
        "top_host_ops": [(e.key[:110], round(e.self_cpu_time_total / 1e3 / steps, 3), round(e.count / steps, 1))
                         for e in host_ops[:TOP]],
        # The project's ops as the compiled step calls them (opaque custom ops run their Python each call).
        "project_ops": [(e.key[:110], round(e.cpu_time_total / 1e3 / steps, 3), round(e.count / steps, 1))
                        for e in host_ops if e.key.startswith("softmax_kernels::")],
    }


@needs_gpu
@pytest.mark.skipif(os.environ.get("SOFTMAX_KERNELS_PROFILE") != "1",
                    reason="a diagnostic, not a check: set SOFTMAX_KERNELS_PROFILE=1 to run it")
def test_profile_compiled_step(request):
    name = os.environ.get("SOFTMAX_KERNELS_PROFILE_CONFIG", "gpt2")
    results = [profile_compiled_step(name, impl) for impl in IMPLS]
    parts = []
    for r in results:
        summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                   if k not in ("top_kernels", "top_host_ops", "project_ops")}
        parts += [f"== {r['config']} {r['impl']} compiled: {json.dumps(summary)}",
                  f"-- top {TOP} kernels by GPU time (per step)",
                  _table(r["top_kernels"], ("kernel", "gpu_ms", "calls")),
                  f"-- top {TOP} host ops by self CPU time (per step)",
                  _table(r["top_host_ops"], ("op", "cpu_ms", "calls")),
                  "-- the project's custom ops (CPU time with children, per step)",
                  _table(r["project_ops"], ("op", "cpu_ms", "calls")) if r["project_ops"] else "none", ""]
    out = outputs_dir(request.config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_step_profile.txt").write_text("\n".join(parts), encoding="utf-8")
    (out / "model_step_profile.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print("\n".join(parts))
    for r in results:
        assert r["recompiled_while_timed"] == 0, f"{r['impl']}: recompiled after its warm-up steps"
