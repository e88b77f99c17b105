"""Host time of eager calls that replay their kept launches, with the kernel modules of another
tree (before a change to the launch path) and of this one, alternated in one process.

Two runs of one probe in two processes differ by a few us on the same machine (the
forward_host_probe files), as much as a change to the launch path may save; here both trees'
modules are loaded side by side (the other tree's custom ops under a namespace of their own) and
each call is timed as ``host_us`` times it (100 calls enqueued while the GPU spins), the two trees
in turn, five rounds; each row gives the least of the rounds. us a call. From the repository root
on a GPU, with the other tree's online_softmax.py and fused_softmax_matmul.py in a folder, e.g.
for the tree before the kept launches called the C launcher (61602aa):

    mkdir -p .before && for f in online_softmax.py fused_softmax_matmul.py; do git show 4e6612e:$f > .before/$f; done
    PYTHONPATH=. python3 outputs/profiles/launch_path_probe.py .before
"""
import importlib
import os
import sys
import tempfile

import torch
import triton

from probe_timing import host_us

MODULES = ("online_softmax", "fused_softmax_matmul")


def load(folder, namespace=None):
    """The two kernel modules of ``folder`` as modules of their own; with ``namespace``, their
    custom ops registered under it (a copy of the sources with the namespace replaced), so that
    two trees' ops can live in one process."""
    if namespace is not None:
        copy = tempfile.mkdtemp()
        for name in MODULES:
            text = open(os.path.join(folder, name + ".py")).read()
            assert 'OP_NAMESPACE = "softmax_kernels"' in text or name != "online_softmax"
            text = text.replace('OP_NAMESPACE = "softmax_kernels"', f'OP_NAMESPACE = "{namespace}"')
            open(os.path.join(copy, name + ".py"), "w").write(text)
        folder = copy
    for name in MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, os.path.abspath(folder))
    try:
        modules = tuple(importlib.import_module(name) for name in MODULES)
    finally:
        sys.path.pop(0)
        for name in MODULES:
            sys.modules.pop(name, None)
    return modules


@triton.jit
def empty(x_ptr):
    pass


def rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def cases(osm, fsm):
    a = rand(64, 1000, dtype=torch.float32)
    o3 = rand(4, 256, 1000, dtype=torch.float32)
    long_row = rand(8, 65536)
    xs, vs = rand(4, 256, 256), rand(4, 256, 64, seed=1)
    xm, wm = rand(64, 128, dtype=torch.float32), rand(128, 10, dtype=torch.float32, seed=1)
    xl, wl = rand(1024, 4096), rand(4096, 1000, seed=1)
    q, k, v = rand(4, 256, 64), rand(4, 256, 64, seed=1), rand(4, 256, 64, seed=2)
    ag, wg = a.clone().requires_grad_(), wm.clone().requires_grad_()
    xg = xm.clone().requires_grad_()
    gy, gz = torch.randn_like(a), rand(64, 10, dtype=torch.float32, seed=3)
    return (
        ("row_softmax 64 x 1000 float32", lambda: osm.row_softmax(a)),
        ("row_softmax 8 x 65536 bf16 (split kernel)", lambda: osm.row_softmax(long_row)),
        ("online_softmax 4 x 256 x 1000 float32", lambda: osm.online_softmax(o3)),
        ("fused_softmax 4 x 256 x 256 x 64 bf16", lambda: fsm.fused_softmax(xs, vs)),
        ("softmax(x @ W) 64 x 128 x 10 float32", lambda: fsm.matmul_softmax_fused_tiled(xm, wm)),
        ("matmul 1024 x 4096 x 1000 bf16", lambda: fsm.matmul(xl, wl)),
        ("FlashAttentionTriton 4 x 256 x 64 bf16 causal", lambda: fsm.FlashAttentionTriton.apply(q, k, v, True)),
        ("row_softmax 64 x 1000 float32, forward + backward",
         lambda: torch.autograd.grad(osm.row_softmax(ag), ag, gy)),
        ("softmax(x @ W) 64 x 128 x 10 float32, forward + backward",
         lambda: torch.autograd.grad(fsm.matmul_softmax_fused_tiled(xg, wg), (xg, wg), gz)),
    )


def main():
    before = load(sys.argv[1], namespace="softmax_kernels_before")
    after = load(os.path.dirname(os.path.abspath(__file__)) + "/../..")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"before: {sys.argv[1]}, after: this tree")
    x0 = torch.empty(1, device="cuda")
    trees = {"before": cases(*before), "after": cases(*after)}
    best = {}
    for _ in range(5):
        best.setdefault("empty launch", []).append(host_us(lambda: empty[(1,)](x0)))
        for tree, calls in trees.items():
            for name, fn in calls:
                best.setdefault((name, tree), []).append(host_us(fn))
    print(f"{min(best['empty launch']):7.1f} us  empty launch (Triton's)")
    for name, _ in trees["after"]:
        b, a = min(best[name, "before"]), min(best[name, "after"])
        print(f"{b:7.1f} -> {a:5.1f} us  ({a - b:+5.1f})  {name}")


main()
