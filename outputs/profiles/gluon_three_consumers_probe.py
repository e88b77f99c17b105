"""The Gluon attention forward at d = 64 with three consumer warpgroups a program (192 queries)
against two (128 queries) and cuDNN: GPU ms from CUDA graphs, bf16, beside
each variant's largest error against float64 on the first batch element. One-off diagnostic.
The `consumers` option it drives was in the code at a1e0a2f only (it was slower everywhere, and
removed after). From the repository root on an H100, at a1e0a2f:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/gluon_three_consumers_probe.py
"""
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fused_softmax_matmul as fsm
from probe_timing import graph_ms

CASES = [(16, 8192, True), (16, 8192, False), (32, 4096, True), (32, 4096, False), (4, 16384, True),
         (64, 2048, True), (64, 1024, False), (16, 4096, True), (16, 2048, False), (8, 1000, True), (32, 1000, False)]
VARIANTS = {"two": dict(consumers=2), "three": dict(consumers=3), "three_free": dict(consumers=3, pingpong=False),
            "three_s3": dict(consumers=3, stages=3)}
if len(sys.argv) > 1:
    CASES = CASES[:int(sys.argv[1])]


def error(O, Q, K, V, causal):
    ref = fsm.attention_reference(*(t[:1].double() for t in (Q, K, V)), causal)
    return (O[:1].double() - ref).abs().max().item()


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
      "ms per call from CUDA graphs (do_bench over replays); err: max |O - float64| on batch element 0", flush=True)
with torch.no_grad():
    for b, n, causal in CASES:
        g = torch.Generator(device="cuda").manual_seed(n)
        Q, K, V = (torch.randn(b, n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(Q[None], K[None], V[None], is_causal=causal)
        t = {"cudnn": graph_ms(cudnn)}
        errs = {"cudnn": error(cudnn()[0], Q, K, V, causal)}
        for name, kw in VARIANTS.items():
            t[name] = graph_ms(lambda: fsm.flash_attention_gluon(Q, K, V, causal, **kw))
            errs[name] = error(fsm.flash_attention_gluon(Q, K, V, causal, **kw)[0], Q, K, V, causal)
        flops = fsm.attention_flops(b, n, n, 64, causal)
        print(f"({b},{n},64) {'causal' if causal else 'full'}: "
              + " ".join(f"{k} {v:.4f}" for k, v in t.items())
              + f" | three/two {t['two'] / t['three']:.3f}x, three/cudnn {t['cudnn'] / t['three']:.3f}x,"
              f" best-three/cudnn {t['cudnn'] / min(t[k] for k in VARIANTS if k != 'two'):.3f}x,"
              f" two/cudnn {t['cudnn'] / t['two']:.3f}x, three {flops / t['three'] / 1e9:.0f} TFLOP/s | err "
              + " ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
