"""Long rows in one program of a thread-block cluster: ``softmax_row_kernel`` (a whole row a
program) launched with ``num_ctas`` CTAs a program, against the split kernel (the rule) and copy.

The split kernel gives a row to a group of programs that exchange (max, sum) through global
memory and wait on an atomic counter; that wait keeps long 16-bit rows at 86-93 % of copy
(outputs/README.md). With ``num_ctas`` > 1 on Hopper, Triton lays a program's tensors across
the CTAs of a cluster and reduces across them in distributed shared memory, with the cluster's
hardware barrier (triton 3.9's PTX for sm_90 holds mapa, barrier.cluster and shared::cluster
operations for this kernel at 2 and 8 CTAs). One program a row, all rows launched (the hardware
schedules the clusters). Run on an H100 (cluster_row_probe.txt): triton 3.6 compiles no
variant (TritonGPUPlanCTAPass refuses the reductions' layouts across the CTAs); see
cluster_exchange_probe.py for a Gluon version. do_bench means, ms (L2 flushed); each output against torch's. From the
repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/cluster_row_probe.py
"""
import torch
import triton

import online_softmax as osm

GiB = 2**30


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def clustered(x, ctas: int, warps: int):
    """row_softmax(x) by softmax_row_kernel, a whole row a program of ``ctas`` CTAs."""
    y = torch.empty_like(x)
    n_rows, n_cols = x.shape
    vec = osm.vector_align((n_cols, x.stride(0), n_cols), x.element_size())
    osm.softmax_row_kernel[(n_rows,)](x, y, n_rows, n_cols // vec, x.stride(0) // vec, n_cols // vec,
                                      BLOCK_SIZE=triton.next_power_of_2(n_cols), VEC=vec, ROWS=1,
                                      num_warps=warps, num_ctas=ctas)
    return y


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
CASES = ((65536, "bfloat16", GiB // 4), (65536, "bfloat16", 2 * GiB), (128256, "bfloat16", GiB // 4),
         (151936, "bfloat16", GiB // 4), (262144, "bfloat16", GiB // 4), (262144, "bfloat16", 2 * GiB),
         (50257, "bfloat16", GiB // 4), (65536, "float32", GiB // 4), (262144, "float32", GiB // 4))
for n, name, nbytes in CASES:
    dtype = getattr(torch, name)
    rows = nbytes // (n * dtype.itemsize)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
    copy_ms = bench(lambda: x.clone())
    want = torch.softmax(x.float(), -1).to(dtype)
    rule_ms = bench(lambda: osm.row_softmax(x))
    print(f"== {rows} x {n} {name}: copy {copy_ms:.4f}, rule ({osm._row_launch(rows, n, n, dtype, 0, 0).kernel}) "
          f"{rule_ms:.4f} ms ({copy_ms / rule_ms:.1%} of copy)", flush=True)
    for ctas in (2, 4, 8):
        for warps in (8, 16, 32):
            per_thread = triton.next_power_of_2(n) // (ctas * warps * 32)
            if not 8 <= per_thread <= 64:
                continue
            try:
                y = clustered(x, ctas, warps)
                ms = bench(lambda: clustered(x, ctas, warps))
            except Exception as e:  # noqa: BLE001 - a variant that cannot compile or launch: say so, go on
                print(f"  {ctas} CTAs x {warps} warps: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            err = (y.float() - want.float()).abs().max().item()
            print(f"  {ctas} CTAs x {warps} warps ({per_thread} values a thread): {ms:.4f} ms "
                  f"({copy_ms / ms:.1%} of copy, {rule_ms / ms:.2f}x the rule), max |y - torch| {err:.1e}", flush=True)
    del x, want
    torch.cuda.empty_cache()
