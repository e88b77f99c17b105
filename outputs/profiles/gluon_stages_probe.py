"""The Gluon attention forward with 2 and 3 K/V ring slots (stages), consumers in ping-pong or free,
at d = 128 on the shapes FlashAttentionTriton sends it, each from a CUDA graph (GPU time alone).
From the repository root on an H100: PYTHONPATH=. python3 outputs/profiles/gluon_stages_probe.py"""
import torch, triton
import fused_softmax_matmul as fsm
from probe_timing import graph_ms

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call", flush=True)
with torch.no_grad():
    for b, n, causal in ((16, 4096, False), (8, 8192, False), (4, 16384, True), (1, 32768, False), (16, 8192, True),
                         (16, 4097, False), (16, 3000, False)):
        g = torch.Generator(device="cuda").manual_seed(0)
        Q, K, V = (torch.randn(b, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        ref = fsm.flash_attention_gluon(Q, K, V, causal)[0]
        times = {}
        for stages in (2, 3):
            for pingpong in (True, False):
                out = fsm.flash_attention_gluon(Q, K, V, causal, stages=stages, pingpong=pingpong)[0]
                if not torch.equal(out, ref):
                    print(f"  stages {stages} pingpong {pingpong}: output differs from the default's", flush=True)
                times[f"s{stages}{'p' if pingpong else 'f'}"] = graph_ms(
                    lambda: fsm.flash_attention_gluon(Q, K, V, causal, stages=stages, pingpong=pingpong))
        flops = fsm.attention_flops(b, n, n, 128, causal)
        best = min(times, key=times.get)
        print(f"({b},{n},128) {'causal' if causal else 'full'}: " + " ".join(f"{k} {v:.4f}" for k, v in times.items())
              + f" | best {best} ({flops / times[best] / 1e9:.0f} TFLOP/s), s3p/s2p {times['s2p'] / times['s3p']:.3f}x", flush=True)
