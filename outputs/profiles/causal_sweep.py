"""Causal flash backward: dK/dV and dQ launches at the shapes where fwd+bwd fell behind."""
import torch, triton
import fused_softmax_matmul as fsm
from fused_softmax_matmul import FlashLaunch as FL

def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=120)

CANDS = {64: [FL(64, 128, 4, 3), FL(64, 128, 8, 3), FL(32, 128, 8, 3), FL(64, 64, 4, 3), FL(32, 64, 4, 3), FL(64, 128, 8, 2), FL(32, 128, 4, 2)],
         128: [FL(64, 128, 8, 2), FL(32, 64, 8, 2), FL(64, 64, 8, 2), FL(32, 128, 8, 2), FL(64, 64, 4, 2)]}
for (b, n, d, dtype) in ((16, 8192, 64, torch.bfloat16), (1, 32768, 64, torch.float16), (4, 16384, 128, torch.bfloat16)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    go = torch.randn_like(q)
    def run(launches):
        def f():
            torch.autograd.grad(fsm.FlashAttentionTriton.apply(q, k, v, True, launches), (q, k, v), go)
        return bench(f)
    chosen = fsm.flash_launches(d, dtype, fsm.few_query_tiles(b, n, q.device), True)
    print(f"== ({b},{n},{d}) {dtype} causal default {chosen} {run(None):.3f} ms", flush=True)
    for c in CANDS[d]:
        try:
            print(f"  dkdv {c} {run({'dkdv': c}):.3f}", flush=True)
        except Exception as exc:
            print(f"  dkdv {c} failed {type(exc).__name__}", flush=True)
