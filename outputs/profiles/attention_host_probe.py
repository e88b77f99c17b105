"""Host time per call of the attention forward and backward (the GPU kept busy by a spin), ours
and cuDNN's, and a cProfile of 50 backward calls. PYTHONPATH=. python3 outputs/profiles/attention_host_probe.py"""
import cProfile, pstats, io
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import fused_softmax_matmul as fsm
from probe_timing import host_us

@triton.jit
def empty_kernel(x):
    pass

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
x0 = torch.zeros(1, device="cuda")
print(f"empty triton launch {host_us(lambda: empty_kernel[(1,)](x0)):.1f} us; torch.softmax(1024) {host_us(lambda: torch.softmax(x0, -1)):.1f} us", flush=True)
for (b, n, d, causal) in ((32, 1000, 128, False), (32, 1024, 64, False), (64, 512, 128, False)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    go = torch.randn_like(q)
    q4, k4, v4 = (t.detach().unsqueeze(1).requires_grad_() for t in (q, k, v))
    go4 = go.unsqueeze(1)
    o = fsm.FlashAttentionTriton.apply(q, k, v, causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o4 = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
        sd_f = host_us(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal))
        sd_b = host_us(lambda: torch.autograd.grad(o4, (q4, k4, v4), go4, retain_graph=True))
        def sd_fb():
            oo = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
            torch.autograd.grad(oo, (q4, k4, v4), go4)
        sd_fb_us = host_us(sd_fb)
    with torch.no_grad():
        t_f = host_us(lambda: fsm.FlashAttentionTriton.apply(q, k, v, causal))
    t_fg = host_us(lambda: fsm.FlashAttentionTriton.apply(q, k, v, causal))
    before = len(fsm._FLASH_BACKWARDS)
    t_b = host_us(lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True))
    after = len(fsm._FLASH_BACKWARDS)
    ov = {"dkdv": fsm.resolve_flash_launches(d, q.dtype, None, fsm.few_query_tiles(b, n, q.device), causal)["dkdv"]}
    o_ov = fsm.FlashAttentionTriton.apply(q, k, v, causal, ov)
    t_b_ov = host_us(lambda: torch.autograd.grad(o_ov, (q, k, v), go, retain_graph=True))
    def fb():
        oo = fsm.FlashAttentionTriton.apply(q, k, v, causal)
        torch.autograd.grad(oo, (q, k, v), go)
    t_fb = host_us(fb)
    print(f"== ({b},{n},{d}) causal={causal}: host us per call | ours fwd no_grad {t_f:.1f}, fwd grad {t_fg:.1f}, bwd {t_b:.1f} "
          f"(kept backwards {before}->{after}), bwd with a launch override (no replay) {t_b_ov:.1f}, fwd+bwd {t_fb:.1f} | "
          f"cuDNN fwd {sd_f:.1f} bwd {sd_b:.1f} fwd+bwd {sd_fb_us:.1f}", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        torch.autograd.grad(o, (q, k, v), go, retain_graph=True)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("\n".join(s.getvalue().splitlines()[:34]), flush=True)
