"""The committed record and what is generated from it: README.md's headline, outputs/README.md's
targets, and the regression gate's comparison (conftest.py's ``headline`` and ``gate`` commands)."""

from __future__ import annotations

import pytest

import conftest
from conftest import (
    case_ratios, gate_report, headline_markdown, load_run, record_json, stale_blocks, targets_markdown, with_block,
)


def test_generated_blocks_match_the_committed_record():
    """README.md's headline and outputs/README.md's targets are what the committed record gives:
    after a new record, `python3 conftest.py headline` writes them."""
    record = record_json()
    if not record.exists():
        pytest.skip(f"no record committed at {record.relative_to(conftest.ROOT)}")
    assert stale_blocks(load_run(record)) == [], "run: python3 conftest.py headline"


def _run(rows, groups):
    """A run's JSON with one benchmark per (group, impl, case value, median seconds)."""
    return {
        "bench_groups": {g: {"case": list(case)} for g, case in groups.items()},
        "benchmarks": [{"group": g, "fullname": f"t::{g}[{c}-{impl}]", "stats": {"median": m},
                        "extra_info": {"impl": impl, "size": c, "workload": w}}
                       for g, impl, c, m, w in rows],
        "machine_info": {"gpu": {"name": "GPU", "torch": "2.11.0+cu130", "triton": "3.6.0"}},
        "commit_info": {"id": "0123456789abcdef"},
    }


def test_a_case_ratio_is_the_fastest_baseline_over_the_project():
    run = _run([("softmax", "torch", 1, 2.0, "x"), ("softmax", "compile", 1, 1.0, "x"), ("softmax", "triton_row", 1, 0.5, "x"),
                ("softmax", "torch", 2, 3.0, "x"), ("softmax", "triton_row", 2, 1.0, "x"),
                ("softmax", "torch", 3, 3.0, "x")],  # no project row: not a case
               {"softmax": ("size",)})
    assert case_ratios(run, "softmax", "triton_row", ("torch", "compile")) == [("1", 2.0), ("2", 3.0)]
    table = headline_markdown(run)
    assert "| row softmax (`softmax`) | 2 | 3.46x | 3.00x | 4.00x |" in table, table  # the headline is against torch alone
    assert "at commit 0123456" in table


def test_targets_say_met_missed_or_absent():
    run = _run([("model_step", "torch", 1, 1.2, "x"), ("model_step", "project", 1, 1.0, "x")], {"model_step": ("size",)})
    for e in run["benchmarks"]:
        e["extra_info"]["compiled"] = "compile"
    table = targets_markdown(run)
    assert "| 47 | GPT-2 step compiled >= 1.05x torch's compiled step | min 1.20x over 1 cases | met |" in table, table
    assert "| 47 | GPT-2 step eager >= 1.15x torch's eager step | not in the record | |" in table


def test_a_block_is_replaced_between_its_markers_and_a_missing_block_is_an_error():
    text = "a\n<!-- x:begin -->\nold\n<!-- x:end -->\nb"
    assert with_block(text, "x", "new") == "a\n<!-- x:begin -->\nnew\n<!-- x:end -->\nb"
    with pytest.raises(ValueError, match="no <!-- y:begin -->"):
        with_block(text, "y", "new")


def test_the_gate_names_cases_slower_than_allowed():
    record = _run([("softmax", "torch", 1, 1.0, "x"), ("softmax", "triton_row", 1, 1.0, "x")], {"softmax": ("size",)})
    run = _run([("softmax", "torch", 1, 1.04, "x"), ("softmax", "triton_row", 1, 1.2, "x")], {"softmax": ("size",)})
    slower, shared = gate_report(run, record, 0.05)
    assert shared == 2 and len(slower) == 1 and "triton_row" in slower[0] and "+20.0%" in slower[0]
