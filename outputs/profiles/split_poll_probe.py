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

from probe_timing import GiB, long_row_cases, softmax_error, split_timed


def timed(x, poll: bool, chunk: int | None, force_split: bool):
    return split_timed(x, chunk, force_split, split_polls=lambda dtype, props: poll)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
CASES = ((50257, "bfloat16", GiB // 4), (50257, "bfloat16", 2 * GiB), (65536, "bfloat16", GiB // 4),
         (65536, "bfloat16", 2 * GiB), (128256, "bfloat16", GiB // 4), (128256, "bfloat16", 2 * GiB),
         (151936, "bfloat16", GiB // 4), (151936, "bfloat16", 2 * GiB), (262144, "bfloat16", GiB // 4),
         (262144, "bfloat16", 2 * GiB), (50257, "float16", GiB // 4), (100003, "bfloat16", GiB // 2),
         (50257, "float32", GiB // 4), (50257, "float32", 2 * GiB), (151936, "float32", GiB // 4),
         (262144, "float32", GiB // 4), (65536, "float32", GiB // 4), (128256, "float32", 2 * GiB))
for x, copy_ms, torch_ms in long_row_cases(CASES):
    for poll, chunk, force in ((False, None, False), (True, None, False)) * 2:  # twice each, alternating
        try:
            launch, ms, y, regs = timed(x, poll, chunk, force)
        except Exception as e:  # noqa: BLE001 - a variant that cannot launch: say so, go on
            print(f"  poll {int(poll)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"  poll {int(poll)}: "
              f"{launch.kernel}/{launch.block} cols/split {launch.split}/warps {launch.warps}/vec {launch.vec}/"
              f"{launch.programs} programs/{regs} registers/maxnreg {launch.maxnreg}: {ms:.4f} ms "
              f"({copy_ms / ms:.1%} of copy, {torch_ms / ms:.2f}x torch) error {softmax_error(y, x):.2e}", flush=True)
        del y
