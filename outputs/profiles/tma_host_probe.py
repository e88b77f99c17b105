"""Host time of an eager softmax(x @ W) call (no grad) on the TMA path against the pointer path:
a kept launch replayed either way, the TMA one making two descriptors a call and its launcher
encoding them. bf16, W row-major and K-major; three interleaved runs of 100 calls each, the
GPU kept busy (``host_us``). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/tma_host_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
from probe_timing import host_us

TMA_OPERANDS = fsm._tma_operands


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("B x K x C layout: host us a call, TMA | pointer (three runs)")
    for B, K, C in ((32, 768, 1000), (512, 768, 1000), (4096, 4096, 1000)):
        for kmajor in (False, True):
            x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
            W = torch.randn(C, K, device="cuda", dtype=torch.bfloat16).t() if kmajor else \
                torch.randn(K, C, device="cuda", dtype=torch.bfloat16)
            runs = {"TMA": [], "pointer": []}
            for _ in range(3):
                for name in runs:
                    fsm._tma_operands = TMA_OPERANDS if name == "TMA" else (lambda *args: None)
                    fsm._MATMUL_REPLAYS.clear()
                    runs[name].append(host_us(lambda: fsm.matmul_softmax_fused_tiled(x, W)))
            fsm._tma_operands = TMA_OPERANDS
            print(f"{B} x {K} x {C} {'K-major' if kmajor else 'row-major'}: "
                  + " | ".join(f"{n} " + " ".join(f"{t:.1f}" for t in ts) for n, ts in runs.items()), flush=True)


if __name__ == "__main__":
    main()
