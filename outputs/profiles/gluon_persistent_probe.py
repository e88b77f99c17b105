"""The Gluon attention forward with its O stored by TMA, one tile a program or persistent (one
program an SM looping over the tiles), against c54c9fb's kernel (one tile a program, O stored from
registers), the Triton kernel and cuDNN: GPU time from CUDA graphs, bf16; O and L compared with
c54c9fb's bit for bit. From the repository root on an H100, with c54c9fb's module beside it:

    git show c54c9fb:fused_softmax_matmul.py > outputs/profiles/head_tree/fsm_c54c9fb.py
    PYTHONPATH=.:outputs/profiles/head_tree python3 outputs/profiles/gluon_persistent_probe.py
"""
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fsm_c54c9fb as before
import fused_softmax_matmul as fsm
from probe_timing import graph_ms

CHOSEN = fsm.flash_forward_path
CASES = [(32, 1024, 128, False), (32, 1000, 128, False), (64, 512, 128, False), (16, 2048, 128, False),
         (16, 4096, 128, False), (4, 16384, 128, False), (32, 1024, 128, True), (16, 2048, 128, True),
         (8, 2048, 128, True), (16, 4096, 128, True), (4, 16384, 128, True), (1, 32768, 128, True),
         (32, 1024, 64, False), (32, 1000, 64, False), (16, 2048, 64, False), (16, 4096, 64, False),
         (16, 8192, 64, False), (32, 1024, 64, True), (16, 4096, 64, True), (16, 8192, 64, True), (4, 16384, 64, True)]


def triton_forward(Q, K, V, causal):
    fsm.flash_forward_path = lambda *args: "triton"
    try:
        return fsm.FlashAttentionTriton.apply(Q, K, V, causal)
    finally:
        fsm.flash_forward_path = CHOSEN


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; ms per call from CUDA graphs", flush=True)
with torch.no_grad():
    for b, n, d, causal in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        Q, K, V = (torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        O0, L0 = before.flash_attention_gluon(Q, K, V, causal)
        same = all(torch.equal(x, y) for p in (True, False)
                   for x, y in zip((O0, L0), fsm.flash_attention_gluon(Q, K, V, causal, persistent=p)))
        fsm._FLASH_FORWARDS.clear()

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None], is_causal=causal)
        t = {"c54c9fb": graph_ms(lambda: before.flash_attention_gluon(Q, K, V, causal)),
             "one_tile": graph_ms(lambda: fsm.flash_attention_gluon(Q, K, V, causal, persistent=False)),
             "persistent": graph_ms(lambda: fsm.flash_attention_gluon(Q, K, V, causal, persistent=True)),
             "triton": graph_ms(lambda: triton_forward(Q, K, V, causal)), "cudnn": graph_ms(cudnn)}
        print(f"({b},{n},{d}) {'causal' if causal else 'full'}: " + " ".join(f"{k} {v:.4f}" for k, v in t.items())
              + f" | persistent/c54c9fb {t['c54c9fb'] / t['persistent']:.2f}x, one_tile/c54c9fb {t['c54c9fb'] / t['one_tile']:.2f}x,"
              f" persistent/triton {t['triton'] / t['persistent']:.2f}x, persistent/cuDNN {t['cudnn'] / t['persistent']:.2f}x,"
              f" same bits {same}", flush=True)
