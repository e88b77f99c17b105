"""GPU time of each attention kernel (forward, dQ, dK/dV) at lengths that are and are not
multiples of the tiles, from torch.profiler's CUDA activity over 10 forward + backward calls.
From the repository root on an H100: PYTHONPATH=. python3 outputs/profiles/backward_kernel_times.py [LENGTHS [DIMS]]
(comma-separated; default 2944,3000,3072,4096,4097 and 128,64) [full,causal]."""
import collections
import torch, triton
import fused_softmax_matmul as fsm

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; us per call, mean of 10", flush=True)
import sys
LENGTHS = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2944, 3000, 3072, 4096, 4097]
DIMS = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
CAUSAL = [v == "causal" for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [False]
for d in DIMS:
    for n, causal in ((n, c) for n in LENGTHS for c in CAUSAL):
        b = 16
        q, k, v = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        go = torch.randn_like(q)
        def step():
            o = fsm.FlashAttentionTriton.apply(q, k, v, causal)
            torch.autograd.grad(o, (q, k, v), go)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        times = collections.defaultdict(float)
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.key.split("(")[0]
                times[name] += e.device_time_total / 10
        flops = fsm.attention_flops(b, n, n, d, causal)
        launches = fsm.resolve_flash_launches(d, torch.bfloat16, None, fsm.few_query_tiles(b, n, q.device), causal)
        line = ", ".join(f"{k.replace('flash_attention_', '')} {v:.1f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]) if v > 1)
        print(f"(16, {n}, {d}) {'causal' if causal else 'full'}, {flops / 1e9:.1f} GFLOP forward, dkdv {launches['dkdv']} dq {launches['dq']}: {line}", flush=True)
