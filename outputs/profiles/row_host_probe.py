"""Host time of a repeated eager row_softmax call, and where it goes, per launch kind.

For one shape per path (the one-pass kernel, the split kernel, the online tiles) and torch:
host microseconds to enqueue one call (2000 calls back to back while the GPU sleeps, least of
three runs), the empty-kernel launch floor measured the same way, then a cProfile of 2000 calls
(the functions with the most own time). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/row_host_probe.py
"""
import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl

import online_softmax as osm


@triton.jit
def empty_kernel(x_ptr):
    pass


def host_us(fn, n=2000):
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))  # about a second of GPU time: no launch waits
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


x0 = torch.empty(16, device="cuda")
for _ in range(10):
    empty_kernel[(1,)](x0)
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print(f"empty kernel launch: {host_us(lambda: empty_kernel[(1,)](x0)):.1f} us")
for rows, n, dtype in ((64, 4096, torch.bfloat16), (64, 65536, torch.bfloat16), (64, 50257, torch.bfloat16),
                       (64, 65536, torch.float32), (64, 65537, torch.bfloat16)):
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    launch = osm._row_launch(rows, n, n, dtype, 0, 0)
    for _ in range(10):
        osm.row_softmax(x)
    ours = host_us(lambda: osm.row_softmax(x))
    theirs = host_us(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {str(dtype)[6:]} ({launch.kernel}): row_softmax {ours:.1f} us, torch.softmax {theirs:.1f} us")
    profile = cProfile.Profile()
    torch.cuda._sleep(int(2e9))
    profile.enable()
    for _ in range(2000):
        osm.row_softmax(x)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
