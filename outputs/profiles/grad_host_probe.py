"""Host time of the public ops when autograd records them, as a training step calls them: the
forward without grad, the forward with grad recorded, and forward + backward, beside torch's
equivalents and an empty Triton kernel's launch. us a call, least of three runs of 30 calls
enqueued while the GPU spins (``host_us``). From the repository root on a GPU:

    PYTHONPATH=. python3 outputs/profiles/grad_host_probe.py
"""
import torch
import triton

import fused_softmax_matmul as fsm
import online_softmax as osm
from probe_timing import host_us


@triton.jit
def empty(x_ptr):
    pass


def least(fn):
    return min(host_us(fn, 30) for _ in range(3))


def rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def case(name, ours, theirs, inputs):
    """ours / theirs: functions of the inputs; the forward + backward sums each output against
    a fixed weight (a gradient of the output's own shape)."""
    nograd = [t.detach() for t in inputs]
    grads = [t.detach().clone().requires_grad_() for t in inputs]
    weight = {}

    def step(fn):
        def run():
            out = fn(*grads)
            if "w" not in weight:
                weight["w"] = torch.randn_like(out)
            out.backward(weight["w"])
        return run

    row = []
    for fn in (ours, theirs):
        with torch.no_grad():
            fwd = least(lambda: fn(*nograd))
        rec = least(lambda: fn(*grads))
        both = least(step(fn))
        row.append(f"{fwd:.1f} / {rec:.1f} / {both:.1f}")
    print(f"{name}: ours {row[0]} | torch {row[1]}", flush=True)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
x0 = torch.empty(1, device="cuda")
empty[(1,)](x0)
print(f"empty launch: {least(lambda: empty[(1,)](x0)):.1f} us")
print("us a call: forward without grad / forward, grad recorded / forward + backward")
case("row_softmax 64 x 1000 float32", osm.row_softmax, lambda a: torch.softmax(a, -1),
     [rand(64, 1000, dtype=torch.float32)])
case("row_softmax 4096 x 4096 bf16", osm.row_softmax, lambda a: torch.softmax(a, -1), [rand(4096, 4096)])
case("online_softmax 4 x 256 x 1000 float32", osm.online_softmax, lambda a: torch.softmax(a, -1),
     [rand(4, 256, 1000, dtype=torch.float32)])
case("fused_softmax 4 x 256 x 256 x 64 bf16", fsm.fused_softmax, lambda a, v: torch.softmax(a, -1) @ v,
     [rand(4, 256, 256), rand(4, 256, 64, seed=1)])
case("softmax(x @ W) 64 x 128 x 10 float32", fsm.matmul_softmax_fused_tiled, lambda a, w: torch.softmax(a @ w, -1),
     [rand(64, 128, dtype=torch.float32), rand(128, 10, dtype=torch.float32, seed=1)])
case("softmax(x @ W) 1024 x 4096 x 1000 bf16", fsm.matmul_softmax_fused_tiled, lambda a, w: torch.softmax(a @ w, -1),
     [rand(1024, 4096), rand(4096, 1000, seed=1) * 4096 ** -0.5])
case("matmul 1024 x 4096 x 1000 bf16", fsm.matmul, lambda a, w: a @ w, [rand(1024, 4096), rand(4096, 1000, seed=1)])
case("FlashAttentionTriton 4 x 256 x 64 bf16 causal", lambda q, k, v: fsm.FlashAttentionTriton.apply(q, k, v, True),
     lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
         q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0],
     [rand(4, 256, 64), rand(4, 256, 64, seed=1), rand(4, 256, 64, seed=2)])
