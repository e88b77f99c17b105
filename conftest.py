"""The one harness: device detection, the benchmark timer fixture, machine info and the CSV hook.

Device detection happens here, at import, before any test module imports a kernel: without a
GPU, Triton must run in interpreter mode, and Triton reads TRITON_INTERPRET when a kernel is
decorated.

A benchmark is a parametrized test that calls the ``bench`` fixture with its ``BenchGroup`` (the
group's CSV, columns and baselines, declared once as data in the test module), the row that
identifies the case, and a function that builds the inputs and returns the callable to time.
The fixture times that callable with CUDA events through pytest-benchmark (so its JSON, compare
and compare-fail see the numbers), measures peak memory, and keeps one record per case — measured
or failed, with the reason. At the end of the session one hook writes every group's CSV from
those records and prints a summary with speed-ups.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
ON_GPU = os.environ.get("TRITON_INTERPRET", "0") != "1"

import pytest  # noqa: E402
import triton  # noqa: E402

ROOT = Path(__file__).resolve().parent
_GROUPS: dict = {}
MiB = 2**20
L2_FLUSH_BYTES = 256 * MiB  # several times any current L2 (H100: 50 MB), as triton's do_bench does


# ----------------------------------------------------------------------------------------------
# Benchmark groups: declared once, as data, in the test modules
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchGroup:
    """One table of results: a pytest-benchmark group and the CSV it feeds.

    ``case`` names the row keys that identify one problem across implementations; ``speedups``
    maps a CSV column to the implementation it divides by (speed-up = baseline time / this time);
    ``csv_impls`` limits the CSV to some implementations (the others still land in the JSON).
    """

    name: str
    csv: str
    columns: tuple[str, ...]
    case: tuple[str, ...]
    impls: tuple[str, ...]
    speedups: dict = dataclasses.field(default_factory=dict)
    # The group's plot beside its CSV: ("line", x column) draws time and peak memory against x,
    # one line per implementation (and block size), one panel per other case value;
    # ("bar", metric) draws metric per case, one bar per implementation. None: no plot.
    plot: tuple[str, str] | None = None
    csv_impls: tuple[str, ...] | None = None
    sort: tuple[str, ...] | None = None  # default: case columns, then impl order
    warmup: int = 10
    rounds: int = 100

    def __post_init__(self):
        _GROUPS[self.name] = self  # the session-end hook finds a group's CSV layout by its name


METRICS = ("forward_ms_mean", "forward_ms_std", "forward_ms_median", "forward_ms_min",
           "forward_peak_MiB", "forward_extra_MiB", "gbps", "tflops", "pct_of_copy", "pct_of_matmul_peak", "rel_error")
# Every key the harness writes into a benchmark's extra_info beside the row's own keys. A row key
# of one of these names would be overwritten in the JSON (a "mode" key once lost the attention
# rows' fwd / fwd_bwd there), so the bench fixture refuses it.
HARNESS_KEYS = frozenset(METRICS) | {"stalled_rounds", "host_bound", "bytes_moved", "flops", "l2_flush", "execution"}

# Failures that say "this configuration does not fit this machine": the row stays empty, the test
# is skipped with the reason. Anything else is a bug: the row stays empty and the test fails.
RESOURCE_ERRORS = (torch.OutOfMemoryError, triton.runtime.errors.OutOfResources)


def _is_resource_limit(exc: BaseException) -> bool:
    from online_softmax import KernelCapacityError  # after TRITON_INTERPRET is settled above

    if isinstance(exc, (*RESOURCE_ERRORS, KernelCapacityError)):
        return True
    text = f"{type(exc).__name__}: {exc}"
    # A failing tl.static_assert: CompileTimeAssertionFailure, or wrapped in a CompilationError,
    # or an InterpreterError in interpreter mode. Kernels assert their resource limits this way.
    return ("static_assert" in text or "CompileTimeAssertion" in text or "out of memory" in text.lower()
            or _interpreter_static_assert(exc))


def _interpreter_static_assert(exc: BaseException) -> bool:
    """True when the interpreter's tl.static_assert raised somewhere in exc's chain.

    The interpreter reports a failing static_assert as InterpreterError("AssertionError('msg')"),
    the same text as a failing tl.device_assert (a bug, not a limit): only the frame that raised
    tells them apart.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "_new_static_assert":  # triton/runtime/interpreter.py
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


# ----------------------------------------------------------------------------------------------
# Options and configuration
# ----------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("softmax-kernels benchmarks")
    group.addoption("--l2-flush", action=argparse.BooleanOptionalAction, default=True,
                    help="flush the L2 cache before every timed round (default: on; --no-l2-flush to turn off)")
    group.addoption("--outputs-dir", default=None,
                    help="where the CSVs go (default: outputs/ on a GPU, outputs/cpu/ in interpreter mode)")
    group.addoption("--bench-rounds", type=int, default=None,
                    help="timed rounds per case (default: each group's own; 2 in interpreter mode)")
    group.addoption("--bench-warmup", type=int, default=None,
                    help="warm-up rounds per case (default: each group's own; 1 in interpreter mode)")


def gpu_slug() -> str:
    if not ON_GPU:
        return "interpreter"
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU running compiled Triton")
    config.bench_records = []
    config.bench_deselected = False
    # pytest-benchmark reads its storage in its own (trylast) pytest_configure, after this one:
    # keep each GPU kind's saved runs apart unless the user chose a storage.
    storage = getattr(config.option, "benchmark_storage", None)
    if storage in ("file://./.benchmarks", None) and hasattr(config.option, "benchmark_storage"):
        config.option.benchmark_storage = f"file://./.benchmarks/{gpu_slug()}"
    if _option_or(config, "bench_rounds", 1) < 1 or _option_or(config, "bench_warmup", 0) < 0:
        raise pytest.UsageError("--bench-rounds must be at least 1 and --bench-warmup at least 0")


def _option_or(config, name: str, default):
    value = config.getoption(name)
    return default if value is None else value


def pytest_deselected(items):
    if items:
        items[0].config.bench_deselected = True


def outputs_dir(config) -> Path:
    """GPU results go to outputs/; interpreter and partial runs never overwrite them."""
    chosen = config.getoption("outputs_dir")
    committed = ROOT / "outputs"
    if chosen:
        path = Path(chosen).resolve()
        if not ON_GPU and path == committed:
            raise pytest.UsageError("interpreter-mode benchmarks may not write into outputs/, which holds GPU results")
        return path
    if not ON_GPU:
        return committed / "cpu"
    partial = config.bench_deselected or any("::" in a for a in config.args)
    return committed / "partial" if partial else committed


# ----------------------------------------------------------------------------------------------
# Machine ceilings, measured once per run
# ----------------------------------------------------------------------------------------------
_CEILINGS: dict = {}


def _time_ms(fn, reps: int) -> float:
    """Median time of fn in ms: CUDA events on a GPU, the wall clock on CPU."""
    fn()
    times = []
    for _ in range(reps):
        if ON_GPU:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9 (the memory ceiling)."""
    if "copy" not in _CEILINGS:
        n = (1 << 30 if ON_GPU else 1 << 26) // 4
        src = torch.empty(n, dtype=torch.float32, device="cuda" if ON_GPU else "cpu").uniform_()
        dst = torch.empty_like(src)
        ms = _time_ms(lambda: dst.copy_(src), 20 if ON_GPU else 5)
        _CEILINGS["copy"] = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
        del src, dst
    return _CEILINGS["copy"]


def matmul_peak_tflops(dtype: torch.dtype) -> float | None:
    """cuBLAS rate on a large square product in dtype under the current float32 precision (GPU only)."""
    if not ON_GPU:
        return None
    key = ("matmul", dtype, torch.get_float32_matmul_precision())
    if key not in _CEILINGS:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        ms = _time_ms(lambda: a @ b, 10)
        _CEILINGS[key] = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
    return _CEILINGS[key]


def pytest_benchmark_update_machine_info(config, machine_info):
    info = {
        "mode": "compiled" if ON_GPU else "interpreter (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "l2_flush": bool(config.getoption("l2_flush")),
        "gpu_clock_cycles_per_ms": _CEILINGS.get("cycles_per_ms"),
        "copy_bandwidth_GBps": _CEILINGS.get("copy"),
        "matmul_peaks_TFLOPs": {f"{k[1]}|{k[2]}": v for k, v in _CEILINGS.items() if isinstance(k, tuple)},
    }
    if ON_GPU:
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name, sm_count=props.multi_processor_count, memory_MiB=props.total_memory // MiB,
            capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda, driver=_driver_version(),
            l2_MiB=getattr(props, "L2_cache_size", 0) / MiB,
        )
    machine_info["gpu"] = info


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def pytest_benchmark_update_json(config, benchmarks, output_json):
    # A case that failed never reaches pytest-benchmark's list: keep its reason beside the numbers.
    output_json["failed_cases"] = [r for r in config.bench_records if r["status"] != "ok"]


# ----------------------------------------------------------------------------------------------
# The timer and the bench fixture
# ----------------------------------------------------------------------------------------------
class EventTimer:
    """A pytest-benchmark timer that reports device time measured by CUDA events.

    pytest-benchmark only ever uses end minus start of a timer. ``measured(fn)`` wraps the target:
    it records events around the call alone, waits for them, and adds the elapsed time to a float64
    running total, which the timer returns. So each round's duration is exactly the events'
    reading: no launch gap, synchronisation or Python between rounds is counted. Short deltas
    are summed in float64 rather than read against one aging reference event, whose float32
    milliseconds would lose resolution. Without a GPU the wall clock is used the same way.

    Before each round the GPU spins for ``spin_ms`` while Python enqueues fn's kernels, so the
    start event fires with them already queued. A round whose enqueueing took longer than the
    spin (the host stalled: the OS, another thread) may have left the GPU idle inside the events;
    it is thrown away and run again, after ``before_retry`` (the L2 flush), at most
    ``MAX_RETRIES`` times, and counted in ``stalled_rounds``. A function whose enqueueing needs
    more than the longest spin (SPIN_CAP_MS), or outlasts the spin on every try of one round, is
    host bound by nature (a Python loop of many small kernels: once CUDA's launch queue is full,
    each launch waits for the GPU, so the queueing time is the GPU's time): from then on its
    rounds are kept as they come (``host_bound``).
    """

    MAX_RETRIES = 3

    def __init__(self, label: str, spin_cycles: int = 0, spin_ms: float = 0.0, before_retry=None):
        self.total = 0.0
        self.label = label
        self.spin_cycles = spin_cycles
        self.spin_ms = spin_ms
        self.before_retry = before_retry
        self.stalled_rounds = 0
        self.host_bound = spin_ms >= SPIN_CAP_MS
        if ON_GPU:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self) -> float:
        return self.total

    def timed_call(self, fn):
        """(seconds fn took, ms the host spent enqueueing it after the spin began, fn's result)."""
        if not ON_GPU:
            t0 = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - t0
            return seconds, seconds * 1e3, result
        torch.cuda.nvtx.range_push(self.label)
        t0 = time.perf_counter()
        if self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)
        self.start.record()
        result = fn()
        self.end.record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        self.end.synchronize()
        torch.cuda.nvtx.range_pop()
        return self.start.elapsed_time(self.end) * 1e-3, enqueue_ms, result

    def measured(self, fn):
        def run():
            for attempt in range(self.MAX_RETRIES + 1):
                seconds, enqueue_ms, result = self.timed_call(fn)
                if not self.spin_ms or self.host_bound or enqueue_ms < self.spin_ms:
                    break
                if attempt == self.MAX_RETRIES:
                    self.host_bound = True
                    break
                self.stalled_rounds += 1
                result = None
                if self.before_retry is not None:
                    self.before_retry()
            self.total += seconds
            return result

        return run


SPIN_CAP_MS = 50.0


def spin_cycles_for(fn) -> tuple[int, float]:
    """(GPU clock cycles, ms) to spin before each timed round: twice the CPU time fn takes to
    enqueue its work plus 0.1 ms for the timer's own calls (at least 0.2 ms, at most
    SPIN_CAP_MS), so the GPU never waits on the launching Python.

    At 0.05 ms (the floor before) the enqueueing of one Triton launch with the events, ~0.05 ms,
    overran the spin in up to 93 of the 100 rounds of a case in an H100 run (7689b67)."""
    if not ON_GPU:
        return 0, 0.0
    if "cycles_per_ms" not in _CEILINGS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm the clock up first
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CEILINGS["cycles_per_ms"] = 10_000_000 / start.elapsed_time(end)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    spin_ms = min(SPIN_CAP_MS, max(0.2, 2 * host_ms + 0.1))
    return int(_CEILINGS["cycles_per_ms"] * spin_ms), spin_ms


def _sync():
    if ON_GPU:
        torch.cuda.synchronize()


def peak_memory(fn) -> tuple[float | None, float | None]:
    """(peak, peak above what was allocated before) in MiB for one call of fn, on a GPU."""
    if not ON_GPU:
        return None, None
    gc.collect()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    _sync()
    peak = torch.cuda.max_memory_allocated()
    del result
    return peak / MiB, (peak - before) / MiB


def _free_memory():
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


@pytest.fixture
def bench(benchmark, request):
    """Time one case: ``bench(group, row, build, bytes_moved=None, flops=None, dtype=None, error=None)``.

    ``build()`` allocates the inputs and returns the zero-argument callable to time, so an
    allocation failure is recorded like any other. ``bytes_moved`` (the least traffic the
    implementation needs) and ``flops`` turn the time into GB/s, TFLOP/s and shares of the
    measured copy bandwidth and matmul rate (``dtype`` picks the matmul peak to compare with).
    ``error(out)``, given the untimed first call's result, returns its error against a float64
    reference, recorded as ``rel_error`` beside the times: speed and accuracy of one run.
    """
    config = request.config

    def run(group: BenchGroup, row: dict, build, bytes_moved=None, flops=None, dtype=None, error=None):
        if row.get("impl", group.impls[0]) not in group.impls:
            raise ValueError(f"impl {row.get('impl')!r} is not one of group {group.name}'s {group.impls}")
        if set(row) & HARNESS_KEYS:  # the JSON's extra_info would keep the harness's value, not the row's
            raise ValueError(f"row keys {sorted(set(row) & HARNESS_KEYS)} of group {group.name} are the harness's own")
        benchmark.group = group.name
        record = {"group": group.name, "test": request.node.nodeid, "row": dict(row), "status": "ok", "reason": ""}
        warmup = _option_or(config, "bench_warmup", group.warmup if ON_GPU else 1)  # --bench-warmup 0 is honoured
        rounds = _option_or(config, "bench_rounds", group.rounds if ON_GPU else 2)
        flush = config.getoption("l2_flush")
        fn = None
        try:
            fn = build()
            first = fn()  # first call outside the numbers: compilation, autotuning, lazy initialisation
            rel_error = error(first) if error is not None else None
            first = None
            peak, extra = peak_memory(fn)
            copy_gbps = copy_bandwidth_gbps()
            matmul_peak = matmul_peak_tflops(dtype) if (flops and dtype is not None) else None
            scratch = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if (flush and ON_GPU) else None

            def flush_l2():
                scratch.zero_()  # pedantic's setup must return None (or args): not the tensor

            spin_cycles, spin_ms = spin_cycles_for(fn)
            timer = EventTimer(f"{group.name}:{row.get('impl', '')}", spin_cycles, spin_ms,
                               before_retry=flush_l2 if scratch is not None else None)
            benchmark._timer = timer  # pytest-benchmark has no public way to set a fixture's timer

            # A garbage collection inside a round stalls the launching Python past the spin and
            # shows up as an outlier of several ms (seen in autograd fwd+bwd cases): collect
            # first, then keep the collector off while rounds are timed.
            gc.collect()
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                benchmark.pedantic(timer.measured(fn), setup=(flush_l2 if scratch is not None else None),
                                   rounds=rounds, warmup_rounds=warmup, iterations=1)
            finally:
                if gc_was_enabled:
                    gc.enable()
            scratch = None  # free the flush buffer before the next case
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row with its reason
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            record.update(status="failed", reason=reason)
            if not benchmark.disabled:  # a run without numbers (--benchmark-disable) writes no CSV of failures alone
                config.bench_records.append(record)
            fn = None
            _free_memory()
            if _is_resource_limit(exc):
                pytest.skip(f"{group.name} {row}: {reason}")
            raise
        stats = benchmark.stats
        if stats is None:  # benchmarks disabled (--benchmark-disable, or under xdist): ran once, no numbers
            return
        s = stats.stats
        mean_s = s.mean
        metrics = {
            "forward_ms_mean": s.mean * 1e3, "forward_ms_std": s.stddev * 1e3,
            "forward_ms_median": s.median * 1e3, "forward_ms_min": s.min * 1e3,
            "forward_peak_MiB": peak, "forward_extra_MiB": extra,
            "gbps": bytes_moved / mean_s / 1e9 if bytes_moved else None,
            "tflops": flops / mean_s / 1e12 if flops else None,
            "rel_error": rel_error,
            "stalled_rounds": timer.stalled_rounds, "host_bound": timer.host_bound,
        }
        metrics["pct_of_copy"] = 100 * metrics["gbps"] / copy_gbps if metrics["gbps"] else None
        metrics["pct_of_matmul_peak"] = 100 * metrics["tflops"] / matmul_peak if (matmul_peak and metrics["tflops"]) else None
        record["metrics"] = metrics
        record["l2_flush"] = bool(flush and ON_GPU)
        run_info = dict(bytes_moved=bytes_moved, flops=flops, l2_flush=record["l2_flush"],
                        execution="compiled" if ON_GPU else "interpreter")
        assert set(metrics) | set(run_info) <= HARNESS_KEYS
        benchmark.extra_info.update({k: _jsonable(v) for k, v in {**row, **metrics, **run_info}.items()})
        config.bench_records.append(record)
        fn = None
        _free_memory()

    return run


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


# ----------------------------------------------------------------------------------------------
# Session end: CSVs and summary
# ----------------------------------------------------------------------------------------------
def group_table(group: BenchGroup, records: list[dict]):
    """Every record of a group as one DataFrame: row keys, metrics, speed-ups, status and reason."""
    import pandas as pd

    rows = []
    for r in records:
        rows.append({**r["row"], **(r.get("metrics") or {}), "status": r["status"], "reason": r["reason"]})
    df = pd.DataFrame(rows)
    for col in set(group.columns) | set(METRICS):
        if col not in df:
            df[col] = None
    impl_col = "impl" if "impl" in df else None
    if impl_col:
        df["_impl_order"] = df[impl_col].map({name: i for i, name in enumerate(group.impls)})
    for column, baseline in group.speedups.items():
        df[column] = speedup(df, group.case, baseline)
    order = list(group.sort) if group.sort else [*group.case, *(["_impl_order"] if impl_col else [])]
    order = [c for c in order if c in df]
    df = df.sort_values(order, kind="stable", na_position="first").reset_index(drop=True)
    return df


def speedup(df, case: tuple[str, ...], baseline: str) -> list:
    """Baseline time / this row's time, matching rows on the case columns; None where either is missing."""
    base = {}
    for key, impl, ms in zip(df[list(case)].itertuples(index=False, name=None), df["impl"], df["forward_ms_mean"]):
        if impl == baseline and not _isnan(ms):
            base[key] = ms
    return [base[k] / ms if (k in base and not _isnan(ms)) else None
            for k, ms in zip(df[list(case)].itertuples(index=False, name=None), df["forward_ms_mean"])]


def _isnan(v) -> bool:
    try:
        return v is None or math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workerinput") or not config.bench_records:
        return
    out_dir = outputs_dir(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.bench_tables = {}
    for name in dict.fromkeys(r["group"] for r in config.bench_records):
        group = _GROUPS[name]
        df = group_table(group, [r for r in config.bench_records if r["group"] == name])
        config.bench_tables[name] = (group, df)
        csv_df = df if group.csv_impls is None else df[df["impl"].isin(group.csv_impls)]
        csv_df = csv_df[list(group.columns)].copy()
        for col in csv_df.columns:  # integer columns with gaps stay integers (pandas' nullable Int64)
            if csv_df[col].dtype == object and all(isinstance(v, int) or _isnan(v) for v in csv_df[col]):
                csv_df[col] = csv_df[col].astype("Int64")
        csv_df.to_csv(out_dir / group.csv, index=False, float_format="%.6g")
        if group.plot is not None:
            plot_group(group, df, (out_dir / group.csv).with_suffix(".png"))
    config.bench_out_dir = out_dir


def _label(keys, values) -> str:
    values = values if isinstance(values, tuple) else (values,)
    values = [int(v) if isinstance(v, float) and not _isnan(v) and v.is_integer() else v for v in values]
    return " ".join(f"{k}={v}" if k != "impl" else str(v) for k, v in zip(keys, values) if not _isnan(v))


def plot_group(group: BenchGroup, df, path: Path) -> None:
    """Draw the group's plot (see ``BenchGroup.plot``) into path; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kind, what = group.plot
    ok = df[df["status"] == "ok"]
    variant = [c for c in ("BLOCK", "BLOCK_SIZE") if c in df and c not in group.case]
    if kind == "line":
        metrics = [m for m in ("forward_ms_mean", "forward_peak_MiB") if m in ok and ok[m].notna().any()]
        facets = [c for c in group.case if c != what and df[c].nunique() > 1]
        panels = list(ok.groupby(facets, dropna=False)) if facets else [((), ok)]
        fig, axes = plt.subplots(len(metrics), len(panels), squeeze=False,
                                 figsize=(5.5 * len(panels), 3.8 * len(metrics)))
        for j, (key, panel) in enumerate(panels):
            for i, metric in enumerate(metrics):
                ax = axes[i][j]
                for line_key, line in panel.groupby(["impl", *variant], dropna=False, sort=False):
                    line = line.sort_values(what)
                    ax.plot(line[what], line[metric], marker="o", label=_label(["impl", *variant], line_key))
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel(what)
                ax.set_ylabel(metric)
                ax.set_title(_label(facets, key) if facets else group.name, fontsize=9)
                ax.grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="best")
    else:
        cases = list(ok.groupby(list(group.case), dropna=False, sort=False))
        impls = list(dict.fromkeys(_label(["impl", *variant], tuple(r)) for r in ok[["impl", *variant]].itertuples(index=False)))
        fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(cases) * max(1, len(impls)) / 3), 4.5))
        width = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for c, (key, case) in enumerate(cases):
                labels = [_label(["impl", *variant], tuple(r)) for r in case[["impl", *variant]].itertuples(index=False)]
                if impl in labels:
                    xs.append(c + k * width)
                    ys.append(case[what].iloc[labels.index(impl)])
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(["\n".join(map(str, key)) for key, _ in cases], fontsize=7)
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{group.name}: {gpu_name()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_name() -> str:
    return torch.cuda.get_device_name() if ON_GPU else "interpreter (no GPU)"


def pytest_terminal_summary(terminalreporter, config):
    tables = getattr(config, "bench_tables", None)
    if not tables:
        return
    import pandas as pd

    tr = terminalreporter
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.max_rows", 500):
        for name, (group, df) in tables.items():
            tr.write_sep("=", f"benchmark group {name} -> {config.bench_out_dir / group.csv}")
            extra = [c for c in ("pct_of_copy", "rel_error") if c in df and df[c].notna().any()]
            shown = [c for c in (*group.columns, *extra) if c in df]
            view = df[list(dict.fromkeys([*shown, "status"]))].copy()
            view[f"speedup_vs_{group.impls[0]}"] = speedup(df, group.case, group.impls[0])
            tr.write_line(view.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
            failed = df[df["status"] != "ok"]
            for _, r in failed.iterrows():
                keys = ", ".join(f"{c}={r[c]}" for c in (*group.case, "impl") if c in r and not _isnan(r[c]))
                tr.write_line(f"FAILED CONFIG {keys}: {r['reason']}", red=True)
