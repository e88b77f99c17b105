"""The correctness battery of every ``--candidate`` name (tests/candidates.py), and the option's own test.

    pytest --candidate mine=path/to/my_kernels.py tests/test_candidates.py

Without ``--candidate`` the battery has no cases. ``test_example_report`` runs the option on
tests/candidate_example.py (a right and a subtly wrong online softmax) and checks its report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import candidates

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("impl,case", candidates.battery_params())
def test_candidate(request, impl, case):
    candidates.check_case(request.node, impl, case)


def test_example_report(tmp_path):
    """The option end to end on tests/candidate_example.py, in a pytest of its own: the battery and
    the softmax benchmark group's candidate, torch and triton_row rows. The report must pass the
    right online softmax in every class, name the classes the two wrong ones fail (the one without
    the rescale: its multi-tile shapes; the one without the -inf guard: edge values and gradient,
    its -inf tiles), and give speed-ups against torch."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)  # the inner run is a session of its own, not a worker's
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "--candidate", "example=tests/candidate_example.py", "--outputs-dir", str(tmp_path),
               "tests/test_candidates.py::test_candidate", "tests/test_bench_softmax.py",
               "-k", "test_candidate or (float32 and (candidate or torch or triton_row) and not compile)"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, f"the wrong candidates' cases must fail the run's tests:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    report = json.loads((tmp_path / "candidate_report.json").read_text())
    (cand,) = report["candidates"]
    assert cand["label"] == "example" and cand["import_error"] is None
    names = cand["names"]
    assert set(names) == {"online_softmax", "OnlineSoftmax", "row_softmax"}

    right = names["online_softmax"]
    assert right["failed"] == 0 and right["passed"] >= 15, right
    assert set(right["classes"]) == set(candidates.CLASSES)
    assert right["called_as"].startswith("online_softmax(x); ") and "BLOCK_1=8, BLOCK_2=1024 left at their defaults" in right["called_as"]

    no_rescale = names["OnlineSoftmax"]
    assert no_rescale["called_as"].startswith("OnlineSoftmax.apply(x); ")
    assert "shape" in no_rescale["failed_classes"]
    shape = no_rescale["classes"]["shape"]
    assert shape["passed"] >= 3, "one-tile rows are right without the rescale"
    # Its first failure is a row longer than its 32-column tile, whichever size the device's cases give.
    columns = int(re.search(r"x \(.*?(\d+)\)", shape["first_failure"]["input"]).group(1))
    assert "relative error" in shape["first_failure"]["reason"] and columns > 32, shape["first_failure"]

    no_guard = names["row_softmax"]
    assert no_guard["failed_classes"] == ["edge values", "gradient"], no_guard["classes"]
    assert "-inf tiles" in no_guard["classes"]["edge values"]["first_failure"]["case"]

    # The right names timed, with a speed-up against torch where torch ran; the wrong one's row is a
    # failure with the reason (a benchmark row is a checked row: a wrong answer is never timed).
    for name in (names["online_softmax"], names["row_softmax"]):
        assert name["benchmarks"] and all(b["ms"] for b in name["benchmarks"]), name["benchmarks"]
        assert all("torch" in b["speedup"] and "triton_row" in b["speedup"] for b in name["benchmarks"])
    assert no_rescale["benchmarks"] and all(b["ms"] is None and "wrong answer" in b["failure"]
                                            for b in no_rescale["benchmarks"]), no_rescale["benchmarks"]
    text = (tmp_path / "candidate_report.txt").read_text()
    assert "FAILED edge values, gradient" in text and "x torch" in text
    assert f"FAILED {', '.join(no_rescale['failed_classes'])}" in text and "all passed" in text
    table = (tmp_path / "softmax_benchmark.csv").read_text()
    assert "candidate:example.online_softmax" in table and "candidate:example.row_softmax" in table


def test_a_candidate_run_writes_beside_the_record_never_over_it(monkeypatch):
    """Without --outputs-dir a --candidate run's JSON, tables and report go to the GPU kind's
    candidates/ directory, even with --record-part all (which alone writes the record); a directory
    given is taken as given."""
    from conftest import PART_SETS, committed_dir, outputs_dir

    monkeypatch.setattr(candidates, "CANDIDATES", [])  # this session's own candidates stay as they are

    def configured(specs, outputs=None, parts=()):
        option = SimpleNamespace(candidate=specs, outputs_dir=outputs)
        config = SimpleNamespace(option=option, getoption=lambda name: getattr(option, name),
                                 bench_parts=parts, bench_whole_parts=parts, bench_part_names=parts)
        candidates.configure(config)
        return outputs_dir(config)

    mine = ["example=tests/candidate_example.py"]
    assert configured(mine, parts=PART_SETS["all"]) == committed_dir() / "candidates"
    assert configured(mine) == committed_dir() / "candidates"
    assert configured(mine, outputs="/tmp/elsewhere") == Path("/tmp/elsewhere").resolve()
    assert configured([], parts=PART_SETS["all"]) == committed_dir(), "a run without candidates is the record's"


class _NewStyle(torch.autograd.Function):
    """forward without ctx (setup_context beside it), as torch.func wants Functions written."""

    @staticmethod
    def forward(x, BLOCK=64):
        return torch.softmax(x, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass


def _needs_blocks(x, V, BLOCK_1, BLOCK_2):
    return torch.softmax(x, -1) @ V


def _no_causal(Q, K, V):
    return torch.softmax(Q @ K.transpose(1, 2) * Q.shape[-1] ** -0.5, -1) @ V


def test_signatures_adapted_or_refused_with_a_reason():
    """How adapt calls each kind of signature, and what it refuses rather than guess."""
    new_style = candidates.adapt("OnlineSoftmax", _NewStyle)
    assert new_style.how.startswith("_NewStyle.apply(x); ") and "BLOCK=64 left at their defaults" in new_style.how
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(new_style.call(x[0]), torch.softmax(x[0], -1))  # a 2-D x given as (1, d1, d2)

    assert "BLOCK_1, BLOCK_2" in candidates.adapt("fused_softmax", _needs_blocks).refused
    assert "not a torch.autograd.Function" in candidates.adapt("FlashAttentionTriton", type("Flash", (), {})).refused

    no_causal = candidates.adapt("FlashAttentionPytorch", _no_causal)
    assert no_causal.refused is None and "no is_causal" in no_causal.how
    Q = torch.randn(1, 4, 8)
    no_causal.call(Q, Q, Q, False)
    with pytest.raises(candidates.Refused, match="is_causal=True"):
        no_causal.call(Q, Q, Q, True)
    blocked = candidates.adapt("FlashAttentionPytorch", lambda Q, K, V, BLOCK=64: _no_causal(Q, K, V))
    assert "no is_causal" in blocked.how and "BLOCK=64 left at their defaults" in blocked.how  # not passed is_causal
