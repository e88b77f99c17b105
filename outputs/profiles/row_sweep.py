"""Long rows on the split path: bytes per program, online tiles, and aligned against unaligned
widths, against torch and copy (do_bench means)."""
import sys

import torch, triton
import online_softmax as osm

if not hasattr(osm, "SPLIT_CHUNK_BYTES"):
    sys.exit("row_sweep.py sets SPLIT_CHUNK_BYTES, which 71cac17 replaced by _split_chunk_bytes: run it on the "
             "code of b176104 (its output), or see row_launch_probe.py")

GiB = 2**30
def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)

checked_launch = osm._row_launch
force_split = False


def row_launch(n_rows, n_cols, stride_x, dtype, device_index, BLOCK_SIZE):
    # With force_split, rows past the on-chip size take the split kernel whatever their dtype.
    if force_split and not BLOCK_SIZE and triton.next_power_of_2(n_cols) * 4 > osm.ROW_BYTES_ON_CHIP:
        return osm._split_launch(n_rows, n_cols, stride_x, dtype, device_index)
    return checked_launch(n_rows, n_cols, stride_x, dtype, device_index, BLOCK_SIZE)


def fresh():
    # A new launch rule must not meet a launch kept from an earlier setting.
    checked_launch.cache_clear()
    osm._ROW_REPLAYS.clear()


osm._row_launch = row_launch

for n, dtype, nbytes in ((50257, torch.bfloat16, GiB // 4), (50256, torch.bfloat16, GiB // 4), (50257, torch.float32, GiB // 4),
                          (128256, torch.bfloat16, 2 * GiB), (128256, torch.float32, GiB), (151936, torch.bfloat16, GiB // 4),
                          (262144, torch.bfloat16, GiB // 4), (65536, torch.bfloat16, GiB // 2)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    copy_ms = bench(lambda: x.clone())
    t_torch = bench(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {dtype}: copy {copy_ms:.3f} torch {t_torch:.3f} ({copy_ms / t_torch:.0%} of copy)", flush=True)
    t = bench(lambda: osm.row_softmax(x))
    print(f"  default ({osm._row_launch(rows, n, n, dtype, 0, 0).kernel}): {t:.3f} ms ({copy_ms / t:.0%} of copy)", flush=True)
    force_split = True
    for kib in (8, 16, 32, 64):
        osm.SPLIT_CHUNK_BYTES = kib * 1024
        fresh()
        try:
            launch = osm._row_launch(rows, n, n, dtype, 0, 0)
            t = bench(lambda: osm.row_softmax(x))
            print(f"  split {kib} KiB: {launch} {t:.3f} ms ({copy_ms / t:.0%} of copy)", flush=True)
        except Exception as exc:
            print(f"  split {kib} KiB: failed {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    force_split = False
    osm.SPLIT_CHUNK_BYTES = 32 * 1024
    fresh()
    for block in (4096, 8192):
        t = bench(lambda: osm.row_softmax(x, block))
        print(f"  online block {block}: {t:.3f} ms ({copy_ms / t:.0%} of copy)", flush=True)
    del x
    torch.cuda.empty_cache()
