"""The split-row kernel waiting on its group's counter by plain reads (POLL) against atomics.

Each program of ``softmax_split_row_kernel`` publishes its chunk's (max, sum), then waits until
its group's counter says every program of the row has. It reads the counter by an acquiring
atomic from one thread, handing the value to the others through shared memory, two barriers a
round; with POLL every thread reads it (volatile loads, no barrier a round) and one fence
acquires once it is reached. Times the rule's launch with and without POLL on the row-softmax
grid's cases under 92 % of copy and a few above, against torch and copy; the error of the
first 64 rows against float64, beside torch's. do_bench means, ms (L2 flushed). From the
repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_poll_probe.py   # at 0ce52ef, the tree that has POLL
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


def timed(x, poll: bool, chunk: int | None, force_split: bool):
    osm.split_polls = lambda dtype, props: poll
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
         (50257, "float32", GiB // 4), (50257, "float32", 2 * GiB), (151936, "float32", GiB // 4),
         (262144, "float32", GiB // 4), (65536, "float32", GiB // 4), (128256, "float32", 2 * GiB))
for n, name, nbytes in CASES:
    dtype = getattr(torch, name)
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    torch_err = error(torch.softmax(x[:64], -1), x)
    print(f"== {rows} x {n} {name}: copy {copy_ms:.4f} torch {torch_ms:.4f} ({copy_ms / torch_ms:.1%} of copy), "
          f"error {torch_err:.2e}", flush=True)
    for poll, chunk, force in ((False, None, False), (True, None, False)) * 2:  # twice each, alternating
        try:
            launch, ms, y, regs = timed(x, poll, chunk, force)
        except Exception as e:  # noqa: BLE001 - a variant that cannot launch: say so, go on
            print(f"  poll {int(poll)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"  poll {int(poll)}: "
              f"{launch.kernel}/{launch.block} cols/split {launch.split}/warps {launch.warps}/vec {launch.vec}/"
              f"{launch.programs} programs/{regs} registers/maxnreg {launch.maxnreg}: {ms:.4f} ms "
              f"({copy_ms / ms:.1%} of copy, {torch_ms / ms:.2f}x torch) error {error(y, x):.2e}", flush=True)
        del y
    del x
    torch.cuda.empty_cache()
