"""The course leaderboard's protocol for FlashAttention, run for this project's kernel and SDPA.

bf16 Q, K, V of (16, 8192, 64), causal; the function under test is compiled with
``torch.compile(fn, fullgraph=False)``; one timed call is the forward plus ``o.sum().backward()``;
``triton.testing.do_bench(call, rep=10000, warmup=1000)`` (its default: the mean, L2 flushed before
each call). SDPA runs in its fast 4-D layout (batch, heads, length, d) with one head, so its
(16, 1, 8192, 64) tensors hold exactly the same numbers.

Run on a GPU from the repository root: ``PYTHONPATH=. python3 outputs/profiles/leaderboard.py [rep
warmup [d]]`` (d: the head dimension, 64 by default, the leaderboard's). Prints one line per
implementation: mean ms, the ratio to compiled SDPA, and the host time of one call (forward and
backward enqueued while the GPU spins, ``probe_timing.host_us``): a call whose host time passes
its GPU time is host bound, and do_bench then times the host.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton

from fused_softmax_matmul import FlashAttentionTriton
from probe_timing import host_us

SHAPE = (16, 8192, 64)


def sdpa(q, k, v, is_causal):
    return F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=is_causal).squeeze(1)


def time_protocol(fn, rep: int, warmup: int, shape: tuple = SHAPE) -> tuple[float, float]:
    """(do_bench's mean ms, host us per call) of the protocol's call."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3))

    def call():
        o = fn(q, k, v, True)
        o.sum().backward()

    return triton.testing.do_bench(call, rep=rep, warmup=warmup), host_us(call, n=20)


def main(rep: int = 10000, warmup: int = 1000, d: int = SHAPE[2]) -> None:
    shape = (*SHAPE[:2], d)
    impls = {
        "FlashAttentionTriton compiled": torch.compile(FlashAttentionTriton.apply, fullgraph=False),
        "FlashAttentionTriton eager": FlashAttentionTriton.apply,
        "SDPA compiled": torch.compile(sdpa, fullgraph=False),
        "SDPA eager": sdpa,
    }
    results = {}
    for name, fn in impls.items():
        try:
            results[name] = time_protocol(fn, rep, warmup, shape)
        except Exception as exc:  # a failure is reported as such, not as a number
            results[name] = None
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    base = (results.get("SDPA compiled") or (None,))[0]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"bf16 {shape} causal, forward + o.sum().backward(), do_bench(rep={rep}, warmup={warmup}) mean")
    for name, result in results.items():
        if result is None:
            print(f"{name:32s} failed")
        else:
            ms, host = result
            ratio = f"{base / ms:.2f}x SDPA compiled" if base else ""
            print(f"{name:32s} {ms:8.3f} ms  {ratio}  (host {host:.0f} us a call)")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
