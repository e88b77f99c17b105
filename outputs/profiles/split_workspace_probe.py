"""The split-row kernel's workspace kept in a cached buffer (two stats slots a program) against a
version that made it per call (one slot a row and program): host time of a repeated eager call,
and GPU time, both versions side by side in one process, runs alternating.

Host microseconds to enqueue one call: 100 calls back to back while the GPU sleeps (well under
CUDA's launch queue), the least and the median of 40 runs a version, the versions' runs
interleaved so that the host's drift reaches both alike; the empty-kernel launch interleaved too.
GPU milliseconds: triton.testing.do_bench (L2 cleared before each run), median of 5 calls of
do_bench a version, interleaved. From the repository root on a GPU, with the version before
written out first:

    git show 2f67de8:online_softmax.py > /tmp/before.py
    PYTHONPATH=. python3 outputs/profiles/split_workspace_probe.py /tmp/before.py
"""
import statistics
import sys
import time
import types

import torch
import triton

import online_softmax as after

# The version before, as a module of another name whose custom ops take another namespace.
before = sys.modules["online_softmax_before"] = types.ModuleType("online_softmax_before")
before.__file__ = sys.argv[1]
source = open(sys.argv[1]).read().replace('OP_NAMESPACE = "softmax_kernels"', 'OP_NAMESPACE = "softmax_kernels_before"')
exec(compile(source, sys.argv[1], "exec"), before.__dict__)


@triton.jit
def empty_kernel(x_ptr):
    pass


def one_run(fn, calls=100):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e7))  # ~10 ms of GPU time: no launch below waits
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def interleaved(fns, runs=40):
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, t in zip(fns, times):
            t.append(one_run(fn))
    torch.cuda.synchronize()
    return [(min(t), statistics.median(t)) for t in times]


x0 = torch.empty(16, device="cuda")
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("== host us a call (least / median of 40 runs of 100 calls): empty launch | before | after | torch.softmax")
for rows, n, stride, dtype in ((64, 65536, 65536, torch.bfloat16), (64, 50257, 50257, torch.bfloat16),
                               (64, 65536, 65536, torch.float32), (64, 65536, 65544, torch.bfloat16),
                               (64, 32000, 32000, torch.bfloat16)):
    x = torch.randn(rows, stride, device="cuda", dtype=dtype)[:, :n]
    kind = after._row_launch(rows, n, stride, dtype, 0, 0).kernel
    for _ in range(10):
        before.row_softmax(x), after.row_softmax(x), empty_kernel[(1,)](x0)
    assert torch.equal(before.row_softmax(x), after.row_softmax(x))
    res = interleaved((lambda: empty_kernel[(1,)](x0), lambda: before.row_softmax(x), lambda: after.row_softmax(x),
                       lambda: torch.softmax(x, -1)))
    print(f"{rows} x {n} {str(dtype)[6:]} stride {stride} ({kind}): " +
          " | ".join(f"{a:.1f} / {b:.1f}" for a, b in res), flush=True)

print("== GPU ms (do_bench, median of 5 a version, interleaved): before | after | % of copy after")
for rows, n, dtype in ((512, 262144, torch.bfloat16), (4096, 262144, torch.bfloat16), (2670, 50257, torch.bfloat16),
                       (16384, 65536, torch.bfloat16), (1024, 65536, torch.float32), (441, 151936, torch.float32),
                       (2048, 262144, torch.float32), (10682, 50257, torch.float32)):
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    assert torch.equal(before.row_softmax(x), after.row_softmax(x))
    times = ([], [])
    for _ in range(5):
        for mod, t in zip((before, after), times):
            t.append(triton.testing.do_bench(lambda: mod.row_softmax(x), warmup=25, rep=100, return_mode="median"))
    b, a = (statistics.median(t) for t in times)
    copy_ms = triton.testing.do_bench(lambda: x.clone(), warmup=25, rep=100, return_mode="median")
    print(f"{rows} x {n} {str(dtype)[6:]}: {b:.4f} | {a:.4f} | {100 * copy_ms / a:.1f}", flush=True)
