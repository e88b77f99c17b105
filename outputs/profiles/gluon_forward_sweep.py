"""The attention forward by the Gluon kernel (consumers in ping-pong, and free) against
FlashAttentionTriton's Triton kernel and SDPA (cuDNN), each replayed from a CUDA graph (GPU time
alone), on the shape grid's attention cases and a few between; then the host time of one call.
From the repository root on an H100: PYTHONPATH=. python3 outputs/profiles/gluon_forward_sweep.py"""
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import fused_softmax_matmul as fsm
from probe_timing import graph_ms, host_us

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call from CUDA graphs", flush=True)
CASES = [(32, 1024, 64, False), (32, 1024, 128, True), (32, 1000, 128, False), (16, 2048, 128, False), (16, 2048, 64, False),
         (16, 3000, 64, True), (16, 4097, 64, False), (16, 4096, 64, False), (16, 4096, 128, True), (16, 4096, 128, False),
         (8, 8192, 128, False), (16, 8192, 64, True), (16, 8192, 64, False), (4, 16384, 128, True), (4, 16384, 64, True),
         (1, 32768, 64, True), (1, 32768, 128, False)]
with torch.no_grad():
    for b, n, d, causal in CASES:
        for dt in (torch.bfloat16, torch.float16):
            if dt == torch.float16 and (b, n) not in ((16, 3000), (1, 32768), (16, 4096)):
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            Q, K, V = (torch.randn(b, n, d, device="cuda", dtype=dt, generator=g) for _ in range(3))
            fns = {"gluon": lambda: fsm.flash_attention_gluon(Q, K, V, causal),
                   "gluon_free": lambda: fsm.flash_attention_gluon(Q, K, V, causal, pingpong=False),
                   "triton": lambda: fsm.FlashAttentionTriton.apply(Q, K, V, causal)}
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None], is_causal=causal)
            fns["cudnn"] = cudnn
            t = {}
            for name in ("gluon_free", "triton", "gluon", "cudnn"):
                t[name] = graph_ms(fns[name])
            flops = fsm.attention_flops(b, n, n, d, causal)
            best = min(t["gluon"], t["gluon_free"])
            print(f"({b},{n},{d}) {'causal' if causal else 'full'} {str(dt)[6:]}: " + " ".join(f"{k} {v:.4f}" for k, v in t.items())
                  + f" | gluon/triton {t['triton'] / best:.2f}x, gluon/cuDNN {t['cudnn'] / best:.2f}x, triton/cuDNN {t['cudnn'] / t['triton']:.2f}x,"
                  f" gluon {flops / best / 1e9:.0f} TFLOP/s", flush=True)
            del Q, K, V
    Q, K, V = (torch.randn(32, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print("host us per call (32, 1024, 128): " + ", ".join(f"{k} {host_us(f):.1f}" for k, f in (
        ("gluon", lambda: fsm.flash_attention_gluon(Q, K, V, False)), ("triton", lambda: fsm.FlashAttentionTriton.apply(Q, K, V, False)),
        ("sdpa", lambda: F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None])))), flush=True)
