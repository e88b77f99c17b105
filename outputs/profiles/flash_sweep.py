"""Flash attention bf16 on shapes off the tuned one: default launches and candidates, vs SDPA (best backend)."""
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import fused_softmax_matmul as fsm
from fused_softmax_matmul import FlashLaunch as FL

def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)

def sdpa_best(q, k, v, causal, bwd):
    q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v))
    best = {}
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(be):
                if bwd:
                    go = torch.randn_like(q4)
                    def f():
                        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
                        o.backward(go)
                else:
                    f = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
                best[be.name] = bench(f)
        except RuntimeError:  # the backend refuses the case
            best[be.name] = None
    return best

FWD = [FL(128, 64, 8, 3), FL(128, 128, 8, 3), FL(128, 64, 4, 3), FL(64, 64, 4, 3), FL(128, 32, 4, 3), FL(128, 128, 8, 2), FL(64, 128, 4, 3)]
FWD128 = [FL(128, 64, 8, 2), FL(128, 32, 8, 2), FL(64, 64, 4, 2), FL(128, 128, 8, 2), FL(128, 64, 8, 3), FL(64, 64, 4, 3), FL(128, 32, 4, 3)]
DKDV = [FL(64, 128, 4, 3), FL(32, 128, 8, 3), FL(64, 128, 8, 3), FL(32, 64, 4, 3), FL(64, 64, 4, 3), FL(32, 128, 4, 2)]
DKDV128 = [FL(32, 64, 8, 2), FL(64, 64, 8, 2), FL(32, 128, 8, 2), FL(64, 128, 8, 2), FL(32, 64, 4, 3), FL(16, 64, 4, 2)]
DQ = [FL(64, 64, 4, 3), FL(128, 64, 8, 3), FL(64, 128, 4, 3), FL(128, 32, 8, 3), FL(64, 32, 4, 3)]
DQ128 = [FL(64, 32, 4, 2), FL(128, 64, 8, 2), FL(64, 64, 4, 2), FL(128, 32, 8, 2), FL(64, 64, 8, 3)]

SHAPES = [(16, 8192, 64, False), (16, 4096, 128, True), (16, 4096, 128, False), (16, 3000, 64, False), (32, 1024, 64, False)]
for (b, n, d, causal) in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    go = torch.randn_like(q)
    sf, sb = sdpa_best(q, k, v, causal, False), sdpa_best(q, k, v, causal, True)
    print(f"== ({b},{n},{d}) causal={causal} SDPA fwd {sf} fwd+bwd {sb}", flush=True)
    default = fsm.flash_launches(d, torch.bfloat16)
    def run(launches, bwd):
        if bwd:
            def f():
                o = fsm.FlashAttentionTriton.apply(q, k, v, causal, launches)
                o.backward(go)
        else:
            f = lambda: fsm.FlashAttentionTriton.apply(q, k, v, causal, launches)
        return bench(f)
    with torch.no_grad():
        t = run(None, False)
    print(f"default fwd {default['forward']} {t:.4f} ms", flush=True)
    for c in (FWD if d <= 64 else FWD128):
        try:
            with torch.no_grad():
                print(f"  fwd {c} {run({'forward': c}, False):.4f}", flush=True)
        except Exception as exc:
            print(f"  fwd {c} failed {type(exc).__name__}", flush=True)
    t = run(None, True)
    print(f"default fwd+bwd {default} {t:.4f} ms", flush=True)
    for c in (DKDV if d <= 64 else DKDV128):
        try:
            print(f"  dkdv {c} {run({'dkdv': c}, True):.4f}", flush=True)
        except Exception as exc:
            print(f"  dkdv {c} failed {type(exc).__name__}", flush=True)
    for c in (DQ if d <= 64 else DQ128):
        try:
            print(f"  dq {c} {run({'dq': c}, True):.4f}", flush=True)
        except Exception as exc:
            print(f"  dq {c} failed {type(exc).__name__}", flush=True)
