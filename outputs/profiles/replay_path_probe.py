"""Host time of each step of a kept launch's call (row_softmax 64 x 1000 float32, a repeated
eager call), and of other ways to allocate its output, beside the launch alone: Triton's launch of an empty kernel, the same kernel's
kept launch (``Replay``), and torch.softmax. us a step, least of 5 runs of 400 calls, each run
enqueued behind a sleeping GPU (nothing waits for it). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/replay_path_probe.py
"""
import time

import torch
import triton

import online_softmax as osm


@triton.jit
def empty(x_ptr):
    pass


def us(fn, n=400, runs=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        torch.cuda._sleep(int(2e9 * 0.04))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
x = torch.randn(64, 1000, device="cuda")
y = torch.empty_like(x)
osm.row_softmax(x)
key = osm.replay_key((x,), (None,))
replay = osm._ROW_REPLAYS[key]
launcher = osm.DirectLauncher(empty)
launcher[(1,)](x)
launcher[(1,)](x)
kept = launcher.replay((1,), (x,), {}, 1)
steps = (
    ("Triton's launch of an empty kernel", lambda: empty[(1,)](x)),
    ("the empty kernel's kept launch (Replay.launch)", lambda: kept.launch(x)),
    ("torch.softmax", lambda: torch.softmax(x, -1)),
    ("row_softmax, whole call", lambda: osm.row_softmax(x)),
    ("row_softmax without its device guard (__wrapped__)", lambda: osm.row_softmax.__wrapped__(x)),
    ("  other_device", lambda: osm.other_device(x)),
    ("  replay_key", lambda: osm.replay_key((x,), (None,))),
    ("  _ROW_REPLAYS.get", lambda: osm._ROW_REPLAYS.get(key)),
    ("  torch.empty(shape, dtype, device)", lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device)),
    ("  torch.empty_like", lambda: torch.empty_like(x)),
    ("  torch.empty_like(memory_format=contiguous)", lambda: torch.empty_like(x, memory_format=torch.contiguous_format)),
    ("  x.new_empty(shape)", lambda: x.new_empty((64, 10))),
    ("  x.new_empty(shape, dtype=float32)", lambda: x.new_empty((64, 10), dtype=torch.float32)),
    ("  torch.empty(shape, dtype, device) of (64, 10)", lambda: torch.empty((64, 10), dtype=x.dtype, device=x.device)),
    ("  Replay.ready", lambda: replay.ready()),
    ("  Replay.launch", lambda: replay.launch(x, y)),
    ("  _cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0)),
    ("  is_compiling", lambda: torch.compiler.is_compiling()),
    ("  transformed", lambda: osm.transformed(x)),
)
for name, fn in steps:
    print(f"{us(fn):7.2f} us  {name}", flush=True)
