"""Attention d = 64 backward launches (dK/dV, dQ) by shape: forward + backward replayed from a
CUDA graph (GPU time alone), the Function's own choice against launch overrides, bf16, full and
causal, on grid shapes and others; the choice timed again after its candidates (drift check). From the repository root on an H100:

    PYTHONPATH=. python3 outputs/profiles/backward_d64_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from fused_softmax_matmul import FlashLaunch as FL
from probe_timing import attention_training_step, graph_ms

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
SHAPES = [(16, 4096, False), (1, 32768, False), (16, 8192, False), (32, 1024, False), (16, 8192, True),
          (4, 16384, True), (16, 4096, True), (32, 1024, True)]
DKDV = [FL(32, 128, 4, 2), FL(64, 128, 4, 3), FL(64, 128, 8, 2), FL(64, 128, 8, 3), FL(128, 128, 8, 2), FL(64, 64, 4, 3)]
DQ = [FL(64, 32, 4, 3), FL(64, 64, 4, 3), FL(128, 64, 8, 2), FL(128, 64, 8, 3)]
for b, n, causal in SHAPES:
    d = 64
    step, now, q = attention_training_step(fsm, b, n, d, causal)
    base = graph_ms(lambda: step())
    print(f"== ({b},{n},{d}) {'causal' if causal else 'full'}: now dkdv {now['dkdv']} dq {now['dq']}, "
          f"forward path {fsm.flash_forward_path(q, q, q, causal)}: fwd+bwd {base:.4f} ms", flush=True)
    for name, candidates in (("dkdv", DKDV), ("dq", DQ)):
        for c in candidates:
            if c == now[name]:
                continue
            try:
                t = graph_ms(lambda: step({name: c}))
                print(f"  {name} {c}: {t:.4f} ({base / t:.2f}x now)", flush=True)
            except Exception as e:  # a launch past the GPU's registers or shared memory
                print(f"  {name} {c}: failed {type(e).__name__} {str(e)[:100]}", flush=True)
    print(f"  now again: {graph_ms(lambda: step()):.4f} ms (drift check)", flush=True)
    torch.cuda.empty_cache()
