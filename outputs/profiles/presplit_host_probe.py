"""Host time of the presplit float32 path (a kept chain of six launches and the flags' zeroing)
against the pointer kernels' launch and torch, and the GPU time of the case the size rule took
last (512 x 4096 x 1000): us a call, least of three runs of 30 calls enqueued while the GPU spins
(``host_us``); ms by do_bench (L2 flushed) and from CUDA graphs of ten calls (``graph_ms``). From the repository root on a GPU:

    PYTHONPATH=.:outputs/profiles python3 outputs/profiles/presplit_host_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import graph_ms, host_us

torch.set_float32_matmul_precision("highest")
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for B, K, C, kmajor in ((512, 4096, 1000, True), (512, 4096, 1000, False), (4096, 4096, 1000, True)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, K, device="cuda", generator=g)
    W = (torch.randn(C, K, device="cuda", generator=g).t() if kmajor else torch.randn(K, C, device="cuda", generator=g))
    W = W / K**0.5
    chosen = fsm._presplit_choice(x, W, B, C)
    pointer = fsm.tiled_launch(B, C, torch.float32, x.device, K=K, w_kmajor=kmajor)
    print(f"{B}x{K}x{C}{' W K-major' if kmajor else ''}: chosen {chosen}")
    for label, fn in (("torch", lambda: fsm.matmul_softmax_ref(x, W)),
                      ("module", lambda: fsm.matmul_softmax_fused_tiled(x, W)),
                      ("pointer", lambda: fsm.matmul_softmax_fused_tiled(x, W, pointer))):
        host = min(host_us(fn, 30) for _ in range(3))
        print(f"  {label}: host {host:.1f} us, do_bench {triton.testing.do_bench(fn, warmup=25, rep=150):.4f} ms,"
              f" graph {graph_ms(fn):.4f} ms", flush=True)
