"""Check and time ``fused_softmax_gluon`` (softmax(x) @ V in Gluon) on a Hopper GPU.

A one-off diagnostic, not part of the benchmark suite. Run from the repository root:

    python3 outputs/profiles/gluon_fused_check.py            # every case
    python3 outputs/profiles/gluon_fused_check.py check      # some cases: check, bench_<d2> (256, 1024, 2048, 8192), d3

Each case runs in its own process under ``timeout``: a kernel that never finishes (an mbarrier
waiting for a phase that never completes) costs that case, not the machine. "check" compares the
Gluon kernel, the Triton kernel and PyTorch with float64 on awkward shapes; "bench_<d2>" checks
once more at the issue's shape (batch 16, d1 2048, d3 512, bfloat16, as tests/test_bench_softmax_matmul.py
builds the softmax_matmul grid) and prints ``triton.testing.do_bench`` medians (L2 flushed).
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = {"check": 300, "bench_8192": 300, "bench_256": 300, "bench_1024": 300, "bench_2048": 300,
         "d3": 300}  # seconds each may take, compilation included


def run_all(names: list[str], script: str = __file__, limits: dict | None = None, flag: str = "--case") -> int:
    """Runs ``script flag name`` for each name in its own process under ``timeout`` (``limits``:
    seconds by name, CASES by default); returns how many failed."""
    limits = CASES if limits is None else limits
    failed = 0
    for name in names:
        print(f"=== {name}", flush=True)
        command = ["timeout", "-k", "10", str(limits[name]), sys.executable, script, flag, name]
        proc = subprocess.run(command, cwd=ROOT)
        if proc.returncode in (124, 137):
            print(f"{name}: TIMEOUT after {limits[name]} s: a kernel never finished (a barrier deadlock?)", flush=True)
        elif proc.returncode:
            print(f"{name}: FAILED with exit status {proc.returncode}", flush=True)
        failed += proc.returncode != 0
    return failed


def compare(x, V, impls):
    """Each implementation's output, the float64 reference and the relative errors against it."""
    from fused_softmax_matmul import softmax_mult
    from support import relative_error

    ref = softmax_mult(x.double(), V.double())
    outs = {name: fn(x, V) for name, fn in impls.items()}
    return outs, ref, {name: relative_error(out, ref) for name, out in outs.items()}


def implementations():
    """name -> fn(x, V): PyTorch, ``fused_softmax`` as the wrapper chooses (materialised past d3 = 128),
    the Triton kernel forced, the Gluon kernel with its own tiles and with others."""
    from fused_softmax_matmul import GluonSoftmaxLaunch, fused_softmax, fused_softmax_gluon, softmax_mult

    def gluon(launch=None):
        return lambda x, V: fused_softmax_gluon(x, V, launch=launch)

    # BLOCK 64: the Triton kernel's fastest bfloat16 tiles at this shape (outputs/README.md).
    return {"torch": softmax_mult, "wrapper": fused_softmax, "triton": lambda x, V: fused_softmax(x, V, 64, 64),
            "gluon": gluon(),
            "gluon eager": gluon(GluonSoftmaxLaunch(64, 256, 4, lazy_rescale=False)),
            "gluon pingpong": gluon(GluonSoftmaxLaunch(64, 256, 4, pingpong=True)),
            "gluon 64x256x3": gluon(GluonSoftmaxLaunch(64, 256, 3)),
            "gluon 128x256x2": gluon(GluonSoftmaxLaunch(128, 256, 2)),
            "gluon 128x256x2 eager": gluon(GluonSoftmaxLaunch(128, 256, 2, lazy_rescale=False))}


def case_check() -> None:
    import torch
    from fused_softmax_matmul import gluon_softmax_unsupported
    from support import assert_close, softmax_matmul_inputs

    shapes = [(1, 64, 128, 128), (2, 100, 200, 40), (1, 17, 8, 8), (3, 130, 1000, 264), (2, 128, 4096, 512)]
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for shape in shapes:
            x, V = softmax_matmul_inputs(*shape, dtype, scale=8.0)
            reason = gluon_softmax_unsupported(x, V)
            if reason:
                raise SystemExit(f"the Gluon kernel does not apply to {shape}: {reason}")
            outs, ref, err = compare(x, V, implementations())
            print(f"{str(dtype)[6:]:>8} {str(shape):>22}  rel. error: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in err.items()), flush=True)
            for name in outs:
                if name.startswith("gluon"):
                    try:
                        assert_close(outs[name], ref, outs["torch"])
                    except AssertionError as failure:
                        bad += 1
                        print(f"    {name} FAILED: {failure}", flush=True)
    if bad:
        raise SystemExit(f"{bad} (shape, launch) pairs failed the accuracy check")


def bench(batch: int, d1: int, d2: int, d3: int, impls: dict) -> None:
    import torch
    import triton
    from fused_softmax_matmul import softmax_matmul_flops
    from support import softmax_matmul_inputs

    x, V = softmax_matmul_inputs(batch, d1, d2, d3, torch.bfloat16)
    _, _, err = compare(x, V, impls)
    print(f"bfloat16 ({batch}, {d1}, {d2}, {d3}): rel. error against float64: "
          + ", ".join(f"{k} {v:.2e}" for k, v in err.items()), flush=True)
    flops = softmax_matmul_flops(batch, d1, d2, d3)
    ms = {}
    for name, fn in impls.items():
        ms[name] = triton.testing.do_bench(lambda: fn(x, V), return_mode="median")
        print(f"  {name:>21}: {ms[name]:.4f} ms median  {flops / ms[name] * 1e-9:7.1f} TFLOP/s  "
              f"{ms['torch'] / ms[name]:.2f}x torch", flush=True)


def header() -> None:
    import torch
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")


def case_bench(d2: int) -> None:
    """The issue's shape (batch 16, d1 2048, d3 512) at one d2, every implementation."""
    header()
    bench(16, 2048, d2, 512, implementations())


def case_d3() -> None:
    """Narrower V at d2 8192: PyTorch, the wrapper's choice and the Gluon kernel's own tiles."""
    header()
    impls = {k: v for k, v in implementations().items() if k in ("torch", "wrapper", "gluon")}
    for d3 in (64, 128, 256):
        bench(16, 2048, 8192, d3, impls)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
        name = sys.argv[2]
        if name == "check":
            case_check()
        elif name == "d3":
            case_d3()
        else:
            case_bench(int(name.split("_")[1]))
    else:
        wanted = sys.argv[1:] or list(CASES)
        unknown = [n for n in wanted if n not in CASES]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
        sys.exit(run_all(wanted))
