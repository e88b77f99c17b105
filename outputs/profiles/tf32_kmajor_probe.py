"""softmax(x) @ V in TF32 ('high') with V's d2 contiguous (K-major, as Hopper's warpgroup MMA takes
32-bit operands) against the wrapper's launch on V as given (d3 contiguous) and torch.

A one-off diagnostic, not part of the benchmark suite. From the repository root on an H100:

    PYTHONPATH=. python3 outputs/profiles/tf32_kmajor_probe.py

For each shape: torch's time and error, the wrapper's (BLOCK_1 = 32 at d3 > 64, the older MMA),
the time of making V's d2-contiguous copy, then fused_softmax on that copy with BLOCK_1 = 64 and
V's tiles fed to the product as loaded (no pass through registers) over a few launches. Errors:
max |out - float64| / max |float64| on the first batch element. Times: do_bench means, ms.
"""
import torch
import triton

import fused_softmax_matmul as fsm
from fused_softmax_matmul import FusedLaunch, fused_softmax, softmax_mult

SHAPES = [(16, 2048, 8192, 512), (8, 4096, 8192, 512), (8, 4096, 8192, 128), (8, 4096, 8192, 64),
          (8, 1000, 3000, 96), (8, 2048, 4096, 128), (8, 4096, 1000, 512)]
# (BLOCK_2, block_3, warps, stages, transposed)
CONFIGS = [(b2, b3, w, 2, tr) for b2 in (32, 64) for b3, w in ((128, 4), (128, 8), (256, 8)) for tr in (False, True)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=80)


def rel(out, ref):
    return ((out[0].double() - ref).abs().max() / ref.abs().max()).item()


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    torch.set_float32_matmul_precision("high")
    for batch, d1, d2, d3 in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn((batch, d1, d2), device="cuda", generator=g) * 3
        V = torch.randn((batch, d2, d3), device="cuda", generator=g)
        ref = torch.softmax(x[0].double(), -1) @ V[0].double()
        t_torch = bench(lambda: softmax_mult(x, V))
        e_torch = rel(softmax_mult(x, V), ref)
        t_default = bench(lambda: fused_softmax(x, V))
        e_default = rel(fused_softmax(x, V), ref)
        t_copy = bench(lambda: V.transpose(1, 2).contiguous())
        Vk = V.transpose(1, 2).contiguous().transpose(1, 2)  # V's values, d2 contiguous
        fsm._round_v = lambda *args: False
        fsm._fused_plan.cache_clear()
        parts = []
        for b2, b3, w, st, tr in CONFIGS:
            launch = FusedLaunch(min(b3, triton.next_power_of_2(d3)), w, st, lazy_rescale=True, transposed=tr)
            try:
                t = bench(lambda: fused_softmax(x, Vk, 64, b2, launch=launch))
                e = rel(fused_softmax(x, Vk, 64, b2, launch=launch), ref)
                parts.append((t, f"64x{b2} b3={launch.block_3} w{w} {'T' if tr else 'N'}: {t:.4f} ({t_torch / t:.2f}x, "
                                 f"err {e / e_torch:.2f}x torch's)"))
            except Exception as exc:
                parts.append((float("inf"), f"64x{b2} b3={launch.block_3} w{w} {'T' if tr else 'N'}: "
                                            f"{type(exc).__name__}"))
        best = min(parts)[0]
        print(f"({batch}, {d1}, {d2}, {d3}) TF32: torch {t_torch:.4f} (err {e_torch:.1e}); default {t_default:.4f} "
              f"({t_torch / t_default:.2f}x, err {e_default / e_torch:.2f}x); V copy {t_copy:.4f}; best K-major "
              f"{best:.4f} ({t_torch / best:.2f}x kernel alone, {t_torch / (best + t_copy):.2f}x with the copy)",
              flush=True)
        for _, text in parts:
            print("   ", text, flush=True)
        x = V = Vk = None  # noqa: F841 (frees them before the next shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
