import torch, triton
import online_softmax as osm
GiB = 2**30
def bench(fn): return triton.testing.do_bench(fn, warmup=25, rep=100)
print(f"# width scan: the wrapper's launch, 0.25 GiB tensors")
for dtype in (torch.bfloat16, torch.float32):
    for n in (1500, 2500, 3000, 5000, 6000, 8500, 9000, 10000, 11000, 14000, 17000, 20000, 40000, 45000):
        rows = (GiB // 4) // (n * dtype.itemsize)
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        c = bench(lambda: x.clone()); t = bench(lambda: torch.softmax(x, -1)); o = bench(lambda: osm.row_softmax(x))
        l = osm._row_launch(rows, n, n, dtype, 0, 0)
        print(f"{str(dtype)[6:]:9s} {n:6d} {l.kernel}/{l.block}/w{l.warps}/r{l.rows}/s{l.split}/a{l.ahead}: ours {c/o:.0%} torch {c/t:.0%} of copy")
        del x
