"""(1) Attention d = 128 backward launches by sequence length, fwd+bwd replayed from a CUDA graph
(GPU time alone) and eager (do_bench); (2) the split-row kernel's warps (values a thread) for
16-bit and float32 rows, % of copy. From the repository root on an H100:

    PYTHONPATH=. python3 outputs/profiles/backward_d128_and_split_warps_probe.py [all|attention|rows]
"""
import sys
import torch, triton
import fused_softmax_matmul as fsm
import online_softmax as osm
from fused_softmax_matmul import FlashLaunch as FL
from probe_timing import attention_training_step, bench, graph_ms

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
part = sys.argv[1] if len(sys.argv) > 1 else "all"
if part in ("all", "attention"):
    SHAPES = [(64, 512, False), (32, 1000, False), (32, 1024, True), (16, 2048, False), (16, 2048, True), (11, 3000, False),
              (8, 4096, False), (8, 4096, True), (4, 8192, False)]
    DKDV = [FL(64, 128, 8, 2), FL(32, 128, 8, 2), FL(32, 128, 8, 3), FL(32, 128, 4, 2)]
    DQ = [FL(32, 64, 4, 2), FL(64, 32, 4, 2), FL(128, 64, 8, 2), FL(64, 64, 8, 2)]
    for b, n, causal in SHAPES:
        d = 128
        step, now, q = attention_training_step(fsm, b, n, d, causal)
        eager = bench(lambda: step())
        graph = graph_ms(lambda: step())
        print(f"== ({b},{n},{d}) causal={causal}: now dkdv {now['dkdv']} dq {now['dq']}: fwd+bwd graph {graph:.4f} eager {eager:.4f}", flush=True)
        for name, cands in (("dkdv", DKDV[1:]), ("dq", DQ)):
            for c in cands:
                try:
                    t = graph_ms(lambda: step({name: c}))
                    print(f"  {name} {c}: graph {t:.4f} ({graph / t:.2f}x now)", flush=True)
                except Exception as e:
                    print(f"  {name} {c}: failed {type(e).__name__} {str(e)[:100]}", flush=True)
        del step, q
        torch.cuda.empty_cache()

if part in ("all", "rows"):
    GiB = 2**30
    print("## split-row kernel: columns a program x warps; % of copy (do_bench)", flush=True)
    real_split = osm._split_launch
    for n, dt, nbytes in ((50257, torch.bfloat16, GiB // 4), (65536, torch.bfloat16, GiB // 4), (128256, torch.bfloat16, GiB // 4),
                          (128256, torch.bfloat16, 2 * GiB), (151936, torch.bfloat16, GiB // 4), (262144, torch.bfloat16, GiB // 4),
                          (50257, torch.float16, GiB // 4), (50257, torch.float32, GiB // 4), (128256, torch.float32, GiB // 4)):
        rows = nbytes // (n * dt.itemsize)
        x = torch.randn(rows, n, device="cuda", dtype=dt) * 4
        ref = torch.softmax(x[:64].double(), -1)
        copy = bench(lambda: x.clone())
        osm._split_launch = real_split
        osm._row_launch.cache_clear(); osm._ROW_REPLAYS.clear()
        chosen = osm._row_launch(rows, n, n, dt, 0, 0)
        base = bench(lambda: osm.row_softmax(x))
        line = f"{rows:6} x {n:6} {str(dt)[6:]:8} copy {copy:.3f} | now {chosen.block}/{chosen.warps}w {copy / base:.0%}"
        for cols in (4096, 8192, 16384):
            for warps in (2, 4, 8, 16):
                if cols // (warps * 32) > 128 or cols // (warps * 32) < 8:
                    continue
                def patched(n_rows, n_cols, stride_x, dtype, device_index, vec=1, cols=cols, warps=warps):
                    split, chunk = osm._split_shape(n_cols, cols * dtype.itemsize, dtype)
                    props = osm._device_properties(device_index)
                    def capacity(n_groups):
                        ints = (n_rows, n_cols, stride_x, n_cols, n_groups)
                        compiled = osm.softmax_split_row_kernel.warmup(
                            dtype, dtype, torch.float32, torch.int32, *map(osm._int_stand_in, ints),
                            CHUNK=chunk, SPLIT=split, PARTS=osm.next_power_of_2(split), VEC=vec, num_warps=warps, grid=(1,))
                        return osm.resident_programs(compiled, warps, props) * props.multi_processor_count
                    most = capacity(n_rows)
                    if most < split:
                        raise osm.KernelCapacityError("too few resident")
                    n_groups = min(n_rows, most // split)
                    if osm._int_stand_in(n_groups) != osm._int_stand_in(n_rows):
                        n_groups = min(n_groups, capacity(n_groups) // split)
                    return osm.RowLaunch("split", chunk, warps, n_groups * split, split, vec).check()
                osm._split_launch = patched
                osm._row_launch.cache_clear(); osm._ROW_REPLAYS.clear()
                try:
                    launch = osm._row_launch(rows, n, n, dt, 0, 0)
                    y = osm.row_softmax(x[:64])
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    t = bench(lambda: osm.row_softmax(x))
                    line += f" | {cols}/{warps}w p{launch.programs} {copy / t:.0%}" + ("" if launch.kernel == "split" else f" ({launch.kernel})") + (f" ERR {err:.1e}" if err > 1e-2 else "")
                except Exception as e:
                    line += f" | {cols}/{warps}w {type(e).__name__}"
        print(line, flush=True)
        osm._split_launch = real_split
        del x
        torch.cuda.empty_cache()
