"""softmax(x) @ V in 16 bits at d3 384 and 512 (two d3 tiles of the Gluon kernel, each repeating
its rows' softmax) against the path ``fused_softmax`` took there before (row_softmax, then
torch.bmm) and PyTorch: GPU ms a call from CUDA graphs (probe_timing.graph_ms). One-off
diagnostic, for the rule's d3 cap (``gluon_fused_wins``); its .txt ran at 6eb4090. From the
repository root on an H100:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/gluon_fused_d512_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import graph_ms

CASES = [(b, d1, d2, 512, dt) for dt in (torch.bfloat16, torch.float16) for b, d1 in ((8, 1000), (8, 2048), (8, 4096), (16, 2048))
         for d2 in (1000, 3000, 4096, 8192)] + [(8, 2048, d2, 384, torch.bfloat16) for d2 in (1000, 4096, 8192)] + [
         (8, 1000, 1024, 512, torch.bfloat16), (4, 1000, 2048, 512, torch.bfloat16), (4, 1000, 8192, 512, torch.bfloat16)]

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms a call from CUDA graphs",
      flush=True)
with torch.no_grad():
    for b, d1, d2, d3, dtype in CASES:
        g = torch.Generator(device="cuda").manual_seed(d2)
        x = torch.randn(b, d1, d2, device="cuda", dtype=dtype, generator=g)
        V = torch.randn(b, d2, d3, device="cuda", dtype=dtype, generator=g)
        launch = fsm.gluon_softmax_launch(d2, d3, dtype)
        programs = b * triton.cdiv(d1, fsm.GLUON_SOFTMAX_ROWS) * triton.cdiv(d3, launch.block_d3)
        t = {"torch": graph_ms(lambda: fsm.softmax_mult(x, V)),
             "materialized": graph_ms(lambda: fsm.fused_softmax(x, V, materialize=True)),
             "gluon": graph_ms(lambda: fsm.fused_softmax_gluon(x, V))}
        print(f"({b},{d1},{d2},{d3}) {str(dtype)[6:]} programs {programs}: "
              + " ".join(f"{k} {v:.4f}" for k, v in t.items())
              + f" | gluon/materialized {t['materialized'] / t['gluon']:.3f}x, gluon/torch {t['torch'] / t['gluon']:.2f}x,"
              f" materialized/torch {t['torch'] / t['materialized']:.2f}x", flush=True)
