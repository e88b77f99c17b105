"""The timer's retry rule with scripted rounds, and the table's derived numbers (no GPU, no interpreter needed)."""

from __future__ import annotations

import pytest

import torch

from conftest import (
    REFERENCE_GPU, ROOT, SPIN_CAP_MS, Ceilings, EventTimer, ReplayTimer, committed_dir, compiled_op, derive_metrics,
)
from support import DEVICE

class ScriptedTimer:
    """EventTimer's retry logic with scripted rounds: (seconds, ms spent enqueueing) per call."""

    def __init__(self, rounds, spin_ms):
        class Timer(EventTimer):
            def timed_call(inner, fn):  # noqa: N805 - the scripted round replaces the device's
                seconds, enqueue_ms = rounds.pop(0)
                return seconds, enqueue_ms, fn()

        self.retries = []
        self.timer = Timer("probe", spin_cycles=1, spin_ms=spin_ms, before_retry=lambda: self.retries.append(1))


def test_a_round_the_host_stalled_is_run_again():
    # Enqueueing 0.9 ms under a 1 ms spin is clean; 2.5 ms means the GPU may have waited inside the events.
    scripted = ScriptedTimer([(0.001, 0.9), (0.004, 2.5), (0.001, 0.8)], spin_ms=1.0)
    run = scripted.timer.measured(lambda: "out")
    assert run() == "out" and scripted.timer() == pytest.approx(0.001)
    assert run() == "out" and scripted.timer() == pytest.approx(0.002), "the stalled round's 4 ms is not counted"
    assert scripted.timer.stalled_rounds == 1 and scripted.retries == [1], "the L2 flush runs again before the retry"


def test_a_host_that_always_stalls_still_gives_a_number():
    rounds = [(0.001 * (i + 1), 5.0) for i in range(EventTimer.MAX_RETRIES + 1)] + [(0.01, 5.0)]
    scripted = ScriptedTimer(rounds, spin_ms=1.0)
    run = scripted.timer.measured(lambda: None)
    run()
    assert scripted.timer() == pytest.approx(0.001 * (EventTimer.MAX_RETRIES + 1)), "the last try is kept"
    assert scripted.timer.stalled_rounds == EventTimer.MAX_RETRIES and scripted.timer.host_bound
    run()  # host bound from now on: the next slow round is kept at once
    assert scripted.timer() == pytest.approx(0.001 * (EventTimer.MAX_RETRIES + 1) + 0.01)
    assert scripted.timer.stalled_rounds == EventTimer.MAX_RETRIES


def test_no_spin_means_no_retries():
    scripted = ScriptedTimer([(0.002, 50.0)], spin_ms=0.0)  # the CPU timer: nothing to stall against
    scripted.timer.measured(lambda: None)()
    assert scripted.timer() == pytest.approx(0.002) and scripted.timer.stalled_rounds == 0


def test_a_capped_spin_keeps_host_bound_rounds():
    scripted = ScriptedTimer([(0.06, 70.0)], spin_ms=SPIN_CAP_MS)  # Python enqueues for longer than any spin
    scripted.timer.measured(lambda: None)()
    assert scripted.timer() == pytest.approx(0.06) and scripted.timer.stalled_rounds == 0 and scripted.timer.host_bound


# ----------------------------------------------------------------------------------------------
# derive_metrics: stats (seconds) + cost model + ceilings -> the table's numbers
# ----------------------------------------------------------------------------------------------
STATS = {"mean": 2e-3, "stddev": 1e-4, "median": 1.9e-3, "min": 1.8e-3}


def test_derived_rates_and_shares():
    ceilings = Ceilings(copy_GBps=1000.0, matmul_TFLOPs={"torch.float32|highest": 50.0})
    m = derive_metrics(STATS, {"bytes_moved": 10**9, "flops": 2 * 10**10, "matmul_peak_key": "torch.float32|highest"},
                       ceilings)
    assert m["forward_ms_mean"] == pytest.approx(2.0) and m["forward_ms_std"] == pytest.approx(0.1)
    assert m["forward_ms_median"] == pytest.approx(1.9) and m["forward_ms_min"] == pytest.approx(1.8)
    assert m["gbps"] == pytest.approx(500.0) and m["pct_of_copy"] == pytest.approx(50.0)  # 1 GB in 2 ms
    assert m["tflops"] == pytest.approx(10.0) and m["pct_of_matmul_peak"] == pytest.approx(20.0)


def test_no_model_or_no_ceiling_gives_empty_cells_not_zeros():
    m = derive_metrics(STATS, {"bytes_moved": None, "flops": 10**9, "matmul_peak_key": "torch.bfloat16|highest"},
                       Ceilings(copy_GBps=None, matmul_TFLOPs={"torch.float32|highest": 50.0}))
    assert m["gbps"] is None and m["pct_of_copy"] is None
    assert m["tflops"] == pytest.approx(0.5) and m["pct_of_matmul_peak"] is None, "another dtype's peak is no yardstick"


def test_ceilings_round_trip_through_json_data():
    c = Ceilings(copy_GBps=2975.0, matmul_TFLOPs={"a|b": 1.0}, cycles_per_ms=1.9e6, launch_floor_us=20.0)
    assert Ceilings.from_dict(c.as_dict()) == c and Ceilings.from_dict(None) == Ceilings()


def test_replayed_rounds_reach_the_reading_exactly():
    timer = ReplayTimer("events", [0.5, 0.25])
    start = timer()
    timer.next_round()
    assert timer() - start == 0.5 and timer.__name__ == "events"
    timer.next_round()
    assert timer() == 0.75 and timer.seconds == []


def test_each_gpu_kind_keeps_its_own_tables():
    assert committed_dir(REFERENCE_GPU) == ROOT / "outputs", "the committed tables are the H100's"
    assert committed_dir("NVIDIA_A100_SXM4_80GB") == ROOT / "outputs" / "NVIDIA_A100_SXM4_80GB"
    assert committed_dir("interpreter") == ROOT / "outputs" / "cpu"


# ----------------------------------------------------------------------------------------------
# compiled_op: the triton_compiled rows' torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("harness_probe::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_compiled_op_traces_an_op_whole():
    x = torch.arange(4.0, device=DEVICE)
    assert torch.equal(compiled_op(lambda t: twice(t) + 1)(x), x * 2 + 1)


def test_compiled_op_refuses_a_graph_break():
    def breaks(t):
        torch._dynamo.graph_break()
        return t + 1

    with pytest.raises(Exception, match="(?i)graph.?break"):  # never a silent eager fallback
        compiled_op(breaks)(torch.ones(2, device=DEVICE))
