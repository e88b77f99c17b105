"""float32 softmax(x) @ V in Gluon: ``fused_softmax_gluon`` with TF32 products (one under 'high',
tf32x3 under 'highest') against what ``fused_softmax`` runs today and PyTorch, on an H100.

A one-off diagnostic, not part of the benchmark suite. From the repository root:

    PYTHONPATH=.:tests:outputs/profiles python3 outputs/profiles/gluon_tf32_probe.py [spec] [sweep]

Each part runs in its own process under ``timeout`` (a kernel that never finishes costs that
part, not the machine). "spec": the issue's shape (16, 2048, 8192, 512) and its d3 64 to 256,
relative errors against float64 and ``triton.testing.do_bench`` medians (L2 flushed), the Gluon
kernel's own tiles and others, and the pass that makes V's TF32 parts alone. "sweep": batch x d1,
d2 and d3 under both settings, each call replayed from a CUDA graph (GPU time alone), grad off:
from these the rule for float32 (``gluon_fused_wins``) is written. "user": as a user calls it,
eagerly: host time per call (enqueued while the GPU spins) and do_bench means (L2 flushed) of
``fused_softmax`` on its path, the path before it (``materialize`` as before) and PyTorch.
"pingpong": under 'high', the kernel's own tiles with the consumers taking turns against without
(CUDA graphs), over batch x d1, d2 and d3. "recheck": the two float32 grid rows whose rounds
were bimodal at eefcaa8, (8, 4096, 3000, 128) and (8, 4096, 4096, 96) under 'highest', each
call's time spread (do_bench, L2 flushed, three runs) for the Gluon kernel and the Triton one.
"""

from __future__ import annotations

import itertools
import sys

PARTS = {"spec": 300, "sweep": 300, "user": 200, "pingpong": 200, "recheck": 200}  # seconds each may take, compilation included


def spec() -> None:
    import torch
    import triton

    import fused_softmax_matmul as fsm
    from support import relative_error, softmax_matmul_inputs

    def median(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    with torch.no_grad():
        for d3 in (512, 256, 128, 64):
            x, V = softmax_matmul_inputs(16, 2048, 8192, d3, torch.float32)
            ref = fsm.softmax_mult(x.double(), V.double()) if d3 == 512 else None
            for precision in ("high", "highest"):
                torch.set_float32_matmul_precision(precision)
                launches = {"gluon": None}
                if d3 == 512:
                    launches["gluon pingpong"] = fsm.GluonSoftmaxLaunch(
                        **{**vars(fsm.gluon_softmax_launch(8192, 512, torch.float32)), "pingpong": True})
                    if precision == "high":
                        launches.update({"gluon 32x256x2": fsm.GluonSoftmaxLaunch(32, 256, 2),
                                         "gluon 64x128x2": fsm.GluonSoftmaxLaunch(64, 128, 2)})
                    else:
                        launches.update({"gluon 32x128x2": fsm.GluonSoftmaxLaunch(32, 128, 2),
                                         "gluon 64x64x2": fsm.GluonSoftmaxLaunch(64, 64, 2),
                                         "gluon 32x128x4": fsm.GluonSoftmaxLaunch(32, 128, 4)})
                impls = {"torch": lambda: fsm.softmax_mult(x, V), "wrapper": lambda: fsm.fused_softmax(x, V)}
                for name, launch in launches.items():
                    impls[name] = lambda launch=launch: fsm.fused_softmax_gluon(x, V, launch=launch)
                parts = fsm.gluon_softmax_v_parts(torch.float32)
                impls["V's parts alone"] = lambda: fsm.gluon_softmax_v_operand(V, parts)
                times = {name: median(fn) for name, fn in impls.items()}
                line = f"(16, 2048, 8192, {d3}) {precision}: path {fsm.fused_softmax_path(x, V)}"
                for name, ms in times.items():
                    line += f"\n  {name:16s} {ms:.4f} ms  {times['torch'] / ms:.2f}x torch"
                    if ref is not None and name != "V's parts alone":
                        line += f"  error {relative_error(impls[name](), ref):.2e}"
                print(line, flush=True)
            del x, V, ref
            torch.cuda.empty_cache()


def sweep() -> None:
    import torch

    import fused_softmax_matmul as fsm
    from probe_timing import graph_ms
    from support import softmax_matmul_inputs

    print("batch d1 d2 d3 precision before | torch before gluon (ms) | gluon/before gluon/torch", flush=True)
    with torch.no_grad():
        for (batch, d1), d2, d3 in itertools.product([(8, 1000), (16, 2048)], [256, 1024, 8192], [64, 128, 256, 512]):
            x, V = softmax_matmul_inputs(batch, d1, d2, d3, torch.float32)
            for precision in ("high", "highest"):
                torch.set_float32_matmul_precision(precision)
                before = fsm.fused_softmax_path(x, V)
                t = {"torch": graph_ms(lambda: fsm.softmax_mult(x, V)),
                     "before": graph_ms(lambda: fsm.fused_softmax(x, V)),
                     "gluon": graph_ms(lambda: fsm.fused_softmax_gluon(x, V))}
                print(f"{batch} {d1} {d2} {d3} {precision} {before} | " + " ".join(f"{v:.4f}" for v in t.values())
                      + f" | {t['before'] / t['gluon']:.2f} {t['torch'] / t['gluon']:.2f}", flush=True)
            del x, V


def user() -> None:
    import torch
    import triton

    import fused_softmax_matmul as fsm
    from probe_timing import host_us
    from support import softmax_matmul_inputs

    print("shape precision path | host us: fused_softmax before torch | ms: fused_softmax before torch | "
          "vs before, vs torch", flush=True)
    with torch.no_grad():
        for shape in [(16, 2048, 256, 64), (8, 1000, 1024, 64), (16, 2048, 1024, 128), (8, 1000, 8192, 512)]:
            x, V = softmax_matmul_inputs(*shape, torch.float32)
            for precision in ("high", "highest"):
                torch.set_float32_matmul_precision(precision)
                programs = shape[0] * fsm.cdiv(shape[1], fsm.default_block(x, V))
                before = fsm.materialized_wins(shape[3], torch.float32, programs, fsm._sm_count(x.device))
                fns = {"fused_softmax": lambda: fsm.fused_softmax(x, V),
                       "before": lambda: fsm.fused_softmax(x, V, materialize=before),
                       "torch": lambda: fsm.softmax_mult(x, V)}
                host = {k: host_us(f) for k, f in fns.items()}
                ms = {k: triton.testing.do_bench(f, warmup=25, rep=150) for k, f in fns.items()}
                print(f"{shape} {precision} {fsm.fused_softmax_path(x, V)} | "
                      + " ".join(f"{v:.1f}" for v in host.values()) + " | "
                      + " ".join(f"{v:.4f}" for v in ms.values())
                      + f" | {ms['before'] / ms['fused_softmax']:.2f} {ms['torch'] / ms['fused_softmax']:.2f}", flush=True)


def pingpong() -> None:
    import torch

    import fused_softmax_matmul as fsm
    from probe_timing import graph_ms
    from support import softmax_matmul_inputs

    torch.set_float32_matmul_precision("high")
    print("batch d1 d2 d3 | default pingpong (ms) | default/pingpong", flush=True)
    with torch.no_grad():
        for (batch, d1), d2, d3 in itertools.product([(8, 1000), (16, 2048)], [1024, 8192], [64, 128, 256, 512]):
            x, V = softmax_matmul_inputs(batch, d1, d2, d3, torch.float32)
            launch = fsm.gluon_softmax_launch(d2, d3, torch.float32)
            turns = fsm.GluonSoftmaxLaunch(**{**vars(launch), "pingpong": not launch.pingpong})
            a = graph_ms(lambda: fsm.fused_softmax_gluon(x, V, launch=launch))
            b = graph_ms(lambda: fsm.fused_softmax_gluon(x, V, launch=turns))
            print(f"{batch} {d1} {d2} {d3} {launch.pingpong} | {a:.4f} {b:.4f} | {a / b:.3f}", flush=True)


def recheck() -> None:
    import torch
    import triton

    import fused_softmax_matmul as fsm
    from support import softmax_matmul_inputs

    torch.set_float32_matmul_precision("highest")
    with torch.no_grad():
        for shape in [(8, 4096, 3000, 128), (8, 4096, 4096, 96), (8, 4096, 3000, 96)]:
            x, V = softmax_matmul_inputs(*shape, torch.float32)
            for name, fn in [("gluon", lambda: fsm.fused_softmax(x, V)),
                             ("triton", lambda: fsm.fused_softmax(x, V, materialize=False))]:
                for run in range(3):
                    t = sorted(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all"))
                    print(f"{shape} {name} run {run}: min {t[0]:.4f} median {t[len(t) // 2]:.4f} "
                          f"p90 {t[len(t) * 9 // 10]:.4f} max {t[-1]:.4f} ms ({len(t)} calls)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--part"]:
        import torch
        import triton

        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
        {"spec": spec, "sweep": sweep, "user": user, "pingpong": pingpong, "recheck": recheck}[sys.argv[2]]()
    else:
        from gluon_fused_check import run_all

        sys.exit(run_all(sys.argv[1:] or list(PARTS), __file__, PARTS, "--part"))
