"""softmax(x) @ V: the Gluon kernel (``fused_softmax_gluon``, its own tiles and 128-wide d2 steps)
against what ``fused_softmax`` ran before it took the Gluon kernel (the Triton kernel up to
d3 = 128, row_softmax + torch.bmm above: ``materialize`` as the wrapper's rule says) and PyTorch,
each replayed from a CUDA graph (GPU time alone), with grad off, over batch, d1, d2 and d3; from
these ``gluon_fused_wins`` is written. From the repository root on an H100:
PYTHONPATH=.:tests:outputs/profiles python3 outputs/profiles/gluon_fused_sweep.py [programs]
("programs": grids of 96 to 192 programs, between the first run's 64 and 256)."""
import itertools
import sys

import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import graph_ms
from support import softmax_matmul_inputs

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
      "ms per call from CUDA graphs", flush=True)
ROWS = [(8, 1000), (16, 2048), (8, 4096)]
D2 = [256, 512, 1024, 2048, 4096, 8192]
D3 = [64, 128, 256, 512]
if sys.argv[1:] == ["programs"]:  # between 64 programs (128 rows each) and 256: 96, 128, 192
    ROWS, D2, D3 = [(8, 1536), (8, 2048), (8, 3000)], [1000, 4096], [64, 96, 128, 256]
print("batch d1 d2 d3 dtype | torch before gluon gluon128 | gluon/before gluon128/before gluon/torch")
with torch.no_grad():
    for (batch, d1), d2, d3 in itertools.product(ROWS, D2, D3):
        for dtype in (torch.bfloat16, torch.float16):
            if dtype == torch.float16 and (d2 not in (1024, 8192) or d3 == 96):
                continue
            x, V = softmax_matmul_inputs(batch, d1, d2, d3, dtype)
            before = fsm.materialized_wins(d3, dtype, batch * fsm.cdiv(d1, fsm.default_block(x, V)), fsm._sm_count(x.device))
            wide = fsm.GluonSoftmaxLaunch(128, min(256, triton.next_power_of_2(d3)), 2)
            t = {"torch": graph_ms(lambda: fsm.softmax_mult(x, V)),
                 "before": graph_ms(lambda: fsm.fused_softmax(x, V, materialize=before)),
                 "gluon": graph_ms(lambda: fsm.fused_softmax_gluon(x, V)),
                 "gluon128": graph_ms(lambda: fsm.fused_softmax_gluon(x, V, launch=wide))}
            print(f"{batch} {d1} {d2} {d3} {str(dtype)[6:]} {'mat' if before else 'fused'} | "
                  + " ".join(f"{v:.4f}" for v in t.values())
                  + f" | {t['before'] / t['gluon']:.2f} {t['before'] / t['gluon128']:.2f} {t['torch'] / t['gluon']:.2f}",
                  flush=True)
            del x, V
