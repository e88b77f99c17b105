"""One case of issue 19's targets, run three times, for ncu to profile one kernel's third launch
(gluon_prof.sh). Cases: fused_default and fused_256 (fused_softmax_gluon at (16, 2048, 8192, 512)
bf16, the wrapper's tiles and 256-wide d3 tiles with 2 slots: one launch from 77de787), tf32_high and
tf32_highest (the same in float32 under each setting), attention (FlashAttentionTriton
forward + backward at (16, 8192, 64) causal bf16, the kernels each chooses)."""
import sys

import torch

import fused_softmax_matmul as fsm

case = sys.argv[1]
torch.manual_seed(0)
if case.startswith("tf32"):  # float32 at the same shape, one TF32 product ('high') or three ('highest')
    torch.set_float32_matmul_precision(case.split("_")[1])
    x = torch.randn(16, 2048, 8192, device="cuda")
    V = torch.randn(16, 8192, 512, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            fsm.fused_softmax_gluon(x, V)
    print(case, "launch", fsm.gluon_softmax_launch(8192, 512, torch.float32))
elif case.startswith("fused"):
    x = torch.randn(16, 2048, 8192, device="cuda", dtype=torch.bfloat16)
    V = torch.randn(16, 8192, 512, device="cuda", dtype=torch.bfloat16)
    launch = fsm.GluonSoftmaxLaunch(128, 256, 2) if case == "fused_256" else None
    with torch.no_grad():
        for _ in range(3):
            fsm.fused_softmax_gluon(x, V, launch=launch)
    print(case, "launch", launch or fsm.gluon_softmax_launch(8192, 512))
else:
    q, k, v = (torch.randn(16, 8192, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for _ in range(3):
        fsm.FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    print(case, "forward", fsm.flash_forward_path(q, k, v, True), "dq", fsm.flash_dq_path(q, k, v, True, None, q),
          "dkdv", fsm.flash_dkdv_path(q, k, v, True, None, q))
torch.cuda.synchronize()
