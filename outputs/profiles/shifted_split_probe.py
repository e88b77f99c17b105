"""Rows that do not start on 16-byte boundaries (odd widths) past the on-chip size: the split
kernel with chunks laid from 16-byte boundaries (VEC > 1, the default), against the earlier
choices (16-bit: online tiles of LONG_16BIT_TILE; float32: the split kernel reading element by
element), torch and copy. do_bench means, ms. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/shifted_split_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
split_vec = osm._split_vec


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def timed(x, vectors: bool):
    """row_softmax(x) with the shifted chunks allowed or not (then 16-bit rows take the online
    tiles and float32 rows the split kernel with VEC 1); the launch and its time."""
    osm._split_vec = split_vec if vectors else (lambda n, s, d: 1 if split_vec(n, s, d) == 1 else None)
    osm._row_launch.cache_clear()
    osm._ROW_REPLAYS.clear()
    rows, n = x.shape
    launch = osm._row_launch(rows, n, x.stride(0), x.dtype, 0, 0)
    return launch, bench(lambda: osm.row_softmax(x))


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, GiB), (50257, torch.float16, GiB // 4),
                          (50257, torch.float32, GiB // 4), (50257, torch.float32, GiB), (100003, torch.bfloat16, GiB // 2),
                          (128257, torch.bfloat16, GiB), (128257, torch.float32, GiB), (65537, torch.bfloat16, GiB // 2)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    want = torch.softmax(x.float(), -1)
    line = f"{rows:6d} x {n:6d} {str(dtype)[6:]:8s} copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:4.0%})"
    for label, vectors in (("vectors", True), ("before", False)):
        launch, ms = timed(x, vectors)
        err = (osm.row_softmax(x).float() - want).abs().max().item()
        line += f" | {label} {launch.kernel}/{launch.vec} {ms:.3f} ({copy_ms / ms:4.0%}, {torch_ms / ms:.2f}x torch, err {err:.1e})"
    print(line, flush=True)
    del x, want
    torch.cuda.empty_cache()
osm._split_vec = split_vec
