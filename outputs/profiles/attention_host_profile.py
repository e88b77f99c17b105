"""Where an eager attention forward + backward spends its host time: per-part timings, cProfile and
torch.profiler of 50 calls at (32, 1000, 128) bf16. PYTHONPATH=. python3 outputs/profiles/attention_host_profile.py"""
import cProfile, pstats, io, time
import torch
import fused_softmax_matmul as fsm
from probe_timing import host_us

b, n, d, causal = 32, 1000, 128, False
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
go = torch.randn_like(q)
def fb():
    oo = fsm.FlashAttentionTriton.apply(q, k, v, causal)
    torch.autograd.grad(oo, (q, k, v), go)
def fb_retain():
    oo = fsm.FlashAttentionTriton.apply(q, k, v, causal)
    torch.autograd.grad(oo, (q, k, v), go, retain_graph=True)
def f_only():
    return fsm.FlashAttentionTriton.apply(q, k, v, causal)
o = f_only()
def b_only():
    torch.autograd.grad(o, (q, k, v), go, retain_graph=True)
for name, fn in (("fwd", f_only), ("bwd", b_only), ("fwd+bwd", fb), ("fwd+bwd retain", fb_retain), ("fwd", f_only), ("fwd+bwd", fb)):
    print(f"{name}: {host_us(fn):.1f} us", flush=True)
# time each part of fb with perf_counter, GPU spinning
torch.cuda._sleep(int(2e9 * 0.05))
t = [0.0, 0.0]
for _ in range(100):
    t0 = time.perf_counter(); oo = f_only(); t1 = time.perf_counter(); torch.autograd.grad(oo, (q, k, v), go); t2 = time.perf_counter()
    t[0] += t1 - t0; t[1] += t2 - t1
torch.cuda.synchronize()
print(f"inside fb: forward {t[0] * 1e4:.1f} us, backward {t[1] * 1e4:.1f} us", flush=True)
pr = cProfile.Profile()
torch.cuda._sleep(int(2e9 * 0.05))
pr.enable()
for _ in range(50):
    fb()
pr.disable()
torch.cuda.synchronize()
for key in ("tottime", "cumtime"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(22)
    print("\n".join(s.getvalue().splitlines()[:40]), flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        fb()
torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
