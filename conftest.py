"""The one harness: device detection, the benchmark timer, the run's JSON and the tables built from it.

Device detection happens here, at import, before any test module imports a kernel: without a
GPU, Triton must run in interpreter mode, and Triton reads TRITON_INTERPRET when a kernel is
decorated.

A benchmark is a parametrized test that calls the ``bench`` fixture with its ``BenchGroup`` (the
group's CSV, columns and baselines, declared once as data in the test module), the row that
identifies the case, and a function that builds the inputs and returns the callable to time
with them (``(fn, inputs)``: the group's error function judges fn's result against them).
The fixture measures the callable with the chosen timer (``--timer``), hands the rounds to
pytest-benchmark (so its JSON, compare and compare-fail see them), and appends the finished row
to ``benchmark.json.part`` in the outputs directory at once. At the end of the session the run's
JSON (pytest-benchmark's own, plus the machine's ceilings, the failed cases and the groups'
layouts) is written atomically as ``benchmark.json``, and every CSV and plot is built from that
file alone: ``python3 conftest.py rebuild JSON`` builds the same bytes from any saved JSON.

The record is one whole run at one commit on one GPU kind, in ``outputs/<GPU>/``: every case of
every group (``--record-part all``, tox -e record), or its parts (``RECORD_PARTS``: each fits one
sitting of minutes) run apart and merged (``python3 conftest.py merge``). README.md's headline and
outputs/README.md's targets are generated from it (``python3 conftest.py headline``), and the
regression gate compares a run with it (``python3 conftest.py gate``).

The file has two halves. The first (the record: its JSON, tables, parts, merge, headline, gate
and the command line) needs only the standard library and pandas, and ``python3 conftest.py``
stops after it; the second is the pytest plugin, which imports torch.

Under pytest-xdist with ``--benchmark-only`` (``-n N``: one worker per GPU), each worker measures
the same way and sends its rows to the controller with its test reports; the controller streams
them to its ``.part`` and hands them to its own pytest-benchmark session, so the run ends as a
serial run does: one JSON, the same tables.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import gc
import importlib.util
import io
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MiB = 2**20
# The committed record is this GPU kind's; each kind's record sits in outputs/<its name>/.
REFERENCE_GPU = "NVIDIA_H100_80GB_HBM3"
RUN_JSON = "benchmark.json"


# ----------------------------------------------------------------------------------------------
# Benchmark groups: declared once, as data, in the test modules
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchGroup:
    """One table of results: a pytest-benchmark group and the CSV it feeds.

    ``case`` names the row keys that identify one problem across implementations; ``speedups``
    maps a CSV column to the implementation it divides by (speed-up = baseline time / this time);
    ``csv_impls`` limits the CSV to some implementations (the others still land in the JSON).
    ``spec``: the CSV's columns are fixed by the project's specification, so the harness adds
    neither ``host_us`` nor ``failure`` to it.
    ``pivot``: (row key, {CSV column: (value of that key, source column)}) makes one CSV row of
    the rows that differ only in that key (e.g. mode "fwd" and "fwd_bwd" of one case): each named
    column takes its source column from the row with that value; the CSV's other columns (but
    ``failure``, which joins the rows' reasons) identify the merged row.
    """

    name: str
    csv: str
    columns: tuple[str, ...]
    case: tuple[str, ...]
    impls: tuple[str, ...]
    speedups: dict = dataclasses.field(default_factory=dict)
    # The group's plot beside its CSV: ("line", x column) draws time and peak memory against x,
    # one line per implementation (and block size), one panel per other case value;
    # ("bar", metric) draws metric per case, one bar per implementation; ("ratio", metric) draws
    # metric (a ratio to a baseline) as horizontal bars, one panel per value of the first case
    # column, a line at 1; ("strip", metric) draws it for groups of hundreds of cases: a column
    # of dots (one a case) per value of the first case column and implementation, a bar at their
    # geometric mean, a line at 1. None: no plot.
    plot: tuple[str, str] | None = None
    csv_impls: tuple[str, ...] | None = None
    pivot: tuple[str, dict] | None = None
    sort: tuple[str, ...] | None = None  # default: case columns, then impl order
    warmup: int = 10
    # Enough for a mean within about 1 % on these kernels, well inside the gate's 5 % (see
    # outputs/README.md, design notes: rounds).
    rounds: int = 30
    spec: bool = False
    # Baselines of a best-of comparison: with them the table gains ms (this row's mean time),
    # best_baseline_ms (the fastest of these implementations on the row's case) and speedup
    # (best_baseline_ms / ms) on every row that is not one of them.
    best_of: tuple[str, ...] = ()
    # Columns under the group's own names: ``aliases`` maps a column to a harness column it copies
    # ({"step_ms": "forward_ms_mean"}); ``per_second`` maps a column to a row key counted per call,
    # divided by the mean time ({"tokens_per_s": "tokens"}).
    aliases: dict = dataclasses.field(default_factory=dict)
    per_second: dict = dataclasses.field(default_factory=dict)
    # A timing protocol of the group's own on a GPU, in place of --timer, the rounds and the
    # harness's remeasures: (timer, its keyword arguments), e.g. ("do_bench", {"warmup": 1000,
    # "rep": 10000}) for a figure comparable with one published under that call. The interpreter
    # keeps its wall-clock rounds: triton.testing's timers need a GPU driver.
    timer: tuple | None = None

    def csv_columns(self) -> list[str]:
        return list(self.columns) if self.spec else [*self.columns, "host_us", "failure"]

    def layout(self) -> dict:
        """The group as plain JSON data: the run's JSON carries it, so tables rebuild from the file alone."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_layout(cls, layout: dict) -> "BenchGroup":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in layout.items() if k in fields}
        return cls(**kw)


# Columns derived from pytest-benchmark's stats and the ceilings (derive_metrics), and measured
# values the harness stores in extra_info beside the row's own keys.
METRICS = ("forward_ms_mean", "forward_ms_std", "forward_ms_median", "forward_ms_min",
           "forward_peak_MiB", "forward_extra_MiB", "gbps", "tflops", "pct_of_copy", "pct_of_matmul_peak",
           "rel_error", "host_us")
# Every key the harness writes into a benchmark's extra_info. A row key of one of these names
# would be overwritten in the JSON, so the bench fixture refuses it.
HARNESS_KEYS = frozenset(METRICS) | {"stalled_rounds", "host_bound", "mean_over_median", "remeasured", "discarded_ms",
                                     "bytes_moved", "flops", "matmul_peak_key", "l2_flush", "execution", "timer",
                                     "gpu", "failure", "case_s"}


def read_run(path: Path) -> dict:
    """A run's JSON from its file: a whole JSON, or the lines of a ``.part`` (``read_part``)."""
    return read_part(path) if path.name.endswith(".part") else json.loads(path.read_text(encoding="utf-8"))


class BadRun(ValueError):
    """A file that is not a run's JSON from this harness: its message names the file and what is wrong."""


def load_run(path: Path) -> dict:
    """read_run, with each way a file can be wrong said in one line (BadRun) instead of a traceback."""
    if path.is_dir():
        raise BadRun(f"{path}: is a directory, not a run's JSON")
    try:
        if path.stat().st_size == 0:
            raise BadRun(f"{path}: is empty")
        data = read_run(path)
    except OSError as exc:
        raise BadRun(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise BadRun(f"{path}: is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise BadRun(f"{path}: is not whole JSON (truncated?): {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    problem = run_problem(data)
    if problem:
        raise BadRun(f"{path}: {problem}")
    return data


def run_problem(data) -> str | None:
    """What keeps data from being a run's JSON of this harness (None: nothing)."""
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not a run's JSON object"
    groups = data.get("bench_groups")
    if not groups or not isinstance(groups, dict):
        return "has no bench_groups (a run's JSON from this harness was expected)"
    for name, layout in groups.items():
        try:
            BenchGroup.from_layout(layout)
        except (TypeError, AttributeError) as exc:
            return f"group {name!r} has a malformed layout: {exc}"
    for key, need in (("benchmarks", ("fullname", "group", "stats", "extra_info")),
                      ("failed_cases", ("test", "group", "row", "reason"))):
        records = data.get(key, [])
        if not isinstance(records, list):
            return f"its {key} is a JSON {type(records).__name__}, not a list"
        for i, record in enumerate(records):
            if not isinstance(record, dict) or not all(k in record for k in need):
                return f"{key}[{i}] lacks one of {', '.join(need)}"
            if key == "benchmarks" and not (isinstance(record["stats"], dict) and isinstance(record["extra_info"], dict)
                                            and all(isinstance(record["stats"].get(k), (int, float))
                                                    for k in ("mean", "stddev", "median", "min"))):
                return f"benchmarks[{i}] has no stats (mean, stddev, median, min) or extra_info"
            if key == "benchmarks" and not 0 < record["stats"]["median"] < math.inf:
                return f"benchmarks[{i}] ({record['fullname']}) has a median of {record['stats']['median']}, not a time"
            if key == "failed_cases" and not (isinstance(record["row"], dict) and isinstance(record["group"], str)):
                return f"failed_cases[{i}] ({record['test']}) has no row object or group name"
    for key in ("ceilings", "bench_run", "machine_info", "commit_info"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"its {key} is a JSON {type(data[key]).__name__}, not an object"
    return None


def read_part(path: Path) -> dict:
    """A run JSON (marked incomplete) from the lines of a ``.part`` file; a torn last line is dropped."""
    data: dict = {"benchmarks": [], "failed_cases": [], "bench_groups": {}, "ceilings": {}, "machine_info": {},
                  "bench_run": {"complete": False}}  # partial also where its header line is lost
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if not isinstance(line, dict):  # not a line this harness writes
            continue
        if "run" in line:
            data["bench_run"] = {**line["run"], "complete": False}
            data["machine_info"] = line.get("machine_info", {})
            if "commit_info" in line:
                data["commit_info"] = line["commit_info"]
        if "group" in line:
            data["bench_groups"][line["group"]["name"]] = line["group"]
        if "benchmark" in line:
            data["benchmarks"].append(line["benchmark"])
        if "failed_case" in line:
            data["failed_cases"].append(line["failed_case"])
        data["ceilings"] = line.get("ceilings", data["ceilings"])
    return data



# ----------------------------------------------------------------------------------------------
# Machine ceilings, measured once per run with the harness's one timing primitive
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ceilings:
    """What the machine can do, measured in the run: the yardsticks of gbps, tflops and host_us."""

    copy_GBps: float | None = None
    matmul_TFLOPs: dict = dataclasses.field(default_factory=dict)  # "dtype|precision" -> rate
    cycles_per_ms: float | None = None
    launch_floor_us: float | None = None  # host time to launch an empty Triton kernel

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Ceilings":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in fields})


CEILINGS = Ceilings()


def merged_ceilings(per_worker: list[dict]) -> "Ceilings":
    """Per value, the median of the workers' measurements (those that measured it)."""
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    ceilings = [Ceilings.from_dict(c) for c in per_worker]
    merged = Ceilings(**{f.name: median(getattr(c, f.name) for c in ceilings)
                         for f in dataclasses.fields(Ceilings) if f.name != "matmul_TFLOPs"})
    for key in sorted({k for c in ceilings for k in c.matmul_TFLOPs}):
        merged.matmul_TFLOPs[key] = median(c.matmul_TFLOPs.get(key) for c in ceilings)
    return merged



# ----------------------------------------------------------------------------------------------
# One writer per outputs directory
# ----------------------------------------------------------------------------------------------
LOCK_NAME = "benchmark.lock"


class DirectoryBusy(Exception):
    """Another live process holds the outputs directory's lock."""


def take_lock(out: Path) -> tuple[int, str | None]:
    """Hold ``out/benchmark.lock`` (an flock, which the kernel drops when its holder dies, and a
    line naming the holder's pid and command): (its descriptor, a note where a dead holder's line
    was taken over). Raises DirectoryBusy naming the live holder."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise DirectoryBusy(f"{out} is being written by {holder}; wait for it to end, or write elsewhere "
                                "(--outputs-dir)") from None
        try:  # a holder that released it unlinked the file: hold the one at the path, not an orphan
            held = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            held = False
        if held:
            break
        os.close(fd)
    stale = os.read(fd, 4096).decode("utf-8", "replace").strip()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    command = " ".join(getattr(sys, "orig_argv", sys.argv))
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename} ({command})\n".encode())
    os.fsync(fd)
    note = f"{path}: took over the lock of {stale}, which is no longer running" if stale else None
    return fd, note


def release_lock(out: Path, fd: int) -> None:
    """Unlink while still holding it, so a waiter that opened the old file sees it orphaned."""
    try:
        (out / LOCK_NAME).unlink(missing_ok=True)
    finally:
        os.close(fd)



def keep_leftover(part: Path) -> Path:
    """A new name for a leftover ``.part`` beside it, from the time it was last written (UTC)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(part.stat().st_mtime))
    for n in range(1000):
        kept = part.with_name(f"benchmark.{stamp}{f'-{n}' if n else ''}.json.part")
        if not kept.exists():
            os.rename(part, kept)
            return kept
    raise FileExistsError(f"{part}: no free name to keep it under")



# ----------------------------------------------------------------------------------------------
# The tables built from a run's JSON
# ----------------------------------------------------------------------------------------------
def derive_metrics(stats: dict, model: dict, ceilings: Ceilings) -> dict:
    """The table's numbers from pytest-benchmark's stats (seconds), the row's cost model
    (bytes_moved, flops, matmul_peak_key) and the machine's measured ceilings. Pure."""
    mean = stats["mean"]
    bytes_moved, flops = model.get("bytes_moved"), model.get("flops")
    gbps = bytes_moved / mean / 1e9 if bytes_moved else None
    tflops = flops / mean / 1e12 if flops else None
    peak = ceilings.matmul_TFLOPs.get(model.get("matmul_peak_key") or "")
    return {
        "forward_ms_mean": mean * 1e3, "forward_ms_std": stats["stddev"] * 1e3,
        "forward_ms_median": stats["median"] * 1e3, "forward_ms_min": stats["min"] * 1e3,
        "gbps": gbps, "tflops": tflops,
        "pct_of_copy": 100 * gbps / ceilings.copy_GBps if (gbps and ceilings.copy_GBps) else None,
        "pct_of_matmul_peak": 100 * tflops / peak if (tflops and peak) else None,
    }



def write_json(data: dict, path: Path) -> None:
    """A run's JSON at path, atomically: a temporary file renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_run(data: dict, out: Path) -> list[Path]:
    """The run's JSON (``write_json``), then its tables, built from the file's bytes."""
    out.mkdir(parents=True, exist_ok=True)
    complete = (data.get("bench_run") or {}).get("complete", True)
    path = out / (RUN_JSON if complete else RUN_JSON.replace(".json", ".partial.json"))
    write_json(data, path)
    return [path, *write_tables(json.loads(path.read_text(encoding="utf-8")), out)]


def table_path(out: Path, group: BenchGroup, complete: bool, suffix: str = ".csv") -> Path:
    name = Path(group.csv).with_suffix(suffix).name
    return out / (name if complete else name.replace(suffix, f".partial{suffix}"))


def write_tables(data: dict, out: Path) -> list[Path]:
    """Every group's CSV and plot from a run's JSON (a whole one, a saved one, or a .part's lines).

    A run that did not end on its own writes ``NAME.partial.csv``: its tables say so, and a whole
    table beside them stays as it was."""
    complete = (data.get("bench_run") or {}).get("complete", True)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (group, df) in tables_from_json(data).items():
        csv_df = df if group.csv_impls is None else df[df["impl"].isin(group.csv_impls)]
        csv_df = pivoted(group, csv_df) if group.pivot else csv_df
        csv_df = csv_df[group.csv_columns()].copy()
        for col in csv_df.columns:  # integer columns with gaps stay integers (pandas' nullable Int64)
            if csv_df[col].dtype == object and all(isinstance(v, int) and not isinstance(v, bool) or _isnan(v)
                                                   for v in csv_df[col]):
                csv_df[col] = csv_df[col].astype("Int64")
        path = table_path(out, group, complete)
        tmp = path.with_name(path.name + ".tmp")
        csv_df.to_csv(tmp, index=False, float_format="%.6g")
        os.replace(tmp, path)
        written.append(path)
        if group.plot is not None:
            png = table_path(out, group, complete, ".png")
            if plot_group(group, df, png, ((data.get("machine_info") or {}).get("gpu") or {}).get("name", "?")):
                written.append(png)
    return written


def tables_from_json(data: dict) -> dict:
    """{group name: (BenchGroup, DataFrame)} from a run's JSON: row keys from extra_info, times from
    stats, derived metrics from stats, cost model and ceilings, failed cases as empty rows."""
    ceilings = Ceilings.from_dict(data.get("ceilings"))
    layouts = data.get("bench_groups") or {}
    records: dict[str, list] = {}
    for b in data.get("benchmarks", []):
        if b.get("group") not in layouts:
            continue
        extra = b["extra_info"]
        metrics = derive_metrics(b["stats"], extra, ceilings)
        row = {**extra, **metrics, "failure": None}
        records.setdefault(b["group"], []).append(row)
    for f in data.get("failed_cases", []):
        if f["group"] in layouts:
            records.setdefault(f["group"], []).append({**f["row"], "failure": f["reason"],
                                                       "not_run": bool(f.get("resource_limit"))})
    return {name: (group, group_table(group, rows))
            for name in layouts if (group := BenchGroup.from_layout(layouts[name])) and (rows := records.get(name))}


def group_table(group: BenchGroup, rows: list[dict]):
    """Every row of a group as one DataFrame: row keys, metrics, speed-ups and failure, in the group's order."""
    import pandas as pd

    df = pd.DataFrame(rows)
    for col in {*group.columns, *METRICS, "failure"}:
        if col not in df:
            df[col] = None
    impl_col = "impl" if "impl" in df else None
    if impl_col:
        df["_impl_order"] = df[impl_col].map({name: i for i, name in enumerate(group.impls)})
    for column, baseline in group.speedups.items():
        df[column] = speedup(df, group.case, baseline)
    for column, source in group.aliases.items():
        df[column] = df[source]
    for column, count in group.per_second.items():
        df[column] = [None if _isnan(n) or _isnan(ms) or ms <= 0 else n / (ms * 1e-3)
                      for n, ms in zip(df[count] if count in df else [None] * len(df), df["forward_ms_mean"])]
    if group.best_of:
        df["ms"] = df["forward_ms_mean"]
        df["best_baseline_ms"] = best_time(df, group.case, group.best_of)
        df["speedup"] = [None if impl in group.best_of or _isnan(best) or _isnan(ms) else best / ms
                         for impl, best, ms in zip(df["impl"], df["best_baseline_ms"], df["ms"])]
    order = list(group.sort) if group.sort else [*group.case, *(["_impl_order"] if impl_col else [])]
    order = [c for c in order if c in df]
    df = df.sort_values(order, kind="stable", na_position="first").reset_index(drop=True)
    return df


def pivoted(group: BenchGroup, df):
    """One row per set of rows that differ only in the pivot key (see ``BenchGroup.pivot``), in the
    group's order without that key, then by the other columns that identify a row. Rows that
    would fill the same cell twice go to separate rows: none is lost."""
    import pandas as pd

    key, columns = group.pivot
    keep = [c for c in group.csv_columns() if c not in columns and c != "failure"]
    order = [c for c in dict.fromkeys([*(group.sort or [*group.case, "_impl_order"]), *keep]) if c in df and c != key]
    df = df.sort_values(order, kind="stable", na_position="first")
    merged: dict[tuple, list[dict]] = {}  # identifying values -> [{pivot value: row}, ...]
    for r in df.to_dict("records"):
        ident = tuple(None if _isnan(r.get(c)) else r.get(c) for c in keep)
        sets = merged.setdefault(ident, [])
        parts = next((p for p in sets if r[key] not in p), None)
        if parts is None:
            sets.append(parts := {})
        parts[r[key]] = r
    out = []
    for ident, sets in merged.items():
        for parts in sets:
            row = dict(zip(keep, ident))
            for column, (value, source) in columns.items():
                row[column] = parts[value].get(source) if value in parts else None
            reasons = {v: p["failure"] for v, p in parts.items() if not _isnan(p.get("failure"))}
            if len(reasons) == len(parts) and len(set(reasons.values())) == 1:
                row["failure"] = next(iter(reasons.values()))
            else:
                row["failure"] = "; ".join(f"{v}: {why}" for v, why in reasons.items()) or None
            out.append(row)
    return pd.DataFrame(out, columns=[*keep, *columns, "failure"])


def speedup(df, case: tuple[str, ...], baseline: str) -> list:
    """Baseline time / this row's time, matching rows on the case columns; None where either is missing."""
    base = {}
    for key, impl, ms in zip(df[list(case)].itertuples(index=False, name=None), df["impl"], df["forward_ms_mean"]):
        if impl == baseline and not _isnan(ms):
            base[key] = ms
    return [base[k] / ms if (k in base and not _isnan(ms)) else None
            for k, ms in zip(df[list(case)].itertuples(index=False, name=None), df["forward_ms_mean"])]


def best_time(df, case: tuple[str, ...], impls: tuple[str, ...]) -> list:
    """The least mean time (ms) of impls on each row's case; None where none of them was measured."""
    best: dict = {}
    for key, impl, ms in zip(df[list(case)].itertuples(index=False, name=None), df["impl"], df["forward_ms_mean"]):
        if impl in impls and not _isnan(ms):
            best[key] = min(ms, best.get(key, math.inf))
    return [best.get(key) for key in df[list(case)].itertuples(index=False, name=None)]


def _isnan(v) -> bool:
    try:
        return v is None or math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def _label(keys, values) -> str:
    values = values if isinstance(values, tuple) else (values,)
    values = [int(v) if isinstance(v, float) and not _isnan(v) and v.is_integer() else v for v in values]
    return " ".join(f"{k}={v}" if k != "impl" else str(v) for k, v in zip(keys, values) if not _isnan(v))


def plot_group(group: BenchGroup, df, path: Path, gpu: str) -> bool:
    """Draw the group's plot (see ``BenchGroup.plot``) into path; False without matplotlib or rows to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kind, what = group.plot
    ok = df[df["failure"].isna() & df["forward_ms_mean"].notna()]
    if kind in ("bar", "ratio", "strip"):  # a speed-up is empty where the case's baseline did not run (e.g. -k triton): no bar
        ok = ok[ok[what].notna()]
    if ok.empty:
        return False
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
    elif kind == "ratio":
        panels = list(ok.groupby(group.case[0], sort=True))
        impls = list(dict.fromkeys(ok["impl"]))
        heights = [panel[list(group.case[1:])].drop_duplicates().shape[0] for _, panel in panels]
        fig, axes = plt.subplots(len(panels), 1, squeeze=False, figsize=(9.0, 1.0 + 0.32 * sum(heights) * len(impls)),
                                 gridspec_kw={"height_ratios": heights})
        width = 0.8 / len(impls)
        for (name, panel), row in zip(panels, axes):
            ax = row[0]
            cases = list(dict.fromkeys(map(tuple, panel[list(group.case[1:])].itertuples(index=False))))
            for k, impl in enumerate(impls):
                mine = panel[panel["impl"] == impl]
                ys = [cases.index(tuple(r)) + k * width for r in mine[list(group.case[1:])].itertuples(index=False)]
                ax.barh(ys, mine[what], width, label=impl, color=f"C{k}")
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_yticks([c + 0.4 - width / 2 for c in range(len(cases))])
            ax.set_yticklabels([" ".join(map(str, c)) for c in cases], fontsize=7)
            ax.invert_yaxis()
            ax.set_title(str(name), fontsize=9)
            ax.set_xlabel(what)
            ax.grid(True, axis="x", alpha=0.3)
        handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{k}") for k in range(len(impls))]
        axes[-1][0].legend(handles, impls, fontsize=7, loc="lower right")
    elif kind == "strip":
        names = sorted(ok[group.case[0]].unique())
        impls = list(dict.fromkeys(ok["impl"]))
        width = 0.8 / len(impls)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) * len(impls)), 5.0))
        for i, name in enumerate(names):
            here = ok[ok[group.case[0]] == name]
            present = [impl for impl in impls if (here["impl"] == impl).any()]
            for slot, impl in enumerate(present):
                k = impls.index(impl)
                values = here[here["impl"] == impl][what].astype(float).sort_values()
                x = i + (slot - (len(present) - 1) / 2) * width
                spread = [x + width * 0.35 * (2 * j / max(1, len(values) - 1) - 1) for j in range(len(values))]
                ax.scatter(spread, values, s=9, color=f"C{k}", alpha=0.55, linewidths=0,
                           label=impl if impl not in ax.get_legend_handles_labels()[1] else None)
                mean = math.exp(sum(map(math.log, values)) / len(values))
                ax.hlines(mean, x - width * 0.45, x + width * 0.45, color=f"C{k}", linewidth=2.5)
                ax.annotate(f"{mean:.2f}", (x, mean), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        counts = ok.groupby(group.case[0])[group.case[1]].nunique() if len(group.case) > 1 else None
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{n}\n{counts[n]} cases" if counts is not None else str(n) for n in names], fontsize=8)
        ax.set_ylabel(f"{what} (log; a dot a case, bar: geometric mean)")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", which="both", alpha=0.3)
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
    fig.suptitle(f"{group.name}: {gpu}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    _save_png(fig, tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def _save_png(fig, path: Path) -> None:
    """fig as a PNG of 256 colours (a plot's flat colours survive; the file is about a third of
    full colour's), with no date or version in it: a rebuild from the same JSON, matplotlib and Pillow
    gives the same bytes."""
    from PIL import Image

    drawn = io.BytesIO()
    fig.savefig(drawn, dpi=110, format="png", metadata={"Software": None})
    drawn.seek(0)
    with Image.open(drawn) as image:
        # method 0: median cut; dither 0: none (the enums' values; Pillow before 9.1 has no enums).
        image.convert("RGB").quantize(256, method=0, dither=0).save(path, format="png", optimize=True)



# A case whose mean round passes its median by more than DISTURBED_SKEW is measured again, at most
# MAX_REMEASURES times: the tables report means, and such a mean says more about the machine (host
# stalls) than about the code. In H100 attention grids (996 cases of 15 rounds) the mean sat within
# 8 % of the median but for 11 cases, at 1.10-4.1x. The slowest round alone is no measure: a timer of
# thousands of samples (do_bench) has some at 2-3x the median, the mean unmoved.
DISTURBED_SKEW = 1.1
MAX_REMEASURES = 2


def remeasure_note(row) -> str | None:
    """What the summary says of a row measured again, or still disturbed (see ``steady``)."""
    skew, again = row.get("mean_over_median"), row.get("remeasured")
    still = not _isnan(skew) and skew > DISTURBED_SKEW
    if not still and (_isnan(again) or not again):
        return None
    thrown = row.get("discarded_ms")
    discarded = ", ".join(f"{ms:.4g}" for ms in (thrown if isinstance(thrown, list) else []))
    return (f"{'DISTURBED, ' if still else ''}mean {skew:.3g}x the median round; "
            f"measured {1 + int(again or 0)} times, kept mean {row['forward_ms_mean']:.4g} ms"
            + (f", thrown away {discarded} ms" if discarded else ""))



# What two parts of one grid must share: their commit, GPU and the run settings that decide a
# time (each run's own workers, with their measured ceilings, may differ).
MERGE_SETTINGS = ("timer", "l2_flush", "execution", "gpu")


def run_settings(data: dict) -> dict:
    """A run's timing setup and GPU kind (``MERGE_SETTINGS``): runs compared or merged must agree on it."""
    return {k: (data.get("bench_run") or {}).get(k) for k in MERGE_SETTINGS}


def merged_commit(data: dict) -> dict:
    """What parts of one run share of their commit: its id and whether the tree was dirty (not how
    the id was found, nor the branch's name)."""
    info = data.get("commit_info") or {}
    return {"id": info.get("id"), "dirty": info.get("dirty")}


def merged_gpu(data: dict) -> dict:
    """What parts of one run share of their GPU: all it records, the driver as its distinct versions
    (a run over several GPUs lists one a GPU)."""
    gpu = dict((data.get("machine_info") or {}).get("gpu") or {})
    if isinstance(gpu.get("driver"), str):
        gpu["driver"] = sorted(set(gpu["driver"].splitlines()))
    return gpu


def merge_runs(parts: list[tuple[str, dict]]) -> dict:
    """One run's JSON from the JSONs of runs that each measured part of the same cases (a grid
    split over calls), so that one set of tables holds them: same commit, same GPU and run
    settings (``MERGE_SETTINGS``), no case and no record part in two runs, a group's layout the same
    in each; the merged run's ``bench_run.record_parts`` lists the record's parts it holds. Rows
    keep their own rounds; the ceilings (the yardsticks of the derived metrics) are per value the
    median of the parts' (as across a run's workers), each part's own ceilings and run record kept
    under ``merged_from``. Raises ValueError naming the part and what differs or is missing."""
    if len(parts) < 2:
        raise ValueError(f"merge takes two runs or more, got {len(parts)}")
    first_name, first = parts[0]
    merged = {**first, "benchmarks": [], "failed_cases": [], "bench_groups": {}, "merged_from": []}
    seen: dict[str, str] = {}
    held: dict[str, str] = {}  # record part -> the run that holds it
    for name, data in parts:
        for part in (data.get("bench_run") or {}).get("record_parts") or ():
            if part in held:
                raise ValueError(f"{name}: record part {part!r} is in {held[part]} already")
            held[part] = name
        if not (data.get("commit_info") or {}).get("id"):
            raise ValueError(f"{name}: it records no commit (a .part written before its header carried one?)")
        for what, of in (("commit", merged_commit), ("GPU", merged_gpu), ("run settings", run_settings)):
            mine, theirs = of(data), of(first)
            if mine != theirs:
                keys = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
                raise ValueError(f"{name}: its {what} differs from {first_name}'s in "
                                 + ", ".join(f"{k} ({mine.get(k)!r} against {theirs.get(k)!r})" for k in keys))
        for group, layout in (data.get("bench_groups") or {}).items():
            if merged["bench_groups"].setdefault(group, layout) != layout:
                raise ValueError(f"{name}: group {group!r} has another layout than in an earlier part")
        for record in (*data.get("benchmarks", []), *data.get("failed_cases", [])):
            test = record.get("fullname") or record.get("test")
            if test is None:
                continue
            if test in seen:
                raise ValueError(f"{name}: {test} was measured (or failed) in {seen[test]} already")
            seen[test] = name
        merged["benchmarks"] += data.get("benchmarks", [])
        merged["failed_cases"] += data.get("failed_cases", [])
        merged["merged_from"].append({"file": name, "datetime": data.get("datetime"), "bench_run": data.get("bench_run"),
                                      "ceilings": data.get("ceilings")})
    merged["ceilings"] = dataclasses.asdict(merged_ceilings([data.get("ceilings") or {} for _, data in parts]))
    merged["bench_run"] = {**run_settings(first),
                           "complete": all((data.get("bench_run") or {}).get("complete", True) for _, data in parts),
                           "record_parts": [p.name for p in RECORD_PARTS if p.name in held]}
    return merged


def run_wall_s(data: dict) -> float | None:
    """A run's wall time from its JSON: its own, or the sum of its parts' for a merged run (they ran
    one after another); None where a run (or a part) recorded none."""
    parts = data.get("merged_from")
    runs = parts or [data]
    walls = [(p.get("bench_run") or {}).get("wall_s") for p in runs]
    return None if None in walls else round(sum(walls), 1)


def compare_with_one_gpu(several: dict, one: dict, tolerance: float = 0.03) -> dict:
    """A several-GPU run's medians against a one-GPU run's, case by case (a case is a test's full
    name): the record of the comparison, with the cases whose medians differ by more than
    ``tolerance`` (relative to the one-GPU median) named in ``differing``, and the cases measured
    in one run but failed in the other in ``failed_in_one``. Both runs must be of one GPU kind and
    one timing setup (``MERGE_SETTINGS``); their commits may differ and are recorded. Raises
    ValueError when the settings differ or the runs share no measured case."""
    settings = [run_settings(d) for d in (several, one)]
    if settings[0] != settings[1]:
        raise ValueError(f"the runs differ in their GPU or timing settings: {settings[0]} against {settings[1]}")
    medians = [{b["fullname"]: b["stats"]["median"] for b in d.get("benchmarks", [])} for d in (several, one)]
    failed = [{f["test"] for f in d.get("failed_cases", [])} for d in (several, one)]
    shared = sorted(medians[0].keys() & medians[1].keys())
    if not shared:
        raise ValueError("the runs share no measured case")
    differing = []
    for test in shared:
        ratio = medians[0][test] / medians[1][test]
        if abs(ratio - 1) > tolerance:
            differing.append({"test": test, "median_ms_several": medians[0][test] * 1e3,
                              "median_ms_one": medians[1][test] * 1e3, "ratio": ratio})
    failed_in_one = sorted(medians[0].keys() & failed[1] | medians[1].keys() & failed[0])
    return {"tolerance": tolerance, "shared": len(shared), "differing": differing, "failed_in_one": failed_in_one,
            "several_gpus": {"workers": len(several.get("bench_run", {}).get("workers") or {}) or None,
                             "wall_s": run_wall_s(several), "commit": (several.get("commit_info") or {}).get("id")},
            "one_gpu": {"wall_s": run_wall_s(one), "commit": (one.get("commit_info") or {}).get("id")}}


def comparison_report(record: dict, one_name: str) -> str:
    """What ``merge --against`` prints: both wall times, then the cases out of tolerance."""
    several, one = record["several_gpus"], record["one_gpu"]
    wall = lambda s: "not recorded" if s is None else f"{s:.1f} s"  # noqa: E731
    lines = [f"several GPUs ({several['workers'] or '?'} workers): wall {wall(several['wall_s'])}; "
             f"one GPU ({one_name}): wall {wall(one['wall_s'])}",
             f"{record['shared']} shared cases, {len(record['differing'])} with medians more than "
             f"{record['tolerance']:.0%} apart"]
    if several["commit"] != one["commit"]:
        lines.append(f"note: the runs are of different commits ({several['commit']} against {one['commit']})")
    for d in record["differing"]:
        lines.append(f"DIFFERS {d['test']}: {d['median_ms_several']:.4g} ms on several GPUs, "
                     f"{d['median_ms_one']:.4g} ms on one ({d['ratio'] - 1:+.1%})")
    lines += [f"FAILED IN ONE RUN ONLY {test}" for test in record["failed_in_one"]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The record: one whole run at one commit, in parts that each fit one GPU call
# ----------------------------------------------------------------------------------------------
def record_json(gpu: str | None = None) -> Path:
    """The committed record of a GPU kind (outputs/<its name>/): the gate reads its own kind's.
    Without a kind, the record the headline and targets come from: the reference GPU's, or where
    there is none, another kind's."""
    if gpu is not None:
        return ROOT / "outputs" / gpu / RUN_JSON
    reference = ROOT / "outputs" / REFERENCE_GPU / RUN_JSON
    others = sorted((ROOT / "outputs").glob(f"*/{RUN_JSON}"))
    return reference if reference.exists() or not others else others[0]


@dataclasses.dataclass(frozen=True)
class RecordPart:
    """Some of the record's cases, chosen so that a part runs in one sitting of at most about 9
    minutes on an H100: the tests (``path::function``) whose cases it holds, and for the shape
    grid whether it holds the core cases (ids ending ``-core``) or the others. ``minutes`` is what
    it is expected to take there, a plan until the record's ``case_s`` say (``python3 conftest.py
    parts``)."""

    name: str
    what: str
    tests: tuple[str, ...]
    minutes: float
    core: bool | None = None

    def holds(self, nodeid: str) -> bool:
        test, _, params = nodeid.partition("[")
        return test in self.tests and (self.core is None or params.endswith("-core]") == self.core)


_GRID = "tests/test_bench_shape_grid.py::"
GRID_TESTS = tuple(_GRID + t for t in ("test_shape_grid_attention", "test_shape_grid_row_softmax",
                                       "test_shape_grid_softmax_matmul", "test_shape_grid_matmul_softmax",
                                       "test_shape_grid_matmul_softmax_linear_weight"))
RECORD_PARTS = (
    RecordPart("headline", "row softmax, softmax(x) @ V (the specification's grid and its precisions), "
                           "softmax(x @ W), FlashAttentionTriton and the course leaderboard's case",
               ("tests/test_bench_softmax.py::test_softmax", "tests/test_bench_softmax_matmul.py::test_softmax_matmul",
                "tests/test_bench_softmax_matmul_precision.py::test_softmax_matmul_precision",
                "tests/test_bench_matmul_softmax.py::test_matmul_softmax",
                "tests/test_bench_flash_attention.py::test_flash_attention",
                "tests/test_bench_flash_attention.py::test_leaderboard"), minutes=5),
    RecordPart("grid-core", "the shape grid's core cases, every workload, with torch.compile and FlexAttention",
               GRID_TESTS, minutes=4, core=True),
    RecordPart("grid-attention", "the shape grid's other attention cases", GRID_TESTS[:1], minutes=3, core=False),
    RecordPart("grid-softmax", "the shape grid's other row softmax and softmax(x) @ V cases", GRID_TESTS[1:3],
               minutes=5, core=False),
    RecordPart("grid-matmul-softmax", "the shape grid's other softmax(x @ W) cases", GRID_TESTS[3:], minutes=3,
               core=False),
    RecordPart("models", "flash_attention at models' shapes, the LM-head loss against its peers, training steps "
                         "of a GPT-2-like and a Llama-like model",
               (_GRID + "test_attention_models", "tests/test_bench_linear_cross_entropy.py::test_linear_cross_entropy",
                "tests/test_bench_model_step.py::test_model_step"), minutes=7),
)
# The README's benchmark command (tox -e gpu): the headline groups and the grid's core cases.
MAIN_JOB = ("headline", "grid-core")
PART_SETS = {"main": MAIN_JOB, "all": tuple(p.name for p in RECORD_PARTS)}


def record_parts(names) -> tuple[str, ...]:
    """Part names in the record's order from names of parts or of part sets (main, all); ValueError for another."""
    known = {p.name for p in RECORD_PARTS}
    chosen = set()
    for name in names:
        if name not in known and name not in PART_SETS:
            raise ValueError(f"no record part {name!r}: the parts are {', '.join(p.name for p in RECORD_PARTS)}, "
                             f"and {' and '.join(PART_SETS)} name sets of them")
        chosen.update(PART_SETS.get(name, (name,)))
    return tuple(p.name for p in RECORD_PARTS if p.name in chosen)


def part_of(nodeid: str) -> str | None:
    holders = [p.name for p in RECORD_PARTS if p.holds(nodeid)]
    if len(holders) > 1:
        raise ValueError(f"{nodeid} is in parts {holders}: a case belongs to one part")
    return holders[0] if holders else None


def whole_parts(parts: tuple[str, ...], keyword: str, markexpr: str, deselect, args) -> tuple[str, ...]:
    """The record's parts a run holds whole: its --record-part parts, none where -k, -m, --deselect
    or test ids (``path::test``) narrowed them."""
    narrowed = keyword or markexpr or deselect or any("::" in str(a) for a in args)
    return () if narrowed else parts


def run_destination(record: Path, on_gpu: bool, parts: tuple[str, ...], names: tuple[str, ...]) -> Path:
    """Where a run writes without --outputs-dir, given its GPU kind's record directory and its
    --record-part names (and the parts they stand for): the record itself only for every part;
    parts/<NAME>/ for some; partial/ for any other selection. Without a GPU there is no record."""
    if not on_gpu or parts == PART_SETS["all"]:
        return record
    return record / "parts" / "+".join(names) if parts else record / "partial"


def case_seconds(data: dict) -> dict[str, float]:
    """Each case's seconds in a run (build, check, rounds: ``case_s``), measured or failed, by its test's id."""
    seconds = {b["fullname"]: b["extra_info"]["case_s"] for b in data.get("benchmarks", [])
               if isinstance(b.get("extra_info", {}).get("case_s"), (int, float))}
    seconds.update({f["test"]: f["case_s"] for f in data.get("failed_cases", [])
                    if isinstance(f.get("case_s"), (int, float))})
    return seconds


def time_left(done: dict[str, float], remaining: list[str], expected: dict[str, float]) -> float:
    """Seconds the remaining cases should take: each its seconds in the record (``expected``) scaled
    by how this run's finished cases compare with theirs there, or this run's mean case where the
    record has none."""
    known = [t for t in done if t in expected and expected[t] > 0]
    scale = sum(done[t] for t in known) / sum(expected[t] for t in known) if known else 1.0
    mean = sum(done.values()) / len(done) if done else 0.0
    return sum(expected[t] * scale if t in expected else mean for t in remaining)


def parts_report(data: dict | None) -> str:
    """``python3 conftest.py parts``: each part, what it holds, its minutes planned and, from the
    record, measured (its cases' seconds, setup and compiles of the run's first case included)."""
    seconds = case_seconds(data) if data else {}
    measured: dict[str, float] = {}
    for test, s in seconds.items():
        name = part_of(test)
        measured[name] = measured.get(name, 0.0) + s
    lines = []
    for p in RECORD_PARTS:
        got = f"{measured[p.name] / 60:.1f} min in the record" if p.name in measured else "no time in the record"
        lines.append(f"{p.name:19} {p.minutes:g} min planned on an H100, {got}: {p.what}")
    lines.append(f"{'main':19} {' + '.join(MAIN_JOB)} (tox -e gpu); all: every part (tox -e record)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The record's headline, targets and regression gate: figures read from a run's JSON, never typed in
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Headline:
    """A line of README.md's table: the project's op (``ours``, as a user calls it) against
    PyTorch's (``torch``) on one case of a group, picked by its row keys (``case``). ``column``: a
    row's own time in ms (extra_info) where the median GPU time is not the user's figure; the
    record's GPU time where a record has no such column."""

    op: str
    label: str
    group: str
    case: dict
    ours: str
    torch: str
    column: str | None = None


HEADLINE = (
    Headline("row softmax", "8192 x 8192, bfloat16", "softmax",
             {"M": 8192, "N": 8192, "dtype": "bfloat16", "BLOCK_SIZE": None}, "triton_row", "torch"),
    Headline("softmax(x) @ V", "x (8, 4096, 8192), V (8, 8192, 512), bfloat16", "shape_grid",
             {"workload": "softmax_matmul", "case": "batch=8 d1=4096 d2=8192 d3=512 bfloat16"}, "triton", "torch"),
    Headline("softmax(x) @ V", "the same in float32, matmul precision 'high'", "shape_grid",
             {"workload": "softmax_matmul", "case": "batch=8 d1=4096 d2=8192 d3=512 float32 high"}, "triton", "torch"),
    Headline("softmax(x @ W)", "4096 x 4096 x 128256, bfloat16", "shape_grid",
             {"workload": "matmul_softmax", "case": "B=4096 K=4096 C=128256 bfloat16"}, "triton", "torch"),
    Headline("FlashAttentionTriton, forward + backward", "(16, 8192, 64) causal, bfloat16 (PyTorch: SDPA)",
             "flash_attention", {"batch": 16, "n_queries": 8192, "n_keys": 8192, "d": 64, "dtype": "bfloat16",
                                 "is_causal": True, "mode": "fwd_bwd"}, "flash_triton", "sdpa"),
    Headline("flash_attention, forward + backward", "Llama-3-8B, 32/8 heads, 4096 causal, bfloat16 (PyTorch: SDPA)",
             "attention_models", {"workload": "attention_models_fwd_bwd",
                                  "case": "llama3-8b B=1 H=32/8 Nq=4096 Nk=4096 d=128 causal"}, "triton", "sdpa"),
    Headline("linear_cross_entropy, forward + backward", "8192 x 4096 x 128256, bfloat16", "linear_cross_entropy",
             {"BT": 8192, "H": 4096, "V": 128256, "softcap": "none", "dtype": "bfloat16", "mode": "fwd_bwd"},
             "triton", "torch"),
    # A step's GPU time leaves out the host, which bounds a small model's step in a training loop.
    Headline("a GPT-2 training step, compiled", "tests/models.py's gpt2, torch.compile(model)",
             "model_step", {"config": "gpt2", "compiled": "compile"}, "project", "torch", column="wall_ms"),
)


def _same(value, wanted) -> bool:
    return value == wanted or (wanted is None and value is None) or str(value) == str(wanted)


def case_row(data: dict, group: str, impl: str, case: dict) -> dict | None:
    """impl's benchmark record on a case of a run (None: not measured); ValueError where the case's
    keys pick several rows (a case defined too loosely)."""
    found = [b for b in data.get("benchmarks", []) if b.get("group") == group
             and b["extra_info"].get("impl") == impl and all(_same(b["extra_info"].get(k), v) for k, v in case.items())]
    if len(found) > 1:
        raise ValueError(f"{group} {impl} {case}: {len(found)} rows match; name the case by more of its keys")
    return found[0] if found else None


def _versions(data: dict) -> str:
    gpu = (data.get("machine_info") or {}).get("gpu") or {}
    versions = ", ".join(f"{k} {str(gpu[k]).split('+')[0]}" for k in ("torch", "triton") if gpu.get(k))
    return f"{gpu.get('name', '?')}{f' ({versions})' if versions else ''}"


def _source(data: dict, path: Path) -> str:
    commit = (data.get("commit_info") or {}).get("id") or "?"
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"the record [{rel}]({rel}) at commit {commit[:7]}"


def no_record(path: Path) -> str:
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"No record is committed yet: `python3 conftest.py headline` writes this from {rel}."


def headline_markdown(data: dict, path: Path) -> str:
    """README.md's table: per headline case, the medians of ours and PyTorch's and their ratio."""
    lines = ["| op | case | ours (ms) | PyTorch (ms) | speed-up |", "| --- | --- | ---: | ---: | ---: |"]
    walls = False
    for h in HEADLINE:
        rows = [case_row(data, h.group, impl, h.case) for impl in (h.ours, h.torch)]
        # The column where both rows hold it; else (a record from before it) the GPU's time, as the others.
        wall = h.column is not None and all(r is not None and not _isnan(r["extra_info"].get(h.column)) for r in rows)
        ours, torch_ms = (None if r is None else r["extra_info"][h.column] if wall else r["stats"]["median"] * 1e3
                          for r in rows)
        walls |= wall
        label = h.label + (" (wall time)" if wall else "")
        cells = [f"{ms:.4g}" if ms is not None else "not measured" for ms in (ours, torch_ms)]
        ratio = f"{torch_ms / ours:.2f}x" if ours and torch_ms else ""
        lines.append(f"| {h.op} | {label} | {cells[0]} | {cells[1]} | {ratio} |")
    lead = ("Rows marked (wall time): a median step of steps run back to back, the host included. Other "
            "rows: m" if walls else "M")
    lines += ["", f"{lead}edian GPU time of one call (CUDA events, launches queued ahead, L2 flushed; no host "
                  f"time). On an {_versions(data)}, from {_source(data, path)}. Written by "
                  "`python3 conftest.py headline`."]
    return "\n".join(lines)


def group_frame(data: dict, group: str):
    """A group's rows of a run (tables_from_json), or None where the run has none."""
    found = tables_from_json({**data, "bench_groups": {k: v for k, v in (data.get("bench_groups") or {}).items()
                                                       if k == group}}).get(group)
    return None if found is None else found[1]


def case_rows(data: dict, group: str, column: str, where=None) -> list[tuple[tuple, dict]]:
    """A group's cases in a run, sorted: (case, {impl: row}) over the rows ``where`` keeps (every row
    without it) whose ``column`` was measured."""
    df = group_frame(data, group)
    if df is None:
        return []
    rows = df if where is None else df[[bool(where(r)) for r in df.to_dict("records")]]
    return [(key, {r["impl"]: r for r in case.to_dict("records") if not _isnan(r[column])})
            for key, case in rows.groupby(list(data["bench_groups"][group]["case"]), dropna=False, sort=True)]


def case_ratios(data: dict, group: str, ours: str, baselines: tuple, where=None) -> list[tuple[tuple, float]]:
    """(case, the fastest baseline's median over ours) for each case where ours and a baseline ran."""
    out = []
    for key, ran in case_rows(data, group, "forward_ms_median", where):
        base = [ran[b]["forward_ms_median"] for b in baselines if b in ran]
        if ours in ran and base:
            out.append((key, min(base) / ran[ours]["forward_ms_median"]))
    return out


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclasses.dataclass(frozen=True)
class Target:
    """An issue's target as the record measures it: ``measure(data)`` gives (what it measured, met)
    or None where the record holds none of it."""

    issue: int
    text: str
    measure: object


def _ratio_summary(ratios: list, statistic: str = "min") -> tuple[str, float]:
    """A target's figure for speed-ups over cases: "min 0.95x over 4 cases" (one case: "0.95x"), and the value."""
    value = geomean(ratios) if statistic == "geomean" else min(ratios)
    cases = f" over {len(ratios)} cases" if len(ratios) > 1 else ""
    return f"{statistic + ' ' if len(ratios) > 1 else ''}{value:.2f}x{cases}", value


def _ratio_target(group: str, ours: str, baselines: tuple, threshold: float, statistic: str = "min", where=None):
    def measure(data):
        ratios = [r for _, r in case_ratios(data, group, ours, baselines, where)]
        if not ratios:
            return None
        text, value = _ratio_summary(ratios, statistic)
        return text, value >= threshold
    return measure


def _keys(**wanted):
    return lambda row: all(_same(row.get(k), v) for k, v in wanted.items())


def _none_failed(group: str, impl: str, what: str):
    """Met where the record has the group and no failed case of impl (a wrong answer or a refusal)."""
    def measure(data):
        if group not in (data.get("bench_groups") or {}):
            return None
        failed = [f for f in data.get("failed_cases", []) if f["group"] == group and f["row"].get("impl") == impl]
        return (f"{len(failed)} {what}", not failed)
    return measure


def _attention_host_us(data):
    """flash_attention's host time over SDPA's for a forward call, the worst case (the GPU kept busy)."""
    forward = case_rows(data, "attention_models", "host_us", where=lambda r: r["workload"].endswith("_fwd"))
    over = [us["triton"]["host_us"] - us["sdpa"]["host_us"] for _, us in forward if "triton" in us and "sdpa" in us]
    return (f"at most {max(over):+.1f} us over {len(over)} cases", max(over) <= 5.0) if over else None


def _lce_memory(data):
    """linear_cross_entropy's memory above its inputs over cut-cross-entropy's, the worst size."""
    ratios = [mib["triton"]["forward_extra_MiB"] / mib["cce"]["forward_extra_MiB"]
              for _, mib in case_rows(data, "linear_cross_entropy", "forward_extra_MiB")
              if "triton" in mib and "cce" in mib and mib["cce"]["forward_extra_MiB"]]
    return (f"at most {max(ratios):.2f}x over {len(ratios)} sizes", max(ratios) <= 1.25) if ratios else None


def _lce_gemm_floor(data):
    """linear_cross_entropy's share of the three products' time at cuBLAS's rate, the LM-head sizes."""
    df = group_frame(data, "linear_cross_entropy")
    if df is None:
        return None
    rows = [r for r in df.to_dict("records") if r["impl"] == "triton" and int(r["V"]) >= 32768 and int(r["H"]) >= 2048
            and not _isnan(r["pct_of_matmul_peak"])]
    if not rows:
        return None
    least = min(r["pct_of_matmul_peak"] for r in rows)
    return f"at least {least:.0f} % over {len(rows)} sizes", least >= 85


def _model_step_pairs(data, compiled: str) -> tuple[list[tuple[float, dict, dict]], str]:
    """(torch's time a step over the project's, torch's row, the project's row) per configuration,
    and what was compared: a training loop's wall time a step (``wall_ms``, the host included)
    where both rows have it, else the GPU's (a record from before the column)."""
    ran = [r for _, r in case_rows(data, "model_step", "forward_ms_median", where=lambda r: r["compiled"] == compiled)
           if "project" in r and "torch" in r]
    wall = bool(ran) and all(not _isnan(r[i].get("wall_ms")) for r in ran for i in ("torch", "project"))
    column = "wall_ms" if wall else "forward_ms_median"
    return [(r["torch"][column] / r["project"][column], r["torch"], r["project"]) for r in ran], \
        " (wall time a step)" if wall else ""


def _model_step_compiled(data):
    """The compiled step's speed-up against torch's compiled step, the worse configuration."""
    pairs, what = _model_step_pairs(data, "compile")
    if not pairs:
        return None
    text, speed = _ratio_summary([p[0] for p in pairs])
    return text + what, speed >= 1.05


def _model_step_eager(data):
    """The eager step's speed-up and peak memory against torch's, the worse configuration."""
    pairs, what = _model_step_pairs(data, "eager")
    if not pairs:
        return None
    speed = min(p[0] for p in pairs)
    memory = max(ours["forward_peak_MiB"] / theirs["forward_peak_MiB"] for _, theirs, ours in pairs)
    return f"{speed:.2f}x at {memory:.2f}x the memory{what}", speed >= 1.15 and memory <= 0.6


_SMV_SPEC = dict(batch_size=16, d1=2048, d3=512)
_ATTENTION_SPEC = dict(batch=16, n_queries=8192, n_keys=8192, d=64, dtype="bfloat16", is_causal=True)
TARGETS = (
    Target(19, "softmax(x) @ V's Triton kernel (materialize=False; a plain call takes Gluon on Hopper) at the specification's shape, d2 8192, bfloat16: >= 3x torch",
           _ratio_target("softmax_matmul_precision", "triton_graph", ("torch",), 3.0,
                         where=_keys(**_SMV_SPEC, d2=8192, dtype="bfloat16"))),
    Target(19, "the same at d2 256: >= 1.0x torch", _ratio_target(
        "softmax_matmul_precision", "triton_graph", ("torch",), 1.0, where=_keys(**_SMV_SPEC, d2=256, dtype="bfloat16"))),
    Target(19, "the same in float32, TF32 ('high'): >= 2.5x torch", _ratio_target(
        "softmax_matmul_precision", "triton_graph", ("torch",), 2.5,
        where=_keys(**_SMV_SPEC, d2=8192, dtype="float32", precision="high"))),
    Target(19, "the same in float32 'highest': >= 2.5x torch", _ratio_target(
        "softmax_matmul_precision", "triton_graph", ("torch",), 2.5,
        where=_keys(**_SMV_SPEC, d2=8192, dtype="float32", precision="highest"))),
    Target(19, "attention (16, 8192, 64) causal bfloat16, forward: >= 1.2x SDPA", _ratio_target(
        "flash_attention", "flash_triton", ("sdpa",), 1.2, where=_keys(**_ATTENTION_SPEC, mode="fwd"))),
    Target(19, "the same, forward + backward: >= 1.0x SDPA", _ratio_target(
        "flash_attention", "flash_triton", ("sdpa",), 1.0, where=_keys(**_ATTENTION_SPEC, mode="fwd_bwd"))),
    Target(45, "attention at models' shapes, forward: geomean >= 1.05x the best peer (SDPA, FlexAttention)",
           _ratio_target("attention_models", "triton", ("sdpa", "flex_compile"), 1.05, "geomean",
                         where=lambda r: r["workload"].endswith("_fwd"))),
    Target(45, "the same, forward + backward: geomean >= 0.95x", _ratio_target(
        "attention_models", "triton", ("sdpa", "flex_compile"), 0.95, "geomean",
        where=lambda r: r["workload"].endswith("_fwd_bwd"))),
    Target(45, "the same: no case below 0.8x", _ratio_target("attention_models", "triton", ("sdpa", "flex_compile"), 0.8)),
    Target(45, "every case runs, within its error bound", _none_failed("attention_models", "triton", "cases failed")),
    Target(45, "host time of an eager forward call within SDPA's + 5 us", _attention_host_us),
    Target(46, "linear_cross_entropy at every size faster than torch, torch.compile, Liger and cut-cross-entropy",
           _ratio_target("linear_cross_entropy", "triton", ("torch", "compile", "liger", "cce"), 1.0)),
    Target(46, "peak memory above the inputs at most 1.25x cut-cross-entropy's", _lce_memory),
    Target(46, "at V >= 32768, H >= 2048: at least 85 % of the three-GEMM floor", _lce_gemm_floor),
    Target(47, "compiled training step >= 1.05x torch's compiled step, both configurations", _model_step_compiled),
    Target(47, "eager training step >= 1.15x torch's at <= 0.6x its peak memory", _model_step_eager),
    Target(47, "losses within bfloat16 noise over every measured step", _none_failed(
        "model_step", "project", "cases over their loss bound or failed")),
)


def targets_markdown(data: dict, path: Path) -> str:
    """outputs/README.md's table: each issue target the record measures, its figure, met or missed."""
    lines = ["| issue | target | measured | met |", "| ---: | --- | --- | --- |"]
    for t in TARGETS:
        got = t.measure(data)
        measured, verdict = ("not in the record", "") if got is None else (got[0], "met" if got[1] else "missed")
        lines.append(f"| {t.issue} | {t.text} | {measured} | {verdict} |")
    lines += ["", f"Medians on an {_versions(data)}, from {_source(data, path)}. "
                  "Written by `python3 conftest.py headline`."]
    return "\n".join(lines)


GENERATED = (  # (file under ROOT, marker, what writes the block)
    ("README.md", "headline", headline_markdown),
    ("outputs/README.md", "targets", targets_markdown),
)


def with_block(text: str, marker: str, body: str) -> str:
    """text with the block between <!-- marker:begin --> and <!-- marker:end --> replaced by body."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    head, found, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"no {begin} ... {end} block")
    return f"{head}{begin}\n{body}\n{end}{tail}"


def stale_blocks(data: dict | None, path: Path, write: bool = False) -> list[str]:
    """The generated blocks that differ from what the record ``data`` (read from ``path``; None:
    no record) gives, each file written anew with ``write``."""
    stale, fresh_files = [], []
    for name, marker, make in GENERATED:  # every block made before any file is written
        file = ROOT / name
        try:
            text = file.read_text(encoding="utf-8")
            fresh = with_block(text, marker, make(data, path) if data is not None else no_record(path))
        except (OSError, ValueError) as error:
            raise ValueError(f"{name}: {getattr(error, 'strerror', None) or error}") from None
        if fresh != text:
            stale.append(f"{name} ({marker})")
            fresh_files.append((file, fresh))
    if write:
        for file, fresh in fresh_files:
            file.write_text(fresh, encoding="utf-8")
    return stale


def gate_report(run: dict, record: dict, max_slowdown: float) -> tuple[list[str], int]:
    """A run's medians against the record's, case by case: lines for the cases slower by more than
    ``max_slowdown`` (a fraction) or failing where the record timed them, and how many cases both
    hold. ValueError where the two are of different GPU kinds or timing settings (every case would
    differ)."""
    settings = [run_settings(d) for d in (run, record)]
    if settings[0] != settings[1]:
        raise ValueError(f"the run and the record differ in their GPU or timing settings: {settings[0]} against "
                         f"{settings[1]}")
    old = {b["fullname"]: b["stats"]["median"] for b in record.get("benchmarks", [])}
    slower, shared = [], 0
    for case in run.get("failed_cases", []):  # the record timed it; this run could not
        if case["test"] in old:
            shared += 1
            slower.append(f"FAILED {case['test']}: the record's {old[case['test']] * 1e3:.4g} ms, now "
                          f"{case['reason']}")
    for b in run.get("benchmarks", []):
        if b["fullname"] in old:
            shared += 1
            ratio = b["stats"]["median"] / old[b["fullname"]]
            if ratio > 1 + max_slowdown:
                slower.append(f"SLOWER {b['fullname']}: {b['stats']['median'] * 1e3:.4g} ms against the record's "
                              f"{old[b['fullname']] * 1e3:.4g} ms ({ratio - 1:+.1%})")
    return slower, shared


# Command line: python3 conftest.py rebuild | merge | headline | gate | parts (python3 conftest.py -h)
# ----------------------------------------------------------------------------------------------
def committed_destination(path: Path) -> bool:
    """Whether path lies in the committed outputs/ (its GPU kinds' records)."""
    return path.resolve().is_relative_to(ROOT / "outputs")


def percentage(text: str) -> float:
    """A --max-slowdown or --tolerance: a number of percent, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a percentage of 0 or more, got {text}")
    return abs(value)  # -0 is 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 conftest.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rebuild = sub.add_parser("rebuild", help="the CSVs and plots of a saved run, from its JSON alone")
    rebuild.add_argument("json", type=Path, help="a run's JSON (benchmark.json, a --benchmark-save or "
                                                 "--benchmark-json file) or a benchmark.json.part")
    rebuild.add_argument("--outputs-dir", type=Path, default=None, help="default: the JSON's directory")
    rebuild.add_argument("--plot", action="append", default=[], metavar="GROUP=KIND:METRIC",
                         help="draw GROUP's plot as KIND (line, bar, ratio) of METRIC, whatever the run's layout "
                              "said: a plot kind added after the run")
    merge = sub.add_parser("merge", help="one run from runs of parts of the record (same commit and GPU, no case "
                                         "twice): its JSON at --output, its tables beside it")
    merge.add_argument("parts", type=Path, nargs="+", help="the runs' JSONs (or .part files); one alone with --against")
    merge.add_argument("--output", type=Path, required=True, help="the merged JSON to write")
    merge.add_argument("--against", type=Path, default=None, metavar="ONE_GPU_JSON",
                       help="a one-GPU run's JSON: compare the merged run's medians with its medians on the cases "
                            "both measured, name those more than --tolerance apart (exit status 1 if any), and "
                            "record both runs' wall times under compared_with_one_gpu in the output")
    merge.add_argument("--tolerance", type=percentage, default=3.0, metavar="PERCENT",
                       help="largest difference of two medians, in percent of the one-GPU median (default 3)")
    for command in (rebuild, merge):
        command.add_argument("--committed", action="store_true",
                             help="allow writing into the committed outputs/ (replacing its tables)")
    headline = sub.add_parser("headline", help="write README.md's headline and outputs/README.md's targets from the "
                                               "record")
    headline.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block differs from the record")
    gate = sub.add_parser("gate", help="a run's medians against the record's: exit 1 if a case is slower than allowed")
    gate.add_argument("json", type=Path, help="the run's JSON (benchmark.json in its --outputs-dir)")
    gate.add_argument("--max-slowdown", type=percentage, default=5.0, metavar="PERCENT", help="default 5")
    parts = sub.add_parser("parts", help="the record's parts, what each holds and its minutes (planned, and from "
                                         "the record)")
    for command in (headline, gate, parts):
        command.add_argument("--record", type=Path, default=None,
                             help=f"the record's JSON (default outputs/{REFERENCE_GPU}/{RUN_JSON}, or another GPU "
                                  f"kind's where it has none; for gate, outputs/<the run's GPU>/{RUN_JSON})")
    args = parser.parse_args(argv)

    def refuse(message: str) -> int:
        print(f"python3 conftest.py {args.command}: {message}", file=sys.stderr)
        return 2

    if args.command in ("headline", "gate", "parts"):
        return record_command(args, refuse)
    if args.command == "merge":
        dest, what = args.output.parent, f"--output {args.output}"
        if args.output.is_dir():
            return refuse(f"{what}: is a directory; give the path of the merged JSON to write")
        inputs = [*args.parts, *([args.against] if args.against is not None else [])]
        if any(args.output.resolve() == Path(p).resolve() for p in inputs):
            return refuse(f"{what} is one of the runs it reads: give the merged JSON another path")
    else:
        dest = args.outputs_dir or args.json.parent
        what = f"--outputs-dir {dest}" if args.outputs_dir else f"the JSON's directory {dest} (no --outputs-dir)"
    if committed_destination(dest) and not args.committed:
        return refuse(f"{what} is in the committed outputs/: name another directory, or pass --committed to replace "
                      "what is committed there")
    try:
        runs = [(str(path), load_run(path)) for path in (args.parts if args.command == "merge" else [args.json])]
    except BadRun as bad:
        return refuse(str(bad))
    report = None
    if args.command == "merge":
        if len(runs) == 1 and args.against is None:
            return refuse("one run alone is no merge: give two runs or more, or one with --against")
        try:
            data = dict(runs[0][1]) if args.against is not None and len(runs) == 1 else merge_runs(runs)
        except ValueError as error:
            return refuse(str(error))
        if committed_destination(dest) and not data["bench_run"].get("complete", True):
            partial = [name for name, part in runs if not (part.get("bench_run") or {}).get("complete", True)]
            return refuse(f"{', '.join(partial)}: a partial run (it did not end on its own) makes no record: merge "
                          "it outside outputs/, or run its part again")
        if len(runs) > 1:
            data["bench_run"]["command"] = " ".join(["python3 conftest.py", *(argv if argv is not None else sys.argv[1:])])
        if args.against is not None:
            try:
                record = compare_with_one_gpu(data, load_run(args.against), args.tolerance / 100)
            except BadRun as bad:
                return refuse(f"--against: {bad}")
            except ValueError as error:
                return refuse(f"--against {args.against}: {error}")
            record["one_gpu"]["file"] = str(args.against)
            data["compared_with_one_gpu"] = record
            report = comparison_report(record, str(args.against))
    else:
        data = runs[0][1]
        for spec in args.plot:
            name, _, drawn = spec.partition("=")
            kind, _, metric = drawn.partition(":")
            layout = data["bench_groups"].get(name, {})
            known = {*layout.get("columns", ()), *layout.get("case", ()), *METRICS, *layout.get("speedups", {})}
            if not layout or kind not in ("line", "bar", "ratio", "strip") or metric not in known:
                parser.error(f"--plot {spec}: expected GROUP=KIND:METRIC with a group of this run "
                             f"({', '.join(data['bench_groups'])}), KIND line, bar, ratio or strip, and METRIC one of its "
                             f"columns or metrics")
            layout["plot"] = [kind, metric]
    try:
        fd, note = take_lock(dest)
    except DirectoryBusy as busy:
        return refuse(str(busy))
    except OSError as exc:
        return refuse(f"{what}: cannot write there: {exc.strerror or exc}")
    if note:
        print(f"NOTE {note}", file=sys.stderr)
    try:
        if args.command == "merge":
            write_json(data, args.output)
            print(args.output)
            if report is not None:
                print(report)
            missing = [p.name for p in RECORD_PARTS if p.name not in data["bench_run"].get("record_parts", ())]
            if data["bench_run"].get("record_parts") and missing:
                print(f"NOTE not yet the whole record: parts {', '.join(missing)} are missing", file=sys.stderr)
            for name, part in runs:
                if not (part.get("bench_run") or {}).get("complete", True):
                    print(f"NOTE {name} is a partial run (it did not end on its own): so is the merged run, its "
                          f"tables NAME.partial.csv", file=sys.stderr)
        for path in write_tables(data, dest):
            print(path)
    finally:
        release_lock(dest, fd)
    compared = data.get("compared_with_one_gpu") if args.command == "merge" else None
    return 1 if compared and (compared["differing"] or compared["failed_in_one"]) else 0


def record_command(args, refuse) -> int:
    """``headline``, ``gate`` and ``parts``: they read the committed record (or --record)."""
    try:
        run = load_run(args.json) if args.command == "gate" else None
    except BadRun as bad:
        return refuse(str(bad))
    # The gate's default: the record of the run's own GPU kind.
    gpu = (run.get("bench_run") or {}).get("gpu") or REFERENCE_GPU if run else None
    path = args.record or record_json(gpu)
    if run and args.record is None and not path.exists():
        records = ", ".join(str(p.relative_to(ROOT)) for p in sorted((ROOT / "outputs").glob(f"*/{RUN_JSON}"))
                            if p.parent.name != "cpu") or "none"  # outputs/cpu/: the interpreter's, never committed
        return refuse(f"no record of {gpu} runs is committed (no {path.relative_to(ROOT)}); name the record to compare "
                      f"{args.json} with: --record JSON (the records: {records})")
    if args.command != "gate" and args.record is None and not path.exists():
        data = None  # no record committed yet: the blocks say so, the parts have no measured minutes
    else:
        try:
            data = load_run(path)
        except BadRun as bad:
            return refuse(str(bad))
    if args.command == "parts":
        print(parts_report(data))
        return 0
    if args.command == "gate":
        try:
            slower, shared = gate_report(run, data, args.max_slowdown / 100)
        except ValueError as error:
            return refuse(str(error))
        print("\n".join(slower + [f"{shared} cases compared with {path}, {len(slower)} slower by more than "
                                   f"{args.max_slowdown:g} % or failing"]))
        if not shared:
            print(f"python3 conftest.py gate: none of {args.json}'s cases is in {path}: nothing was compared",
                  file=sys.stderr)
        return 1 if slower or not shared else 0
    try:
        stale = stale_blocks(data, path, write=not args.check)
    except ValueError as error:
        return refuse(str(error))
    for block in stale:
        print(f"{'differs from the record' if args.check else 'written'}: {block}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":  # the commands above need the standard library and pandas only
    sys.exit(main())


# ----------------------------------------------------------------------------------------------
# The pytest plugin: the device, the bench fixture, the run's record (torch, triton, pytest)
# ----------------------------------------------------------------------------------------------
# Several GPUs: pytest-xdist names each worker (gw0, gw1, ...) in PYTEST_XDIST_WORKER before the
# worker imports this file, and the controller lists its GPUs in WORKER_GPUS_ENV before it starts
# the workers (pytest_configure). Each worker sees one GPU, round-robin, and must choose it before
# torch first asks CUDA about devices (just below): CUDA reads CUDA_VISIBLE_DEVICES once.
WORKER_GPUS_ENV = "SOFTMAX_KERNELS_WORKER_GPUS"


def _pin_worker_gpu() -> None:
    number = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    gpus = [g for g in os.environ.get(WORKER_GPUS_ENV, "").split(",") if g]
    if gpus and number.isdigit():
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(number) % len(gpus)]


_pin_worker_gpu()

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402

from online_softmax import INTERPRET, KernelCapacityError  # noqa: E402 - TRITON_INTERPRET is settled above

ON_GPU = not INTERPRET  # TRITON_INTERPRET as Triton reads it (1, true, yes, on, y)

L2_FLUSH_BYTES = 256 * MiB  # several times any current L2 (H100: 50 MB), as triton's do_bench does
# The code that ran, where the tree was copied without .git: "<commit>" or "<commit>-dirty".
COMMIT_ENV = "SOFTMAX_KERNELS_COMMIT"
TIMERS = ("events", "do_bench", "cudagraph")
# --candidate: a user's own kernels checked and timed beside the project's (tests/candidates.py,
# importable where the ini's pythonpath has tests/; a run of this harness from elsewhere goes without).
_CANDIDATES = importlib.util.find_spec("candidates")
pytest_plugins = (("candidates",) if _CANDIDATES and _CANDIDATES.origin
                  and Path(_CANDIDATES.origin).resolve() == ROOT / "tests" / "candidates.py" else ())


def fill_fresh_tensors_with_nan() -> None:
    """torch.empty, torch.empty_like and Tensor.new_empty return floating tensors full of NaN: a
    kernel or product that reads memory nobody wrote then fails its test on every run, not on the
    runs where the allocator hands back a NaN. Interpreter runs only (on the GPU the fill would be
    timed)."""
    def filled(allocate):
        @functools.wraps(allocate)
        def allocate_nan(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() and t.numel() else t
        return allocate_nan
    if not getattr(torch.empty, "fills_nan", False):
        torch.empty, torch.empty_like = filled(torch.empty), filled(torch.empty_like)
        torch.Tensor.new_empty = filled(torch.Tensor.new_empty)
        torch.empty.fills_nan = True


if not ON_GPU:
    fill_fresh_tensors_with_nan()


# Failures that say "this configuration does not fit this machine": the row stays empty with its
# reason in the failure column, the test is skipped. Only these named types: a message is no
# declaration (a tl.static_assert or a Triton size error raised by a wrapper that used to take the
# shape is a bug to see, not a skip). Anything else fails the test.
RESOURCE_ERRORS = (torch.OutOfMemoryError, triton.runtime.errors.OutOfResources)


class Unavailable(RuntimeError):
    """An implementation this machine cannot run: a form of an op it lacks (a CUDA graph, or a
    compiled Triton launch, in the interpreter), a peer library not installed, or one that refuses
    the case by its own rule (an SDPA backend that does not take it). Its row stays empty with the
    reason, as for a configuration that does not fit."""


class WrongAnswer(AssertionError):
    """A benchmarked case whose error against float64 is over its bound: the test fails, its row
    is a failure with the two numbers, and it is never timed."""


def is_resource_limit(exc: BaseException) -> bool:
    return isinstance(exc, (*RESOURCE_ERRORS, KernelCapacityError, Unavailable))


# ----------------------------------------------------------------------------------------------
# Options and configuration
# ----------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("softmax-kernels benchmarks")
    group.addoption("--l2-flush", action=argparse.BooleanOptionalAction, default=True,
                    help="flush the L2 cache before every timed round (default: on; --no-l2-flush to turn off)")
    group.addoption("--outputs-dir", default=None,
                    help="where the run's JSON, CSVs and plots go (default: the record's outputs/<GPU>/ for "
                         "--record-part all, outputs/<GPU>/parts/<NAME>/ for other parts, outputs/<GPU>/partial/ "
                         "for any other selection, outputs/cpu/ in interpreter mode)")
    group.addoption("--record-part", action="append", default=[], metavar="NAME",
                    help="run the benchmark cases of a part of the record (repeatable): "
                         f"{', '.join(p.name for p in RECORD_PARTS)}; main ({' + '.join(MAIN_JOB)}: tox -e gpu), "
                         "all (the whole record: tox -e record). python3 conftest.py parts lists them")
    group.addoption("--bench-rounds", type=int, default=None,
                    help="timed rounds per case (default: each group's own; 2 in interpreter mode)")
    group.addoption("--bench-warmup", type=int, default=None,
                    help="warm-up rounds per case (default: each group's own; 1 in interpreter mode)")
    group.addoption("--timer", choices=TIMERS, default="events",
                    help="events (default): CUDA events around each call, GPU kept busy while it is queued; "
                         "do_bench / cudagraph: triton.testing's timers, to cross-check a figure (GPU only)")


def gpu_slug() -> str:
    if not ON_GPU:
        return "interpreter"
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long benchmark case (LM-head sizes, attention at length 16384)")
    config.bench_run = None
    try:
        config.bench_part_names = tuple(dict.fromkeys(config.getoption("record_part")))
        config.bench_parts = record_parts(config.bench_part_names)
    except ValueError as error:
        raise pytest.UsageError(f"--record-part: {error}") from None
    o = config.option
    config.bench_whole_parts = whole_parts(config.bench_parts, o.keyword, o.markexpr, getattr(o, "deselect", None),
                                           config.args)
    config.bench_xdist = None
    config.bench_started = time.time()  # the run's wall time counts from here (collection included)
    if wants_xdist_timing(config):
        # pytest-benchmark turns itself off under xdist and then refuses --benchmark-only; the
        # harness times under xdist itself, so the option is hidden from pytest-benchmark's
        # configure (after this one) and given back at session start (pytest_sessionstart).
        config.bench_xdist = {"only": config.option.benchmark_only}
        config.option.benchmark_only = False
    # pytest-benchmark reads its options in its own (trylast) pytest_configure, after this one.
    if hasattr(config.option, "benchmark_storage"):
        # Keep each GPU kind's saved runs apart unless the user chose a storage.
        if config.option.benchmark_storage in ("file://./.benchmarks", None):
            config.option.benchmark_storage = f"file://./.benchmarks/{gpu_slug()}"
        # A collection inside a round stalls the launching Python: rounds run with the collector
        # off, through pytest-benchmark's own option so the JSON's options say so.
        config.option.benchmark_disable_gc = True
    if _option_or(config, "bench_rounds", 1) < 1 or _option_or(config, "bench_warmup", 0) < 0:
        raise pytest.UsageError("--bench-rounds must be at least 1 and --bench-warmup at least 0")
    if config.getoption("timer") != "events" and not ON_GPU:
        raise pytest.UsageError(f"--timer {config.getoption('timer')} needs a GPU (triton.testing's timers do not run "
                                "in the interpreter); the interpreter has only --timer events (the wall clock)")
    if hasattr(config, "workerinput") and os.environ.get(WORKER_GPUS_ENV) and torch.cuda.device_count() != 1:
        raise pytest.UsageError(f"xdist worker {os.environ.get('PYTEST_XDIST_WORKER')} sees {torch.cuda.device_count()} GPUs, "
                                "not the one it was given: CUDA started before conftest.py set CUDA_VISIBLE_DEVICES "
                                "(a plugin that touches CUDA at import?)")
    if not hasattr(config, "workerinput"):
        check_destinations(config)
        _install_signal_handlers(config)
        if xdist_active(config) and ON_GPU:
            share_gpus(config)
        if config.bench_xdist:
            # The controller writes rows as they arrive, after cases ran: it holds both places a
            # run may write (the selection is known to the workers only) before any case runs.
            hold_dirs(config, *run_dirs(outputs_dir(config)))
            config.pluginmanager.register(WorkerRowsMerger(config), "softmax-kernels-worker-rows")


def xdist_active(config) -> bool:
    """pytest-benchmark's own test: the controller of a distributed run, or one of its workers."""
    return config.getoption("dist", "no") != "no" or bool(os.environ.get("PYTEST_XDIST_WORKER"))


def wants_xdist_timing(config) -> bool:
    """Timed benchmarks under xdist: asked for with --benchmark-only (or --benchmark-enable).

    Without either, a distributed run (tox -e cpu's -n auto) keeps pytest-benchmark's rule: each
    benchmark runs once, untimed, as a smoke test, and writes no tables."""
    o = config.option
    if not hasattr(o, "benchmark_only") or not xdist_active(config):
        return False
    if o.benchmark_disable and not o.benchmark_enable or o.benchmark_skip and not o.benchmark_only:
        return False
    return bool(o.benchmark_only or o.benchmark_enable)


def share_gpus(config) -> None:
    """The controller: every worker gets one of the visible GPUs (see _pin_worker_gpu); a timed run's are of one kind."""
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    count = torch.cuda.device_count()
    gpus = visible[:count] if visible else [str(i) for i in range(count)]
    if config.bench_xdist:  # tests that time nothing may run on any mix of GPUs
        check_one_kind([torch.cuda.get_device_name(i) for i in range(count)], gpus)
    os.environ[WORKER_GPUS_ENV] = ",".join(gpus)
    workers = len(getattr(config.option, "tx", None) or ())
    if config.bench_xdist and workers > len(gpus):
        config.issue_config_time_warning(pytest.PytestWarning(
            f"{workers} workers on {len(gpus)} GPUs: workers share GPUs round-robin, and the timings of "
            "workers sharing one GPU disturb each other"), stacklevel=2)


def check_one_kind(names: list[str], gpus: list[str]) -> None:
    """One run, one GPU kind: its rows make one set of tables (outputs/ or outputs/<kind>/)."""
    kinds: dict[str, list[str]] = {}
    for name, gpu in zip(names, gpus):
        kinds.setdefault(name, []).append(gpu)
    if len(kinds) > 1:
        runs = "; ".join(f"CUDA_VISIBLE_DEVICES={','.join(ids)} for the {name}" for name, ids in kinds.items())
        raise pytest.UsageError(f"the visible GPUs are of {len(kinds)} kinds; a run spreads over GPUs of one kind. "
                                f"Run once per kind, each writing that kind's tables: {runs}")


def check_destinations(config) -> None:
    """--benchmark-json and a storage the run saves into, checked before any case runs (each is
    written at the end, when a refusal would lose the numbers)."""
    path = getattr(config.option, "benchmark_json", None)
    # pytest-benchmark before 5.3 opens the file as it parses the option: the check reads its name.
    if hasattr(path, "write"):
        path = path.name
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise pytest.UsageError(f"--benchmark-json {path}: is a directory; give the path of the JSON file to write")
        _check_writable_dir(path.resolve().parent, f"--benchmark-json {path}")
    o = config.option
    storage = str(getattr(o, "benchmark_storage", None) or "")
    saving = getattr(o, "benchmark_save", None) or getattr(o, "benchmark_autosave", False)
    if saving and "://" not in storage.replace("file://", "", 1):
        _check_writable_dir(Path(storage.removeprefix("file://")).resolve(), f"--benchmark-storage {storage}")


def _check_writable_dir(path: Path, what: str) -> None:
    """Fail before any benchmark runs, not at the end of the run when the numbers would be lost."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise pytest.UsageError(f"{what}: cannot write into {path}: {exc.strerror or exc}") from None


# The signals of the run's process that arrived (SIGTERM, SIGINT), in order. Set by the handler
# itself, before anything else runs: a second signal that lands inside pytest's handling of the
# first (before a hook could note it) still marks the run interrupted.
_SIGNALS: list = []
_WRITING_RECORD = [False]  # while the session's end writes the run's JSON and tables
_FIRST_SIGNAL_AT = [None]  # time.monotonic() of the first signal
REPEAT_SIGNAL_S = 5.0  # signals this soon after the first repeat it: a double Ctrl-C, a supervisor's burst


def _install_signal_handlers(config) -> None:
    """SIGTERM ends the run like Ctrl-C: pytest finishes the session, so measured rows are kept.

    While the record is being written a signal is noted, not raised: the JSON and the tables are
    finished (atomically, a few seconds), never left half done. A signal within REPEAT_SIGNAL_S of
    the first that stopped the run is noted too: the run is already ending, and raising again cut
    its summary short (under load, in the signals-in-quick-succession test); a later one stops it
    again, for a user whose run does not end."""
    def interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
        now = time.monotonic()
        _SIGNALS.append(signal.Signals(signum).name)
        repeat = _FIRST_SIGNAL_AT[0] is not None and now - _FIRST_SIGNAL_AT[0] < REPEAT_SIGNAL_S
        if _FIRST_SIGNAL_AT[0] is None:
            _FIRST_SIGNAL_AT[0] = now
        if not _WRITING_RECORD[0] and not repeat:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    config.bench_old_handlers = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            config.bench_old_handlers[sig] = signal.signal(sig, interrupt)
        except ValueError:  # not the main thread (pytest run inside another program): leave it be
            return


def pytest_unconfigure(config):
    # After a signal the process is on its way out: the handler stays, so a late one of a burst
    # neither kills it before its output is flushed nor prints a traceback; else the caller's
    # handlers come back (a pytest run inside another program).
    sys.stdout.flush()
    sys.stderr.flush()
    if not _SIGNALS:
        for sig, handler in getattr(config, "bench_old_handlers", {}).items():
            signal.signal(sig, handler)
    release_locks(config)
    gc.unfreeze()  # what settle_heap froze is collected at exit, as it would have been (Triton's IR objects among it)




def hold_dirs(config, *dirs: Path) -> None:
    """The run's locks on dirs (each taken once), or a usage error before any case runs."""
    held = config.__dict__.setdefault("bench_locks", {})
    for out in dirs:
        if out in held:
            continue
        _check_writable_dir(out, f"--outputs-dir {out}")
        try:
            held[out], note = take_lock(out)
        except DirectoryBusy as busy:
            raise pytest.UsageError(f"--outputs-dir: {busy}") from None
        if note:
            bench_note(config, note)


def release_locks(config) -> None:
    for out, fd in getattr(config, "bench_locks", {}).items():
        release_lock(out, fd)
    config.bench_locks = {}


def run_dirs(out: Path) -> tuple[Path, ...]:
    """The directories a run into ``out`` may write: an interrupted run into a committed
    directory writes its partial tables into its partial/ (pytest_sessionfinish)."""
    return (out, out / "partial") if out == committed_dir() else (out,)


def bench_note(config, text: str) -> None:
    """A line for the run's summary (pytest_terminal_summary)."""
    config.__dict__.setdefault("bench_notes", []).append(text)


def _option_or(config, name: str, default):
    value = config.getoption(name)
    return default if value is None else value




def committed_dir(slug: str | None = None) -> Path:
    """Where this GPU kind's record lives: outputs/<GPU>/ (outputs/cpu/, never committed, for the interpreter)."""
    slug = slug or gpu_slug()
    return ROOT / "outputs" / ("cpu" if slug == "interpreter" else slug)


def outputs_dir(config) -> Path:
    """Only the whole record (--record-part all) writes outputs/<GPU>/; a part writes its parts/<NAME>/
    there, any other selection partial/, the interpreter outputs/cpu/: none of them over a record."""
    chosen = config.getoption("outputs_dir")
    if chosen:
        path = Path(chosen).resolve()
        if path == ROOT / "outputs" or path.parent == ROOT / "outputs" and path != committed_dir():
            raise pytest.UsageError(f"--outputs-dir {chosen}: outputs/ holds each GPU kind's record in outputs/<GPU>/; "
                                    f"this run's is {committed_dir().relative_to(ROOT)}")
        return path
    return run_destination(committed_dir(), ON_GPU, config.bench_whole_parts, config.bench_part_names)


def pytest_collection_modifyitems(config, items):
    """--record-part: only the benchmark cases of the parts named, each benchmark case in a part."""
    if not config.bench_parts:
        return
    part = {i.nodeid: part_of(i.nodeid) for i in items}
    homeless = [i.nodeid for i in items if "bench" in getattr(i, "fixturenames", ()) and part[i.nodeid] is None]
    if homeless:
        raise pytest.UsageError(f"{len(homeless)} benchmark cases are in no part of the record (conftest.py's "
                                f"RECORD_PARTS), e.g. {homeless[0]}")
    keep = [i for i in items if part[i.nodeid] in config.bench_parts]
    dropped = [i for i in items if part[i.nodeid] not in config.bench_parts]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _bench_items(session) -> list:
    return [i for i in session.items if "bench" in getattr(i, "fixturenames", ())]


def pytest_collection_finish(session):
    """Open the run's record before any benchmark runs: a directory that cannot be written stops the run here."""
    config = session.config
    if config.option.collectonly or not _bench_items(session):
        return
    if hasattr(config, "workerinput"):
        if config.bench_xdist:
            config.bench_run = WorkerRows(config, session.items)
        return
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or bs.disabled or bs.skip:
        return
    out = outputs_dir(config)
    hold_dirs(config, *run_dirs(out))
    config.bench_run = RunRecord(out, config)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        recorded = record_json(gpu_slug())
        try:
            expected = case_seconds(load_run(recorded)) if recorded.exists() else {}
        except BadRun:
            expected = {}
        config.pluginmanager.register(Progress([i.nodeid for i in _bench_items(session)], expected, reporter.write_line),
                                      "softmax-kernels-progress")


# ----------------------------------------------------------------------------------------------
# The run's record: each finished row reaches disk at once
# ----------------------------------------------------------------------------------------------
class RunRecord:
    """``OUT/benchmark.json.part``: one JSON line per finished row, flushed and fsynced as it lands.

    A crash or SIGKILL leaves it behind with every row measured so far; ``python conftest.py
    rebuild OUT/benchmark.json.part`` turns it into tables marked partial. A session that ends
    (even by SIGTERM or Ctrl-C) writes the whole JSON beside it and removes it.
    """

    def __init__(self, out: Path, config):
        self.out = out
        self.config = config
        self.failed: list[dict] = []
        self.groups: dict[str, dict] = {}
        self.path = out / f"{RUN_JSON}.part"
        hold_dirs(config, out)  # the controller of a distributed run holds it already
        if self.path.exists():  # an earlier run's rows (it was killed): kept, under a name of their own
            kept = keep_leftover(self.path)
            bench_note(config, f"{self.path} was left by a run that did not end (its rows are kept): moved to {kept}; "
                               f"its tables: python conftest.py rebuild {kept} --outputs-dir DIR")
        self.file = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 - open for the whole session
        self.commit_info = run_commit_info(config)  # once a run: the run's JSON takes it too
        self._write({"run": run_header(config), "machine_info": config._benchmarksession.get_machine_info(),
                     "commit_info": self.commit_info})

    def _write(self, obj: dict) -> None:
        self.file.write(json.dumps(obj, default=str, sort_keys=True) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def add(self, group: BenchGroup, benchmark=None, failure: dict | None = None) -> None:
        """One finished row: benchmark, pytest-benchmark's statistics of a measured case, or failure."""
        line: dict = {"ceilings": CEILINGS.as_dict()}
        if group.name not in self.groups:
            self.groups[group.name] = line["group"] = group.layout()
        if benchmark is not None:
            line["benchmark"] = benchmark.as_dict(include_data=False)
        if failure is not None:
            self.failed.append(failure)
            line["failed_case"] = failure
        self._write(line)

    def close(self, remove: bool) -> None:
        self.file.close()
        if remove:
            self.path.unlink(missing_ok=True)




WORKER_ROW = "softmax_kernels_row"  # the user_properties name of a row a worker sends


class WorkerRows:
    """An xdist worker's record: each finished row goes to the controller in its test's report.

    ``user_properties`` are what reports carry from worker to controller. The row carries the
    rounds themselves (pytest-benchmark's statistics with their data), so the controller's
    session computes the same statistics; and its place in the collection, so the merged JSON
    lists the cases in a serial run's order, whichever worker ran them when.
    """

    def __init__(self, config, items):
        self.config = config
        self.order = {item.nodeid: i for i, item in enumerate(items)}
        self.node = None  # the item being run (pytest_runtest_setup)

    def add(self, group: BenchGroup, benchmark=None, failure: dict | None = None) -> None:
        payload = {"group": group.layout(), "order": self.order.get(self.node.nodeid),
                   "worker": os.environ.get("PYTEST_XDIST_WORKER"), "device": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "ceilings": CEILINGS.as_dict()}
        if benchmark is not None:
            payload["benchmark"] = benchmark.as_dict(include_data=True)
        if failure is not None:
            payload["failed_case"] = failure
        self.node.user_properties.append((WORKER_ROW, json.dumps(payload, default=str, sort_keys=True)))


def pytest_runtest_setup(item):
    if isinstance(item.config.bench_run, WorkerRows):
        item.config.bench_run.node = item
    if "bench" in getattr(item, "fixturenames", ()):
        settle_heap()


def settle_heap() -> None:
    """Collect the last case's garbage, then freeze what is left (modules, pytest's items, compile
    caches) out of the collector's sight. A case collects several times (before its rounds, for its
    peak memory, after it), and a full collection walks every object: with torch, Inductor and
    pytest's items loaded that was most of a short case's time (see outputs/README.md, design notes:
    the collector). Frozen objects are never collected, so this runs between cases only, when no
    case's tensors are alive; pytest_unconfigure unfreezes them."""
    gc.collect()
    gc.freeze()


PROGRESS_EVERY_S = 30.0  # a line of progress at most this often: a long run says where it is, a short one stays quiet


class Progress:
    """A timed run's progress, one line at most every PROGRESS_EVERY_S: cases done of all, the time
    so far, and the time left (``time_left``: each case left at its seconds in this GPU's record,
    scaled by how this run's finished cases compare, or at this run's mean case)."""

    def __init__(self, cases: list[str], expected: dict[str, float], write):
        self.total, self.pending, self.expected, self.write = len(cases), set(cases), expected, write
        self.seconds: dict[str, float] = {}  # each case's setup, call and teardown in this run
        self.started = self.shown = time.monotonic()
        known = [expected[c] for c in cases if c in expected]
        estimate = (f"about {time_left({}, cases, expected) / 60:.0f} min by the record"
                    if len(known) == len(cases) else "progress every 30 s")
        write(f"{self.total} benchmark cases to run; {estimate}")

    def pytest_runtest_logreport(self, report):
        if report.nodeid not in self.pending:
            return
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when != "teardown":
            return
        self.pending.discard(report.nodeid)
        now = time.monotonic()
        if now - self.shown < PROGRESS_EVERY_S and self.pending:
            return
        self.shown = now
        done = {c: s for c, s in self.seconds.items() if c not in self.pending}
        left = time_left(done, sorted(self.pending), self.expected)
        self.write(f"progress: {self.total - len(self.pending)}/{self.total} cases, {(now - self.started) / 60:.1f} min "
                   f"so far, about {left / 60:.1f} min left")


class WorkerRowsMerger:
    """The controller of a distributed run: every worker's rows into one record, as they arrive.

    Each row becomes a pytest-benchmark record of the controller's session (so --benchmark-json,
    --benchmark-save, --benchmark-compare and its table work as in a serial run) and a line of
    the controller's ``benchmark.json.part``. The run's ceilings are, per value, the median of
    the workers' (each worker measures its own GPU); each worker's own are kept in the JSON's
    ``bench_run.workers``.
    """

    def __init__(self, config):
        self.config = config
        self.workers: dict[str, dict] = {}
        self.order: dict[str, int] = {}  # node id -> place in the collection

    def pytest_runtest_logreport(self, report):
        if report.when != "call":  # setup and teardown reports repeat the properties
            return
        for name, value in report.user_properties:
            if name == WORKER_ROW:
                self.take(json.loads(value))

    def take(self, payload: dict) -> None:
        config = self.config
        if config.bench_run is None:
            config.bench_run = RunRecord(outputs_dir(config), config)
        self.workers[payload["worker"]] = {"device": payload["device"], "ceilings": payload["ceilings"]}
        merged = merged_ceilings([w["ceilings"] for w in self.workers.values()])
        for field in dataclasses.fields(Ceilings):
            setattr(CEILINGS, field.name, getattr(merged, field.name))
        group = BenchGroup.from_layout(payload["group"])
        metadata = None
        if "benchmark" in payload:
            metadata = worker_metadata(payload["benchmark"])
            self.order[metadata.fullname] = payload["order"]
            benchmarks = config._benchmarksession.benchmarks
            benchmarks.append(metadata)
            benchmarks.sort(key=lambda b: self.order.get(b.fullname, math.inf))
        run = config.bench_run
        run.add(group, benchmark=metadata, failure=payload.get("failed_case"))
        if "failed_case" in payload:
            self.order[payload["failed_case"]["test"]] = payload["order"]
            run.failed.sort(key=lambda f: self.order.get(f["test"], math.inf))


def worker_metadata(benchmark: dict):
    """A worker's benchmark as a record of this process's pytest-benchmark session, its
    statistics recomputed from the worker's rounds."""
    import types

    from pytest_benchmark.stats import Metadata

    stats = benchmark["stats"]
    source = types.SimpleNamespace(has_error=False, cprofile_stats=None, **{
        k: benchmark.get(k) for k in ("name", "fullname", "group", "param", "params", "extra_info")})
    metadata = Metadata(source, iterations=stats["iterations"], options=benchmark["options"])
    for seconds in stats["data"]:
        metadata.update(seconds * stats["iterations"])
    return metadata



def timer_name(config, group: BenchGroup | None = None) -> str:
    """The timer the rounds came from, as the JSON records it: the interpreter's is the wall clock;
    a group's own protocol with its arguments, do_bench(warmup=1000, rep=10000)."""
    if not ON_GPU:
        return "perf_counter"
    name, args = group_timer(group, config.getoption("timer")) if group else (config.getoption("timer"), {})
    return f"{name}({', '.join(f'{k}={v}' for k, v in args.items())})" if args else name


def group_timer(group: BenchGroup, timer: str, on_gpu: bool = ON_GPU) -> tuple[str, dict]:
    """(timer, its arguments) a group's cases are measured with: the group's own protocol on a GPU,
    else --timer's with its defaults."""
    if group.timer and on_gpu:
        name, args = group.timer
        return name, dict(args)
    return timer, {}


def run_commit_info(config) -> dict:
    """The commit the run's code came from, as pytest-benchmark's JSON records it."""
    commit_info = config.hook.pytest_benchmark_generate_commit_info(config=config)
    config.hook.pytest_benchmark_update_commit_info(config=config, commit_info=commit_info)
    return commit_info


def run_info(config) -> dict:
    return {"timer": timer_name(config), "l2_flush": bool(config.getoption("l2_flush") and ON_GPU),
            "execution": "compiled" if ON_GPU else "interpreter", "gpu": gpu_slug()}


def run_header(config) -> dict:
    """run_info and what the run was: the command that made it (through tox, its environment too)
    and the record's parts it holds whole (none where -k, -m or test ids narrowed them)."""
    command = " ".join(["python -m pytest", *map(str, config.invocation_params.args)])
    tox = os.environ.get("TOX_ENV_NAME")
    return {**run_info(config), "command": f"tox -e {tox}: {command}" if tox else command,
            "record_parts": list(config.bench_whole_parts)}



# ----------------------------------------------------------------------------------------------
# Machine ceilings, measured once per run with the harness's one timing primitive
# ----------------------------------------------------------------------------------------------
def median_ms(fn, rounds: int) -> float:
    return 1e3 * statistics.median(measure(fn, rounds=rounds, warmup=1).seconds)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9 (the memory ceiling)."""
    if CEILINGS.copy_GBps is None:
        n = (1 << 30 if ON_GPU else 1 << 26) // 4
        src = torch.empty(n, dtype=torch.float32, device="cuda" if ON_GPU else "cpu").uniform_()
        dst = torch.empty_like(src)
        ms = median_ms(lambda: dst.copy_(src), 20 if ON_GPU else 5)
        CEILINGS.copy_GBps = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
        del src, dst
    return CEILINGS.copy_GBps


def matmul_peak_key(dtype: torch.dtype) -> str:
    return f"{dtype}|{torch.get_float32_matmul_precision()}"


def matmul_peak_tflops(dtype: torch.dtype) -> float | None:
    """cuBLAS rate on a large square product in dtype under the current float32 precision (GPU only)."""
    if not ON_GPU:
        return None
    key = matmul_peak_key(dtype)
    if key not in CEILINGS.matmul_TFLOPs:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        CEILINGS.matmul_TFLOPs[key] = 2 * n**3 / (median_ms(lambda: a @ b, 10) * 1e-3) / 1e12
        del a, b
    return CEILINGS.matmul_TFLOPs[key]


@triton.jit
def empty_kernel(x_ptr):
    pass


def launch_floor_us() -> float:
    """Host time of one empty Triton launch: what no Triton op can go below (issue 13's floor)."""
    if CEILINGS.launch_floor_us is None:
        x = torch.empty(1, device="cuda" if ON_GPU else "cpu")
        empty_kernel[(1,)](x)  # the first launch compiles
        CEILINGS.launch_floor_us = host_us(lambda: empty_kernel[(1,)](x))
    return CEILINGS.launch_floor_us


def pytest_benchmark_update_machine_info(config, machine_info):  # noqa: ARG001 - hook signature
    """Identity only (what the machine and software are): measured values live in the JSON's
    ``ceilings``, so --benchmark-compare of two runs on one machine sees equal machine_info."""
    cpu = machine_info.get("cpu")
    if isinstance(cpu, dict):
        for volatile in ("hz_actual", "hz_actual_friendly"):  # the clock of the moment, not the machine
            cpu.pop(volatile, None)
    info = {"mode": "compiled" if ON_GPU else "interpreter (TRITON_INTERPRET=1)",
            "torch": torch.__version__, "triton": triton.__version__}
    if ON_GPU:
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name, sm_count=props.multi_processor_count, memory_MiB=props.total_memory // MiB,
            capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda, driver=_driver_version(),
            l2_MiB=getattr(props, "L2_cache_size", 0) / MiB,
        )
    else:
        info["name"] = "interpreter (no GPU)"
    machine_info["gpu"] = info


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def pytest_benchmark_update_commit_info(config, commit_info):  # noqa: ARG001 - hook signature
    """The code that ran: SOFTMAX_KERNELS_COMMIT wins over .git (a copied tree may carry a stale one, or none)."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        commit, dirty = given.removesuffix("-dirty"), given.endswith("-dirty")
        commit_info.update(id=commit, dirty=dirty, source=f"environment variable {COMMIT_ENV}")
        commit_info.pop("error", None)


def pytest_benchmark_update_json(config, benchmarks, output_json):  # noqa: ARG001 - hook signature
    run = config.bench_run
    output_json["ceilings"] = CEILINGS.as_dict()
    output_json["failed_cases"] = list(run.failed) if run else []
    output_json["bench_groups"] = dict(run.groups) if run else {}
    output_json["bench_run"] = {**run_header(config), "complete": run_complete(config), **wall_time(config)}
    merger = config.pluginmanager.get_plugin("softmax-kernels-worker-rows")
    if merger is not None:
        output_json["bench_run"]["workers"] = dict(sorted(merger.workers.items()))


def wall_time(config) -> dict:
    """The run's start (UTC) and its wall time in seconds up to now: its JSON is written at its end."""
    import datetime

    started = config.bench_started
    return {"started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - started, 1)}


# ----------------------------------------------------------------------------------------------
# The timing primitive
# ----------------------------------------------------------------------------------------------
class EventTimer:
    """Device time of one call, measured by CUDA events (the wall clock without a GPU).

    ``measured(fn)`` wraps the target: it records events around the call alone, waits for them,
    and adds the elapsed time to a float64 running total, which ``__call__`` returns. Short deltas
    are summed in float64 rather than read against one aging reference event, whose float32
    milliseconds would lose resolution.

    Before each round the GPU spins for ``spin_ms`` while Python enqueues fn's kernels, so the
    start event fires with them already queued. A round whose enqueueing took longer than the
    spin (the host stalled: the OS, another thread) may have left the GPU idle inside the events;
    it is thrown away and run again, after ``before_retry`` (the L2 flush), at most
    ``MAX_RETRIES`` times, and counted in ``stalled_rounds``. A function whose enqueueing needs
    more than the longest spin (SPIN_CAP_MS), or outlasts the spin on every try of one round, is
    host bound by nature (a Python loop of many small kernels: once CUDA's launch queue is full,
    each launch waits for the GPU, so the queueing time is the GPU's time): from then on its
    rounds are kept as they come (``host_bound``). The NVTX range, named by ``label`` (the
    test's node id), opens after the spin, so a profiler's range holds the call alone.
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
        t0 = time.perf_counter()
        if self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)
        torch.cuda.nvtx.range_push(self.label)
        self.start.record()
        result = fn()
        self.end.record()
        torch.cuda.nvtx.range_pop()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        self.end.synchronize()
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


def clock_cycles_per_ms() -> float:
    if CEILINGS.cycles_per_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm the clock up first
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        CEILINGS.cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    return CEILINGS.cycles_per_ms


def host_ms_once(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    _sync()
    return host_ms


def spin_cycles_for(fn) -> tuple[int, float]:
    """(GPU clock cycles, ms) to spin before each timed round: twice the CPU time fn takes to
    enqueue its work plus 0.1 ms for the timer's own calls (at least 0.2 ms, at most
    SPIN_CAP_MS), so the GPU never waits on the launching Python. At 0.05 ms, queueing one
    Triton launch with its events (~0.05 ms on the H100 machine) overran the spin in most rounds."""
    if not ON_GPU:
        return 0, 0.0
    spin_ms = min(SPIN_CAP_MS, max(0.2, 2 * host_ms_once(fn) + 0.1))
    return int(clock_cycles_per_ms() * spin_ms), spin_ms


HOST_US_TARGET_MS = 5.0  # enough queued calls for the clock's resolution and the loop's noise to vanish
HOST_US_MAX_CALLS = 100  # calls, not launches: a call of many launches may still fill CUDA's queue
# GPU work queued a measurement, at most (but HOST_US_MIN_CALLS calls): the GPU runs every queued call before
# the next, so a call of milliseconds would make host_us the case's longest step (design notes: host_us calls).
HOST_US_GPU_MS = 20.0
HOST_US_MIN_CALLS = 4
# The median of this many measurements: a call of milliseconds (a model's step) is one or two calls
# a measurement, which one host hiccup (a collection, another process) can set far off.
HOST_US_SAMPLES = 5


def host_us_calls(once_ms: float, gpu_ms: float | None = None) -> int:
    """Calls a ``host_us`` measurement queues: HOST_US_TARGET_MS of host time (one call's ``once_ms``), at most
    HOST_US_MAX_CALLS, and, given one call's GPU time, at most HOST_US_GPU_MS of GPU work (but
    HOST_US_MIN_CALLS), never more than the host target alone gives."""
    n = max(1, min(HOST_US_MAX_CALLS, int(HOST_US_TARGET_MS / max(once_ms, 1e-3))))
    if gpu_ms:
        n = min(n, max(HOST_US_MIN_CALLS, int(HOST_US_GPU_MS / gpu_ms)))
    return n


def host_us(fn, gpu_ms: float | None = None) -> float | None:
    """Host time to enqueue one call of fn, in microseconds, with the GPU kept busy: the median
    of HOST_US_SAMPLES measurements, each of ``host_us_calls`` calls (``gpu_ms``: one call's GPU
    time, where known).

    The GPU spins while n calls are queued back to back, so no launch waits for the GPU and the
    host's cost alone is timed. Where the spin had ended before the calls were queued, they
    waited for the GPU (a value read back, or a full launch queue): that time is not the host's
    alone, and after a second try with a spin four times as long (a slow host's hiccup) the
    answer is None (null in the JSON, an empty cell). In the interpreter there is no queue: one
    call's wall time.
    """
    if not ON_GPU:
        return host_ms_once(fn) * 1e3
    once_ms = host_ms_once(fn)
    n = host_us_calls(once_ms, gpu_ms)
    samples = []
    for _ in range(HOST_US_SAMPLES):
        us = _host_us_once(fn, n, once_ms)
        if us is None:
            return None
        samples.append(us)
    return statistics.median(samples)


def _host_us_once(fn, n: int, once_ms: float) -> float | None:
    """One measurement of ``host_us``: n calls queued behind a spin, or None where they waited."""
    for spin_ms in (2 * n * once_ms + 1.0, 8 * n * once_ms + 4.0):
        torch.cuda._sleep(int(clock_cycles_per_ms() * spin_ms))
        spun = torch.cuda.Event()
        spun.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        seconds = time.perf_counter() - t0
        waited = spun.query()
        _sync()
        if not waited:
            return seconds / n * 1e6
    return None


@dataclasses.dataclass
class Timing:
    seconds: list
    stalled_rounds: int = 0
    host_bound: bool = False
    remeasured: int = 0  # whole measurements thrown away as disturbed (see ``steady``)
    discarded_ms: list = dataclasses.field(default_factory=list)  # their mean times

    def skew(self) -> float:
        """The mean round over the median round (1.0 with fewer than three rounds)."""
        if len(self.seconds) < 3:
            return 1.0
        median = statistics.median(self.seconds)
        return statistics.fmean(self.seconds) / median if median > 0 else 1.0



def steady(measure_once, on_gpu: bool = ON_GPU) -> Timing:
    """measure_once() again while its rounds are disturbed (see DISTURBED_SKEW), at most
    MAX_REMEASURES more times: the first undisturbed measurement, or the least skewed of all, is
    kept, with how many were thrown away, their means (recorded in the run's JSON), and the
    stalled rounds of every attempt. Only upward skews are measured again, and a kept attempt has
    had the thrown-away ones for warm-up: a case measured again can come out a little faster than
    it would have on a quiet machine. Only ``on_gpu``: wall-clock rounds in the interpreter are
    noise by nature."""
    attempts = [measure_once()]
    while on_gpu and attempts[-1].skew() > DISTURBED_SKEW and len(attempts) <= MAX_REMEASURES:
        attempts.append(measure_once())
    kept = min(attempts, key=Timing.skew)
    others = [t for t in attempts if t is not kept]
    return dataclasses.replace(kept, remeasured=len(others),
                               stalled_rounds=sum(t.stalled_rounds for t in attempts),
                               host_bound=any(t.host_bound for t in attempts),
                               discarded_ms=[1e3 * statistics.fmean(t.seconds) for t in others if t.seconds])


def measure(fn, rounds: int, warmup: int, timer: str = "events", flush=None, label: str = "",
            disable_gc: bool = True, timer_args: dict | None = None) -> Timing:
    """Seconds per round of fn: the harness's one timing primitive (benchmarks, ceilings, sweeps).

    ``events``: EventTimer rounds, ``flush`` (the L2 flush) before each, ``warmup`` rounds first.
    ``do_bench`` / ``cudagraph``: triton.testing's timers, every sample they took (their own
    warm-up and repetitions, in ms of GPU time, given by ``timer_args``, else their defaults;
    do_bench flushes L2 itself).
    """
    timer_args = timer_args or {}
    if timer == "do_bench":
        return Timing([ms * 1e-3 for ms in triton.testing.do_bench(fn, return_mode="all", **timer_args)])
    if timer == "cudagraph":  # captures on a stream of its own
        return Timing([ms * 1e-3 for ms in triton.testing.do_bench_cudagraph(fn, return_mode="all", **timer_args)])
    if timer != "events":
        raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
    if timer_args:
        raise ValueError(f"timer events takes rounds and warmup, not {sorted(timer_args)}")
    spin_cycles, spin_ms = spin_cycles_for(fn)
    timed = EventTimer(label, spin_cycles, spin_ms, before_retry=flush)
    run = timed.measured(fn)
    seconds = []
    gc.collect()
    gc_was_enabled = gc.isenabled()
    if disable_gc:
        gc.disable()
    try:
        for i in range(warmup + rounds):
            if flush is not None:
                flush()
            before = timed.total
            run()
            if i >= warmup:
                seconds.append(timed.total - before)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(seconds, timed.stalled_rounds, timed.host_bound)


class ReplayTimer:
    """Hands rounds measured by ``measure`` to pytest-benchmark, one per call of ``next_round``.

    pytest-benchmark has no public way to take durations measured elsewhere; it reads a timer
    before and after each round, so the timer's reading advances by exactly the measured round.
    """

    def __init__(self, name: str, seconds: list):
        self.__name__ = name  # pytest-benchmark records the timer's __name__ in the JSON's options
        self.seconds = list(seconds)
        self.total = 0.0

    def __call__(self) -> float:
        return self.total

    def next_round(self):
        self.total += self.seconds.pop(0)


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


# ----------------------------------------------------------------------------------------------
# Compiled and graph-replayed forms of an op (issue 13's triton_compiled and triton_graph rows)
# ----------------------------------------------------------------------------------------------
_COMPILED: dict = {}
# Each shape of a grid is a recompile of one function: past Dynamo's default limit (8) it would
# silently run eager under the compiled row's name. A higher limit, and an error beyond it.
_DYNAMO_LIMITS = {"recompile_limit": 256, "cache_size_limit": 256, "fail_on_recompile_limit_hit": True}


def compiled(fn, fullgraph: bool = False, backend: str = "inductor"):
    """torch.compile(fn) with static shapes, built once per process for every group (its compile
    time is never timed: the bench fixture's first call is untimed). Each Python function
    recompiles per shape against its own limit, so a group that wants its own count compiles a
    function of its own."""
    for name, value in _DYNAMO_LIMITS.items():
        try:
            setattr(torch._dynamo.config, name, value)
        except AttributeError:  # a torch without this setting
            pass
    key = (fn, fullgraph, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, fullgraph=fullgraph, dynamic=False, backend=backend)
    return _COMPILED[key]


def compiled_op(fn):
    """fn under torch.compile(fullgraph=True): a graph break is an error, not a silent fallback.

    Inductor on a GPU; aot_eager in the interpreter, where Inductor would compile C++ for every
    shape and user Triton kernels do not run compiled."""
    return compiled(fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")


def graph_replay(fn):
    """A zero-argument callable replaying one captured call of fn (itself zero-argument) from a CUDA graph.

    The capture's output tensors are the replay's: each replay writes into them again."""
    if not ON_GPU:
        raise Unavailable("CUDA graphs need a GPU (interpreter mode)")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture: compilation, allocator pools
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def caller_form(impl: str, call):
    """call as the row's implementation runs: replayed from a CUDA graph for a ``*_graph`` row."""
    return graph_replay(call) if impl.endswith("_graph") else call


# ----------------------------------------------------------------------------------------------
# The bench fixture: measure, hand the rounds to pytest-benchmark, record
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def bench(benchmark, request):
    """Time one checked case: ``bench(group, row, build, error=..., bound=..., bytes_moved=None, flops=None, dtype=None)``.

    ``build()`` allocates the inputs and returns ``(fn, inputs)``: the zero-argument callable to
    time and what it was built from, so an allocation failure is recorded like any other.
    ``bytes_moved`` (the least traffic the implementation needs) and ``flops`` turn the time into
    GB/s, TFLOP/s and shares of the measured copy bandwidth and matmul rate (``dtype`` picks the
    matmul peak to compare with). ``error(out, inputs)``, given the untimed first call's result
    and build's inputs, returns its error against a float64 reference, recorded as ``rel_error``
    beside the times: speed and accuracy of one run. It may return a dict of named errors instead
    ({"grad_rel_error": ...}), recorded as row keys. ``bound`` is what each error may be at most
    (a number, or a dict of them for named errors, or a function of build's inputs returning
    either): derived as the correctness tests derive theirs. A case over it (or NaN) is a
    WrongAnswer: the test fails and its row is a failure with both numbers, never a time.
    """
    config = request.config

    def run(group: BenchGroup, row: dict, build, bytes_moved=None, flops=None, dtype=None, error=None, bound=None):
        if error is None or bound is None:
            raise ValueError(f"group {group.name}: a timed case is a checked case: pass error= (its error against "
                             "float64) and bound= (what the error may be at most)")
        if row.get("impl", group.impls[0]) not in group.impls:
            raise ValueError(f"impl {row.get('impl')!r} is not one of group {group.name}'s {group.impls}")
        if set(row) & HARNESS_KEYS:  # the JSON's extra_info would keep the harness's value, not the row's
            raise ValueError(f"row keys {sorted(set(row) & HARNESS_KEYS)} of group {group.name} are the harness's own")
        benchmark.group = group.name
        started = time.perf_counter()
        try:
            timing, extra = measure_case(config, benchmark, request.node.nodeid, group, build, dtype, error, bound)
            if isinstance(extra.get("rel_error"), dict):
                row = named_errors(group, row, extra.pop("rel_error"))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row with its reason
            record_failure(config, group, request.node.nodeid, row, exc, time.perf_counter() - started)
            raise
        if timing_on(config):  # not with --benchmark-disable, nor untimed under xdist: the case ran once, no numbers
            record_rounds(config, benchmark, group, row, timing, {**extra, "bytes_moved": bytes_moved, "flops": flops,
                                                                  "case_s": time.perf_counter() - started})
        _free_memory()

    return run


def named_errors(group: BenchGroup, row: dict, errors: dict) -> dict:
    """The row with the error hook's named errors as keys of their own."""
    clash = set(errors) & (HARNESS_KEYS | set(row))
    if clash:
        raise ValueError(f"error names {sorted(clash)} of group {group.name} clash with row or harness keys")
    return {**row, **errors}


def record_failure(config, group: BenchGroup, nodeid: str, row: dict, exc: Exception, case_s: float) -> None:
    """An empty row with its reason; a configuration that does not fit the machine skips its test, the rest fail it."""
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    limit = is_resource_limit(exc)
    if config.bench_run is not None:
        config.bench_run.add(group, failure={"group": group.name, "test": nodeid, "reason": reason, "resource_limit": limit,
                                             "row": {k: _jsonable(v) for k, v in row.items()}, "case_s": round(case_s, 2)})
    _free_memory()
    if limit:
        pytest.skip(f"{group.name} {row}: {reason}")


def record_rounds(config, benchmark, group: BenchGroup, row: dict, timing: "Timing", extra: dict) -> None:
    """The measured rounds into pytest-benchmark's statistics, the row's keys and measured values
    into its extra_info, and the finished row onto disk."""
    replay = ReplayTimer(timer_name(config, group), timing.seconds)
    benchmark._timer = replay  # pytest-benchmark has no public way to set a fixture's timer
    if isinstance(config.bench_run, WorkerRows):
        # A worker's pytest-benchmark session is off (xdist): the fixture still computes the
        # statistics, which go to the controller's session (WorkerRows), never this one's.
        benchmark.disabled = False
        benchmark._add_stats = lambda stats: None
    benchmark.pedantic(replay.next_round, rounds=len(timing.seconds), warmup_rounds=0, iterations=1)
    extra = {**extra, "stalled_rounds": timing.stalled_rounds, "host_bound": timing.host_bound,
             "mean_over_median": timing.skew(), "remeasured": timing.remeasured,
             "discarded_ms": timing.discarded_ms or None, **run_info(config), "timer": timer_name(config, group)}
    assert set(extra) <= HARNESS_KEYS
    benchmark.extra_info.update({k: _jsonable(v) for k, v in {**row, **extra}.items()})
    if config.bench_run is not None:
        config.bench_run.add(group, benchmark=benchmark.stats)


def check_error(group: BenchGroup, rel_error, bound) -> None:
    """Raise WrongAnswer where an error is over its bound (or not a number)."""
    errors = rel_error if isinstance(rel_error, dict) else {"rel_error": rel_error}
    bounds = bound if isinstance(bound, dict) else {"rel_error": bound}
    if set(errors) != set(bounds):
        raise ValueError(f"group {group.name}: errors {sorted(errors)} and bounds {sorted(bounds)} name different things")
    over = [f"{name} {errors[name]!r} > bound {bounds[name]:.3g}" for name in errors
            if not (isinstance(errors[name], (int, float)) and errors[name] <= bounds[name])]
    if over:
        raise WrongAnswer(f"wrong answer: {'; '.join(over)} (error against float64)")


def measure_case(config, benchmark, nodeid: str, group: BenchGroup, build, dtype, error, bound) -> tuple[Timing, dict]:
    """Build, check, measure: (the rounds, the measured values that are not times). Untimed (pytest-benchmark
    off: --benchmark-disable, or xdist without --benchmark-only), the one call goes through the fixture,
    which then runs its target once, as pytest-benchmark does for any test when it is off."""
    built = build()
    if not (isinstance(built, tuple) and len(built) == 2 and callable(built[0])):
        raise TypeError(f"build of group {group.name} must return (fn, inputs) with fn a zero-argument callable, "
                        f"got {type(built).__name__}")
    fn, inputs = built
    # The first call, outside the numbers: compilation, autotuning, lazy initialisation.
    first = fn() if timing_on(config) else benchmark.pedantic(fn)
    rel_error = error(first, inputs)
    check_error(group, rel_error, bound(inputs) if callable(bound) else bound)
    first = inputs = None
    bs = config._benchmarksession
    if not timing_on(config):
        return Timing([]), {}
    warmup = _option_or(config, "bench_warmup", group.warmup if ON_GPU else 1)  # --bench-warmup 0 is honoured
    rounds = _option_or(config, "bench_rounds", group.rounds if ON_GPU else 2)
    peak, extra_mib = peak_memory(fn)
    copy_bandwidth_gbps()
    launch_floor_us()
    has_flops = dtype is not None
    if has_flops:
        matmul_peak_tflops(dtype)
    scratch = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") \
        if (config.getoption("l2_flush") and ON_GPU) else None
    flush = (lambda: scratch.zero_()) if scratch is not None else None
    timer, timer_args = group_timer(group, config.getoption("timer"))
    # A group's own protocol is one call of its timer, taken as it comes (as its publisher takes it).
    timing = steady(lambda: measure(fn, rounds, warmup, timer=timer, flush=flush, label=nodeid,
                                    disable_gc=bool(bs.options["disable_gc"]), timer_args=timer_args),
                    on_gpu=ON_GPU and not group.timer)
    extra = {"forward_peak_MiB": peak, "forward_extra_MiB": extra_mib, "rel_error": rel_error,
             "host_us": host_us(fn, 1e3 * statistics.median(timing.seconds) if timing.seconds else None),
             "matmul_peak_key": matmul_peak_key(dtype) if has_flops else None}
    return timing, extra


def timing_on(config) -> bool:
    """Whether cases are timed: pytest-benchmark's session is on, or the harness times under xdist."""
    return bool(config.bench_xdist) or not config._benchmarksession.disabled


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return list(v)
    return str(v)



# ----------------------------------------------------------------------------------------------
# Session end: the run's JSON, then the tables built from it
# ----------------------------------------------------------------------------------------------
def pytest_keyboard_interrupt(excinfo):  # noqa: ARG001 - hook signature
    _SIGNALS.append("KeyboardInterrupt")  # also pytest.exit(); the signals themselves are noted first


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """The one mark of a run that ended on its own: the test loop returned (it did not raise)."""
    result = yield
    session.config.bench_loop_ended = True
    return result


def pytest_sessionstart(session):
    config = session.config
    config.bench_session = session
    if config.bench_xdist:
        bs = config._benchmarksession
        config.option.benchmark_only = bs.only = config.bench_xdist["only"]
        bs.skip = bs.skip and not bs.only
        bs.xdist_warning = False  # its "disabled under xdist" warning would be untrue
        if not hasattr(config, "workerinput"):
            # The controller's session receives every worker's rows (WorkerRowsMerger): it saves,
            # compares and displays them as a serial run's.
            bs.disabled = False


def run_complete(config) -> bool:
    """True only for a run that reached its end on its own: its test loop returned, no signal came
    (however many, whenever), and it was not stopped early (-x, --maxfail)."""
    session = getattr(config, "bench_session", None)
    return (getattr(config, "bench_loop_ended", False) and not _SIGNALS
            and not (session is not None and (session.shouldstop or session.shouldfail)))


def pytest_sessionfinish(session):
    """Write the run's JSON and its tables (pytest-benchmark's own saving has run before this)."""
    config = session.config
    run = getattr(config, "bench_run", None)
    if run is None or hasattr(config, "workerinput"):  # a worker's rows went to the controller
        return
    bs = config._benchmarksession
    if not bs.benchmarks and not run.failed:
        run.close(remove=True)
        release_locks(config)
        return
    complete = run_complete(config)  # decided once, before the writing: a later signal changes nothing
    _WRITING_RECORD[0] = True
    arrived = len(_SIGNALS)
    try:
        data = config.hook.pytest_benchmark_generate_json(config=config, benchmarks=bs.benchmarks, include_data=False,
                                                          machine_info=bs.get_machine_info(), commit_info=run.commit_info)
        config.hook.pytest_benchmark_update_json(config=config, benchmarks=bs.benchmarks, output_json=data)
        data["bench_run"]["complete"] = complete
        out = run.out
        if not complete and out == committed_dir():  # never replace whole committed tables
            out = out / "partial"
        config.bench_written = write_run(data, out)
        run.close(remove=True)
        config.bench_run = None
    finally:
        _WRITING_RECORD[0] = False
        release_locks(config)
    if len(_SIGNALS) > arrived:
        bench_note(config, f"{', '.join(_SIGNALS[arrived:])} arrived while the record was written: it was finished first")


def pytest_terminal_summary(terminalreporter, config):
    for note in getattr(config, "bench_notes", ()):
        terminalreporter.write_line(f"NOTE {note}", yellow=True)
    written = getattr(config, "bench_written", None)
    if not written:
        return
    import pandas as pd

    tr = terminalreporter
    data = json.loads(written[0].read_text(encoding="utf-8"))
    if not data.get("bench_run", {}).get("complete", True):
        tr.write_sep("=", f"interrupted: partial tables in {written[0].parent}", red=True)
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.max_rows", 500):
        for name, (group, df) in tables_from_json(data).items():
            path = table_path(written[0].parent, group, data.get("bench_run", {}).get("complete", True))
            tr.write_sep("=", f"benchmark group {name} -> {path}")
            extra = [c for c in ("pct_of_copy", "rel_error", "host_us") if c in df and df[c].notna().any()]
            shown = [c for c in ("impl", *group.columns, *extra) if c in df]
            view = df[list(dict.fromkeys(shown))].copy()
            view[f"speedup_vs_{group.impls[0]}"] = speedup(df, group.case, group.impls[0])
            if group.pivot:
                view = pivoted(group, df)[[c for c in group.csv_columns() if c != "failure"]]
            tr.write_line(view.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
            for _, r in df.iterrows():
                keys = ", ".join(f"{c}={r[c]}" for c in (*group.case, "impl") if c in r and not _isnan(r[c]))
                if not _isnan(r["failure"]):
                    if not _isnan(r.get("not_run")) and bool(r.get("not_run")):  # cannot run here: its test skipped
                        tr.write_line(f"not run: {keys}: {r['failure']}")
                    else:
                        tr.write_line(f"FAILED CONFIG {keys}: {r['failure']}", red=True)
                elif note := remeasure_note(r):
                    tr.write_line(f"{keys}: {note}", yellow=True)
