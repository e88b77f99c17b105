"""The split-row kernel holding its chunk's 16-bit inputs across the wait (KEEP_INPUT) against
holding their exponentials (float32, twice the registers).

Each program of ``softmax_split_row_kernel`` reads its chunk of a row, publishes the chunk's
(max, sum) and waits for the rest of its group. It holds the chunk's exponentials through the
wait (one multiply a value after it); with KEEP_INPUT it holds the 16-bit inputs instead and
works the exponentials out again after the wait: half the registers a value, so more programs
a SM, or wider chunks (fewer programs a row to wait for) at as many. Times the rule's launch,
then KEEP_INPUT at the rule's chunk and at 4096, 8192 and 16384 columns a program, on the 16-bit
cases of the row-softmax grid under 92 % of copy; at 32000 columns (the one-pass kernel by the
rule) the split kernel too. The register count ptxas gave each variant and the programs
resident; the error of the first 64 rows against float64, beside torch's. do_bench means, ms
(L2 flushed). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_keep_probe.py   # at 95bf35f, the tree that has KEEP_INPUT
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
chunk_rule = osm._split_chunk_bytes
fills_poorly = osm._fills_poorly
registers = osm.kernel_registers
seen = []


def counted(compiled):
    n = registers(compiled)
    seen.append(n)
    return n


osm.kernel_registers = counted


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def error(y, x):
    ref = torch.softmax(x[:64].double(), -1)
    return (y[:64].double() - ref).abs().max().item()


def timed(x, keep: bool, chunk: int | None, force_split: bool):
    osm.split_keeps_input = lambda dtype, props: keep
    osm._split_chunk_bytes = chunk_rule if chunk is None else (lambda n_cols, dtype: chunk * dtype.itemsize)
    osm._fills_poorly = (lambda n_cols, dtype: True) if force_split else fills_poorly
    osm.forget_row_launches()
    seen.clear()
    launch = osm._row_launch(x.shape[0], x.shape[1], x.stride(0), x.dtype, 0, 0)
    y = osm.row_softmax(x)
    ms = bench(lambda: osm.row_softmax(x))
    return launch, ms, y, seen[0] if seen else None


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
CASES = ((50257, "bfloat16", GiB // 4), (50257, "bfloat16", 2 * GiB), (65536, "bfloat16", GiB // 4),
         (65536, "bfloat16", 2 * GiB), (128256, "bfloat16", GiB // 4), (128256, "bfloat16", 2 * GiB),
         (151936, "bfloat16", GiB // 4), (151936, "bfloat16", 2 * GiB), (262144, "bfloat16", GiB // 4),
         (262144, "bfloat16", 2 * GiB), (50257, "float16", GiB // 4), (100003, "bfloat16", GiB // 2),
         (32000, "bfloat16", GiB // 4), (32000, "bfloat16", 2 * GiB))
for n, name, nbytes in CASES:
    dtype = getattr(torch, name)
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    torch_err = error(torch.softmax(x[:64], -1), x)
    print(f"== {rows} x {n} {name}: copy {copy_ms:.4f} torch {torch_ms:.4f} ({copy_ms / torch_ms:.1%} of copy), "
          f"error {torch_err:.2e}", flush=True)
    variants = [(False, None, False), (True, None, False), (True, 4096, False), (True, 8192, False), (True, 16384, False)]
    if n == 32000:
        variants = [(False, None, False), (False, 4096, True), (True, 4096, True), (True, 8192, True)]
    for keep, chunk, force in variants:
        try:
            launch, ms, y, regs = timed(x, keep, chunk, force)
        except Exception as e:  # noqa: BLE001 - a variant that cannot launch: say so, go on
            print(f"  keep {int(keep)} {chunk or 'rule'}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"  keep {int(keep)} {'rule' if chunk is None else f'{chunk} cols':10s}{' split' if force else ''}: "
              f"{launch.kernel}/{launch.block} cols/split {launch.split}/warps {launch.warps}/vec {launch.vec}/"
              f"{launch.programs} programs/{regs} registers/maxnreg {launch.maxnreg}: {ms:.4f} ms "
              f"({copy_ms / ms:.1%} of copy, {torch_ms / ms:.2f}x torch) error {error(y, x):.2e}", flush=True)
        del y
    del x
    torch.cuda.empty_cache()
