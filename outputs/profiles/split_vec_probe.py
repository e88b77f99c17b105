"""The split kernel on rows that start on 16 bytes but whose width is no multiple of 16 values:
VEC as ``_split_vec`` gives it now (the vector) against VEC 1 (as before), with frames off in
both (``_split_frame`` giving 1) so that VEC alone differs. 0.25 GiB, do_bench means (L2
flushed); outputs compared with the first's. "% of copy" is against cloning x, a strided view
for the bf16 rows (a strided copy, slower than a contiguous one): compare the ms. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/split_vec_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30
vec_rule = osm._split_vec


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
osm._split_frame = lambda n_cols, stride_x, dtype: 1
for n, stride, dtype in ((20008, 20480, torch.bfloat16), (40008, 40960, torch.bfloat16), (65540, 65540, torch.float32),
                         (100004, 100004, torch.float32)):
    rows = (GiB // 4) // (stride * dtype.itemsize)
    x = torch.randn(rows, stride, device="cuda", dtype=dtype)[:, :n]
    copy_ms = bench(lambda: x.clone())
    base = None
    for rule in ("now", "VEC 1"):
        osm._split_vec = vec_rule if rule == "now" else (lambda n_cols, stride_x, dtype: 1)
        osm.forget_row_launches()
        launch = osm._row_launch(rows, n, stride, dtype, 0, 0)
        y = osm.row_softmax(x)
        base = y if base is None else base
        ms = bench(lambda: osm.row_softmax(x))
        print(f"{rows} x {n} (stride {stride}) {str(dtype)[6:]} {rule:6s}: {launch.kernel}/{launch.block} cols/split "
              f"{launch.split}/vec {launch.vec}/{launch.programs} programs: {ms:.3f} ms ({copy_ms / ms:.0%} of copy) "
              f"max diff {(y.float() - base.float()).abs().max().item():.1e}", flush=True)
    del x, y, base
