"""The split-row kernel under a register cap (``maxnreg``), with and without its L2 prefetch.

The programs of ``softmax_split_row_kernel`` a SM holds at once are set by its registers a
thread (64 for 8192 float32 columns over 8 warps, 67 with the prefetch, 70 for 4096 float32
columns of rows off 16 bytes over 4 warps: ptxas for sm_90, triton 3.6). Capping them lets more
programs in, at the price of spills where the kernel needs more. Times the wrapper's chunk with
PREFETCH off and on under no cap and caps of 64, 56 and 48 registers, against torch and copy; the
launch's programs (as many as the device holds at once, up to the rows) show the residency each
cap bought. Outputs compared bit for bit with the first variant's. do_bench means, ms (L2
flushed). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_registers_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def timed(x, prefetch: bool, cap: int | None):
    osm.split_prefetch = lambda dtype, props: prefetch
    osm.split_registers = lambda dtype, chunk, warps, prefetch: cap
    osm.forget_row_launches()
    launch = osm._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    y = osm.row_softmax(x)
    ms = bench(lambda: osm.row_softmax(x))
    return launch, ms, y


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (65536, torch.bfloat16, GiB // 4), (128256, torch.bfloat16, GiB // 4),
                         (151936, torch.bfloat16, 2 * GiB), (262144, torch.bfloat16, GiB // 4), (50257, torch.float32, GiB // 4),
                         (50257, torch.float32, 2 * GiB), (65536, torch.float32, GiB // 4), (128256, torch.float32, 2 * GiB),
                         (151936, torch.float32, GiB // 4), (262144, torch.float32, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {str(dtype)[6:]}: copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:.0%} of copy)", flush=True)
    base = None
    for prefetch in (False, True):
        for cap in (None, 64, 56, 48):
            launch, ms, y = timed(x, prefetch, cap)
            if base is None:
                base = y
            same = "same" if torch.equal(y, base) else "DIFFERENT"
            print(f"  prefetch {int(prefetch)} maxnreg {str(cap):4s}: {launch.kernel}/{launch.block} cols/split {launch.split}/"
                  f"vec {launch.vec}/{launch.programs} programs: {ms:.3f} ms ({copy_ms / ms:.0%} of copy, "
                  f"{torch_ms / ms:.2f}x torch) {same}", flush=True)
    del x, base, y
    torch.cuda.empty_cache()
