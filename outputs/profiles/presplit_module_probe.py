"""The presplit float32 path as the module runs it: softmax(x @ W) and x @ W under 'highest', the
wrappers' own launch (``_presplit_choice``) against the pointer kernels' (``tiled_launch``) and
torch, by do_bench (mean, L2 flushed) and by CUDA graphs of 10 calls; error against float64;
the split pass alone (``tf32_parts_kernel``: its GB/s, read + written); forward + backward of one case.
From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/presplit_module_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm

CASES = ((4096, 4096, 50257, False), (4096, 4096, 1000, True), (4096, 4096, 1000, False), (512, 4096, 1000, True),
         (4096, 768, 32000, False), (4096, 4096, 4096, False), (512, 2048, 1000, False), (4096, 2048, 32000, True))


def graph_ms(fn, calls=10):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


torch.set_float32_matmul_precision("highest")
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("# ms: do_bench / CUDA graph; softmax(x @ W) then x @ W")
for B, K, C, kmajor in CASES:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", generator=g)
    W = (torch.randn(C, K, device="cuda", generator=g).t() if kmajor else torch.randn(K, C, device="cuda", generator=g))
    W = W / K**0.5
    chosen = fsm._presplit_choice(x, W, B, C)
    pointer = fsm.tiled_launch(B, C, torch.float32, x.device, K=K, w_kmajor=kmajor)
    ref = x.double() @ W.double()
    name = f"{B}x{K}x{C}{' W K-major' if kmajor else ''}"
    print(f"{name}: chosen {chosen}")
    for what, ours, theirs, want in (("softmax(x @ W)", fsm.matmul_softmax_fused_tiled, fsm.matmul_softmax_ref,
                                      torch.softmax(ref, -1)),
                                     ("x @ W", fsm.matmul, lambda a, b: a @ b, ref)):
        rows = [("torch", lambda: theirs(x, W)), ("presplit", lambda: ours(x, W, chosen)),
                ("pointer", lambda: ours(x, W, pointer))] if chosen else [("torch", lambda: theirs(x, W)),
                                                                          ("pointer", lambda: ours(x, W, pointer))]
        times = {}
        for label, fn in rows:
            times[label] = (triton.testing.do_bench(fn, warmup=25, rep=150), graph_ms(fn))
        line = " | ".join(f"{label} {a:.4f} / {b:.4f} (err {rel(fn(), want):.2e})" for (label, fn), (a, b)
                          in zip(rows, times.values()))
        ratio = " ".join(f"{label} {times['torch'][0] / times[label][0]:.2f}x/{times['torch'][1] / times[label][1]:.2f}x"
                         for label in times if label != "torch")
        print(f"  {what}: {line}; vs torch {ratio}", flush=True)
    if chosen:
        for label, t in (("x", x), ("W^T", W.t())):
            parts = torch.empty_like(t, memory_format=torch.contiguous_format), torch.empty_like(t, memory_format=torch.contiguous_format)
            grid = (triton.cdiv(t.shape[0], fsm.PARTS_BLOCK) * triton.cdiv(t.shape[1], fsm.PARTS_BLOCK),)  # 2-D at f468c1e
            flags = torch.zeros(t.shape[0], dtype=torch.int32, device="cuda")
            ms = triton.testing.do_bench(lambda: fsm.tf32_parts_kernel[grid](
                t, *parts, flags, 0, 0, *t.shape, *t.stride(), BLOCK_R=fsm.PARTS_BLOCK, BLOCK_K=fsm.PARTS_BLOCK, num_warps=4),
                warmup=25, rep=100)
            print(f"  split pass {label} ({'strides ' + str(t.stride())}): {ms:.4f} ms, {12 * t.numel() / ms / 1e6:.0f} GB/s")
    del x, W, ref
    torch.cuda.empty_cache()

# Forward + backward, softmax(x @ W) with nn.Linear's weight: the backward's products take the
# path too where it pays.
B, K, C = 4096, 4096, 1000
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(B, K, device="cuda", generator=g, requires_grad=True)
W = (torch.randn(C, K, device="cuda", generator=g) / K**0.5).t().detach().requires_grad_()
dy = torch.randn(B, C, device="cuda", generator=g)
for label, fn in (("torch", fsm.matmul_softmax_ref), ("module", fsm.matmul_softmax_fused_tiled)):
    def step():
        x.grad = W.grad = None
        fn(x, W).backward(dy)
    print(f"fwd+bwd {B}x{K}x{C} W K-major, {label}: {triton.testing.do_bench(step, warmup=10, rep=150):.4f} ms")

# Where a forward + backward's GPU time goes (torch.profiler, 5 steps), each way.
for label, fn in (("torch", fsm.matmul_softmax_ref), ("module", fsm.matmul_softmax_fused_tiled)):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            x.grad = W.grad = None
            fn(x, W).backward(dy)
        torch.cuda.synchronize()
    print(f"# fwd+bwd kernels, {label}, 5 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))
