"""row_softmax on widths off the grid: the wrapper's launch at each, against torch and copy.

Widths 1500 to 45000, bf16 and float32, tensors of 0.25 GiB. Each line: the launch
(kernel/block/warps/rows a program/programs a row/prefetch distance) and the share of copy of
ours and torch's. do_bench means (L2 flushed). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/width_scan_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100)


print("# width scan: the wrapper's launch, 0.25 GiB tensors")
for dtype in (torch.bfloat16, torch.float32):
    for n in (1500, 2500, 3000, 5000, 6000, 8500, 9000, 10000, 11000, 14000, 17000, 20000, 40000, 45000):
        rows = (GiB // 4) // (n * dtype.itemsize)
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        copy_ms = bench(lambda: x.clone())
        torch_ms = bench(lambda: torch.softmax(x, -1))
        ours_ms = bench(lambda: osm.row_softmax(x))
        launch = osm._row_launch(rows, n, n, dtype, 0, 0)
        print(f"{str(dtype)[6:]:9s} {n:6d} {launch.kernel}/{launch.block}/w{launch.warps}/r{launch.rows}/s{launch.split}/"
              f"a{launch.ahead}: ours {copy_ms / ours_ms:.0%} torch {copy_ms / torch_ms:.0%} of copy")
        del x
