"""The attention backward in two kernels (dQ writing D = rowsum(dO * O), then dK/dV) against the
three of before (a row-sum kernel first), fwd+bwd from a CUDA graph and eager (do_bench), and the
backward's host time per call. From the repository root, with the earlier module beside:

    git show 0feb774:fused_softmax_matmul.py > outputs/profiles/before_fsm.py
    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/backward_two_kernels.py
"""
import torch, triton
import fused_softmax_matmul as now
import before_fsm as before
from probe_timing import bench, graph_ms, host_us

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for (b, n, d, causal, dt) in ((64, 512, 128, False, torch.bfloat16), (32, 1000, 128, False, torch.bfloat16),
                              (32, 1024, 64, False, torch.bfloat16), (16, 3000, 64, True, torch.float16),
                              (16, 4096, 128, True, torch.bfloat16), (16, 8192, 64, True, torch.bfloat16),
                              (16, 8192, 64, False, torch.bfloat16)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, d, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
    go = torch.randn_like(q)
    line = f"({b},{n},{d}) {'causal' if causal else 'full'} {str(dt)[6:]}:"
    grads = {}
    for name, mod in (("before", before), ("now", now)):
        def step():
            oo = mod.FlashAttentionTriton.apply(q, k, v, causal)
            return torch.autograd.grad(oo, (q, k, v), go)
        gms, ems = graph_ms(step), bench(step)  # before any graph of this op is kept alive below
        o = mod.FlashAttentionTriton.apply(q, k, v, causal)
        grads[name] = torch.autograd.grad(o, (q, k, v), go, retain_graph=True)
        hb = host_us(lambda o=o: torch.autograd.grad(o, (q, k, v), go, retain_graph=True))
        del o
        line += f" | {name}: graph {gms:.4f} eager {ems:.4f} ms, bwd host {hb:.0f} us"
    same = all(torch.equal(a, b_) for a, b_ in zip(grads["before"], grads["now"]))
    print(line + f" | gradients identical: {same}", flush=True)
