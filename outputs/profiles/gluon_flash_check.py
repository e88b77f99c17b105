"""Check and time ``flash_attention_gluon`` (FlashAttention forward in Gluon) on a Hopper GPU.

A one-off diagnostic, not part of the benchmark suite. From the repository root:

    PYTHONPATH=. python3 outputs/profiles/gluon_flash_check.py          # every case
    PYTHONPATH=. python3 outputs/profiles/gluon_flash_check.py bench     # one case

Each case runs in its own process under ``timeout``, so a kernel that never finishes (a barrier
waiting for a phase that never completes) costs that case only. "check" runs the kernel's tests;
"bench" prints ``triton.testing.do_bench`` means of the forward at the issue's shapes (with the
consumers' ping-pong, and without: gluon_free) beside FlashAttentionTriton's and SDPA's (cuDNN),
with the kernel's error against float64 on the first head.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = {"check": 400, "bench": 300}


def bench() -> None:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fused_softmax_matmul import FlashAttentionTriton, attention_reference, flash_attention_gluon

    for batch, n, d, causal in ((16, 8192, 64, True), (16, 8192, 64, False), (16, 4096, 128, True),
                                (16, 4096, 128, False), (16, 3000, 64, False), (4, 16384, 128, True),
                                (32, 1000, 128, False), (32, 1024, 64, False)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        Q, K, V = (torch.randn((batch, n, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        with torch.no_grad():
            O = flash_attention_gluon(Q, K, V, causal)[0]
            ref = attention_reference(*(t[:1, :256].double() if t is Q else t[:1].double() for t in (Q, K, V)), causal)
            err = ((O[:1, :256].double() - ref).norm() / ref.norm()).item()

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None], is_causal=causal)
            times = {name: triton.testing.do_bench(fn, warmup=50, rep=300) for name, fn in (
                ("gluon", lambda: flash_attention_gluon(Q, K, V, causal)),
                ("gluon_free", lambda: flash_attention_gluon(Q, K, V, causal, pingpong=False)),
                ("triton", lambda: FlashAttentionTriton.apply(Q, K, V, causal)),
                ("sdpa_cudnn", cudnn))}
        line = " ".join(f"{k} {v:.4f}" for k, v in times.items())
        print(f"({batch}, {n}, {d}) {'causal' if causal else 'full'}: {line} ms; gluon vs cuDNN "
              f"{times['sdpa_cudnn'] / times['gluon']:.2f}x; error {err:.2e}", flush=True)


def main(names) -> int:
    failed = 0
    for name in names:
        print(f"=== {name}", flush=True)
        if name == "check":
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_flash_attention_gluon.py"]
        else:
            command = [sys.executable, __file__, "--case", name]
        proc = subprocess.run(["timeout", "-k", "10", str(CASES[name]), *command], cwd=ROOT)
        if proc.returncode in (124, 137):
            print(f"{name}: TIMEOUT after {CASES[name]} s: a kernel never finished (a barrier deadlock?)", flush=True)
        failed += proc.returncode != 0
    return failed


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        bench()
    else:
        sys.exit(main(sys.argv[1:] or list(CASES)))
