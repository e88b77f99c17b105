"""Host time of one attention forward call on the Gluon path (FlashAttentionTriton at d = 128 past
GLUON_FLASH_MIN_FLOPS at cc57a42, a floor since replaced by gluon_flash_forward_wins, and
flash_attention_gluon itself) beside the Triton path and SDPA: calls
enqueued back to back while the GPU spins, so no launch waits. From the repository root on an H100:
PYTHONPATH=. python3 outputs/profiles/gluon_host_cost.py"""
import torch, triton
import torch.nn.functional as F
import fused_softmax_matmul as fsm
from probe_timing import host_us

@triton.jit
def empty_kernel(x):
    pass

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
x0 = torch.zeros(1, device="cuda")
Q, K, V = (torch.randn(16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
triton_launch = {"forward": fsm.flash_launches(128, torch.bfloat16)["forward"]}
assert fsm.flash_forward_path(Q, K, V, False) == "gluon"
with torch.no_grad():
    for rep in range(3):
        print(f"run {rep}: empty triton launch {host_us(lambda: empty_kernel[(1,)](x0)):.1f} us | (16, 4096, 128) full bf16: "
              f"FlashAttentionTriton (gluon path) {host_us(lambda: fsm.FlashAttentionTriton.apply(Q, K, V, False)):.1f}, "
              f"flash_attention_gluon {host_us(lambda: fsm.flash_attention_gluon(Q, K, V, False)):.1f}, "
              f"FlashAttentionTriton with the Triton forward forced {host_us(lambda: fsm.FlashAttentionTriton.apply(Q, K, V, False, triton_launch)):.1f}, "
              f"SDPA {host_us(lambda: F.scaled_dot_product_attention(Q[:, None], K[:, None], V[:, None])):.1f} us", flush=True)
