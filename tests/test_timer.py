"""The timer's retry rule with scripted rounds, and the table's derived numbers (no GPU, no interpreter needed)."""

from __future__ import annotations

import pytest

import torch

import triton.testing

from conftest import (
    DISTURBED_SKEW, MAX_REMEASURES, REFERENCE_GPU, ROOT, SPIN_CAP_MS, BenchGroup, Ceilings, EventTimer, ReplayTimer,
    Timing, committed_dir, compiled_op, derive_metrics, group_timer, measure, remeasure_note, steady,
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
# steady: a measurement whose rounds were disturbed is taken again
# ----------------------------------------------------------------------------------------------
QUIET = [1.0, 1.01, 0.99, 1.02, 1.0]
DISTURBED = [1.0, 0.99, 4.0, 1.01, 6.5]  # two rounds at 4-6.5x the median: the machine, not the code


def scripted_measurements(*attempts):
    left = [Timing([ms * 1e-3 for ms in a]) for a in attempts]
    calls = []

    def measure_once():
        calls.append(1)
        return left.pop(0)

    return measure_once, calls


def test_a_quiet_measurement_is_kept_as_it_is():
    once, calls = scripted_measurements(QUIET)
    t = steady(once, on_gpu=True)
    assert len(calls) == 1 and t.remeasured == 0 and t.discarded_ms == []
    assert t.skew() == pytest.approx(1.004) and t.seconds == pytest.approx([ms * 1e-3 for ms in QUIET])


def test_one_slow_round_that_leaves_the_mean_alone_is_no_disturbance():
    many = [1.0] * 999 + [3.0]  # do_bench's thousands of samples: a few at 2-3x are the rule
    once, calls = scripted_measurements(many)
    assert steady(once, on_gpu=True).remeasured == 0 and len(calls) == 1


def test_a_disturbed_measurement_is_taken_again_and_thrown_away():
    once, calls = scripted_measurements(DISTURBED, QUIET)
    t = steady(once, on_gpu=True)
    assert len(calls) == 2 and t.remeasured == 1
    assert t.seconds == pytest.approx([ms * 1e-3 for ms in QUIET]), "the quiet attempt is the one kept"
    assert t.discarded_ms == pytest.approx([sum(DISTURBED) / len(DISTURBED)]), "the thrown-away mean is on record"


def test_a_machine_disturbed_throughout_keeps_its_least_skewed_measurement():
    milder = [1.0, 1.0, 2.0, 1.0, 1.0]  # mean 1.2x the median
    attempts = [DISTURBED] * MAX_REMEASURES + [milder] + [QUIET]  # the quiet one is never reached
    once, calls = scripted_measurements(*attempts)
    t = steady(once, on_gpu=True)
    assert len(calls) == 1 + MAX_REMEASURES and t.remeasured == MAX_REMEASURES
    assert t.skew() == pytest.approx(1.2) and t.skew() > DISTURBED_SKEW, "still disturbed, and said so"


def test_the_stalls_of_every_attempt_are_counted():
    attempts = [Timing([ms * 1e-3 for ms in DISTURBED], stalled_rounds=3),
                Timing([ms * 1e-3 for ms in QUIET], stalled_rounds=1)]
    assert steady(lambda: attempts.pop(0), on_gpu=True).stalled_rounds == 4


def test_wall_clock_rounds_are_never_taken_again():
    once, calls = scripted_measurements(DISTURBED, QUIET)  # the interpreter: noise, not disturbance
    assert steady(once, on_gpu=False).remeasured == 0 and len(calls) == 1


def test_too_few_rounds_to_judge_are_never_taken_again():
    once, calls = scripted_measurements([1.0, 9.0])  # the interpreter's two rounds of wall time
    assert steady(once, on_gpu=True).remeasured == 0 and len(calls) == 1


def test_the_summary_names_measurements_taken_again_or_still_disturbed():
    row = {"mean_over_median": 1.02, "remeasured": 1, "discarded_ms": [2.7], "forward_ms_mean": 1.0}
    assert remeasure_note(row) == "mean 1.02x the median round; measured 2 times, kept mean 1 ms, thrown away 2.7 ms"
    still = {"mean_over_median": 1.3, "remeasured": 2, "discarded_ms": [5.0, 4.0], "forward_ms_mean": 1.5}
    assert remeasure_note(still).startswith("DISTURBED, mean 1.3x the median round; measured 3 times")
    quiet = {"mean_over_median": 1.05, "remeasured": 0, "discarded_ms": None, "forward_ms_mean": 1.0}
    assert remeasure_note(quiet) is None
    assert remeasure_note({"mean_over_median": None, "remeasured": None, "forward_ms_mean": 1.0}) is None, "older runs"


# ----------------------------------------------------------------------------------------------
# A group's own timing protocol (the course leaderboard's do_bench call)
# ----------------------------------------------------------------------------------------------
def _group(**kw):
    return BenchGroup(name="probe", csv="probe.csv", columns=("n", "impl"), case=("n",), impls=("a",), **kw)


def test_a_group_protocol_replaces_the_timer_on_a_gpu_only():
    course = _group(timer=("do_bench", {"warmup": 1000, "rep": 10000}))
    assert group_timer(course, "events", on_gpu=True) == ("do_bench", {"warmup": 1000, "rep": 10000})
    assert group_timer(course, "cudagraph", on_gpu=True) == ("do_bench", {"warmup": 1000, "rep": 10000}), "over --timer"
    assert group_timer(course, "events", on_gpu=False) == ("events", {}), "the interpreter keeps its wall clock"
    assert group_timer(_group(), "do_bench", on_gpu=True) == ("do_bench", {}), "--timer as before elsewhere"
    assert BenchGroup.from_layout(course.layout()).timer == course.timer, "rebuilt from a run's JSON"


def test_the_group_timer_is_called_with_the_groups_arguments(monkeypatch):
    calls = []

    def do_bench(fn, **kw):
        calls.append(kw)
        fn()
        return [1.25, 1.5]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    timer, args = group_timer(_group(timer=("do_bench", {"warmup": 1000, "rep": 10000})), "events", on_gpu=True)
    ran = []
    timing = measure(lambda: ran.append(1), rounds=30, warmup=10, timer=timer, timer_args=args)
    assert calls == [{"return_mode": "all", "warmup": 1000, "rep": 10000}] and ran == [1]
    assert timing.seconds == pytest.approx([1.25e-3, 1.5e-3]), "every sample, in seconds, not the group's rounds"
    measure(lambda: None, rounds=30, warmup=10, timer="do_bench")
    assert calls[-1] == {"return_mode": "all"}, "--timer do_bench keeps triton's defaults"
    with pytest.raises(ValueError, match="rounds and warmup"):
        measure(lambda: None, rounds=1, warmup=0, timer="events", timer_args={"rep": 10})


def test_the_leaderboard_is_timed_by_the_course_protocol():
    from test_bench_flash_attention import LEADERBOARD

    assert LEADERBOARD.timer == ("do_bench", {"warmup": 1000, "rep": 10000})


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
    assert committed_dir(REFERENCE_GPU) == ROOT / "outputs" / REFERENCE_GPU, "each kind's record in outputs/<GPU>/"
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
