"""The harness's timing primitive on a GPU: its three timers agree, host time and graph replay.

GPU only (CUDA events, CUDA graphs and triton.testing's timers do not exist in the interpreter).
"""

from __future__ import annotations

import statistics

import torch

from conftest import graph_replay, host_us, launch_floor_us, measure
from online_softmax import row_softmax
from support import needs_gpu

pytestmark = needs_gpu


def median_ms(fn, timer: str) -> float:
    flush = torch.empty(2**26, dtype=torch.int32, device="cuda")
    timing = measure(fn, rounds=50, warmup=5, timer=timer, flush=flush.zero_ if timer == "events" else None)
    return 1e3 * statistics.median(timing.seconds)


def test_the_three_timers_agree_on_a_long_kernel():
    # ~0.3 ms of memory traffic: long enough that launch gaps and flush strategies are noise.
    x = torch.randn(8192, 8192, device="cuda")
    fn = lambda: row_softmax(x)  # noqa: E731
    fn()
    times = {timer: median_ms(fn, timer) for timer in ("events", "do_bench", "cudagraph")}
    assert max(times.values()) / min(times.values()) < 1.05, times


def test_host_time_of_an_empty_launch_is_the_floor():
    floor = launch_floor_us()
    assert 1.0 < floor < 500.0, floor  # tens of microseconds on the H100 machine
    x = torch.randn(4096, 1024, device="cuda")
    assert host_us(lambda: row_softmax(x)) >= 0.5 * floor, "an op's launch cannot cost less than an empty one's"


def test_graph_replay_equals_eager():
    x = torch.randn(1000, 781, device="cuda")
    replay = graph_replay(lambda: row_softmax(x))
    x.copy_(torch.randn_like(x))  # the replay reads the captured input's current values
    torch.testing.assert_close(replay(), row_softmax(x), rtol=0, atol=0)
