"""float32 x @ W under 'highest' by three TF32 products whose operands were split beforehand.

``tl.dot(..., input_precision="tf32x3")`` splits both operand tiles into TF32 halves inside the
K loop; on Hopper W's tile then goes from shared memory to registers and back each step, and
the float32 kernels keep 32 x 128 tiles (4096^3 at torch's SGEMM speed). Here x and W are split
once into hi (rounded to TF32) and lo (the rest) by a plain pass, and the kernel streams four
tiles a step into three TF32 products that read both operands from shared memory. Printed: ms
(do_bench mean, L2 flushed), the split pass's own ms, and the error against float64, for torch,
the module's matmul and each tile. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/presplit_tf32x3_probe.py 4096x4096x4096 4096x4096x4096t 512x4096x1000

Output: presplit_tf32x3_probe.txt. Its products accumulate inside the MMA, which loses the
tile's low bits (error 2.9e-5); presplit_flush_probe.py finds the fix.
"""
import sys

import torch
import triton
import triton.language as tl

import fused_softmax_matmul as fsm


@triton.jit
def presplit_kernel(xh, xl, wh, wl, out, B, K, C, sxb, swk, swc, sob,
                    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
                    SPLIT: tl.constexpr):
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
    w_off = ks[:, None].to(tl.int64) * swk + cols[None, :].to(tl.int64) * swc
    acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    for k in range(0, K, BLOCK_K):
        xm = (rows[:, None] < B) & ((k + ks)[None, :] < K)
        wm = ((k + ks)[:, None] < K) & (cols[None, :] < C)
        a = tl.load(xh + x_off, mask=xm, other=0.0)
        b = tl.load(wh + w_off, mask=wm, other=0.0)
        if SPLIT:
            a_lo = tl.load(xl + x_off, mask=xm, other=0.0)
            b_lo = tl.load(wl + w_off, mask=wm, other=0.0)
            acc = tl.dot(a_lo, b, acc, input_precision="tf32")
            acc = tl.dot(a, b_lo, acc, input_precision="tf32")
        acc = tl.dot(a, b, acc, input_precision="tf32")
        x_off += BLOCK_K
        w_off += BLOCK_K * swk
    tl.store(out + rows[:, None].to(tl.int64) * sob + cols[None, :], acc,
             mask=(rows[:, None] < B) & (cols[None, :] < C))


def split(t):
    hi = ((t.view(torch.int32) + 0x1000) & -8192).view(torch.float32)
    return hi, t - hi


def presplit_mm(x, W, tile, split_first=True, parts=None):
    bb, bc, bk, warps, stages = tile
    B, K = x.shape
    C = W.shape[1]
    (xh, xl), (wh, wl) = parts if parts is not None else (split(x), split(W))
    out = torch.empty(B, C, device=x.device)
    grid = (triton.cdiv(B, bb) * triton.cdiv(C, bc),)
    presplit_kernel[grid](xh, xl, wh, wl, out, B, K, C, xh.stride(0), *wh.stride(), out.stride(0),
                          BLOCK_B=bb, BLOCK_C=bc, BLOCK_K=bk, GROUP_B=8, SPLIT=True, num_warps=warps, num_stages=stages)
    return out


def tf32_mm(x, W, tile):
    bb, bc, bk, warps, stages = tile
    B, K = x.shape
    C = W.shape[1]
    out = torch.empty(B, C, device=x.device)
    grid = (triton.cdiv(B, bb) * triton.cdiv(C, bc),)
    presplit_kernel[grid](x, x, W, W, out, B, K, C, x.stride(0), *W.stride(), out.stride(0),
                          BLOCK_B=bb, BLOCK_C=bc, BLOCK_K=bk, GROUP_B=8, SPLIT=False, num_warps=warps, num_stages=stages)
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


TILES = ((128, 128, 32, 8, 3), (128, 128, 32, 4, 3), (64, 128, 32, 4, 4), (128, 256, 32, 8, 2),
         (256, 128, 32, 8, 2), (128, 64, 32, 4, 4), (64, 64, 32, 4, 4))

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for arg in sys.argv[1:]:
    # BxKxC: W row-major (K, C); BxKxCt: W K-major, nn.Linear's weight (C, K) transposed. Hopper's
    # warpgroup MMA reads 32-bit operands K-major only (see tf32_kmajor_probe.py).
    kmajor = arg.endswith("t")
    B, K, C = map(int, arg.rstrip("t").split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", generator=g)
    W = torch.randn(C, K, device="cuda", generator=g).t() if kmajor else torch.randn(K, C, device="cuda", generator=g)
    W = W / K**0.5
    ref = x.double() @ W.double()
    flops = 2 * B * K * C
    t_torch = bench(lambda: x @ W)
    t_mod = bench(lambda: fsm.matmul(x, W))
    parts = (split(x), split(W))
    t_split = bench(lambda: (split(x), split(W)))
    line = (f"{arg} torch {t_torch:.4f} ({flops / t_torch / 1e9:.0f} TF/s, err {rel(x @ W, ref):.2e})"
            f" | module {t_mod:.4f} (err {rel(fsm.matmul(x, W), ref):.2e})")
    print(line, flush=True)
    # A row-major W's parts may also be written K-major by the split pass (a transposing copy).
    layouts = [("as given", parts, t_split)]
    if not kmajor:
        k_parts = (split(x), split(W.t().contiguous().t()))
        layouts.append(("W parts K-major", k_parts, bench(lambda: (split(x), split(W.t().contiguous().t())))))
    for name, layout_parts, split_ms in layouts:
        print(f"  {name}: split pass {split_ms:.4f}", flush=True)
        for tile in TILES:
            try:
                t = bench(lambda: presplit_mm(x, W, tile, parts=layout_parts))
                e = rel(presplit_mm(x, W, tile, parts=layout_parts), ref)
                wt = layout_parts[1][0]
                t1 = bench(lambda: tf32_mm(x, wt, tile))
                print(f"   tile {tile}: presplit {t:.4f} ({3 * flops / t / 1e9:.0f} TF32 TF/s, {t_torch / t:.2f}x torch,"
                      f" with split pass {t_torch / (t + split_ms):.2f}x, err {e:.2e}) | one tf32 product {t1:.4f}",
                      flush=True)
            except Exception as exc:  # out of resources
                print(f"   tile {tile}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
