"""Rows past the on-chip size, most of them of odd widths (rows off 16-byte boundaries): the
split kernel as chosen (chunks laid from 16-byte boundaries: VEC > 1; 16-bit rows in as few
programs as cover them: "chosen"), with a power of two of programs a row ("pow2"), without
VEC ("before": 16-bit rows off 16 bytes in online tiles, float32 ones on the split kernel
reading element by element), and 16-bit rows in online tiles of LONG_16BIT_TILE ("online"),
against torch and copy. do_bench means, ms. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/shifted_split_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
split_vec = osm._split_vec
split_shape = osm._split_shape


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def pow2_shape(n_cols, chunk_bytes, dtype):
    """_split_shape as it was: a power of two of programs a row whatever the dtype."""
    split = osm.next_power_of_2(osm.cdiv(n_cols, chunk_bytes // dtype.itemsize))
    return split, osm.next_power_of_2(osm.cdiv(n_cols, split))


def timed(x, vectors: bool, pow2: bool = False):
    """row_softmax(x) with the shifted chunks allowed or not (then 16-bit rows take the online
    tiles and float32 rows the split kernel with VEC 1), and with a power of two of programs a
    row or not; the launch and its time."""
    osm._split_vec = split_vec if vectors else (lambda n, s, d: 1 if split_vec(n, s, d) == 1 else None)
    osm._split_shape = pow2_shape if pow2 else split_shape
    osm._row_launch.cache_clear()
    osm._ROW_REPLAYS.clear()
    rows, n = x.shape
    launch = osm._row_launch(rows, n, x.stride(0), x.dtype, 0, 0)
    return launch, bench(lambda: osm.row_softmax(x))


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, GiB), (50257, torch.float16, GiB // 4),
                          (50257, torch.float32, GiB // 4), (50257, torch.float32, GiB), (100003, torch.bfloat16, GiB // 2),
                          (128257, torch.bfloat16, GiB), (128257, torch.float32, GiB), (65537, torch.bfloat16, GiB // 2),
                          (151936, torch.bfloat16, 2 * GiB), (151936, torch.bfloat16, GiB // 4), (262144, torch.bfloat16, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    want = torch.softmax(x.float(), -1)
    line = f"{rows:6d} x {n:6d} {str(dtype)[6:]:8s} copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:4.0%})"
    for label, vectors, pow2 in (("chosen", True, False), ("pow2", True, True), ("before", False, True)):
        launch, ms = timed(x, vectors, pow2)
        err = (osm.row_softmax(x).float() - want).abs().max().item()
        line += f" | {label} {launch.kernel}/{launch.vec}/{launch.split} {ms:.3f} ({copy_ms / ms:4.0%}, {torch_ms / ms:.2f}x torch, err {err:.1e})"
    if dtype.itemsize < 4:
        ms = bench(lambda: osm.row_softmax(x, osm.LONG_16BIT_TILE))
        line += f" | online {ms:.3f} ({copy_ms / ms:4.0%})"
    print(line, flush=True)
    del x, want
    torch.cuda.empty_cache()
osm._split_vec, osm._split_shape = split_vec, split_shape
