"""Host time of each public op's forward (no grad) as a caller pays it, beside torch's and an
empty Triton kernel's launch, then where it goes (cProfile, the functions of most own time).
online_softmax with and without its kept launch (``_ONLINE_REPLAYS``). us a call, least of
three runs of 100 calls enqueued while the GPU spins (``host_us``). From the repository root on
a GPU:

    PYTHONPATH=. python3 outputs/profiles/forward_host_probe.py
"""
import cProfile
import io
import pstats

import torch
import triton

import fused_softmax_matmul as fsm
import online_softmax as osm
from probe_timing import host_us


@triton.jit
def empty(x_ptr):
    pass


class NoKeep(dict):
    """Replays that keep nothing: every call takes the checked path."""

    def keeper(self, key):
        return lambda replay: None


def least(fn):
    return min(host_us(fn, 100) for _ in range(3))


def rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def profile(fn, calls=300):
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 0.05))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(10)
    lines = [line for line in out.getvalue().splitlines() if line.strip() and "/" in line or "{" in line]
    return "\n".join("    " + line.strip() for line in lines[:10])


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
x0 = torch.empty(1, device="cuda")
empty[(1,)](x0)
print(f"empty launch: {least(lambda: empty[(1,)](x0)):.1f} us")
a = rand(64, 1000, dtype=torch.float32)
o3 = rand(4, 256, 1000, dtype=torch.float32)
xs, vs = rand(4, 256, 256), rand(4, 256, 64, seed=1)
xm, wm = rand(64, 128, dtype=torch.float32), rand(128, 10, dtype=torch.float32, seed=1)
xl, wl = rand(1024, 4096), rand(4096, 1000, seed=1)
q, k, v = rand(4, 256, 64), rand(4, 256, 64, seed=1), rand(4, 256, 64, seed=2)
CASES = (
    ("torch.softmax 64 x 1000 float32", lambda: torch.softmax(a, -1)),
    ("row_softmax 64 x 1000 float32", lambda: osm.row_softmax(a)),
    ("torch.softmax 4 x 256 x 1000 float32", lambda: torch.softmax(o3, -1)),
    ("online_softmax 4 x 256 x 1000 float32", lambda: osm.online_softmax(o3)),
    ("fused_softmax 4 x 256 x 256 x 64 bf16", lambda: fsm.fused_softmax(xs, vs)),
    ("torch softmax(x) @ V 4 x 256 x 256 x 64 bf16", lambda: torch.softmax(xs, -1) @ vs),
    ("softmax(x @ W) 64 x 128 x 10 float32", lambda: fsm.matmul_softmax_fused_tiled(xm, wm)),
    ("torch softmax(x @ W) 64 x 128 x 10 float32", lambda: torch.softmax(xm @ wm, -1)),
    ("matmul 1024 x 4096 x 1000 bf16", lambda: fsm.matmul(xl, wl)),
    ("torch x @ W 1024 x 4096 x 1000 bf16", lambda: xl @ wl),
    ("FlashAttentionTriton 4 x 256 x 64 bf16 causal", lambda: fsm.FlashAttentionTriton.apply(q, k, v, True)),
    ("SDPA 4 x 256 x 64 bf16 causal", lambda: torch.nn.functional.scaled_dot_product_attention(
        q[:, None], k[:, None], v[:, None], is_causal=True)),
)
with torch.no_grad():
    for name, fn in CASES:
        print(f"{name}: {least(fn):.1f} us", flush=True)
    kept = osm._ONLINE_REPLAYS
    osm._ONLINE_REPLAYS = NoKeep()
    print(f"online_softmax 4 x 256 x 1000 float32, no kept launch: {least(lambda: osm.online_softmax(o3)):.1f} us")
    osm._ONLINE_REPLAYS = kept
    for name, fn in CASES:
        if not name.startswith(("torch", "SDPA")):
            print(f"== {name}, cProfile of 300 calls (tottime):\n{profile(fn)}", flush=True)
