"""The one-pass row kernel with and without its L2 prefetch (AHEAD, ``row_prefetch``).

One program a row (a row of 4096 columns or more), launched directly on aligned rows: AHEAD 0
(none), and each program asking L2 for the row half, one and two times ``resident`` rows on
before it stores (``resident``: the programs the device holds at once, from the compiled
kernel's registers; the program that takes this one's place reads the row ``resident`` on),
against copy; the wrapper's launch as it stands. Outputs compared bit for bit with AHEAD 0's.
Widths 4096 to 32768, bf16 and float32 (0.25 GiB; 2 GiB at 32000 bf16), and 20000 and 24576
bf16, which fill their block of 32768 poorly. do_bench means, ms (L2 flushed). From the
repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/row_ahead_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
props = torch.cuda.get_device_properties(0)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((32000, torch.bfloat16, GiB // 4), (32000, torch.bfloat16, 2 * GiB), (32768, torch.bfloat16, GiB // 4),
                         (16384, torch.bfloat16, GiB // 4), (8192, torch.bfloat16, GiB // 4), (4096, torch.bfloat16, GiB // 4),
                         (32000, torch.float32, GiB // 4), (16384, torch.float32, GiB // 4), (8192, torch.float32, GiB // 4),
                         (20000, torch.bfloat16, GiB // 4), (24576, torch.bfloat16, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    osm.forget_row_launches()
    launch = osm._row_launch(rows, n, n, dtype, 0, 0)
    wrapper_ms = bench(lambda: osm.row_softmax(x))
    print(f"== {rows} x {n} {str(dtype)[6:]}: copy {copy_ms:.3f}; the wrapper's launch {launch.kernel}/{launch.block} cols/"
          f"split {launch.split}/ahead {launch.ahead}: {wrapper_ms:.3f} ms ({copy_ms / wrapper_ms:.0%} of copy)", flush=True)
    if launch.kernel != "row":  # the split kernel: time the one-pass kernel all the same
        launch = osm._one_pass_launch(rows, n, n, dtype, 0, osm.next_power_of_2(n))
    vec = osm.vector_align((n, n, n), x.element_size())
    y = torch.empty_like(x)
    compiled = osm.softmax_row_kernel.warmup(x, y, rows, n // vec, n // vec, n // vec, BLOCK_SIZE=launch.block, VEC=vec,
                                             ROWS=launch.rows, num_warps=launch.warps, grid=(1,))
    resident = osm.resident_programs(compiled, launch.warps, props) * props.multi_processor_count
    base = None
    for ahead in (0, resident // 2 * launch.rows, resident * launch.rows, 2 * resident * launch.rows):
        def run():
            osm.softmax_row_kernel[(launch.programs,)](x, y, rows, n // vec, n // vec, n // vec, BLOCK_SIZE=launch.block,
                                                       VEC=vec, ROWS=launch.rows, AHEAD=ahead, num_warps=launch.warps)
        run()
        if base is None:
            base = y.clone()
        same = "same" if torch.equal(y, base) else "DIFFERENT"
        ms = bench(run)
        print(f"  ahead {ahead:5d} (resident {resident}, regs {osm.kernel_registers(compiled)}): {ms:.3f} ms "
              f"({copy_ms / ms:.0%} of copy) {same}", flush=True)
    del x, y, base
    torch.cuda.empty_cache()
