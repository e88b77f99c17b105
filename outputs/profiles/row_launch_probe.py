"""Launch choices of row_softmax as functions of the shape, measured.

Part 1, rows past the on-chip size (the split kernel): columns a program (4096, 8192, 16384)
by the count of programs a row, a power of two ("pow2") or as few as cover the row ("exact"),
against the wrapper's own choice, torch and copy. Part 2, narrow rows (the one-pass kernel,
persistent programs looping over blocks, "loop", or one program a block, "all"): ROWS rows a
block (2-D blocks of ROWS x the row) and warps a program.
do_bench means, ms. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/row_launch_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
split_shape = osm._split_shape


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def shape_rule(cols: int, pow2: bool):
    def rule(n_cols, chunk_bytes, dtype):
        split = osm.cdiv(n_cols, cols)
        if pow2:
            split = osm.next_power_of_2(split)
        return split, osm.next_power_of_2(osm.cdiv(n_cols, split))
    return rule


def fresh():
    osm._row_launch.cache_clear()
    osm._ROW_REPLAYS.clear()


def rows_of(n, dtype, nbytes):
    return max(1, nbytes // (n * dtype.itemsize))


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("## part 1: the split kernel")
for n, dtype, nbytes in ((128256, torch.float32, GiB // 4), (128256, torch.float32, 2 * GiB), (151936, torch.float32, GiB // 4),
                         (151936, torch.float32, 2 * GiB), (50257, torch.float32, GiB // 4), (50257, torch.float32, 2 * GiB),
                         (262144, torch.float32, GiB // 4), (65536, torch.float32, GiB // 4),
                         (50257, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, 2 * GiB), (65536, torch.bfloat16, GiB // 4),
                         (128256, torch.bfloat16, GiB // 4), (151936, torch.bfloat16, GiB // 4), (262144, torch.bfloat16, GiB // 4),
                         (100003, torch.bfloat16, GiB // 2)):
    rows = rows_of(n, dtype, nbytes)
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    osm._split_shape = split_shape
    fresh()
    launch = osm._row_launch(rows, n, n, dtype, 0, 0)
    ms = bench(lambda: osm.row_softmax(x))
    line = (f"{rows:6d} x {n:6d} {str(dtype)[6:]:8s} copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:3.0%}) | "
            f"chosen {launch.block}/{launch.split} {ms:.3f} ({copy_ms / ms:3.0%})")
    for cols in (4096, 8192, 16384):
        for pow2 in (False, True):
            osm._split_shape = shape_rule(cols, pow2)
            fresh()
            try:
                launch = osm._row_launch(rows, n, n, dtype, 0, 0)
                ms = bench(lambda: osm.row_softmax(x))
                line += f" | {cols}{'p' if pow2 else 'e'} {launch.split} {ms:.3f} ({copy_ms / ms:3.0%})"
            except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is a line, not a stop
                line += f" | {cols}{'p' if pow2 else 'e'} {type(exc).__name__}"
    print(line, flush=True)
osm._split_shape = split_shape
fresh()

print("## part 2: narrow rows, the one-pass kernel: ROWS x warps x grid (loop: programs per SM as 2048 threads allow)")
sms = torch.cuda.get_device_properties(0).multi_processor_count
for n, dtype, nbytes in ((1000, torch.float32, GiB // 4), (1000, torch.float32, 2 * GiB), (1000, torch.bfloat16, GiB // 4),
                         (1000, torch.bfloat16, 2 * GiB), (4096, torch.float32, GiB // 4), (4096, torch.bfloat16, GiB // 4),
                         (2048, torch.bfloat16, GiB // 4), (512, torch.float32, GiB // 4), (32000, torch.bfloat16, GiB // 4)):
    rows = rows_of(n, dtype, nbytes)
    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    compiled = torch.compile(lambda t: torch.softmax(t, -1))
    compile_ms = bench(lambda: compiled(x))
    fresh()
    launch = osm._row_launch(rows, n, n, dtype, 0, 0)
    ms = bench(lambda: osm.row_softmax(x))
    line = (f"{rows:8d} x {n:5d} {str(dtype)[6:]:8s} copy {copy_ms:.3f} torch {torch_ms:.3f} ({copy_ms / torch_ms:3.0%}) "
            f"compile {compile_ms:.3f} ({copy_ms / compile_ms:3.0%}) | chosen {launch.warps}w {ms:.3f} ({copy_ms / ms:3.0%})")
    block = osm.next_power_of_2(n)
    vec = osm.vector_align((n, n, n), x.element_size())
    for r in (1, 2, 4):
        for warps in (4, 8):
            if block * r // (warps * 32) > 64 or block * r < warps * 32 * 2:
                continue  # more than 64 values a thread would spill; fewer than 2 leaves lanes idle
            for persistent in (True, False):
                blocks = osm.cdiv(rows, r)
                grid = (min(blocks, sms * max(1, 2048 // (warps * 32))) if persistent else blocks,)
                run = lambda: osm.softmax_row_kernel[grid](x, y, rows, n // vec, n // vec, n // vec,  # noqa: E731
                                                           BLOCK_SIZE=block, VEC=vec, ROWS=r, num_warps=warps)
                run()
                ref = torch.softmax(x[:256].double(), -1)
                err = ((y[:256].double() - ref).norm() / ref.norm()).item()
                ms = bench(run)
                line += f" | r{r} {warps}w {'loop' if persistent else 'all'} {ms:.3f} ({copy_ms / ms:3.0%}{'' if err < 1e-2 else ' WRONG'})"
    print(line, flush=True)
