"""The record and what is made from it: its parts, the merge of parts, README.md's headline and
outputs/README.md's targets (``python3 conftest.py headline``), the regression gate, the progress
estimate, and the command line's independence from torch. Runs of made-up JSON: no timing here."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from conftest import (
    HEADLINE, MAIN_JOB, PART_SETS, RECORD_PARTS, REFERENCE_GPU, ROOT, Headline, gate_report, headline_markdown, load_run,
    main, merge_runs, no_record, part_of, record_json, record_parts, run_destination, stale_blocks, targets_markdown,
    time_left, whole_parts, with_block,
)
from test_harness import child_env

GENERATED_FILES = {"README.md": "headline", "outputs/README.md": "targets"}


def test_generated_blocks_match_the_committed_record():
    """README.md's headline and outputs/README.md's targets are what the committed record gives:
    after a new record, `python3 conftest.py headline` writes them."""
    for name, marker in GENERATED_FILES.items():
        text = (ROOT / name).read_text(encoding="utf-8")
        assert f"<!-- {marker}:begin -->" in text and f"<!-- {marker}:end -->" in text, \
            f"{name} has lost the markers of its generated {marker} block"
    path = record_json()
    if not path.exists():
        pytest.skip(f"no record committed at {path.relative_to(ROOT)}: the blocks wait for one")
    assert stale_blocks(load_run(path), path) == [], "the blocks differ from the record: python3 conftest.py headline"


# ----------------------------------------------------------------------------------------------
# Made-up runs
# ----------------------------------------------------------------------------------------------
def bench(group: str, impl: str, median_ms: float, test: str = "tests/test_bench_x.py::test_x", **row) -> dict:
    key = "-".join(str(v) for v in row.values())
    return {"group": group, "name": f"{test.split('::')[1]}[{key}-{impl}]", "fullname": f"{test}[{key}-{impl}]",
            "stats": {"mean": median_ms / 1e3, "stddev": 0.0, "median": median_ms / 1e3, "min": median_ms / 1e3},
            "extra_info": {**row, "impl": impl}}


def run(benchmarks: list[dict], groups: dict, commit: str = "0123456789abcdef", parts=(), failed=(),
        gpu: str = REFERENCE_GPU) -> dict:
    return {
        "bench_groups": {g: {"name": g, "csv": f"{g}.csv", "columns": [*case, "impl"], "case": list(case),
                             "impls": sorted({b["extra_info"]["impl"] for b in benchmarks if b["group"] == g})}
                         for g, case in groups.items()},
        "benchmarks": benchmarks, "failed_cases": list(failed),
        "machine_info": {"gpu": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "triton": "3.6.0"}},
        "commit_info": {"id": commit, "dirty": False},
        "bench_run": {"timer": "events", "l2_flush": True, "execution": "compiled", "gpu": gpu, "complete": True,
                      "record_parts": list(parts), "command": "python -m pytest --benchmark-only"},
        "ceilings": {"copy_GBps": 3000.0, "matmul_TFLOPs": {}},
    }


SOFTMAX = dict(M=8192, N=8192, dtype="bfloat16", BLOCK_SIZE=None)


def test_the_headline_is_the_medians_and_their_ratio_at_each_headline_case(tmp_path):
    data = run([bench("softmax", "torch", 0.27, **SOFTMAX), bench("softmax", "triton_row", 0.09, **SOFTMAX),
                bench("softmax", "triton_row", 0.5, **{**SOFTMAX, "BLOCK_SIZE": 256})],  # not the plain call
               {"softmax": ("M", "N", "dtype")})
    table = headline_markdown(data, tmp_path / "benchmark.json")
    assert "| row softmax | 8192 x 8192, bfloat16 | 0.09 | 0.27 | 3.00x |" in table, table
    assert "| softmax(x @ W) | 4096 x 4096 x 128256, bfloat16 | not measured | not measured |  |" in table, table
    assert "at commit 0123456" in table and "NVIDIA H100 80GB HBM3 (torch 2.11.0, triton 3.6.0)" in table
    assert len([line for line in table.splitlines() if line.startswith("| ") and "---" not in line]) == len(HEADLINE) + 1


def test_the_model_steps_headline_is_its_wall_time_where_the_record_has_it(tmp_path):
    """The GPT-2 step's row compares a step's wall time in a loop (the host included); a record
    from before that column gives the GPU's time, unmarked."""
    def step(impl, ms, wall=None):
        return bench("model_step", impl, ms, config="gpt2", compiled="compile",
                     **({} if wall is None else {"wall_ms": wall}))

    groups = {"model_step": ("config", "compiled")}
    table = headline_markdown(run([step("torch", 18.0, 18.0), step("project", 17.8, 20.0)], groups), tmp_path / "b.json")
    assert "torch.compile(model) (wall time) | 20 | 18 | 0.90x |" in table, table
    assert "Rows marked (wall time): a median step of steps run back to back, the host included" in table
    # Neither, one of the two or a NaN: both GPU times, never one of each.
    for rows in ([step("torch", 18.0), step("project", 17.8)], [step("torch", 18.0, 18.0), step("project", 17.8)],
                 [step("torch", 18.0, float("nan")), step("project", 17.8, 20.0)]):
        table = headline_markdown(run(rows, groups), tmp_path / "b.json")
        assert "torch.compile(model) | 17.8 | 18 | 1.01x |" in table and "wall time" not in table.lower(), table


def test_a_headline_case_that_picks_several_rows_is_an_error(tmp_path):
    data = run([bench("softmax", "torch", 0.27, **SOFTMAX), bench("softmax", "torch", 0.3, **{**SOFTMAX, "x": 1})],
               {"softmax": ("M", "N", "dtype")})
    with pytest.raises(ValueError, match="2 rows match"):
        headline_markdown(data, tmp_path / "benchmark.json")


def test_each_headline_case_names_a_group_and_the_project_against_pytorch():
    assert all(isinstance(h, Headline) and h.ours != h.torch and h.case for h in HEADLINE)
    assert len({(h.group, tuple(sorted(h.case.items()))) for h in HEADLINE}) == len(HEADLINE)


def test_the_shape_grids_headline_cases_are_core_cases():
    """The main job (tox -e gpu) runs the grid's core cases only: a headline case of the grid must be one."""
    import test_bench_shape_grid as grid

    labels = {("softmax_matmul", f"batch=8 d1={d1} d2={d2} d3={d3} {dt}" + (f" {p}" if dt == "float32" else ""))
              for _, d1, d2, d3, dt, p in (c for c in grid.CORE if c[0] == "softmax_matmul")}
    labels |= {("matmul_softmax", f"B={B} K={K} C={C} {dt}") for _, B, K, C, dt in (c for c in grid.CORE
                                                                                     if c[0] == "matmul_softmax")}
    cases = [(h.case["workload"], h.case["case"]) for h in HEADLINE if h.group == "shape_grid"]
    assert cases and set(cases) <= labels, sorted(set(cases) - labels)


def model_step(impl: str, compiled: str, ms: float, peak: float) -> dict:
    b = bench("model_step", impl, ms, config="gpt2", compiled=compiled)
    b["extra_info"]["forward_peak_MiB"] = peak
    return b


def test_targets_say_met_missed_or_not_in_the_record(tmp_path):
    data = run([model_step("torch", "compile", 12.0, 100.0), model_step("project", "compile", 10.0, 90.0),
                model_step("torch", "eager", 20.0, 100.0), model_step("project", "eager", 19.0, 50.0)],
               {"model_step": ("config", "compiled")})
    table = targets_markdown(data, tmp_path / "benchmark.json")
    assert "| 47 | compiled training step >= 1.05x torch's compiled step, both configurations | 1.20x | met |" in table
    assert "| 47 | eager training step >= 1.15x torch's at <= 0.6x its peak memory | 1.05x at 0.50x the memory | " \
           "missed |" in table, table
    assert "| 47 | losses within bfloat16 noise over every measured step | 0 cases over their loss bound or failed " \
           "| met |" in table, table
    assert "| 46 | peak memory above the inputs at most 1.25x cut-cross-entropy's | not in the record |  |" in table


def test_a_ratio_target_is_over_the_fastest_peer_that_ran_the_case(tmp_path):
    case = dict(workload="attention_models_fwd", case="m")
    data = run([bench("attention_models", "sdpa", 2.0, **case), bench("attention_models", "flex_compile", 1.0, **case),
                bench("attention_models", "triton", 1.25, **case)], {"attention_models": ("workload", "case")})
    assert "| 45 | the same: no case below 0.8x | 0.80x | met |" in targets_markdown(data, tmp_path / "b.json")


def test_a_block_is_replaced_between_its_markers_and_a_missing_block_is_an_error():
    text = "a\n<!-- x:begin -->\nold\n<!-- x:end -->\nb"
    assert with_block(text, "x", "new") == "a\n<!-- x:begin -->\nnew\n<!-- x:end -->\nb"
    with pytest.raises(ValueError, match="no <!-- y:begin -->"):
        with_block(text, "y", "new")


def test_headline_writes_the_blocks_then_check_finds_them_current(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(conftest, "ROOT", tmp_path)
    (tmp_path / "outputs").mkdir()
    for name, marker in GENERATED_FILES.items():
        (tmp_path / name).write_text(f"# {name}\n<!-- {marker}:begin -->\n<!-- {marker}:end -->\nend\n")
    assert main(["headline", "--check"]) == 1, "empty blocks differ from what they should say"
    assert main(["headline"]) == 0
    assert no_record(record_json()) in (tmp_path / "README.md").read_text()
    path = record_json()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run([bench("softmax", "torch", 0.27, **SOFTMAX), bench("softmax", "triton_row", 0.09,
                                                                                      **SOFTMAX)],
                                   {"softmax": ("M", "N", "dtype")})))
    assert main(["headline", "--check"]) == 1
    assert main(["headline"]) == 0 and main(["headline", "--check"]) == 0
    assert "| row softmax | 8192 x 8192, bfloat16 | 0.09 | 0.27 | 3.00x |" in (tmp_path / "README.md").read_text()
    assert "| 19 |" in (tmp_path / "outputs" / "README.md").read_text()
    assert (tmp_path / "README.md").read_text().endswith("<!-- headline:end -->\nend\n")
    capsys.readouterr()


def test_headline_writes_nothing_when_a_file_lacks_its_block(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(conftest, "ROOT", tmp_path)
    (tmp_path / "outputs").mkdir()
    names = list(GENERATED_FILES)
    for name, marker in GENERATED_FILES.items():
        text = f"<!-- {marker}:begin -->\n<!-- {marker}:end -->\n" if name == names[0] else "no block\n"
        (tmp_path / name).write_text(text)
    before = (tmp_path / names[0]).read_text()
    assert main(["headline"]) == 2
    assert names[1] in capsys.readouterr().err
    assert (tmp_path / names[0]).read_text() == before, "one file written, the other refused"


# ----------------------------------------------------------------------------------------------
# The gate
# ----------------------------------------------------------------------------------------------
def test_the_gate_names_cases_slower_than_allowed_and_refuses_another_gpu():
    record = run([bench("softmax", "torch", 1.0, n=1), bench("softmax", "triton_row", 1.0, n=1)], {"softmax": ("n",)})
    now = run([bench("softmax", "torch", 1.04, n=1), bench("softmax", "triton_row", 1.2, n=1)], {"softmax": ("n",)})
    slower, shared = gate_report(now, record, 0.05)
    assert shared == 2 and len(slower) == 1 and "triton_row" in slower[0] and "+20.0%" in slower[0]
    with pytest.raises(ValueError, match="differ in their GPU"):
        gate_report(run(now["benchmarks"], {"softmax": ("n",)}, gpu="NVIDIA_H200"), record, 0.05)


def test_the_gate_command_fails_on_a_slower_case(tmp_path, capsys):
    record, now = tmp_path / "record.json", tmp_path / "now.json"
    record.write_text(json.dumps(run([bench("softmax", "torch", 1.0, n=1)], {"softmax": ("n",)})))
    now.write_text(json.dumps(run([bench("softmax", "torch", 1.2, n=1)], {"softmax": ("n",)})))
    assert main(["gate", str(now), "--record", str(record)]) == 1
    assert "1 cases compared" in capsys.readouterr().out
    assert main(["gate", str(record), "--record", str(record)]) == 0


def test_the_gate_fails_a_case_that_now_fails(tmp_path, capsys):
    """A case the record timed that the run could not run is a failure, not a case left out."""
    record, now = tmp_path / "record.json", tmp_path / "now.json"
    timed = bench("softmax", "torch", 1.0, n=1)
    record.write_text(json.dumps(run([timed, bench("softmax", "triton_row", 1.0, n=1)], {"softmax": ("n",)})))
    failed = {"test": timed["fullname"], "group": "softmax", "row": {"n": 1, "impl": "torch"},
              "reason": "OutOfMemoryError: 2 GiB"}
    now.write_text(json.dumps(run([bench("softmax", "triton_row", 1.0, n=1)], {"softmax": ("n",)}, failed=[failed])))
    assert main(["gate", str(now), "--record", str(record)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {timed['fullname']}: the record's 1 ms, now OutOfMemoryError" in out and "2 cases compared" in out


@pytest.mark.parametrize("median", [float("nan"), 0.0, -1e-3, float("inf")])
def test_a_median_that_is_no_time_is_refused(tmp_path, capsys, median):
    record, now = tmp_path / "record.json", tmp_path / "now.json"
    record.write_text(json.dumps(run([bench("softmax", "torch", 1.0, n=1)], {"softmax": ("n",)})))
    odd = bench("softmax", "torch", 1.0, n=1)
    odd["stats"]["median"] = median
    now.write_text(json.dumps(run([odd], {"softmax": ("n",)})))
    assert main(["gate", str(now), "--record", str(record)]) == 2
    assert "has a median of" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Parts: every benchmark case in one part; merged, the parts make one run
# ----------------------------------------------------------------------------------------------
def benchmark_tests() -> list[str]:
    """path::function of every test in tests/test_bench_*.py that takes the bench fixture."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_bench_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and "bench" in [a.arg for a in node.args.args]:
                found.append(f"tests/{path.name}::{node.name}")
    return found


@pytest.mark.parametrize("core", ["-core]", "]"])
def test_every_benchmark_case_is_in_one_part_of_the_record(core):
    tests = benchmark_tests()
    assert len(tests) >= 10
    for test in tests:
        holders = [p.name for p in RECORD_PARTS if p.holds(f"{test}[x-impl{core}")]
        assert len(holders) == 1, f"{test}: in parts {holders}; each benchmark case belongs to one part (RECORD_PARTS)"


def test_parts_by_name():
    assert record_parts(["main"]) == MAIN_JOB == ("headline", "grid-core")
    assert record_parts(["all"]) == PART_SETS["all"] == tuple(p.name for p in RECORD_PARTS)
    assert record_parts(["grid-softmax", "headline", "headline"]) == ("headline", "grid-softmax")
    with pytest.raises(ValueError, match="no record part 'grid'"):
        record_parts(["grid"])
    grid = "tests/test_bench_shape_grid.py::test_shape_grid_softmax_matmul"
    assert part_of(f"{grid}[d1_1000-d2_3000-d3_96-bfloat16-torch-core]") == "grid-core"
    assert part_of(f"{grid}[d1_1000-d2_3000-d3_96-bfloat16-torch]") == "grid-softmax"
    assert part_of("tests/test_bench_softmax.py::test_softmax[8192-8192-float32-torch-None]") == "headline"
    assert part_of("tests/test_timer.py::test_x") is None


def test_where_a_run_writes():
    record = Path("/r/outputs/GPU")
    assert run_destination(record, True, PART_SETS["all"], ("all",)) == record
    assert run_destination(record, True, MAIN_JOB, ("main",)) == record / "parts" / "main"
    assert run_destination(record, True, ("headline", "models"), ("models", "headline")) == \
        record / "parts" / "models+headline"
    assert run_destination(record, True, (), ()) == record / "partial"
    assert run_destination(record, False, PART_SETS["all"], ("all",)) == record
    # A narrowed selection of the whole record holds no part whole: partial/, never over the record.
    everything = PART_SETS["all"]
    assert whole_parts(everything, "", "", None, ["tests"]) == everything
    for narrowed in (("softmax", "", None, []), ("", "not slow", None, []), ("", "", ["tests/x.py::t"], []),
                     ("", "", None, ["tests/test_bench_softmax.py::test_softmax"])):
        assert whole_parts(everything, *narrowed) == ()
        assert run_destination(record, True, whole_parts(everything, *narrowed), ("all",)) == record / "partial"


def test_parts_of_one_commit_merge_into_the_record_and_no_part_twice(tmp_path):
    a = run([bench("softmax", "torch", 1.0, n=1)], {"softmax": ("n",)}, parts=("headline",))
    b = run([bench("softmax", "torch", 1.0, n=2)], {"softmax": ("n",)}, parts=("grid-core", "models"))
    merged = merge_runs([("a.json", a), ("b.json", b)])
    assert merged["bench_run"]["record_parts"] == ["headline", "grid-core", "models"]
    assert merged["commit_info"] == a["commit_info"] and len(merged["benchmarks"]) == 2
    assert [p["bench_run"]["command"] for p in merged["merged_from"]] == ["python -m pytest --benchmark-only"] * 2
    with pytest.raises(ValueError, match="record part 'headline' is in a.json already"):
        merge_runs([("a.json", a), ("c.json", run([bench("softmax", "torch", 1.0, n=3)], {"softmax": ("n",)},
                                                  parts=("headline",)))])
    with pytest.raises(ValueError, match="its commit differs from a.json's in id .'fedcba9876543210' against"):
        merge_runs([("a.json", a), ("d.json", run([bench("softmax", "torch", 1.0, n=4)], {"softmax": ("n",)},
                                                  commit="fedcba9876543210"))])
    # How the commit was found, and a GPU's driver listed once a GPU (a run over two), are no difference.
    e, f = (run([bench("softmax", "torch", 1.0, n=n)], {"softmax": ("n",)}) for n in (6, 7))
    f["commit_info"]["source"] = "environment variable SOFTMAX_KERNELS_COMMIT"
    e["machine_info"]["gpu"]["driver"], f["machine_info"]["gpu"]["driver"] = "580.1", "580.1\n580.1"
    assert len(merge_runs([("e.json", e), ("f.json", f)])["benchmarks"]) == 2
    f["machine_info"]["gpu"]["driver"] = "575.2"
    with pytest.raises(ValueError, match=r"its GPU differs from e.json's in driver \(\['575.2'\] against"):
        merge_runs([("e.json", e), ("f.json", f)])
    with pytest.raises(ValueError, match="its GPU|run settings"):
        merge_runs([("a.json", a), ("e.json", run([bench("softmax", "torch", 1.0, n=5)], {"softmax": ("n",)},
                                                  gpu="NVIDIA_H200"))])
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
    out = tmp_path / "record" / "benchmark.json"
    assert main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["bench_run"]["command"].startswith("python3 conftest.py merge ")
    assert (out.parent / "softmax.csv").exists(), "merge writes the merged run's tables beside its JSON"


# ----------------------------------------------------------------------------------------------
# Progress: the time left from the record's seconds per case, scaled to this run's pace
# ----------------------------------------------------------------------------------------------
def test_time_left_scales_the_records_seconds_by_this_runs_pace():
    expected = {"a": 10.0, "b": 20.0, "c": 30.0}
    assert time_left({"a": 5.0}, ["b", "c"], expected) == pytest.approx(25.0)  # this run goes twice as fast
    assert time_left({"a": 5.0, "x": 15.0}, ["y"], expected) == pytest.approx(10.0)  # no record: the mean case
    assert time_left({}, ["a", "b"], expected) == pytest.approx(30.0)
    assert time_left({}, ["y"], {}) == 0.0


# ----------------------------------------------------------------------------------------------
# The command line needs no torch, triton or pytest (plain python3 with pandas)
# ----------------------------------------------------------------------------------------------
WITHOUT_TORCH = """
import runpy, sys
for name in ("torch", "triton", "pytest"):
    sys.modules[name] = None  # import fails, as where they are not installed
sys.argv = ["conftest.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_command_line_runs_without_torch(tmp_path):
    record = tmp_path / "record.json"
    record.write_text(json.dumps(run([bench("softmax", "torch", 1.0, n=1), bench("softmax", "triton_row", 0.5, n=1)],
                                     {"softmax": ("n",)}, parts=PART_SETS["all"])))
    for args in (["parts", "--record", str(record)], ["gate", str(record), "--record", str(record)],
                 ["rebuild", str(record), "--outputs-dir", str(tmp_path / "tables")]):
        proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{args[0]}: {proc.stdout}{proc.stderr}"
    assert (tmp_path / "tables" / "softmax.csv").exists()


# ----------------------------------------------------------------------------------------------
# The README's install step gives what its benchmark commands run (python3 -m tox, pytest, ...)
# ----------------------------------------------------------------------------------------------
def test_the_bench_extra_holds_the_tools_the_readme_names():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    held = {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower() for requirement in extra["bench"]}
    (line,) = [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
               if line.startswith('pip install ".[bench]"')]
    named = {tool.strip().lower() for tool in line.split("tools:", 1)[1].split(",")}
    assert named == held, (f"README.md's install line names {sorted(named)}, pyproject.toml's bench extra holds "
                           f"{sorted(held)}")


def test_the_front_door_and_the_record_stay_within_their_sizes():
    """What a newcomer reads and clones: README.md at most 12,000 bytes, outputs/README.md at most
    20,000, the committed outputs/ at most 5 MB in at most 40 files, none of them Python."""
    root = Path(conftest.__file__).parent
    assert (root / "README.md").stat().st_size <= 12_000
    assert (root / "outputs" / "README.md").stat().st_size <= 20_000
    try:
        listed = subprocess.run(["git", "ls-files", "outputs"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the committed files are not known")
    files = [root / name for name in listed.stdout.splitlines()]
    assert files and len(files) <= 40, len(files)
    assert sum(f.stat().st_size for f in files) <= 5_000_000
    assert not [f for f in files if f.suffix == ".py"]


def test_model_step_targets_compare_a_training_loops_wall_time():
    """Issue 47's targets compare a step's wall time in a loop (``wall_ms``, the host included)
    where the record has it: a host-bound step whose GPU time beats torch's may still lose; a
    record from before the column compares the GPU's time a step."""
    from conftest import _model_step_compiled, _model_step_eager

    def step(impl, compiled, ms, wall=None, peak=1000.0):
        row = dict(config="gpt2", compiled=compiled, forward_peak_MiB=peak)
        if wall is not None:
            row["wall_ms"] = wall
        return bench("model_step", impl, ms, "tests/test_bench_model_step.py::test_model_step", **row)

    groups = {"model_step": ("config", "compiled")}
    with_wall = run([step("torch", "compile", 18.0, 18.2), step("project", "compile", 17.8, 20.8),
                     step("torch", "eager", 26.0, 26.1), step("project", "eager", 25.0, 27.3, peak=500.0)], groups)
    assert _model_step_compiled(with_wall) == ("0.87x (wall time a step)", False)
    assert _model_step_eager(with_wall) == ("0.96x at 0.50x the memory (wall time a step)", False)
    gpu_only = run([step("torch", "compile", 18.0), step("project", "compile", 17.0)], groups)
    assert _model_step_compiled(gpu_only) == ("1.06x", True)
