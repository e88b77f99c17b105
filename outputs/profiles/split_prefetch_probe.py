"""The split-row kernel loading each program's next chunk while its group waits (PREFETCH)
or after (the loads in the row's own step), at 4096 and 8192 columns a program, against the
wrapper's choice, torch and copy. do_bench means, ms; the error relative to float64 is the
norm of the difference over the norm of the reference, first 64 rows. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_prefetch_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
chunk_rule, prefetch_rule = osm._split_chunk_bytes, osm._split_prefetch


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def fresh():
    osm._row_launch.cache_clear()
    osm._ROW_REPLAYS.clear()


def timed(x, cols, prefetch):
    osm._split_chunk_bytes = chunk_rule if cols is None else (lambda n_cols, dtype: cols * dtype.itemsize)
    osm._split_prefetch = prefetch_rule if prefetch is None else (lambda dtype: prefetch)
    fresh()
    launch = osm._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    return launch, bench(lambda: osm.row_softmax(x)), osm.row_softmax(x[:64])


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, 2 * GiB), (50256, torch.bfloat16, GiB // 4),
                         (65536, torch.bfloat16, GiB // 4), (100003, torch.bfloat16, GiB // 2), (128256, torch.bfloat16, GiB // 4),
                         (128256, torch.bfloat16, 2 * GiB), (151936, torch.bfloat16, GiB // 4), (262144, torch.bfloat16, GiB // 4),
                         (50257, torch.float16, GiB // 4), (50257, torch.float32, GiB // 4), (128256, torch.float32, GiB // 4),
                         (151936, torch.float32, GiB // 4), (262144, torch.float32, GiB // 4)):
    rows = max(1, nbytes // (n * dtype.itemsize))
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    ref = torch.softmax(x[:64].double(), -1)
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    line = f"{rows:6d} x {n:6d} {str(dtype)[6:]:8s} copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:3.0%})"
    for cols, prefetch in ((None, None), (4096, False), (4096, True), (8192, False), (8192, True)):
        launch, ms, y = timed(x, cols, prefetch)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        label = "chosen" if cols is None else f"{cols}{'+p' if prefetch else ''}"
        line += f" | {label} {launch.split}/{launch.prefetch} {ms:.3f} ({copy_ms / ms:3.0%}, {torch_ms / ms:.2f}x, {err:.0e})"
    print(line, flush=True)
osm._split_chunk_bytes, osm._split_prefetch = chunk_rule, prefetch_rule
