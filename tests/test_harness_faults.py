"""The record survives its users: signals in quick succession, two runs into one directory, a
killed run's leftovers, bad destinations, rebuilds without a destination, bad files; and the ops'
own faults (the interpreter switch, a CPU tensor, numpy warnings). A wrong kernel benchmarked:
test_harness_xdist.py (serial and under xdist).

Runs of pytest in a subprocess (the probe module of test_harness.py, in interpreter mode), and
the rebuild/merge command line called in this process. Everything is written under tmp_path;
the command line's committed outputs/ is pointed at a temporary copy where a test needs one.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

import conftest
from test_harness import (
    PROBE_COLUMNS, ROOT, assert_measured, read_csv, run_json, run_pytest, start_probe, write_probe,
)
from test_harness import interpreter_runs  # noqa: F401 - the module's fixture: skip where the interpreter fails


# ----------------------------------------------------------------------------------------------
# Signals: never recorded as whole, however many arrive and when
# ----------------------------------------------------------------------------------------------
# (signal, seconds before sending it): the second lands inside pytest's handling of the first
# (its keyboard-interrupt hooks), the later ones on the session's end and the record's writing.
SIGNALS = [(signal.SIGTERM, 0.0), (signal.SIGINT, 0.02), (signal.SIGTERM, 0.05), (signal.SIGTERM, 0.1),
           (signal.SIGINT, 0.2), (signal.SIGTERM, 0.3), (signal.SIGINT, 0.6)]


def test_signals_in_quick_succession_leave_a_partial_record(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "probe.csv").write_text("a whole table from an earlier run\n")
    proc = start_probe(tmp_path, [(1, "fits", 16), (2, "fits", 32), (3, "sleepy", 16), (4, "fits", 16)])
    for sig, delay in SIGNALS:
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode in (2, -signal.SIGTERM, -signal.SIGINT), output[-4000:]
    assert (out / "probe.csv").read_text() == "a whole table from an earlier run\n", "an interrupted run replaced a whole table"
    assert not (out / "benchmark.json").exists(), output[-4000:]
    if (out / "benchmark.partial.json").exists():  # the record was written: partial, with the measured rows
        data = json.loads((out / "benchmark.partial.json").read_text())
        assert data["bench_run"]["complete"] is False and len(data["benchmarks"]) == 2
        columns, rows = read_csv(out / "probe.partial.csv")
        assert columns == PROBE_COLUMNS and [r["n"] for r in rows] == ["1", "2"], rows
        for r in rows:
            assert_measured(r)
        assert "interrupted: partial tables" in output
    else:  # stopped before its record was written: the rows are in its .part, rebuilt as partial
        assert conftest.main(["rebuild", str(out / "benchmark.json.part"), "--outputs-dir", str(tmp_path / "rebuilt")]) == 0
        assert [r["n"] for r in read_csv(tmp_path / "rebuilt" / "probe.partial.csv")[1]] == ["1", "2"]


# ----------------------------------------------------------------------------------------------
# One writer per directory; a killed run's .part and lock
# ----------------------------------------------------------------------------------------------
def test_a_second_run_is_refused_and_a_killed_runs_rows_are_kept(tmp_path):
    """A live run's directory refuses a second run before any case; once the first is killed,
    its .part is kept under a new name (named in the next run's summary), its lock taken over."""
    first = start_probe(tmp_path, [(1, "fits", 16), (2, "sleepy", 16)])
    second = tmp_path / "second"
    second.mkdir()
    proc = run_pytest([*write_probe(second, [(7, "fits", 16)])[:-1], str(tmp_path / "out")], cwd=second, pythonpath=ROOT)
    assert proc.returncode == 4, proc.output[-4000:]  # pytest's usage error
    assert f"is being written by pid {first.pid}" in proc.output and "test_probe.py" in proc.output, proc.output[-4000:]
    assert "7" not in {r["n"] for r in read_csv_or_empty(tmp_path / "out" / "probe.csv")}
    first.kill()  # SIGKILL: no handler runs; the .part and the lock's line stay behind
    first.communicate(timeout=60)
    part = tmp_path / "out" / "benchmark.json.part"
    rows_before = part.read_bytes()
    (tmp_path / "sleeping").unlink()
    proc = run_pytest([*write_probe(second, [(7, "fits", 16)])[:-1], str(tmp_path / "out")], cwd=second, pythonpath=ROOT)
    assert proc.returncode == 0, proc.output[-4000:]
    kept = list((tmp_path / "out").glob("benchmark.*.json.part"))
    assert len(kept) == 1 and kept[0].read_bytes() == rows_before, "the killed run's rows were not kept as they were"
    assert f"moved to {kept[0]}" in proc.output and f"took over the lock of pid {first.pid}" in proc.output, proc.output[-4000:]
    assert conftest.main(["rebuild", str(kept[0]), "--outputs-dir", str(tmp_path / "rebuilt")]) == 0
    assert [r["n"] for r in read_csv(tmp_path / "rebuilt" / "probe.partial.csv")[1]] == ["1"]
    assert [r["n"] for r in read_csv(tmp_path / "out" / "probe.csv")[1]] == ["7"]
    assert not (tmp_path / "out" / conftest.LOCK_NAME).exists() and not part.exists()


def read_csv_or_empty(path: Path) -> list[dict]:
    return read_csv(path)[1] if path.exists() else []


def test_a_lock_names_its_holder_and_a_rebuild_respects_it(tmp_path):
    fd, note = conftest.take_lock(tmp_path)
    assert note is None
    try:
        with pytest.raises(conftest.DirectoryBusy, match=f"pid {__import__('os').getpid()} "):
            conftest.take_lock(tmp_path)
        data = tmp_path / "run.json"
        data.write_text(json.dumps(probe_run()))
        assert conftest.main(["rebuild", str(data)]) == 2, "a rebuild wrote into a directory a live run holds"
    finally:
        conftest.release_lock(tmp_path, fd)
    assert conftest.main(["rebuild", str(tmp_path / "run.json")]) == 0


# ----------------------------------------------------------------------------------------------
# Destinations checked before any case runs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option,target,message", [
    ("--benchmark-json", "a_dir", "is a directory"),
    ("--benchmark-storage", "file://{tmp}/a_file/storage", "cannot write into"),
])
def test_a_bad_destination_is_refused_before_any_case(tmp_path, option, target, message):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    target = target.format(tmp=tmp_path)
    args = [*write_probe(tmp_path, [(1, "sleepy", 16)]), f"{option}={target}", "--benchmark-save=probe"]
    proc = run_pytest(args, cwd=tmp_path, pythonpath=ROOT)
    assert proc.returncode == 4, proc.output[-4000:]  # pytest's usage error
    assert option in proc.output and message in proc.output, proc.output[-4000:]
    assert not (tmp_path / "sleeping").exists(), "a benchmark ran before the check"


# ----------------------------------------------------------------------------------------------
# rebuild and merge: never into the committed outputs/ unasked; one line per bad file
# ----------------------------------------------------------------------------------------------
def probe_run() -> dict:
    group = conftest.BenchGroup(name="grid", csv="grid.csv", columns=("n", "impl", "forward_ms_mean"), case=("n",),
                                impls=("torch", "triton"))
    return run_json(group, [dict(n=1, impl="torch", ms=2.0), dict(n=1, impl="triton", ms=1.0)], [])


@pytest.fixture
def committed(tmp_path, monkeypatch):
    """A stand-in for the repository's outputs/ (the command line's ROOT moved to tmp_path), holding an older run."""
    monkeypatch.setattr(conftest, "ROOT", tmp_path)
    older = tmp_path / "outputs" / "older.json"
    older.parent.mkdir()
    older.write_text(json.dumps(probe_run()))
    return older


def test_rebuild_and_merge_write_into_committed_outputs_only_when_asked(committed, capsys):
    before = sorted(p.name for p in committed.parent.iterdir())
    assert conftest.main(["rebuild", str(committed)]) == 2
    assert conftest.main(["rebuild", str(committed), "--outputs-dir", str(committed.parent / "cpu")]) == 2
    assert conftest.main(["merge", str(committed), str(committed), "--output", str(committed.parent / "m.json")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all("is in the committed outputs/" in e and "--committed" in e for e in errors), errors
    assert sorted(p.name for p in committed.parent.rglob("*")) == before, "a refused command wrote into outputs/"
    assert conftest.main(["rebuild", str(committed), "--committed"]) == 0
    assert (committed.parent / "grid.csv").exists()
    assert conftest.main(["rebuild", str(committed), "--outputs-dir", str(committed.parent.parent / "elsewhere")]) == 0


BAD_FILES = {
    "truncated": ('{"bench_groups": {"grid": {', "is not whole JSON (truncated?)"),
    "empty": ("", "is empty"),
    "a list": ("[1, 2]", "holds a JSON list, not a run's JSON object"),
    "foreign": ('{"benchmarks": []}', "has no bench_groups"),
    "no stats": (None, "benchmarks[0] has no stats"),
    "directory": (None, "is a directory"),
    "garbage part": ("not json\n\x00\x00\n", "has no bench_groups"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_each_bad_file_is_one_line_naming_it(tmp_path, capsys, kind):
    text, message = BAD_FILES[kind]
    path = tmp_path / ("benchmark.json.part" if kind == "garbage part" else "bad.json")
    if kind == "directory":
        path.mkdir()
    elif kind == "no stats":
        data = probe_run()
        del data["benchmarks"][0]["stats"]["median"]
        path.write_text(json.dumps(data))
    else:
        path.write_text(text)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(probe_run()))
    out = tmp_path / "tables"
    for argv in (["rebuild", str(path), "--outputs-dir", str(out)], ["merge", str(good), str(path), "--output", str(out / "m.json")]):
        assert conftest.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: {message}" in err and "Traceback" not in err, err
    assert not out.exists() or not any(out.iterdir())


def test_merge_names_parts_by_path(tmp_path, capsys):
    data = probe_run()
    data["commit_info"] = {"id": "abc"}
    for i, b in enumerate(data["benchmarks"]):
        b["fullname"] = f"test_grid[{i}]"
    for part in ("a", "c"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "benchmark.json").write_text(json.dumps(data))
    a, c = tmp_path / "a" / "benchmark.json", tmp_path / "c" / "benchmark.json"
    assert conftest.main(["merge", str(a), str(c), "--output", str(tmp_path / "m.json")]) == 2
    assert f"{c}: test_grid[0] was measured (or failed) in {a} already" in capsys.readouterr().err


def named_run(tmp_path: Path, name: str, gpu: str | None = "NVIDIA_H200", complete: bool = True, n: int = 0) -> Path:
    """probe_run at commit abc on a GPU kind, its case names numbered from n, written at tmp_path/name."""
    data = probe_run()
    data["commit_info"] = {"id": "abc"}
    data["bench_run"] = {"gpu": gpu, "complete": complete}
    for i, b in enumerate(data["benchmarks"]):
        b["fullname"] = f"test_grid[{n + i}]"
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# (arguments, with {tmp} for tmp_path; what the one line on stderr says). Each is refused (exit 2).
BAD_ARGUMENTS = {
    "merge into a directory": (["merge", "{tmp}/a.json", "{tmp}/b.json", "--output", "{tmp}"],
                               "--output {tmp}: is a directory"),
    "gate of a kind without a record": (["gate", "{tmp}/a.json"], "no record of NVIDIA_A100 runs is committed"),
    "gate without a GPU kind's record": (["gate", "{tmp}/interpreter.json"],
                                         "no record of interpreter runs is committed"),
    "a negative slowdown": (["gate", "{tmp}/a.json", "--record", "{tmp}/b.json", "--max-slowdown", "-5"],
                            "--max-slowdown: expected a percentage of 0 or more, got -5"),
    "a negative tolerance": (["merge", "{tmp}/a.json", "--against", "{tmp}/b.json", "--output", "{tmp}/m.json",
                              "--tolerance", "-1"], "--tolerance: expected a percentage of 0 or more, got -1"),
    "an endless slowdown": (["gate", "{tmp}/a.json", "--record", "{tmp}/b.json", "--max-slowdown", "inf"],
                            "--max-slowdown: expected a percentage of 0 or more, got inf"),
    "a merge over its input": (["merge", "{tmp}/a.json", "{tmp}/b.json", "--output", "{tmp}/a.json"],
                               "--output {tmp}/a.json is one of the runs it reads"),
    "a benchmark with no name": (["merge", "{tmp}/a.json", "{tmp}/nameless.json", "--output", "{tmp}/m.json"],
                                 "{tmp}/nameless.json: benchmarks[0] lacks one of fullname"),
}


@pytest.mark.parametrize("what", list(BAD_ARGUMENTS))
def test_each_bad_argument_is_one_line_naming_it(tmp_path, capsys, what, monkeypatch):
    monkeypatch.setattr(conftest, "ROOT", tmp_path)  # outputs/ holds no record of any kind
    named_run(tmp_path, "a.json", gpu="NVIDIA_A100")
    named_run(tmp_path, "b.json", gpu="NVIDIA_A100", n=2)
    named_run(tmp_path, "interpreter.json", gpu="interpreter")
    nameless = json.loads((tmp_path / "b.json").read_text())
    del nameless["benchmarks"][0]["fullname"]
    (tmp_path / "nameless.json").write_text(json.dumps(nameless))
    original = (tmp_path / "a.json").read_text()
    args, message = BAD_ARGUMENTS[what]
    percent = {"--max-slowdown", "--tolerance"} & set(args)
    with pytest.raises(SystemExit) if percent else contextlib.nullcontext():  # argparse's own refusal
        assert conftest.main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert not (tmp_path / "m.json").exists() and (tmp_path / "a.json").read_text() == original


def test_a_gate_that_compares_nothing_says_why_it_fails(tmp_path, capsys):
    run, record = named_run(tmp_path, "run.json"), named_run(tmp_path, "record.json", n=2)
    assert conftest.main(["gate", str(run), "--record", str(record)]) == 1
    assert f"none of {run}'s cases is in {record}" in capsys.readouterr().err


def test_a_partial_run_makes_no_record(committed, capsys):
    """Merged into the committed outputs/, a partial run would leave the record's old tables beside
    its .partial ones: refused, nothing written."""
    tmp = committed.parent.parent
    a, b = named_run(tmp, "a.json"), named_run(tmp, "b.json", complete=False, n=2)
    before = sorted(p.name for p in committed.parent.rglob("*"))
    assert conftest.main(["merge", str(a), str(b), "--output", str(committed.parent / "benchmark.json"),
                          "--committed"]) == 2
    assert f"{b}: a partial run" in capsys.readouterr().err
    assert sorted(p.name for p in committed.parent.rglob("*")) == before


def test_a_merge_of_a_partial_run_says_so(tmp_path, capsys):
    a, b = named_run(tmp_path, "a.json"), named_run(tmp_path, "b.json", complete=False, n=2)
    assert conftest.main(["merge", str(a), str(b), "--output", str(tmp_path / "m" / "benchmark.json")]) == 0
    out, err = capsys.readouterr()
    assert f"NOTE {b} is a partial run" in err and "grid.partial.csv" in out, (out, err)


@pytest.mark.parametrize("target,message", [
    ("no_such_file.py", "no such file"),
    ("no_such_module", "no file nor importable module of that name"),
    ("README.md", "not a Python file"),
])
def test_a_candidate_that_is_not_there_is_refused_before_any_case(target, message):
    proc = run_pytest(["--candidate", target, "--collect-only", "-q", "tests/test_bench_softmax.py"], cwd=ROOT)
    assert proc.returncode == 4, proc.output[-4000:]  # pytest's usage error, not a passing run
    assert f"--candidate {target}: {message}" in proc.output and "Traceback" not in proc.output, proc.output[-4000:]


# A benchmark group's own bound catching a wrong kernel, serial and under xdist: test_harness_xdist.py.


# ----------------------------------------------------------------------------------------------
# The ops: the interpreter switch, the CPU-tensor error, double backward, no numpy warnings
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
                                      ("0", False), ("false", False), ("off", False), ("", False)])
def test_the_interpreter_switch_is_read_as_triton_reads_it(monkeypatch, value, on):
    from online_softmax import interpreter_requested

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_requested() is on


def test_a_cpu_tensor_without_the_interpreter_names_it(monkeypatch):
    import online_softmax

    monkeypatch.setattr(online_softmax, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        online_softmax.check_tensor("x", torch.ones(2, 3), 2)


def test_ordinary_calls_raise_no_numpy_warnings():
    """As under ``python -W error::RuntimeWarning``, whatever the test run's own filters (tox.ini's
    ignore the interpreter's): inside the block every RuntimeWarning is an error."""
    from fused_softmax_matmul import fused_softmax
    from online_softmax import row_softmax

    x, V = torch.randn(2, 5, 37), torch.randn(2, 37, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fused_softmax(x, V)
        row_softmax(x[0])


def test_null_sections_and_lines_rebuild_as_tables(tmp_path):
    """A run's bench_run and machine_info may be null (load_run takes them), and a .part may hold a
    line that is JSON but no object: the tables are written all the same."""
    data = probe_run()
    data["bench_run"] = data["machine_info"] = None
    run = tmp_path / "run.json"
    run.write_text(json.dumps(data))
    assert conftest.main(["rebuild", str(run), "--outputs-dir", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "grid.csv").exists()
    part = tmp_path / "benchmark.json.part"
    lines = [{"run": {"gpu": "NVIDIA_H200"}}, {"group": probe_run()["bench_groups"]["grid"]}, None,
             *({"benchmark": b} for b in probe_run()["benchmarks"])]
    part.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert conftest.main(["rebuild", str(part), "--outputs-dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "grid.partial.csv").exists()
    part.write_text("".join(json.dumps(line) + "\n" for line in lines[1:]))  # the header line torn away
    assert conftest.main(["rebuild", str(part), "--outputs-dir", str(tmp_path / "c")]) == 0
    assert [p.name for p in (tmp_path / "c").glob("grid*.csv")] == ["grid.partial.csv"]
