"""Why the leaderboard's call (o.sum().backward()) is slower than fwd + backward(dense dO)."""
import torch, triton
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from fused_softmax_matmul import FlashAttentionTriton

SHAPE = (16, 8192, 64)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
go = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
ones = torch.ones(SHAPE, device="cuda", dtype=torch.bfloat16)

def sdpa(q, k, v, c):
    return F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=c).squeeze(1)

variants = {
    "fwd only (no grad)": lambda f: (lambda: f(q.detach(), k.detach(), v.detach(), True)),
    "backward(randn)": lambda f: (lambda: f(q, k, v, True).backward(go)),
    "backward(ones)": lambda f: (lambda: f(q, k, v, True).backward(ones)),
    "sum().backward()": lambda f: (lambda: f(q, k, v, True).sum().backward()),
    "autograd.grad(randn)": lambda f: (lambda: torch.autograd.grad(f(q, k, v, True), (q, k, v), go)),
}
for name, f in (("triton", FlashAttentionTriton.apply), ("sdpa", sdpa)):
    for vname, make in variants.items():
        fn = make(f)
        print(f"{name:8s} {vname:22s} {triton.testing.do_bench(fn, warmup=100, rep=500):.3f} ms", flush=True)
fn = variants["sum().backward()"](FlashAttentionTriton.apply)
for _ in range(3):
    fn()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
