"""The split kernel with rows laid from 128-byte boundaries (FRAME, ``_split_frame``) and from
16-byte ones (frames of a vector), on widths whose rows do not all start on 128 bytes.

bf16 and float32, 0.25 GiB (2 GiB at 50257 bf16): the wrapper's launch, then the same with
``_split_frame`` giving 1, against torch and copy; outputs compared with the first's (max abs
difference: the chunks differ, so does the order of adding). do_bench means, ms (L2 flushed).
From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/row_frame_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
frame_rule = osm._split_frame


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, dtype, nbytes in ((17000, torch.bfloat16, GiB // 4), (20000, torch.bfloat16, GiB // 4), (45000, torch.bfloat16, GiB // 4),
                         (50257, torch.bfloat16, GiB // 4), (50257, torch.bfloat16, 2 * GiB), (50256, torch.bfloat16, GiB // 4),
                         (100003, torch.bfloat16, GiB // 4), (151937, torch.bfloat16, GiB // 4), (50257, torch.float16, GiB // 4),
                         (50257, torch.float32, GiB // 4), (50257, torch.float32, 2 * GiB), (45000, torch.float32, GiB // 4),
                         (100003, torch.float32, GiB // 4)):
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    torch_ms = bench(lambda: torch.softmax(x, -1))
    print(f"== {rows} x {n} {str(dtype)[6:]} (rows {n * dtype.itemsize % 128} bytes past 128 apart): copy {copy_ms:.3f} "
          f"torch {torch_ms:.3f} ({copy_ms / torch_ms:.0%} of copy)", flush=True)
    base = None
    for framed in (True, False):
        osm._split_frame = frame_rule if framed else (lambda n_cols, stride_x, dtype: 1)
        osm.forget_row_launches()
        launch = osm._row_launch(rows, n, n, dtype, 0, 0)
        y = osm.row_softmax(x)
        base = y if base is None else base
        ms = bench(lambda: osm.row_softmax(x))
        print(f"  {'frames of 128 bytes' if framed else 'frames of 16 bytes':20s} {launch.kernel}/{launch.block} cols/"
              f"split {launch.split}/vec {launch.vec}/frame {launch.frame}/{launch.programs} programs: {ms:.3f} ms "
              f"({copy_ms / ms:.0%} of copy, {torch_ms / ms:.2f}x torch) max diff {(y.float() - base.float()).abs().max().item():.1e}",
              flush=True)
    osm._split_frame = frame_rule
    del x, y, base
    torch.cuda.empty_cache()
