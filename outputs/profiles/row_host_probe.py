"""Host time of a repeated eager row_softmax call per launch kind, against torch.softmax and the
empty-kernel launch floor, and where the split kernel's extra time goes.

Host microseconds to enqueue one call: 100 calls back to back while the GPU sleeps (well under
CUDA's launch queue, so no call waits for the GPU), the least and the median of 30 such runs.
Then a cProfile of 3000 calls (in runs of 100 behind a sleeping GPU) of the split-kernel case:
its functions by own time. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/row_host_probe.py
"""
import cProfile
import pstats
import statistics
import time

import torch
import triton
import triton.language as tl

import online_softmax as osm


@triton.jit
def empty_kernel(x_ptr):
    pass


def host_us(fn, calls=100, runs=30):
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e7))  # ~10 ms of GPU time: no launch below waits
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return min(times), statistics.median(times)


x0 = torch.empty(16, device="cuda")
for _ in range(10):
    empty_kernel[(1,)](x0)
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("empty kernel launch: least %.1f, median %.1f us" % host_us(lambda: empty_kernel[(1,)](x0)))
split_x = None
for rows, n, dtype in ((64, 4096, torch.bfloat16), (64, 32000, torch.bfloat16), (64, 65536, torch.bfloat16),
                       (64, 50257, torch.bfloat16), (64, 65536, torch.float32), (64, 65544, torch.bfloat16)):
    x = torch.randn(rows, n, device="cuda", dtype=dtype)[:, :n - 8] if n == 65544 else torch.randn(rows, n, device="cuda", dtype=dtype)
    launch = osm._row_launch(rows, x.shape[1], x.stride(0), dtype, 0, 0)
    for _ in range(10):
        osm.row_softmax(x)
    ours = host_us(lambda: osm.row_softmax(x))
    theirs = host_us(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {x.shape[1]} {str(dtype)[6:]} (stride {x.stride(0)}; {launch.kernel}): row_softmax least "
          f"{ours[0]:.1f}, median {ours[1]:.1f} us; torch.softmax {theirs[0]:.1f}, {theirs[1]:.1f} us", flush=True)
    if launch.kernel == "split" and split_x is None:
        split_x = x
profile = cProfile.Profile()
for _ in range(30):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e7))
    profile.enable()
    for _ in range(100):
        osm.row_softmax(split_x)
    profile.disable()
torch.cuda.synchronize()
print(f"== cProfile, {tuple(split_x.shape)} {split_x.dtype} (split), 3000 calls")
pstats.Stats(profile).sort_stats("tottime").print_stats(14)
