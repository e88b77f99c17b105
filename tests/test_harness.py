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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(args: list[str], cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """Benchmarks on (-p no:xdist), no cache files, in interpreter mode, whatever the outer run uses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["TRITON_INTERPRET"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--benchmark-only", "-rs", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    proc.output = proc.stdout + proc.stderr
    return proc


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
    proc = run_pytest([str(ROOT / "tests" / "test_benchmarks.py") + "::test_softmax_matmul",
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
    params = [b["params"] for b in json.loads((tmp / "run.json").read_text())["benchmarks"]]
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
    data = json.loads((tmp / "run.json").read_text())
    info = data["machine_info"]["gpu"]
    assert info["mode"].startswith("interpreter"), info
    assert {"torch", "triton", "l2_flush", "copy_bandwidth_GBps"} <= info.keys(), info
    assert info["copy_bandwidth_GBps"] > 0, "the copy ceiling is measured during the run, before the JSON is written"
    assert data["failed_cases"] == []

    benchmarks = data["benchmarks"]
    assert benchmarks and {b["group"] for b in benchmarks} == {"softmax_matmul"}
    csv_means = {(int(r["d2"]), r["BLOCK"]): float(r["forward_ms_mean"])
                 for r in read_csv(tmp / "out" / "softmax_matmul_benchmark.csv")[1]}
    for b in benchmarks:
        extra = b["extra_info"]
        for key in ("batch_size", "d1", "d2", "d3", "impl", "BLOCK", "forward_ms_mean", "bytes_moved", "flops", "execution"):
            assert key in extra, f"{b['name']}: extra_info lacks {key}: {extra}"
        assert extra["execution"] == "interpreter"
        # The CSV, the extra_info and pytest-benchmark's own statistics are one measurement.
        assert extra["forward_ms_mean"] == pytest.approx(b["stats"]["mean"] * 1e3, rel=1e-9)
        key = (extra["d2"], "" if extra["BLOCK"] is None else str(extra["BLOCK"]))
        assert csv_means[key] == pytest.approx(extra["forward_ms_mean"], rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Failing configurations: a resource limit is recorded and skipped, a bug fails the run
# ----------------------------------------------------------------------------------------------
PROBE_MODULE = '''
import pytest, torch, triton, triton.language as tl
from conftest import BenchGroup

PROBE = BenchGroup(name="probe", csv="probe.csv", case=("n",), impls=("fits", "too_big", "broken", "clash"),
                   columns=("n", "impl", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB"))


@triton.jit
def fill_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK <= 32, "BLOCK past the probe limit")
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), 1.0, tl.float32))


@pytest.mark.parametrize("n,impl,BLOCK", CASES)
def test_probe(bench, n, impl, BLOCK):
    def build():
        if impl == "broken":
            raise ValueError("a bug in the probe")
        x = torch.empty(64)
        return lambda: fill_kernel[(1,)](x, BLOCK=BLOCK)

    row = dict(n=n, impl=impl, BLOCK=BLOCK)
    if impl == "clash":
        row["execution"] = "a row key the harness writes itself"
    bench(PROBE, row, build)
'''


def run_probe(tmp_path: Path, cases: list[tuple]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run a throwaway benchmark module under the project's harness (loaded with -p conftest)."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE_MODULE).replace("CASES", repr(cases)))
    proc = run_pytest(["-p", "conftest", "test_probe.py", "--outputs-dir", "out", "--benchmark-save", "probe"],
                      cwd=tmp_path, pythonpath=ROOT)
    assert "group probe ->" in proc.output, f"the harness did not run:\n{proc.output[-4000:]}"
    columns, rows = read_csv(tmp_path / "out" / "probe.csv")
    assert columns == ["n", "impl", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB"]
    return proc, rows


def assert_measured(row: dict):
    assert float(row["forward_ms_mean"]) > 0 and float(row["forward_ms_std"]) >= 0, row


def assert_empty(row: dict):
    assert row["forward_ms_mean"] == row["forward_ms_std"] == row["forward_peak_MiB"] == "", row


def test_static_assert_is_a_recorded_limit(tmp_path):
    proc, rows = run_probe(tmp_path, [(1, "fits", 16), (1, "too_big", 64), (2, "fits", 32)])
    assert proc.returncode == 0, f"a configuration past a kernel's limit must not fail the run:\n{proc.output[-4000:]}"
    assert [(r["n"], r["impl"], r["BLOCK"]) for r in rows] == [("1", "fits", "16"), ("1", "too_big", "64"), ("2", "fits", "32")]
    assert_measured(rows[0])
    assert_empty(rows[1])
    assert_measured(rows[2])  # the case after the failure was still measured
    failed = [line for line in proc.output.splitlines() if line.startswith("FAILED CONFIG")]
    assert len(failed) == 1 and "n=1, impl=too_big" in failed[0] and "BLOCK past the probe limit" in failed[0], failed
    assert "2 passed, 1 skipped" in proc.output

    # --benchmark-save with the default storage lands in the per-GPU-kind folder, with the reason.
    saved = list((tmp_path / ".benchmarks" / "interpreter").glob("*/0001_probe.json"))
    assert len(saved) == 1, list((tmp_path / ".benchmarks").rglob("*"))
    data = json.loads(saved[0].read_text())
    assert [b["extra_info"]["impl"] for b in data["benchmarks"]] == ["fits", "fits"]
    assert [(c["row"]["impl"], "BLOCK past the probe limit" in c["reason"]) for c in data["failed_cases"]] == [("too_big", True)]


def test_other_errors_fail_the_run_and_keep_the_row(tmp_path):
    proc, rows = run_probe(tmp_path, [(1, "fits", 16), (1, "broken", 16)])
    assert proc.returncode == 1, proc.output[-4000:]
    assert "1 failed, 1 passed" in proc.output
    assert_measured(rows[0])
    assert_empty(rows[1])
    assert any(line.startswith("FAILED CONFIG n=1, impl=broken: ValueError: a bug in the probe")
               for line in proc.output.splitlines()), proc.output[-4000:]


def test_a_row_key_the_harness_owns_is_refused(tmp_path):
    proc, rows = run_probe(tmp_path, [(1, "fits", 16), (1, "clash", 16)])
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.output, proc.output[-4000:]
    assert "row keys ['execution'] of group probe are the harness's own" in proc.output
    assert [r["impl"] for r in rows] == ["fits"]
