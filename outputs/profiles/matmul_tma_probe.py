"""softmax(x @ W)'s tile kernel with its x and W tiles brought by TMA (tensor descriptors)
against the pointer loads it has (``matmul_softmax_tile_kernel``), W's rows as given and padded to
1024 / 128-aligned pitches; and the whole op against torch. CUDA-graph times (ms per call, GPU
time alone); the tile kernels alone leave out the rescale launch that both would be followed by.

A one-off diagnostic, not part of the benchmark suite. From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/matmul_tma_probe.py
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import fused_softmax_matmul as fsm
from fused_softmax_matmul import MatmulLaunch, store_tile_part, tile_coords

sys.path.insert(0, "outputs/profiles")
from probe_timing import graph_ms  # noqa: E402


@triton.jit
def tma_tile_kernel(x_desc, w_desc, out_ptr, stats_ptr, B, K, C, stride_ob, stride_oc, n_tiles_b, n_tiles_c,
                    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr):
    tile_b, tile_c = tile_coords(tl.program_id(0), n_tiles_b, n_tiles_c, GROUP_B)
    acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([tile_b * BLOCK_B, k])
        b = w_desc.load([k, tile_c * BLOCK_C])
        acc = tl.dot(a, b, acc)
    rows = tile_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    store_tile_part(acc, rows, cols, B, C, out_ptr, stats_ptr, tile_c, n_tiles_c, stride_ob, stride_oc)


def tma_tiles(x, W, out, stats, launch):
    (B, K), C = x.shape, W.shape[1]
    xd = TensorDescriptor.from_tensor(x, [launch.block_b, launch.block_k])
    wd = TensorDescriptor.from_tensor(W, [launch.block_k, launch.block_c])
    nb, nc = triton.cdiv(B, launch.block_b), triton.cdiv(C, launch.block_c)
    tma_tile_kernel[(nb * nc,)](xd, wd, out, stats, B, K, C, *out.stride(), nb, nc,
                                BLOCK_B=launch.block_b, BLOCK_C=launch.block_c, BLOCK_K=launch.block_k,
                                GROUP_B=launch.group_b, num_warps=launch.num_warps, num_stages=launch.num_stages)


def pointer_tiles(x, W, out, stats, launch):
    (B, K), C = x.shape, W.shape[1]
    nb, nc = triton.cdiv(B, launch.block_b), triton.cdiv(C, launch.block_c)
    args, vectors = fsm._matmul_args(x, W, out)
    fsm.matmul_softmax_tile_kernel[(nb * nc,)](x, W, out, stats, *args, nb, nc,
                                               **fsm._constants(launch, x.dtype), **vectors)


def name(launch):
    return f"{launch.block_b}x{launch.block_c}x{launch.block_k}/{launch.num_warps}w/{launch.num_stages}s/k{launch.split_k}"


L = MatmulLaunch
BF16, F32 = torch.bfloat16, torch.float32
CASES = [  # (B, K, C, dtype, launches to try beside the wrapper's)
    (4096, 4096, 1000, BF16, [L(128, 256, 64, 8, 8, 4), L(128, 128, 64, 8, 8, 4), L(128, 256, 64, 8, 8, 3)]),
    (4096, 2048, 1000, BF16, [L(128, 256, 64, 8, 8, 4), L(128, 128, 64, 8, 8, 4)]),
    (4096, 768, 1000, BF16, [L(128, 256, 64, 8, 8, 4), L(128, 128, 64, 8, 8, 4)]),
    (1024, 4096, 1000, BF16, [L(64, 64, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4), L(64, 256, 64, 8, 8, 4, 2)]),
    (1024, 2048, 1000, BF16, [L(64, 64, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4), L(64, 256, 64, 8, 8, 4, 2)]),
    (512, 4096, 1000, BF16, [L(64, 64, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4, 2),
                             L(64, 256, 64, 8, 8, 4, 4)]),
    (512, 2048, 1000, BF16, [L(64, 64, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4, 2),
                             L(64, 256, 64, 8, 8, 4, 4)]),
    (512, 768, 1000, BF16, [L(64, 64, 64, 8, 4, 4), L(64, 128, 64, 8, 4, 4), L(16, 256, 64, 8, 4, 4)]),
    (256, 2048, 1000, BF16, [L(64, 64, 64, 8, 4, 4, 2), L(32, 64, 64, 8, 4, 4, 2), L(64, 128, 64, 8, 4, 4, 4)]),
    (32, 4096, 1000, BF16, [L(16, 256, 64, 8, 4, 4, 16), L(16, 128, 64, 8, 4, 4, 8), L(32, 64, 64, 8, 4, 4, 8)]),
    (32, 2048, 1000, BF16, [L(16, 256, 64, 8, 4, 4, 16), L(16, 128, 64, 8, 4, 4, 8), L(32, 64, 64, 8, 4, 4, 8)]),
    (32, 768, 1000, BF16, [L(16, 256, 64, 8, 4, 4), L(16, 128, 64, 8, 4, 4), L(16, 64, 64, 8, 4, 4, 3)]),
    (1, 768, 1000, BF16, [L(16, 256, 64, 8, 4, 4), L(16, 128, 64, 8, 4, 4)]),
    (1, 2048, 1000, BF16, [L(16, 256, 64, 8, 4, 4, 16), L(16, 64, 64, 8, 4, 4, 16)]),
    (1, 4096, 1000, BF16, [L(16, 256, 64, 8, 4, 4, 16), L(16, 64, 64, 8, 4, 4, 16)]),
    (1, 768, 128256, BF16, [L(16, 256, 64, 8, 4, 3), L(16, 128, 64, 8, 4, 4)]),
    (32, 768, 128256, BF16, [L(32, 256, 64, 8, 4, 3), L(32, 128, 128, 8, 4, 3)]),
    (1, 768, 50257, BF16, [L(16, 128, 64, 8, 4, 4)]),
    (512, 768, 50257, BF16, [L(64, 256, 64, 8, 8, 4)]),
    (4096, 4096, 10, F32, [L(32, 16, 32, 8, 4, 3), L(32, 16, 128, 8, 4, 3)]),
    (4096, 768, 10, F32, [L(32, 16, 32, 8, 4, 3)]),
    (512, 4096, 10, F32, [L(32, 16, 128, 8, 4, 4, 8)]),
]


def main():
    for B, K, C, dtype, launches in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
        W = (torch.randn(K, C, device="cuda", generator=g) / K**0.5).to(dtype)
        ref = torch.softmax(x.float() @ W.float(), -1)
        chosen = fsm.tiled_launch(B, C, dtype, x.device, K=K)
        line = (f"{B}x{K}x{C} {str(dtype)[6:]}: torch {graph_ms(lambda: torch.softmax(x @ W, -1)):.4f}"
                f" | op {name(chosen)} {graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W)):.4f}")
        for pitch in (1024 if C == 1000 else (C + 63) // 64 * 64,):
            if pitch == C:
                continue
            wide = torch.zeros(K, pitch, device="cuda", dtype=dtype)
            wide[:, :C] = W
            Wp = wide[:, :C]
            line += f" | op pitch {pitch} {graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, Wp)):.4f}"
        out = torch.empty(B, C, device="cuda", dtype=dtype)
        for launch in launches:
            nc = triton.cdiv(C, launch.block_c)
            stats = torch.empty(2, B, nc, device="cuda", dtype=torch.float32)
            line += f" | {name(launch)}:"
            if launch.split_k == 1 and nc > 1:
                line += f" ptr {graph_ms(lambda: pointer_tiles(x, W, out, stats, launch)):.4f}"
            if launch.split_k == 1 and nc > 1 and (C * x.element_size()) % 16 == 0:
                tma_tiles(x, W, out, stats, launch)
                fsm._launch_rescale(out, stats, launch, None, False)
                err = (out.float() - ref).abs().max().item()
                line += f" tma {graph_ms(lambda: tma_tiles(x, W, out, stats, launch)):.4f} (err {err:.1e})"
            line += f" op {graph_ms(lambda: fsm.matmul_softmax_fused_tiled(x, W, launch)):.4f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
