"""The split-row kernel now (each chunk's exponentials kept in registers across the wait, one
ex2.approx.ftz a value, and whatever else the wrapper now chooses: PREFETCH) against the code at
82a51af (the chunk's logits kept and their exp taken twice, with tl.exp: loaded from BEFORE, a
copy of online_softmax.py at 82a51af, through its own wrapper), both at 8, 16 and 32 KiB of a
row a program, against torch and copy. do_bench means, ms; errors relative to float64 (the
norm of the difference over the norm of the reference, first 64 rows). From the repository
root on a GPU:

    git show 82a51af:online_softmax.py > /tmp/before.py
    BEFORE=/tmp/before.py PYTHONPATH=. python3 outputs/profiles/split_exp_probe.py
"""
import importlib.util
import os
import sys

import torch
import triton

import online_softmax as osm

GiB = 2**30
spec = importlib.util.spec_from_file_location("before", os.environ["BEFORE"])
before = sys.modules["before"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(before)
chunk_bytes_rule = osm._split_chunk_bytes


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def timed(x, which: str, chunk_bytes: int):
    module = before if which == "82a51af" else osm
    if which == "82a51af":
        before.SPLIT_CHUNK_BYTES = before.SPLIT_CHUNK_BYTES_16BIT = chunk_bytes
    else:
        osm._split_chunk_bytes = lambda n_cols, dtype: chunk_bytes
    module._row_launch.cache_clear()
    module._ROW_REPLAYS.clear()
    launch = module._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    ms = bench(lambda: module.row_softmax(x))
    return launch, ms, module.row_softmax(x[:64])


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (50256, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, GiB),
                         (50257, torch.float16, GiB // 4), (50257, torch.float32, GiB // 4), (65536, torch.bfloat16, GiB // 2),
                         (100003, torch.bfloat16, GiB // 2), (128256, torch.bfloat16, GiB), (128256, torch.float32, GiB),
                         (131072, torch.float32, 2 * GiB), (151936, torch.bfloat16, GiB // 4), (262144, torch.bfloat16, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    ref = torch.softmax(x[:64].double(), -1)
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {str(dtype)[6:]}: copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:.0%} of copy, "
          f"err {rel_err(torch.softmax(x[:64], -1), ref):.1e})")
    for chunk_bytes in (8 * 1024, 16 * 1024, 32 * 1024):
        for which in ("82a51af", "now"):
            launch, ms, y = timed(x, which, chunk_bytes)
            print(f"  {which:7s} {chunk_bytes // 1024:2d} KiB {launch.kernel}/split {launch.split}/vec {launch.vec}/"
                  f"{launch.programs} programs: {ms:.3f} ms ({copy_ms / ms:.0%} of copy, {torch_ms / ms:.2f}x torch, "
                  f"err {rel_err(y, ref):.1e})")
    osm._split_chunk_bytes = chunk_bytes_rule
