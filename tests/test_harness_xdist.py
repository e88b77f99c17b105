"""The harness spread over pytest-xdist workers (one per GPU on a GPU machine): rows merged into one run.

Two workers run two groups' interpreter grids, timed (``--benchmark-only -n 2``); a serial run
(``-p no:xdist``) of the same selection is the reference. The merged tables must hold the serial
tables' rows (keys, columns, which cells are measured and which failed), the merged JSON the
serial JSON's cases in the serial order, and ``python conftest.py rebuild`` must turn the merged
JSON into the merged run's bytes. On one machine both workers share its one device, as workers
share GPUs when there are fewer GPUs than workers. Both runs time the softmax group's triton_row
with a deliberately wrong kernel (WRONG_KERNEL): its rows must be failures, never times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import needs_gpu
from test_harness import ROOT, child_env, read_csv, rebuild, skip_unless_interpreter_runs

SELECTION = [str(ROOT / "tests" / "test_bench_softmax.py"), str(ROOT / "tests" / "test_bench_softmax_matmul.py"),
             # The compiled forms compile for seconds on CPU and tell nothing about the merge;
             # triton_graph stays: its Unavailable rows are the failed cases that must cross too.
             "-k", "not triton_compiled"]
TABLES = ("softmax_benchmark.csv", "softmax_matmul_benchmark.csv")
# A plugin (loaded with -p wrong_kernel, in every worker too) that swaps the softmax group's
# triton_row for a kernel that forgets to normalise one row in two.
WRONG_KERNEL = '''
import torch


def pytest_collection_modifyitems(items):
    import test_bench_softmax

    def wrong(block):
        def softmax(x):
            out = torch.softmax(x.float(), dim=-1).to(x.dtype)
            out[::2] *= 1.5
            return out
        return softmax
    test_bench_softmax.IMPLS["triton_row"] = wrong
'''
# Columns computed from the measured times: they differ between any two runs, so only whether
# each cell is filled is compared.
TIMED = {"forward_ms_mean", "forward_ms_std", "forward_ms_median", "forward_ms_min", "gbps", "tflops", "pct_of_copy",
         "pct_of_matmul_peak", "host_us", "ms", "best_baseline_ms", "speedup"}


def run(tmp: Path, *args: str, selection=SELECTION, env=None, returncode=0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--benchmark-only", "-rs", *selection,
                           "--outputs-dir", str(tmp / "out"), "--benchmark-json", str(tmp / "run.json"), *args],
                          cwd=tmp, env=env or child_env(), capture_output=True, text=True, timeout=300)
    proc.output = proc.stdout + proc.stderr
    assert proc.returncode == returncode, proc.output[-4000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    skip_unless_interpreter_runs()
    serial = tmp_path_factory.mktemp("serial")
    merged = tmp_path_factory.mktemp("xdist")
    plugins = tmp_path_factory.mktemp("plugins")
    (plugins / "wrong_kernel.py").write_text(textwrap.dedent(WRONG_KERNEL))
    env = child_env(plugins)
    return (serial, run(serial, "-p", "no:xdist", "-p", "wrong_kernel", env=env, returncode=1), merged,
            run(merged, "-n", "2", "-p", "wrong_kernel", env=env, returncode=1))


def untimed(row: dict) -> dict:
    return {k: (v != "" if k in TIMED or k.startswith("speedup") else v) for k, v in row.items()}


def test_merged_tables_hold_the_serial_rows(runs):
    serial, _, merged, proc = runs
    assert "automatically disabled" not in proc.output, "pytest-benchmark's xdist warning: the run was not timed"
    for name in TABLES:
        columns, rows = read_csv(merged / "out" / name)
        serial_columns, serial_rows = read_csv(serial / "out" / name)
        assert columns == serial_columns, name
        assert [untimed(r) for r in rows] == [untimed(r) for r in serial_rows], name
        assert any(r.get("forward_ms_mean") for r in rows), f"{name}: no measured row"
    failures = [r for r in read_csv(merged / "out" / "softmax_benchmark.csv")[1] if r["failure"]]
    assert {r["impl"] for r in failures} == {"triton_graph", "triton_row"}, failures
    for r in failures:
        assert "Unavailable" in r["failure"] if r["impl"] == "triton_graph" else "WrongAnswer" in r["failure"], r


def test_a_wrong_kernel_fails_its_test_and_is_never_timed(runs):
    """Each wrong triton_row case fails its test (serial and under xdist), its row a failure with
    its error and bound; none of them is timed."""
    for tmp, proc in (runs[:2], runs[2:]):
        data = json.loads((tmp / "out" / "benchmark.json").read_text())
        wrong = [f for f in data["failed_cases"] if f["row"]["impl"] == "triton_row"]
        assert len(wrong) == 3 and all(f["reason"].startswith("WrongAnswer: wrong answer: rel_error") and
                                       not f["resource_limit"] for f in wrong), wrong
        assert not [b for b in data["benchmarks"] if b["extra_info"]["impl"] == "triton_row"]
        assert "3 failed" in proc.output, proc.output[-3000:]


def test_one_merged_json_in_the_serial_order(runs):
    serial, _, merged, _ = runs
    data = json.loads((merged / "out" / "benchmark.json").read_text())
    reference = json.loads((serial / "out" / "benchmark.json").read_text())
    assert not (merged / "out" / "benchmark.json.part").exists()
    assert [b["fullname"] for b in data["benchmarks"]] == [b["fullname"] for b in reference["benchmarks"]]
    assert [f["test"] for f in data["failed_cases"]] == [f["test"] for f in reference["failed_cases"]]
    assert data["bench_groups"] == reference["bench_groups"] and data["bench_run"]["complete"] is True
    for run in (data, reference):  # each run's start and wall time, for the record beside another run's
        assert run["bench_run"]["wall_s"] > 0 and run["bench_run"]["started"].endswith("+00:00"), run["bench_run"]
    from conftest import compare_with_one_gpu

    # merge --against pairs every case of the two runs (interpreter times are not compared here).
    compared = compare_with_one_gpu(data, reference)
    assert compared["shared"] == len(reference["benchmarks"]) and compared["several_gpus"]["workers"] == 2
    for b, r in zip(data["benchmarks"], reference["benchmarks"]):
        assert b["options"] == r["options"] and b["stats"]["rounds"] == r["stats"]["rounds"] == 2, b["fullname"]
        assert set(b["extra_info"]) == set(r["extra_info"]), b["fullname"]
    workers = data["bench_run"]["workers"]
    assert set(workers) == {"gw0", "gw1"}, f"both workers must have measured rows: {workers}"
    for name in ("copy_GBps", "launch_floor_us"):
        values = sorted(w["ceilings"][name] for w in workers.values())
        assert data["ceilings"][name] == pytest.approx((values[0] + values[1]) / 2), "the median of the workers' ceilings"
    # pytest-benchmark's own file, written by the controller's session, holds every worker's rounds.
    saved = json.loads((merged / "run.json").read_text())
    assert [b["fullname"] for b in saved["benchmarks"]] == [b["fullname"] for b in data["benchmarks"]]
    assert all(len(b["stats"]["data"]) == 2 for b in saved["benchmarks"])
    for b, s in zip(data["benchmarks"], saved["benchmarks"]):
        assert s["stats"]["mean"] == b["stats"]["mean"], b["fullname"]


def test_merged_json_rebuilds_the_merged_tables(runs, tmp_path):
    _, _, merged, _ = runs
    proc = rebuild(merged / "out" / "benchmark.json", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in (*TABLES, "softmax_benchmark.png"):
        assert (tmp_path / name).read_bytes() == (merged / "out" / name).read_bytes(), name


# ----------------------------------------------------------------------------------------------
# The GPU of each worker, and one kind per run
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("worker,gpus,expected", [
    ("gw0", "0,1,2,3", "0"), ("gw3", "0,1,2,3", "3"),
    ("gw2", "0,1", "0"), ("gw3", "0,1", "1"),  # more workers than GPUs: round-robin
    ("gw1", "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),  # the controller's CUDA_VISIBLE_DEVICES entries, as given
])
def test_each_worker_sees_one_gpu(monkeypatch, worker, gpus, expected):
    from conftest import WORKER_GPUS_ENV, _pin_worker_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unchanged")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv(WORKER_GPUS_ENV, gpus)
    _pin_worker_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected
    monkeypatch.delenv(WORKER_GPUS_ENV)  # no GPU list (a CPU machine): the worker's devices stay as they were
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unchanged")
    _pin_worker_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "unchanged"


def test_gpus_of_two_kinds_are_refused_with_the_runs_to_make():
    from conftest import check_one_kind

    check_one_kind(["NVIDIA H100 80GB HBM3"] * 2, ["0", "1"])
    with pytest.raises(pytest.UsageError) as err:
        check_one_kind(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"], ["0", "1", "2"])
    assert "CUDA_VISIBLE_DEVICES=0,2 for the NVIDIA H100 80GB HBM3" in str(err.value)
    assert "CUDA_VISIBLE_DEVICES=1 for the NVIDIA A100-SXM4-80GB" in str(err.value)


@needs_gpu
def test_two_workers_share_one_gpu_compiled(tmp_path):
    """The merge with compiled kernels and CUDA events: two workers on one GPU, against a serial run."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    env = {k: v for k, v in child_env(CUDA_VISIBLE_DEVICES=first).items() if k != "TRITON_INTERPRET"}
    selection = [str(ROOT / "tests" / "test_bench_softmax.py"), "-k", "1024-1024-float32 and (torch or triton_row)"]
    (tmp_path / "serial").mkdir()
    (tmp_path / "xdist").mkdir()
    run(tmp_path / "serial", "-p", "no:xdist", selection=selection, env=env)
    proc = run(tmp_path / "xdist", "-n", "2", selection=selection, env=env)
    assert "workers share GPUs round-robin" in proc.output, proc.output[-4000:]
    columns, rows = read_csv(tmp_path / "xdist" / "out" / "softmax_benchmark.csv")
    serial_columns, serial_rows = read_csv(tmp_path / "serial" / "out" / "softmax_benchmark.csv")
    assert columns == serial_columns and [untimed(r) for r in rows] == [untimed(r) for r in serial_rows]
    data = json.loads((tmp_path / "xdist" / "out" / "benchmark.json").read_text())
    assert {w: v["device"] for w, v in data["bench_run"]["workers"].items()} == {"gw0": first, "gw1": first}
    assert data["bench_run"]["execution"] == "compiled" and data["ceilings"]["copy_GBps"] > 0
    # No comparison of times: two workers on one GPU disturb each other (one GPU per worker is the
    # timed setup, checked by hand on a several-GPU machine).
    assert all(float(r["forward_ms_mean"]) > 0 for r in rows), rows


# ----------------------------------------------------------------------------------------------
# A several-GPU run against a one-GPU run of the same cases: merge --against
# ----------------------------------------------------------------------------------------------
def synthetic_run(medians_ms: dict, wall_s: float | None, failed=(), workers=None, commit="abc") -> dict:
    """A run's JSON with what the comparison reads, valid for ``load_run``: one group g."""
    from conftest import BenchGroup

    bench_run = {"timer": "events", "l2_flush": True, "execution": "compiled", "gpu": "NVIDIA_H100_80GB_HBM3",
                 "complete": True, "wall_s": wall_s}
    if workers:
        bench_run["workers"] = {f"gw{i}": {"device": str(i)} for i in range(workers)}
    group = BenchGroup(name="g", csv="g.csv", columns=("case", "impl"), case=("case",), impls=("impl",))
    stats = lambda ms: {"mean": ms / 1e3, "stddev": 0.0, "median": ms / 1e3, "min": ms / 1e3}  # noqa: E731
    return {"bench_run": bench_run, "commit_info": {"id": commit}, "machine_info": {"gpu": {"name": "H100"}},
            "bench_groups": {"g": group.layout()},
            "benchmarks": [{"fullname": test, "group": "g", "stats": stats(ms), "extra_info": {}}
                           for test, ms in medians_ms.items()],
            "failed_cases": [{"test": test, "group": "g", "row": {}, "reason": "OutOfMemoryError"} for test in failed]}


def test_merge_against_a_one_gpu_run_names_the_cases_apart(tmp_path, capsys):
    """``merge SEVERAL --against ONE``: the shared cases' medians compared (3 % by default), the ones
    further apart named with both medians, a case failed in one run only named too, both wall times
    in the output's record; exit status 1 while any are named, 0 when none."""
    from conftest import compare_with_one_gpu, main

    several = synthetic_run({"t[a]": 1.00, "t[b]": 2.07, "t[c]": 0.50, "t[d]": 4.0, "t[only-several]": 1.0},
                            wall_s=95.0, workers=2)
    one = synthetic_run({"t[a]": 1.02, "t[b]": 2.00, "t[c]": 0.55, "t[e]": 4.0}, wall_s=180.5, failed=["t[d]"],
                        commit="def")
    (tmp_path / "several.json").write_text(json.dumps(several))
    (tmp_path / "one.json").write_text(json.dumps(one))
    out = tmp_path / "checked.json"
    assert main(["merge", str(tmp_path / "several.json"), "--against", str(tmp_path / "one.json"),
                 "--output", str(out)]) == 1
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())["compared_with_one_gpu"]
    assert record["shared"] == 3 and record["tolerance"] == 0.03
    # a: 2 % apart, within; b: 3.5 % over; c: 9.1 % under.
    assert [(d["test"], round(d["ratio"], 3)) for d in record["differing"]] == [("t[b]", 1.035), ("t[c]", 0.909)]
    assert record["failed_in_one"] == ["t[d]"]
    assert record["several_gpus"] == {"workers": 2, "wall_s": 95.0, "commit": "abc"}
    assert record["one_gpu"] == {"wall_s": 180.5, "commit": "def", "file": str(tmp_path / "one.json")}
    assert "wall 95.0 s" in printed and "wall 180.5 s" in printed and "different commits" in printed
    assert "DIFFERS t[b]: 2.07 ms on several GPUs, 2 ms on one (+3.5%)" in printed
    assert "DIFFERS t[c]" in printed and "DIFFERS t[a]" not in printed and "FAILED IN ONE RUN ONLY t[d]" in printed
    # A wider tolerance and no failed case: nothing named, exit status 0.
    one["failed_cases"] = []
    (tmp_path / "one.json").write_text(json.dumps(one))
    assert main(["merge", str(tmp_path / "several.json"), "--against", str(tmp_path / "one.json"),
                 "--output", str(out), "--tolerance", "10"]) == 0
    # Parts merged first: the several-GPU wall time is their sum; a run that recorded none says so.
    part = synthetic_run({"t[x]": 1.0}, wall_s=5.0)
    merged = {**several, "merged_from": [{"bench_run": several["bench_run"]}, {"bench_run": part["bench_run"]}]}
    assert compare_with_one_gpu(merged, one)["several_gpus"]["wall_s"] == 100.0
    one["bench_run"].pop("wall_s")
    assert compare_with_one_gpu(several, one)["one_gpu"]["wall_s"] is None
    # Runs of another GPU or timer, or with no case in common, are refused.
    for change in (lambda r: r["bench_run"].update(gpu="NVIDIA_H200"), lambda r: r["bench_run"].update(timer="do_bench"),
                   lambda r: r.update(benchmarks=[])):
        other = json.loads(json.dumps(one))
        change(other)
        with pytest.raises(ValueError):
            compare_with_one_gpu(several, other)
    # One JSON alone is no merge without --against: refused in one line, exit status 2.
    assert main(["merge", str(tmp_path / "several.json"), "--output", str(out)]) == 2
