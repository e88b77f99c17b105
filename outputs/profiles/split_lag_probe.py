"""The split-row kernel waiting on each row (LAG 0) against writing each row after reading the next (LAG 1, 2).

LAG 0: each program of a group reads its chunk of a row, publishes its (max, sum), then waits
for the rest of its group, holding its chunk's exponentials, and writes. LAG 1: it publishes,
goes on to read its chunk of the next row and publish that, and only then takes the first
row's pairs (in by then, or nearly) and reads its chunk again, from L2, to write it. LAG 2:
LAG 1 asking L2 to keep the first read (evict_last) and to drop the second read and the
output (evict_first). Times each at the wrapper's chunk and at chunks of 4096, 8192 and 16384
columns on the row-softmax grid's cases under 92 % of copy, against torch and copy; the error
of the first 64 rows against float64, beside torch's. do_bench means, ms (L2 flushed). From
the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_lag_probe.py   # at f847b24, the tree that has LAG
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
chunk_rule = osm._split_chunk_bytes
fills_poorly = osm._fills_poorly


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def error(y, x):
    ref = torch.softmax(x[:64].double(), -1)
    return (y[:64].double() - ref).abs().max().item()


def timed(x, lag: int, chunk: int | None, force_split: bool):
    osm.split_lag = lambda dtype, props: lag
    osm._split_chunk_bytes = chunk_rule if chunk is None else (lambda n_cols, dtype: chunk * dtype.itemsize)
    osm._fills_poorly = (lambda n_cols, dtype: True) if force_split else fills_poorly
    osm.forget_row_launches()
    launch = osm._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    y = osm.row_softmax(x)
    ms = bench(lambda: osm.row_softmax(x))
    return launch, ms, y


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
CASES = ((50257, "bfloat16", GiB // 4), (50257, "bfloat16", 2 * GiB), (65536, "bfloat16", GiB // 4),
         (65536, "bfloat16", 2 * GiB), (128256, "bfloat16", GiB // 4), (128256, "bfloat16", 2 * GiB),
         (151936, "bfloat16", GiB // 4), (151936, "bfloat16", 2 * GiB), (262144, "bfloat16", GiB // 4),
         (262144, "bfloat16", 2 * GiB), (32000, "bfloat16", GiB // 4), (50257, "float32", GiB // 4),
         (50257, "float32", 2 * GiB), (151936, "float32", GiB // 4), (262144, "float32", GiB // 4),
         (65536, "float32", GiB // 4), (128256, "float32", 2 * GiB))
for n, name, nbytes in CASES:
    dtype = getattr(torch, name)
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    torch_err = error(torch.softmax(x[:64], -1), x)
    print(f"== {rows} x {n} {name}: copy {copy_ms:.4f} torch {torch_ms:.4f} ({copy_ms / torch_ms:.1%} of copy), "
          f"error {torch_err:.2e}", flush=True)
    force = n == 32000
    for lag, chunk in ((0, None), (1, None), (2, None), (2, 4096), (2, 8192), (2, 16384)):
        try:
            launch, ms, y = timed(x, lag, chunk, force)
        except Exception as e:  # noqa: BLE001 - a variant that cannot launch: say so, go on
            print(f"  lag {lag} {chunk or 'rule'}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"  lag {lag} {'rule' if chunk is None else f'{chunk} cols':10s}: {launch.kernel}/{launch.block} cols/"
              f"split {launch.split}/vec {launch.vec}/frame {launch.frame}/{launch.programs} programs/"
              f"maxnreg {launch.maxnreg}: {ms:.4f} ms ({copy_ms / ms:.1%} of copy, {torch_ms / ms:.2f}x torch) "
              f"error {error(y, x):.2e}", flush=True)
        del y
    del x
    torch.cuda.empty_cache()
