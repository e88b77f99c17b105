"""float32 x @ W as three TF32 products on split operands: where the error of
``presplit_tf32x3_probe.py`` (2.9e-5, torch's SGEMM 1.2e-6) comes from, and what it costs to fix.

Two ways of splitting, both with W's parts K-major (Hopper's warpgroup MMA reads 32-bit
operands K-major only):
- round: hi = t rounded to TF32, lo = t - hi, both written by the split pass;
- trunc: hi = t itself, which the MMA reads as TF32 by dropping the low 13 bits, and lo = t -
  (t with those bits cleared); only lo is written, so x and a K-major W are read as given.
Two ways of summing:
- acc: every product accumulates into the running tile inside the MMA (the first probe);
- flush: each K step's three products start from zero and are added to the tile in float32,
  as triton's own tf32x3 does.
Printed: ms (do_bench mean, L2 flushed), the split pass's ms, error against float64. From the
repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/presplit_flush_probe.py 4096x4096x4096 4096x4096x1000
"""
import sys

import torch
import triton
import triton.language as tl

import fused_softmax_matmul as fsm


@triton.jit
def three_products_kernel(xh, xl, wh, wl, out, B, K, C, sxb, swc, sob,
                          BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_B: tl.constexpr, FLUSH: tl.constexpr):
    n_tiles_b, n_tiles_c = tl.cdiv(B, BLOCK_B), tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0)
    per_group = GROUP_B * n_tiles_c
    first_b = (pid // per_group) * GROUP_B
    group_size = tl.minimum(n_tiles_b - first_b, GROUP_B)
    tile_b, tile_c = first_b + (pid % per_group) % group_size, (pid % per_group) // group_size
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ks = tl.arange(0, BLOCK_K)
    x_off = rows[:, None].to(tl.int64) * sxb + ks[None, :]
    w_off = ks[:, None] + cols[None, :].to(tl.int64) * swc  # W (K, C) with K contiguous
    acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    for k in range(0, K, BLOCK_K):
        xm = (rows[:, None] < B) & ((k + ks)[None, :] < K)
        wm = ((k + ks)[:, None] < K) & (cols[None, :] < C)
        a = tl.load(xh + x_off, mask=xm, other=0.0)
        b = tl.load(wh + w_off, mask=wm, other=0.0)
        a_lo = tl.load(xl + x_off, mask=xm, other=0.0)
        b_lo = tl.load(wl + w_off, mask=wm, other=0.0)
        if FLUSH:
            p = tl.dot(a_lo, b, input_precision="tf32")
            p = tl.dot(a, b_lo, p, input_precision="tf32")
            acc += tl.dot(a, b, p, input_precision="tf32")
        else:
            acc = tl.dot(a_lo, b, acc, input_precision="tf32")
            acc = tl.dot(a, b_lo, acc, input_precision="tf32")
            acc = tl.dot(a, b, acc, input_precision="tf32")
        x_off += BLOCK_K
        w_off += BLOCK_K
    tl.store(out + rows[:, None].to(tl.int64) * sob + cols[None, :], acc,
             mask=(rows[:, None] < B) & (cols[None, :] < C))


def split_round(t):
    hi = ((t.view(torch.int32) + 0x1000) & -8192).view(torch.float32)
    return hi, t - hi


def split_trunc(t):
    return t, t - (t.view(torch.int32) & -8192).view(torch.float32)


def run(parts, B, K, C, tile, flush):
    bb, bc, bk, warps, stages = tile
    (xh, xl), (wh, wl) = parts
    out = torch.empty(B, C, device=xh.device)
    grid = (triton.cdiv(B, bb) * triton.cdiv(C, bc),)
    three_products_kernel[grid](xh, xl, wh, wl, out, B, K, C, xh.stride(0), wh.stride(1), out.stride(0),
                                BLOCK_B=bb, BLOCK_C=bc, BLOCK_K=bk, GROUP_B=8, FLUSH=flush,
                                num_warps=warps, num_stages=stages)
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


TILES = ((128, 128, 32, 4, 3), (128, 128, 32, 8, 3), (128, 256, 32, 8, 2), (64, 128, 32, 4, 4),
         (128, 64, 32, 4, 4), (64, 64, 32, 4, 4))

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for arg in sys.argv[1:]:
    B, K, C = map(int, arg.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", generator=g)
    W = (torch.randn(C, K, device="cuda", generator=g) / K**0.5).t()  # nn.Linear's weight, transposed
    ref = x.double() @ W.double()
    t_torch = bench(lambda: x @ W)
    print(f"{arg} (W K-major) torch {t_torch:.4f} (err {rel(x @ W, ref):.2e}) | module {bench(lambda: fsm.matmul(x, W)):.4f}"
          f" (err {rel(fsm.matmul(x, W), ref):.2e})", flush=True)
    for name, split in (("round", split_round), ("trunc", split_trunc)):
        parts = (split(x), split(W))
        split_ms = bench(lambda: (split(x), split(W)))
        print(f"  {name}: split pass {split_ms:.4f}", flush=True)
        for tile in TILES:
            for flush in (False, True):
                try:
                    t = bench(lambda: run(parts, B, K, C, tile, flush))
                    e = rel(run(parts, B, K, C, tile, flush), ref)
                    print(f"   {tile} {'flush' if flush else 'acc  '}: {t:.4f} ({t_torch / t:.2f}x torch,"
                          f" with split {t_torch / (t + split_ms):.2f}x), err {e:.2e}", flush=True)
                except Exception as exc:  # out of resources
                    print(f"   {tile} {flush}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
