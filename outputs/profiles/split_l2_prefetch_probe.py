"""The split-row kernel with and without its L2 prefetch (``split_prefetch``, PREFETCH).

Each program of ``softmax_split_row_kernel`` reads its chunk of a row, then waits for the rest of
its group; while it waits it has no loads in flight. With PREFETCH one thread of each program
asks L2 for its chunk of the next row it takes (``cp.async.bulk.prefetch.L2``, Hopper; no
registers held) just before the wait. Times the kernel with and without it at the wrapper's
chunk and at chunks of 4096 and 8192 columns, against torch and copy; each output is compared
bit for bit with the one without the prefetch at the same chunk (a prefetch changes no value).
do_bench means, ms (L2 flushed). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_l2_prefetch_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
chunk_rule = osm._split_chunk_bytes


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def timed(x, prefetch: bool, chunk_bytes: int | None):
    osm.split_prefetch = lambda dtype, props: prefetch
    osm._split_chunk_bytes = chunk_rule if chunk_bytes is None else (lambda n_cols, dtype: chunk_bytes)
    osm.forget_row_launches()
    launch = osm._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    y = osm.row_softmax(x)
    ms = bench(lambda: osm.row_softmax(x))
    return launch, ms, y


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, 2 * GiB), (65536, torch.bfloat16, GiB // 4),
                         (65536, torch.bfloat16, 2 * GiB), (128256, torch.bfloat16, GiB // 4), (128256, torch.bfloat16, 2 * GiB),
                         (151936, torch.bfloat16, GiB // 4), (151936, torch.bfloat16, 2 * GiB), (262144, torch.bfloat16, GiB // 4),
                         (262144, torch.bfloat16, 2 * GiB), (50257, torch.float16, GiB // 4), (100003, torch.bfloat16, GiB // 2),
                         (50257, torch.float32, GiB // 4), (128256, torch.float32, 2 * GiB), (262144, torch.float32, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {str(dtype)[6:]}: copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:.0%} of copy)", flush=True)
    for chunk_bytes in (None, 4096 * dtype.itemsize, 8192 * dtype.itemsize):
        base = None
        for prefetch in (False, True):
            launch, ms, y = timed(x, prefetch, chunk_bytes)
            if base is None:
                base = y
            same = "same" if torch.equal(y, base) else "DIFFERENT"
            print(f"  {'rule' if chunk_bytes is None else f'{chunk_bytes // dtype.itemsize} cols':10s} prefetch "
                  f"{int(prefetch)}: {launch.kernel}/{launch.block} cols/split {launch.split}/vec {launch.vec}/"
                  f"{launch.programs} programs: {ms:.3f} ms ({copy_ms / ms:.0%} of copy, {torch_ms / ms:.2f}x torch) {same}",
                  flush=True)
    del x, base, y
    torch.cuda.empty_cache()
