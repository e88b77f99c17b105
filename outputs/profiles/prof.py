"""One case of softmax(x) @ V, run three times, for ncu to profile the third launch."""
import sys
import torch
import fused_softmax_matmul as fsm

case = sys.argv[1]
dtype_name, d2, B, prec = case.split("_")
dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
torch.set_float32_matmul_precision(prec)
torch.manual_seed(0)
x = torch.randn(16, 2048, int(d2), device="cuda", dtype=dtype)
V = torch.randn(16, int(d2), 512, device="cuda", dtype=dtype)
B = int(B)
for _ in range(3):
    if B == 0:
        fsm.softmax_mult(x, V)
    else:
        fsm.fused_softmax(x, V, B, B)
torch.cuda.synchronize()
print(case, "launch", fsm.fused_launch(512, B or 16, dtype, B or 16))
