"""Row softmax on widths that fill their power-of-two block poorly, and the row kernel's L2 prefetch.

The one-pass kernel holds a row in a block of the next power of two of columns: 20000 columns
take 32768 (61 % of the lanes), 24576 the same (75 %), 12000 take 16384. A row that fills a SM
on its own (32 warps) then keeps fewer bytes in flight than a full one. For widths from 8192
to 32768, bf16 and float32 (0.25 GiB, and 2 GiB at 9000, 20000 and 32000): the wrapper's launch, the
same one-pass launch with each program asking L2 for the row ``resident`` rows on (the
programs the device holds at once: the one that will take that row's place) before it stores
(``AHEAD``), and the split kernel on the same rows (``ROW_BYTES_ON_CHIP`` lowered so the
wrapper chooses it; its prefetch as ``split_prefetch`` says, and without). Outputs compared
with the wrapper's (max abs difference: the split kernel adds in another order). do_bench
means, ms (L2 flushed). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/row_fill_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
on_chip = osm.ROW_BYTES_ON_CHIP
prefetch_rule = osm.split_prefetch
props = torch.cuda.get_device_properties(0)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def fresh(row_bytes: int, prefetch=None):
    osm.ROW_BYTES_ON_CHIP = row_bytes
    osm.split_prefetch = prefetch_rule if prefetch is None else (lambda dtype, p: prefetch)
    osm.forget_row_launches()


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((20000, torch.bfloat16, GiB // 4), (20000, torch.bfloat16, 2 * GiB), (24576, torch.bfloat16, GiB // 4),
                         (28000, torch.bfloat16, GiB // 4), (32000, torch.bfloat16, GiB // 4), (32000, torch.bfloat16, 2 * GiB),
                         (12000, torch.bfloat16, GiB // 4), (11000, torch.bfloat16, GiB // 4), (10000, torch.bfloat16, GiB // 4),
                         (9000, torch.bfloat16, GiB // 4), (8500, torch.bfloat16, GiB // 4), (9000, torch.float16, GiB // 4),
                         (9000, torch.bfloat16, 2 * GiB),
                         (20000, torch.float32, GiB // 4), (24576, torch.float32, GiB // 4), (12000, torch.float32, GiB // 4),
                         (32000, torch.float32, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {str(dtype)[6:]}: copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:.0%} of copy)", flush=True)

    def show(name, ms, y, launch=""):
        print(f"  {name:24s} {ms:.3f} ms ({copy_ms / ms:.0%} of copy, {torch_ms / ms:.2f}x torch) "
              f"max diff {(y.float() - base.float()).abs().max().item():.1e} {launch}", flush=True)

    fresh(on_chip)
    launch = osm._row_launch(rows, n, n, dtype, 0, 0)
    base = osm.row_softmax(x)
    show("wrapper", bench(lambda: osm.row_softmax(x)), base, launch)
    if launch.kernel == "row":
        vec = osm.vector_align((n, n, n), x.element_size())
        y = torch.empty_like(x)
        args = (x, y, rows, n // vec, n // vec, n // vec)
        options = dict(BLOCK_SIZE=launch.block, VEC=vec, ROWS=launch.rows, num_warps=launch.warps)
        compiled = osm.softmax_row_kernel.warmup(*args, **options, grid=(1,))
        resident = osm.resident_programs(compiled, launch.warps, props) * props.multi_processor_count
        ahead = resident * launch.rows
        run = lambda: osm.softmax_row_kernel[(launch.programs,)](*args, **options, AHEAD=ahead)  # noqa: E731
        run()
        show(f"row, L2 ahead {ahead}", bench(run), y)
    for prefetch in (None, False):
        fresh(1, prefetch)
        launch = osm._row_launch(rows, n, n, dtype, 0, 0)
        y = osm.row_softmax(x)
        show(f"split{'' if prefetch is None else ', no prefetch'}", bench(lambda: osm.row_softmax(x)), y, launch)
    fresh(on_chip)
    del x, y, base
    torch.cuda.empty_cache()
