"""The benchmark harness end to end: pytest runs in a subprocess, then its CSV, JSON and terminal output are read.

Every run is forced into interpreter mode (TRITON_INTERPRET=1), so these tests take the small CPU
smoke grids and the same seconds on a GPU machine as on CPU. Each run writes only under tmp_path:
CSVs through --outputs-dir, pytest-benchmark's storage under the run's working directory.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def child_env(pythonpath: Path | None = None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_", "SOFTMAX_KERNELS_"))}
    env["TRITON_INTERPRET"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return {**env, **extra}


PYTEST = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--benchmark-only", "-rs"]


def run_pytest(args: list[str], cwd: Path, pythonpath: Path | None = None, **env) -> subprocess.CompletedProcess:
    """Benchmarks on (-p no:xdist), no cache files, in interpreter mode, whatever the outer run uses."""
    proc = subprocess.run([*PYTEST, *args], cwd=cwd, env=child_env(pythonpath, **env), capture_output=True,
                          text=True, timeout=300)
    proc.output = proc.stdout + proc.stderr
    return proc


def rebuild(json_path: Path, out: Path) -> subprocess.CompletedProcess:
    """The documented command: python conftest.py rebuild JSON --outputs-dir DIR."""
    return subprocess.run([sys.executable, str(ROOT / "conftest.py"), "rebuild", str(json_path), "--outputs-dir", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)


INTERPRETER_PROBE = """
import triton, triton.language as tl, torch
@triton.jit
def probe(x_ptr, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        tl.store(x_ptr + start + tl.arange(0, BLOCK), 1.0)
x = torch.zeros(32)
probe[(1,)](x, 32, BLOCK=16)
assert bool((x == 1).all())
"""


@pytest.fixture(scope="module", autouse=True)
def interpreter_runs():
    skip_unless_interpreter_runs()


def skip_unless_interpreter_runs():
    """Skip, saying why, where this triton's interpreter cannot run a loop over a runtime bound.

    Triton 3.6's interpreter (the GPU machine's) converts a scalar argument with int() of a
    one-element numpy array, which numpy 2.3 and later refuse ("only 0-dimensional arrays can be
    converted to Python scalars"). There the harness runs compiled instead (the GPU run itself).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_PROBE], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.skip(f"triton {__import__('triton').__version__}'s interpreter fails here: "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}")


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


# ----------------------------------------------------------------------------------------------
# A real group: softmax_matmul in its smoke form
# ----------------------------------------------------------------------------------------------
SOFTMAX_MATMUL_COLUMNS = ["batch_size", "d1", "d2", "d3", "triton", "BLOCK",
                          "forward_ms_mean", "forward_ms_std", "forward_peak_MiB"]


@pytest.fixture(scope="module")
def softmax_matmul_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("softmax_matmul")
    # Run from tmp with the test file's absolute path: rootdir and tox.ini's [pytest] stay the
    # repository's, while the default .benchmarks storage (relative to the cwd) lands in tmp.
    # The caller forms (triton_compiled, triton_graph) are the kernels' business, not the harness's:
    # test_bench_softmax_matmul.py runs them.
    proc = run_pytest([str(ROOT / "tests" / "test_bench_softmax_matmul.py") + "::test_softmax_matmul", "-k", "not triton_",
                       "--outputs-dir", str(tmp / "out"), "--benchmark-json", str(tmp / "run.json")], cwd=tmp)
    assert proc.returncode == 0, proc.output[-4000:]
    return tmp, proc


def test_softmax_matmul_csv(softmax_matmul_run):
    tmp, _ = softmax_matmul_run
    columns, rows = read_csv(tmp / "out" / "softmax_matmul_benchmark.csv")
    assert columns == SOFTMAX_MATMUL_COLUMNS
    # The cases that ran, from the JSON (the child's grid is the interpreter's, wherever this runs):
    # one CSV row per (d2, impl, B) of PyTorch and Triton (compile is JSON-only), in the order d2,
    # then PyTorch before Triton, then block size.
    params = [b["params"] for b in json.loads((tmp / "out" / "benchmark.json").read_text())["benchmarks"]]
    expected = sorted(((p["d2"], p["impl"] == "triton", p["B"]) for p in params if p["impl"] in ("torch", "triton")),
                      key=lambda k: (k[0], k[1], k[2] or 0))
    assert len({d2 for d2, _, _ in expected}) >= 2 and {t for _, t, _ in expected} == {False, True}, expected
    got = [(int(r["d2"]), r["triton"] == "True", int(r["BLOCK"]) if r["BLOCK"] else None) for r in rows]
    assert got == expected, f"rows (d2, triton, BLOCK) out of order or missing:\n{got}\nexpected\n{expected}"
    assert len({(r["batch_size"], r["d1"], r["d3"]) for r in rows}) == 1, "one (batch_size, d1, d3) for the grid"
    for r in rows:
        assert (r["BLOCK"] == "") == (r["triton"] == "False"), f"BLOCK must be empty exactly on PyTorch rows: {r}"
        assert float(r["forward_ms_mean"]) > 0 and float(r["forward_ms_std"]) >= 0, r
        assert r["forward_peak_MiB"] == "", f"peak memory is a GPU measurement: {r}"


def test_softmax_matmul_json(softmax_matmul_run):
    tmp, _ = softmax_matmul_run
    data = json.loads((tmp / "out" / "benchmark.json").read_text())
    info = data["machine_info"]["gpu"]
    assert info["mode"].startswith("interpreter"), info
    # Identity only: a measured value in machine_info makes every compare warn.
    assert set(info) == {"mode", "name", "torch", "triton"}, info
    assert "hz_actual" not in data["machine_info"].get("cpu", {})
    assert data["ceilings"]["copy_GBps"] > 0, "the copy ceiling is measured during the run, before the JSON is written"
    assert data["ceilings"]["launch_floor_us"] > 0
    assert data["failed_cases"] == [] and data["bench_run"]["complete"] is True
    assert data["bench_groups"]["softmax_matmul"]["spec"] is True

    benchmarks = data["benchmarks"]
    assert benchmarks and {b["group"] for b in benchmarks} == {"softmax_matmul"}
    csv_means = {(int(r["d2"]), r["BLOCK"]): float(r["forward_ms_mean"])
                 for r in read_csv(tmp / "out" / "softmax_matmul_benchmark.csv")[1]}
    for b in benchmarks:
        extra = b["extra_info"]
        for key in ("batch_size", "d1", "d2", "d3", "impl", "BLOCK", "bytes_moved", "flops", "execution", "host_us"):
            assert key in extra, f"{b['name']}: extra_info lacks {key}: {extra}"
        assert extra["execution"] == "interpreter" and extra["host_us"] > 0
        assert b["options"]["disable_gc"] is True and b["options"]["timer"] == "perf_counter", b["options"]
        # The CSV is built from pytest-benchmark's own statistics.
        key = (extra["d2"], "" if extra["BLOCK"] is None else str(extra["BLOCK"]))
        assert csv_means[key] == pytest.approx(b["stats"]["mean"] * 1e3, rel=1e-5)
    # --benchmark-json is pytest-benchmark's file; it carries the same additions.
    assert json.loads((tmp / "run.json").read_text())["bench_groups"].keys() == {"softmax_matmul"}


def test_tables_rebuild_byte_identical(softmax_matmul_run, tmp_path):
    tmp, _ = softmax_matmul_run
    for source in (tmp / "out" / "benchmark.json", tmp / "run.json"):  # the run's record, pytest-benchmark's file
        out = tmp_path / source.stem
        proc = rebuild(source, out)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for name in ("softmax_matmul_benchmark.csv", "softmax_matmul_benchmark.png"):
            assert (out / name).read_bytes() == (tmp / "out" / name).read_bytes(), f"{name} rebuilt from {source.name} differs"


def test_a_grid_runs_the_compiled_form_at_its_one_chosen_case():
    from support import at_one_case

    slow = pytest.param(2, "b", marks=pytest.mark.slow)
    params = at_one_case([(1, "a"), slow], ["eager", ("triton_compiled", None)], at=(2, "b"))
    assert [p.values for p in params] == [(1, "a", "eager"), (2, "b", "eager"), (2, "b", "triton_compiled", None)]
    assert [[m.name for m in p.marks] for p in params] == [[], ["slow"], ["slow"]], "a case's marks stay on its rows"
    with pytest.raises(ValueError, match="none of the cases"):  # a chosen case off the grid would drop the form unseen
        at_one_case([(1, "a")], ["triton_compiled"], at=(3, "c"))


def test_host_us_queues_at_most_its_share_of_gpu_work():
    """host_us's calls a measurement: 5 ms of host time up to 100 calls; given a call's GPU time, at most 20 ms
    of it (4 calls at least); never more than the host target gives."""
    from conftest import host_us_calls

    assert host_us_calls(0.01) == 100 and host_us_calls(0.5) == 10 and host_us_calls(10.0) == 1
    assert host_us_calls(0.01, gpu_ms=0.05) == 100, "light GPU work: the host target decides"
    assert host_us_calls(0.01, gpu_ms=1.0) == 20 and host_us_calls(0.01, gpu_ms=25.0) == 4
    assert host_us_calls(10.0, gpu_ms=25.0) == 1, "the GPU cap never raises the count"


# ----------------------------------------------------------------------------------------------
# Failing configurations: a resource limit is recorded and skipped, a bug fails the run
# ----------------------------------------------------------------------------------------------
PROBE_MODULE = '''
import os, time
import pytest, torch, triton, triton.language as tl
from conftest import BenchGroup, Unavailable
from online_softmax import KernelCapacityError

PROBE = BenchGroup(name="probe", csv="probe.csv", case=("n",),
                   impls=("fits", "too_big", "broken", "clash", "sleepy", "absent", "named", "bare", "capacity",
                          "wrong"),
                   columns=("n", "impl", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB"))


@triton.jit
def fill_kernel(x_ptr, value, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK <= 32, "BLOCK past the probe limit")
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), value, tl.float32))


@pytest.mark.parametrize("n,impl,BLOCK", CASES)
def test_probe(bench, n, impl, BLOCK):
    def build():
        if impl == "broken":
            raise ValueError("a bug in the probe")
        if impl == "absent":  # a peer whose package does not import
            raise Unavailable("the probe's peer is not installed")
        if impl == "capacity":  # a wrapper's declared limit
            raise KernelCapacityError("n past what the probe holds")
        if impl == "sleepy":  # tells the test it is running, then waits to be stopped
            open("sleeping", "w").close()
            time.sleep(120)
        x = torch.zeros(64)
        delay = float(os.environ.get("PROBE_DELAY_S", "0"))  # a deliberately slowed kernel

        def fill():
            time.sleep(delay)
            return fill_kernel[(1,)](x, 0.5 if impl == "wrong" else 1.0, BLOCK=BLOCK)
        return fill if impl == "bare" else (fill, (x,))

    row = dict(n=n, impl=impl, BLOCK=BLOCK)
    if impl == "clash":
        row["execution"] = "a row key the harness writes itself"
    # The error: how far the filled entries are from 1 (the wrong kernel fills 0.5). The named
    # errors are computed from build's inputs: the share of x that the kernel filled.
    error = lambda out, inputs: float((inputs[0][:BLOCK] - 1).abs().max())  # noqa: E731
    named = lambda out, inputs: {"probe_error": float(inputs[0].sum()) / inputs[0].numel(), "other_error": 0.0}  # noqa: E731
    if impl == "named":
        bench(PROBE, row, build, error=named, bound={"probe_error": 0.5, "other_error": 0.0})
    else:
        bench(PROBE, row, build, error=error, bound=1e-6)
'''


PROBE_COLUMNS = ["n", "impl", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB", "host_us", "failure"]


def write_probe(tmp_path: Path, cases: list[tuple]) -> list[str]:
    """A throwaway benchmark module under the project's harness (loaded with -p conftest): its pytest args."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE_MODULE).replace("CASES", repr(cases)))
    return ["-p", "conftest", "test_probe.py", "--outputs-dir", "out"]


def run_probe(tmp_path: Path, cases: list[tuple], *args, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = run_pytest([*write_probe(tmp_path, cases), "--benchmark-save", "probe", *args],
                      cwd=tmp_path, pythonpath=ROOT, **env)
    assert "group probe ->" in proc.output, f"the harness did not run:\n{proc.output[-4000:]}"
    columns, rows = read_csv(tmp_path / "out" / "probe.csv")
    assert columns == PROBE_COLUMNS
    return proc, rows


def assert_measured(row: dict):
    assert float(row["forward_ms_mean"]) > 0 and float(row["forward_ms_std"]) >= 0, row
    assert float(row["host_us"]) > 0 and row["failure"] == "", row


def assert_empty(row: dict, reason: str):
    assert row["forward_ms_mean"] == row["forward_ms_std"] == row["forward_peak_MiB"] == row["host_us"] == "", row
    assert reason in row["failure"], row


def test_a_declared_limit_is_a_recorded_skip_a_wrong_answer_and_a_static_assert_fail(tmp_path):
    """Only a named capacity type (KernelCapacityError) makes an empty row that skips; a kernel's
    tl.static_assert is a failure like any other, and a kernel whose answer is over its bound
    fails its test, its row a failure with both numbers, never a time."""
    cases = [(1, "fits", 16), (1, "too_big", 64), (1, "capacity", 16), (1, "wrong", 16), (2, "fits", 32)]
    proc, rows = run_probe(tmp_path, cases)
    assert proc.returncode == 1, proc.output[-4000:]
    assert [(r["n"], r["impl"], r["BLOCK"]) for r in rows] == [(str(n), i, str(b)) for n, i, b in cases]
    assert_measured(rows[0])
    assert_empty(rows[1], "BLOCK past the probe limit")
    assert_empty(rows[2], "KernelCapacityError: n past what the probe holds")
    assert_empty(rows[3], "WrongAnswer: wrong answer: rel_error 0.5 > bound 1e-06")
    assert_measured(rows[4])  # the case after the failures was still measured
    failed = [line for line in proc.output.splitlines() if line.startswith("FAILED CONFIG")]
    assert len(failed) == 2 and "n=1, impl=wrong" in failed[1], failed
    assert "not run: n=1, impl=capacity: KernelCapacityError: n past what the probe holds" in proc.output
    assert "2 failed, 2 passed, 1 skipped" in proc.output, proc.output[-4000:]

    # --benchmark-save with the default storage lands in the per-GPU-kind folder, with the reason.
    saved = list((tmp_path / ".benchmarks" / "interpreter").glob("*/0001_probe.json"))
    assert len(saved) == 1, list((tmp_path / ".benchmarks").rglob("*"))
    data = json.loads(saved[0].read_text())
    assert [b["extra_info"]["impl"] for b in data["benchmarks"]] == ["fits", "fits"]
    assert [(c["row"]["impl"], c["resource_limit"]) for c in data["failed_cases"]] == [
        ("too_big", False), ("capacity", True), ("wrong", False)]


def test_other_errors_fail_the_run_and_keep_the_row(tmp_path):
    proc, rows = run_probe(tmp_path, [(1, "fits", 16), (1, "broken", 16), (1, "bare", 16)])
    assert proc.returncode == 1, proc.output[-4000:]
    assert "2 failed, 1 passed" in proc.output
    assert_measured(rows[0])
    assert_empty(rows[1], "ValueError: a bug in the probe")
    assert_empty(rows[2], "TypeError: build of group probe must return (fn, inputs)")
    assert any(line.startswith("FAILED CONFIG n=1, impl=broken: ValueError: a bug in the probe")
               for line in proc.output.splitlines()), proc.output[-4000:]


def test_an_unavailable_impl_is_an_empty_row_and_named_errors_are_row_keys(tmp_path):
    proc, rows = run_probe(tmp_path, [(1, "fits", 16), (1, "absent", 16), (1, "named", 16)])
    assert proc.returncode == 0, f"an unavailable implementation must not fail the run:\n{proc.output[-4000:]}"
    assert "2 passed, 1 skipped" in proc.output, proc.output[-4000:]
    assert "FAILED" not in proc.output, "a configuration that cannot run here is no failure"
    assert "not run: n=1, impl=absent: Unavailable: the probe's peer is not installed" in proc.output
    # Progress: a line at the start, then at most every 30 s and at the end (cases done of all, time left).
    assert "3 benchmark cases to run" in proc.output and "progress: 3/3 cases" in proc.output, proc.output[-4000:]
    assert [r["impl"] for r in rows] == ["fits", "absent", "named"]
    assert_empty(rows[1], "Unavailable: the probe's peer is not installed")
    assert_measured(rows[2])
    data = json.loads(next((tmp_path / ".benchmarks" / "interpreter").glob("*/0001_probe.json")).read_text())
    extra = {b["extra_info"]["impl"]: b["extra_info"] for b in data["benchmarks"]}
    assert extra["named"]["probe_error"] == 0.25 and extra["named"]["other_error"] == 0.0, extra["named"]
    assert "rel_error" not in extra["named"] and extra["fits"]["rel_error"] == 0.0


def test_untimed_cases_under_xdist_use_the_fixture_and_warn_of_nothing(tmp_path):
    """tox -e cpu's form: pytest-xdist turns pytest-benchmark off, and each case runs once, through
    the fixture (pytest-benchmark's disabled mode), not around it: no "fixture was not used"."""
    args = write_probe(tmp_path, [(1, "fits", 16), (2, "fits", 32), (1, "absent", 16)])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", *args], cwd=tmp_path,
                          env=child_env(ROOT), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and "2 passed, 1 skipped in" in summary, output[-4000:]
    assert "was not used" not in output and "warning" not in summary, output[-4000:]
    assert not (tmp_path / "out").exists(), "an untimed run writes no tables"


def test_a_row_key_the_harness_owns_is_refused(tmp_path):
    proc, rows = run_probe(tmp_path, [(1, "fits", 16), (1, "clash", 16)])
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.output, proc.output[-4000:]
    assert "row keys ['execution'] of group probe are the harness's own" in proc.output
    assert [r["impl"] for r in rows] == ["fits"]


# ----------------------------------------------------------------------------------------------
# The JSON: clean compare, the code that ran
# ----------------------------------------------------------------------------------------------
def test_compare_of_two_runs_sees_one_machine(tmp_path):
    cases = [(1, "fits", 16)]
    proc, _ = run_probe(tmp_path, cases, SOFTMAX_KERNELS_COMMIT="0123abc-dirty")
    assert proc.returncode == 0, proc.output[-4000:]
    saved = json.loads(next((tmp_path / ".benchmarks" / "interpreter").glob("*/0001_probe.json")).read_text())
    assert saved["commit_info"]["id"] == "0123abc" and saved["commit_info"]["dirty"] is True, saved["commit_info"]
    proc = run_pytest([*write_probe(tmp_path, cases), "--benchmark-compare=0001", "--benchmark-compare-fail=median:1000%"],
                      cwd=tmp_path, pythonpath=ROOT)
    assert proc.returncode == 0, proc.output[-4000:]
    assert "Comparing against benchmarks from" in proc.output, proc.output[-4000:]
    assert "machine_info is different" not in proc.output, proc.output[-4000:]


def test_the_gate_fails_on_a_slowed_kernel(tmp_path):
    """The tox gate's options against a baseline in pytest-benchmark's storage layout, from another directory."""
    cases = [(1, "fits", 16)]
    baseline = tmp_path / "baseline"
    proc = run_pytest([*write_probe(tmp_path, cases), f"--benchmark-storage=file://{baseline}", "--benchmark-save=base"],
                      cwd=tmp_path, pythonpath=ROOT)
    assert proc.returncode == 0 and len(list(baseline.glob("*/0001_base.json"))) == 1, proc.output[-4000:]
    proc = run_pytest([*write_probe(tmp_path, cases), f"--benchmark-storage=file://{baseline}", "--benchmark-compare=*/0001",
                       "--benchmark-compare-fail=median:5%"], cwd=tmp_path, pythonpath=ROOT, PROBE_DELAY_S="0.2")
    assert proc.returncode != 0 and "Performance has regressed" in proc.output, proc.output[-4000:]


# ----------------------------------------------------------------------------------------------
# Nothing lost, nothing overwritten
# ----------------------------------------------------------------------------------------------
def start_probe(tmp_path: Path, cases: list[tuple]) -> subprocess.Popen:
    """A probe run in the background, returned once its sleepy case is running (the others measured)."""
    proc = subprocess.Popen([*PYTEST, *write_probe(tmp_path, cases)], cwd=tmp_path, env=child_env(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "sleeping").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("option", ["--outputs-dir", "--benchmark-json"])
def test_an_unwritable_destination_fails_before_any_benchmark(tmp_path, option):
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / ("sub" if option == "--outputs-dir" else "run.json")
    args = [a for a in write_probe(tmp_path, [(1, "sleepy", 16)]) if a not in ("--outputs-dir", "out")]
    proc = run_pytest([*args, option, str(target)], cwd=tmp_path, pythonpath=ROOT)
    assert proc.returncode == 4, proc.output[-4000:]  # pytest's usage error
    assert f"{option} " in proc.output and "cannot write into" in proc.output, proc.output[-4000:]
    assert not (tmp_path / "sleeping").exists(), "a benchmark ran before the check"


# ----------------------------------------------------------------------------------------------
# Tables from a JSON written here: a pivoted group, a bar plot with missing baselines
# ----------------------------------------------------------------------------------------------
def run_json(group, measured: list[dict], failed: list[dict]) -> dict:
    """A run's JSON as the harness writes it, with one round of 1 ms per 'ms' of each measured row."""
    def benchmark(i, row):
        ms = row.pop("ms")
        return {"fullname": f"test_{group.name}[{i}]", "group": group.name,
                "stats": {"mean": ms * 1e-3, "stddev": 0.0, "median": ms * 1e-3, "min": ms * 1e-3},
                "extra_info": {**row, "host_us": 10 * ms, "flops": None, "bytes_moved": None}}

    return {"benchmarks": [benchmark(i, dict(r)) for i, r in enumerate(measured)],
            "bench_groups": {group.name: group.layout()},
            "failed_cases": [{"test": f"test_{group.name}[failed {i}]", "group": group.name, "row": r, "reason": why}
                             for i, (r, why) in enumerate(failed)],
            "ceilings": {}, "machine_info": {}, "bench_run": {"complete": True}}


def test_pivot_makes_one_row_of_a_cases_modes(tmp_path):
    from conftest import BenchGroup, write_tables

    group = BenchGroup(name="pivot", csv="pivot.csv", columns=("n", "impl", "tile", "fwd_ms", "both_ms", "err"),
                       case=("n", "mode"), impls=("torch", "triton", "peer"),
                       pivot=("mode", {"fwd_ms": ("fwd", "forward_ms_mean"), "both_ms": ("both", "forward_ms_mean"),
                                       "err": ("both", "grad_error"), "host_us": ("both", "host_us")}))
    measured = [dict(n=1, mode="fwd", impl="torch", tile=None, ms=1.0), dict(n=1, mode="both", impl="torch", tile=None, ms=3.0,
                                                                           grad_error=0.5),
                dict(n=1, mode="fwd", impl="triton", tile=16, ms=2.0), dict(n=1, mode="fwd", impl="triton", tile=32, ms=4.0),
                dict(n=1, mode="both", impl="triton", tile=32, ms=5.0),
                dict(n=2, mode="fwd", impl="torch", tile=None, ms=6.0)]
    failed = [(dict(n=1, mode="fwd", impl="peer", tile=None), "Unavailable: no peer"),
              (dict(n=1, mode="both", impl="peer", tile=None), "Unavailable: no peer"),
              (dict(n=2, mode="both", impl="torch", tile=None), "OutOfMemoryError: 2 GiB")]
    write_tables(run_json(group, measured, failed), tmp_path)
    columns, rows = read_csv(tmp_path / "pivot.csv")
    assert columns == ["n", "impl", "tile", "fwd_ms", "both_ms", "err", "host_us", "failure"]
    got = [tuple(r.values()) for r in rows]
    assert got == [
        ("1", "torch", "", "1", "3", "0.5", "30", ""),
        ("1", "triton", "16", "2", "", "", "", ""),   # a tile that ran in one mode only: the other's cells empty
        ("1", "triton", "32", "4", "5", "", "50", ""),
        ("1", "peer", "", "", "", "", "", "Unavailable: no peer"),  # one reason for both modes, said once
        ("2", "torch", "", "6", "", "", "", "both: OutOfMemoryError: 2 GiB"),
    ], got

    # Two rows that would fill one cell (a key the CSV does not show): two CSV rows, nothing dropped.
    twice = [dict(n=1, mode="fwd", impl="torch", tile=None, ms=1.0), dict(n=1, mode="fwd", impl="torch", tile=None, ms=2.0)]
    write_tables(run_json(group, twice, []), tmp_path)
    assert [r["fwd_ms"] for r in read_csv(tmp_path / "pivot.csv")[1]] == ["1", "2"]


def test_bar_plot_skips_cases_without_their_baseline(tmp_path):
    from conftest import BenchGroup, write_tables

    group = BenchGroup(name="bars", csv="bars.csv", columns=("n", "impl", "forward_ms_mean"), case=("n",),
                       impls=("torch", "triton"), speedups={"speedup_vs_torch": "torch"}, plot=("bar", "speedup_vs_torch"))
    only_triton = [dict(n=1, impl="triton", ms=1.0), dict(n=2, impl="triton", ms=2.0)]
    assert not (tmp_path / "bars.png").exists()
    assert [p.name for p in write_tables(run_json(group, only_triton, []), tmp_path)] == ["bars.csv"], \
        "no baseline anywhere: no speed-up to draw, so no plot (and no TypeError)"
    with_one_baseline = [*only_triton, dict(n=1, impl="torch", ms=2.0)]
    assert [p.name for p in write_tables(run_json(group, with_one_baseline, []), tmp_path)] == ["bars.csv", "bars.png"]
    first = (tmp_path / "bars.png").read_bytes()
    write_tables(run_json(group, with_one_baseline, []), tmp_path)
    assert (tmp_path / "bars.png").read_bytes() == first, "a plot drawn twice from one JSON: the same bytes"
    from PIL import Image

    with Image.open(tmp_path / "bars.png") as image:
        assert image.mode == "P", "plots are saved in 256 colours (outputs/ stays small)"


def test_ratio_plot_and_a_plot_added_at_rebuild(tmp_path):
    """A group saved with no plot gets one from ``rebuild --plot`` (a kind added after its run),
    with its CSV unchanged; a malformed --plot is refused by name."""
    from conftest import BenchGroup, main, write_tables

    group = BenchGroup(name="grid", csv="grid.csv", columns=("workload", "case", "impl", "forward_ms_mean"),
                       case=("workload", "case"), impls=("torch", "triton"), speedups={"speedup": "torch"})
    rows = [dict(workload=w, case=c, impl=i, ms=ms) for w, c in (("a", "x"), ("a", "y"), ("b", "x"))
            for i, ms in (("torch", 2.0), ("triton", 1.0))]
    data = run_json(group, rows, [])
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert [p.name for p in write_tables(data, tmp_path / "as_run")] == ["grid.csv"]
    assert main(["rebuild", str(tmp_path / "run.json"), "--outputs-dir", str(tmp_path / "drawn"),
                 "--plot", "grid=ratio:speedup"]) == 0
    assert (tmp_path / "drawn" / "grid.png").stat().st_size > 0
    assert (tmp_path / "drawn" / "grid.csv").read_bytes() == (tmp_path / "as_run" / "grid.csv").read_bytes()
    # The strip plot (a dot a case): its height does not grow with the cases, as the ratio plot's does.
    many = [dict(workload=w, case=str(c), impl=i, ms=ms) for w in "ab" for c in range(60)
            for i, ms in (("torch", 2.0), ("triton", 1.0 + c / 100))]
    (tmp_path / "many.json").write_text(json.dumps(run_json(group, many, [])))
    heights = {}
    for kind in ("ratio", "strip"):
        assert main(["rebuild", str(tmp_path / "many.json"), "--outputs-dir", str(tmp_path / kind),
                     "--plot", f"grid={kind}:speedup"]) == 0
        from PIL import Image

        with Image.open(tmp_path / kind / "grid.png") as image:
            heights[kind] = image.size[1]
    assert heights["strip"] < 600 < heights["ratio"], heights
    for bad in ("other=ratio:speedup", "grid=pie:speedup", "grid=ratio", "grid=ratio:nosuch"):
        with pytest.raises(SystemExit):
            main(["rebuild", str(tmp_path / "run.json"), "--plot", bad])


def test_runs_of_parts_of_a_grid_merge_into_one_set_of_tables(tmp_path):
    """``python conftest.py merge A B --output M``: the parts' rows in one JSON whose tables equal
    one run's (a baseline measured in one part, its Triton row in the other, still pair up), the
    ceilings their median with each part's kept; parts of another commit or GPU, or measuring a
    case twice, are refused by name."""
    from conftest import BenchGroup, main, merge_runs, write_tables

    group = BenchGroup(name="grid", csv="grid.csv", columns=("workload", "case", "impl", "forward_ms_mean", "speedup"),
                       case=("workload", "case"), impls=("torch", "triton"), speedups={"speedup": "torch"})
    rows = [dict(workload="a", case=c, impl=i, ms=ms) for c in "xy" for i, ms in (("torch", 2.0), ("triton", 1.0))]
    whole = run_json(group, rows, [])
    parts = []
    for n, (mine, copy) in enumerate(((rows[:3], 1000.0), (rows[3:], 3000.0))):
        part = run_json(group, mine, [] if n else [(dict(workload="b", case="z", impl="triton"), "Unavailable: none")])
        for i, b in enumerate(part["benchmarks"]):
            b["fullname"] = f"test_grid[{n}-{i}]"
        part.update(ceilings={"copy_GBps": copy}, commit_info={"id": "abc", "dirty": False},
                    machine_info={"gpu": {"name": "H100"}}, datetime=f"day {n}")
        part["failed_cases"] = [{**f, "test": "test_grid[b-z]"} for f in part["failed_cases"]]
        (tmp_path / f"part{n}.json").write_text(json.dumps(part))
        parts.append((f"part{n}.json", part))
    assert main(["merge", str(tmp_path / "part0.json"), str(tmp_path / "part1.json"),
                 "--output", str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["ceilings"]["copy_GBps"] == 2000.0
    assert [p["ceilings"]["copy_GBps"] for p in merged["merged_from"]] == [1000.0, 3000.0]
    assert merged["bench_run"]["complete"] and len(merged["benchmarks"]) == 4 and len(merged["failed_cases"]) == 1
    whole["failed_cases"] = merged["failed_cases"]
    write_tables(whole, tmp_path / "whole")
    write_tables(merged, tmp_path / "merged")
    assert (tmp_path / "merged" / "grid.csv").read_bytes() == (tmp_path / "whole" / "grid.csv").read_bytes()
    _, table = read_csv(tmp_path / "merged" / "grid.csv")
    assert [r["speedup"] for r in table if r["impl"] == "triton" and r["case"] == "y"] == ["2"]
    for change, message in ((lambda p: p["commit_info"].update(id="def"), "commit"),
                            (lambda p: p.pop("commit_info"), "records no commit"),
                            (lambda p: p["machine_info"]["gpu"].update(name="A100"), "GPU"),
                            (lambda p: p["bench_run"].update(timer="do_bench"), "run settings"),
                            (lambda p: p["benchmarks"].append(dict(parts[0][1]["benchmarks"][0])), "measured .* in part0.json")):
        other = json.loads(json.dumps(parts[1][1]))
        change(other)
        with pytest.raises(ValueError, match=message):
            merge_runs([parts[0], ("part1.json", other)])
    # Each run's own workers (their measured ceilings) differ and do not stop a merge; they are kept.
    other = json.loads(json.dumps(parts[1][1]))
    other["bench_run"]["workers"] = {"gw0": {"ceilings": {"copy_GBps": 2900.0}}}
    assert merge_runs([parts[0], ("part1.json", other)])["merged_from"][1]["bench_run"]["workers"]
    assert main(["merge", str(tmp_path / "part0.json"), "--output", str(tmp_path / "alone.json")]) == 2


def test_a_part_file_records_its_commit_for_merges(tmp_path):
    """A stopped run's .part carries its commit in its first line, so its rows can be merged with
    another part of the same commit (and are refused beside another commit's)."""
    from conftest import read_part

    part = tmp_path / "benchmark.json.part"
    part.write_text(json.dumps({"run": {"timer": "events"}, "machine_info": {"gpu": {"name": "H100"}},
                                "commit_info": {"id": "abc", "dirty": False}}) + "\n", encoding="utf-8")
    data = read_part(part)
    assert data["commit_info"] == {"id": "abc", "dirty": False} and data["bench_run"]["complete"] is False
