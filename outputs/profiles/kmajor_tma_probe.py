"""softmax(x @ W) and x @ W with W K-major (nn.Linear's weight transposed), 16-bit: the TMA tile
kernels (``_tma_operands``) against the pointer kernels, under the launch chosen before (128 x 256
tiles) and now (256 x 128 where B >= 256 and W is read from DRAM), beside torch. Also the largest
difference between the two paths' outputs, and each one's against float64 on the first shape.

GPU milliseconds a call from CUDA graphs of 20 calls, median of 10 replays. From the repository
root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/kmajor_tma_probe.py
"""
import torch
import torch.nn.functional as F
import triton

import fused_softmax_matmul as fsm
from probe_timing import replay_median_ms as graph_ms

TMA_OPERANDS = fsm._tma_operands


def pointer_operands(*args):
    return None


def ours(fn, x, W, launch, tma):
    fsm._tma_operands = TMA_OPERANDS if tma else pointer_operands
    fsm._MATMUL_REPLAYS.clear()
    try:
        out = fn(x, W, launch)
        return graph_ms(lambda: fn(x, W, launch)), out
    finally:
        fsm._tma_operands = TMA_OPERANDS


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("B x K x C dtype: torch | pointer, launch before | pointer, launch now | TMA, launch now (launch now)"
          " | TMA / pointer before | torch / TMA | max |TMA - pointer|")
    shapes = ((4096, 4096, 32000), (8192, 4096, 32000), (4096, 2048, 32000), (4096, 768, 50257),
              (2048, 4096, 128256), (512, 4096, 32000), (256, 4096, 32000), (32, 4096, 32000), (1, 4096, 128256),
              (4096, 4096, 1000), (2048, 4096, 1000), (1024, 4096, 1000), (512, 4096, 1000), (4096, 4096, 3000),
              (4096, 768, 1000))
    for B, K, C in shapes:
        for dtype in (torch.bfloat16, torch.float16):
            if dtype == torch.float16 and (B, K, C) not in ((4096, 4096, 32000), (4096, 4096, 1000)):
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(B, K, device="cuda", dtype=dtype, generator=g)
            weight = torch.randn(C, K, device="cuda", dtype=dtype, generator=g) * K ** -0.5
            W = weight.t()
            now = fsm.tiled_launch(B, C, dtype, x.device, K=K, w_kmajor=True)
            before = now
            if (now.block_b, now.block_c) == (256, 128) and now.group_b == 8:
                before = fsm.MatmulLaunch(128, 256, now.block_k, 8, 8, now.num_stages, now.split_k)
            torch_ms = graph_ms(lambda: torch.softmax(F.linear(x, weight), -1))
            results = {}
            parts = []
            for name, launch, tma in (("ptr_before", before, False), ("ptr_now", now, False), ("tma_now", now, True)):
                try:
                    results[name] = ours(fsm.matmul_softmax_fused_tiled, x, W, launch, tma)
                    parts.append(f"{results[name][0]:.4f}")
                except Exception as e:  # out of shared memory, say
                    parts.append(f"{type(e).__name__}: {str(e)[:80]}")
            line = f"{B} x {K} x {C} {str(dtype)[6:]}: {torch_ms:.4f} | " + " | ".join(parts)
            line += f" ({now.block_b}x{now.block_c}x{now.block_k} g{now.group_b} w{now.num_warps} s{now.num_stages} k{now.split_k})"
            if "tma_now" in results and "ptr_before" in results:
                diff = (results["tma_now"][1].float() - results["ptr_now"][1].float()).abs().max().item()
                line += (f" | {results['ptr_before'][0] / results['tma_now'][0]:.3f}x"
                         f" | {torch_ms / results['tma_now'][0]:.3f}x | {diff:.2e}")
            print(line, flush=True)
            if (B, K, C) == (4096, 4096, 32000):
                ref = torch.softmax(x.double() @ W.double(), -1)
                errs = {n: (r[1].double() - ref).abs().max().item() for n, r in results.items()}
                errs["torch"] = (torch.softmax(F.linear(x, weight), -1).double() - ref).abs().max().item()
                print("  max |error| against float64: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
                mm = []
                for name, launch, tma in (("pointer before", before, False), ("TMA now", now, True)):
                    mm.append(f"{name} {ours(fsm.matmul, x, W, launch, tma)[0]:.4f}")
                print(f"  x @ W alone: torch {graph_ms(lambda: F.linear(x, weight)):.4f} | " + " | ".join(mm))
            del x, weight, W, results
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
