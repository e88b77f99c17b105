"""The processes of vocab_parallel_linear_cross_entropy's tests and of its throughput measurement.

Nothing here imports the kernel modules at the top: each process chooses compiled Triton or the
interpreter (TRITON_INTERPRET, read when the kernels are decorated) before it imports them.

Tests: tests/test_linear_cross_entropy_parallel.py spawns ``check_worker`` in ``world`` processes
(gloo on the CPU in the interpreter, NCCL with one GPU each). Each process builds the same inputs
from one seed, holds its shard of W (shard sizes uneven where V is no multiple of world), and
compares the loss, lse and gradients with the unsharded call it makes itself.

Measurement (GPU), one process per GPU by torch's launcher:

    python -m torch.distributed.run --standalone --nproc-per-node N tests/vocab_parallel_worker.py \
        --out DIR [--shape 8192 4096 128256]

appends one JSON line per run to DIR/vocab_parallel_linear_cross_entropy.jsonl: forward+backward
median time over ROUNDS calls (CUDA events, the slowest rank's), tokens/s of the group, and each
rank's peak memory above its inputs. With N = 1 it also measures the unsharded
``linear_cross_entropy`` for comparison.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# The measurement's rounds: a step takes tens of milliseconds at 8192 x 4096 x 128256, so 20 are
# a second or two; the first calls (compilation, NCCL's set-up, cuBLAS's workspace) come before.
WARMUP, ROUNDS = 3, 20


def _kernels(interpret: bool):
    """The kernel module, imported after the interpreter flag is set for this process."""
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    for path in (str(ROOT), str(ROOT / "tests")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import fused_softmax_matmul

    return fused_softmax_matmul


def shard_sizes(V: int, world: int) -> list[int]:
    """V split over world ranks, the first V % world shards one larger (uneven where V is no multiple)."""
    return [V // world + (r < V % world) for r in range(world)]


def inputs(BT: int, H: int, V: int, dtype: torch.dtype, device, seed: int = 0, ignored: float = 0.15):
    """x (BT, H) of size 3, W (V, H) nn.Linear-scaled, bias, class weights in [0.5, 1.5), targets with
    some ignored (-100): drawn on the CPU from one seed, so every rank holds the same."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(BT, H, generator=g)).to(dtype)
    W = (torch.randn(V, H, generator=g) * H**-0.5).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    weight = 0.5 + torch.rand(V, generator=g)
    target = torch.randint(0, V, (BT,), generator=g)
    target[torch.rand(BT, generator=g) < ignored] = -100
    return [t.to(device) for t in (x, W, bias, weight, target)]


# (name, options, reductions): what each case runs; the bias and weight tensors come from ``inputs``.
CASES = [
    ("plain", {}, ("mean", "sum", "none")),
    ("all_options", dict(bias=True, weight=True, label_smoothing=0.1, softcap=2.0, z_loss=1e-2), ("mean", "none")),
    # label smoothing without softcap: the target's term goes into the gradients apart from the tile
    ("smoothing", dict(bias=True, weight=True, label_smoothing=0.1), ("mean",)),
]


def _grads(fn, x, W, bias, target, reduction, options, **kwargs):
    leaves = [x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()]
    options = dict(options)
    if options.pop("bias", False):
        options["bias"] = bias.detach().clone().requires_grad_()
        leaves.append(options["bias"])
    loss, lse = fn(leaves[0], leaves[1], target, reduction=reduction, return_lse=True, **options, **kwargs)
    # A signed upstream gradient per row for "none", so the backward's scaling shows.
    dloss = torch.ones_like(loss) if loss.dim() == 0 else torch.linspace(-1, 1, loss.numel(), device=loss.device)
    return [loss.detach(), lse, *torch.autograd.grad(loss, leaves, dloss)]


def check_worker(rank: int, world: int, backend: str, init_method: str, interpret: bool, shape: tuple,
                 dtype_name: str) -> None:
    """Each case's loss, lse, dx, dW shard and bias shard against the unsharded call; raises on a mismatch."""
    fsm = _kernels(interpret)
    import torch.distributed as dist

    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        BT, H, V = shape
        dtype = getattr(torch, dtype_name)
        x, W, bias, weight, target = inputs(BT, H, V, dtype, device)
        sizes = shard_sizes(V, world)
        start = sum(sizes[:rank])
        end = start + sizes[rank]
        # Interpreter: chunks of 8 rows and tiles of 16 classes, so several of each run per shard.
        launch = fsm.LinearCrossEntropyLaunch(8, 16, 4) if interpret else None
        try:
            fsm.vocab_parallel_linear_cross_entropy(x, W[start:end], target, vocab_start=start)
        except ValueError as e:
            assert "vocab_start and n_classes go together" in str(e), e
        else:
            raise AssertionError("vocab_start without n_classes was accepted")
        try:
            fsm.vocab_parallel_linear_cross_entropy(x, W[start:end, 0], target)
        except ValueError as e:
            assert "W_shard must have 2 dimensions" in str(e), e
        else:
            raise AssertionError("a 1-D W_shard was accepted")
        for name, options, reductions in CASES:
            opts = {k: (weight if k == "weight" else v) for k, v in options.items()}
            for reduction in reductions:
                whole = _grads(fsm.linear_cross_entropy, x, W, bias, target, reduction, opts, launch=launch)
                sharded = _grads(fsm.vocab_parallel_linear_cross_entropy, x, W[start:end], bias[start:end], target,
                                 reduction, opts, launch=launch)
                want = [*whole[:3], whole[3][start:end], *([whole[4][start:end]] if len(whole) > 4 else [])]
                for what, got, ref in zip(("loss", "lse", "dx", "dW", "dbias"), sharded, want):
                    _compare(f"rank {rank} of {world}, {name}, {reduction}, {what}", got, ref, dtype)
    finally:
        dist.destroy_process_group()


def _compare(label: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """In float32 the same sums in another order (the shards' log-sum-exps merged): within 8 units
    of float32 roundoff, relative to the result's size. In a 16-bit dtype cuBLAS may round a
    shard's logits otherwise than the whole's (another kernel for another shape) and dx is
    rounded on each rank before the group's sum: within 2 units of that dtype's roundoff."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, \
        f"{label}: {tuple(got.shape)} {got.dtype}, want {tuple(ref.shape)} {ref.dtype}"
    assert torch.equal(got.isnan(), ref.isnan()), f"{label}: NaN pattern differs"
    ok = ~ref.isnan()
    diff = (got[ok].double() - ref[ok].double()).norm().item()
    size = max(ref[ok].double().norm().item(), 1e-30)
    bound = 8 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert diff <= bound * size, f"{label}: relative difference {diff / size:.2e} > {bound:.1e}"


def measure(out: Path, shape: tuple) -> None:
    """Forward+backward bf16 timing and per-rank peak memory, one JSON line (rank 0 writes it)."""
    import torch.distributed as dist

    fsm = _kernels(False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    BT, H, V = shape
    sizes = shard_sizes(V, world)
    start = sum(sizes[:rank])
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(BT, H, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    # Each rank draws its own shard: the values do not matter to the time, only the shapes.
    W = (torch.randn(sizes[rank], H, generator=g, device=device) * H**-0.5).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, V, (BT,), generator=g, device=device)
    target[::17] = -100  # some ignored rows, as a batch of padded sequences has
    runs = {"vocab_parallel": lambda: fsm.vocab_parallel_linear_cross_entropy(x, W, target, n_classes=V,
                                                                             vocab_start=start)}
    if world == 1:
        runs["unsharded"] = lambda: fsm.linear_cross_entropy(x, W, target)
    records = []
    for name, loss_fn in runs.items():
        def step():
            loss = loss_fn()
            return torch.autograd.grad(loss, (x, W))

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
        # A fixed count on every rank: triton.testing.do_bench picks its count from a first
        # estimate per rank, which could leave one rank's collectives without partners.
        dist.barrier()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ROUNDS)]
        for _ in range(WARMUP):
            step()
        for begin, end in events:
            begin.record()
            step()
            end.record()
        torch.cuda.synchronize()
        ms = statistics.median(begin.elapsed_time(end) for begin, end in events)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"rank": rank, "ms": round(ms, 3), "peak_MiB_above_inputs": round(peak_mib, 1),
                                          "V_shard": sizes[rank]})
        slowest = max(r["ms"] for r in per_rank)
        records.append({"impl": name, "world": world, "BT": BT, "H": H, "V": V, "dtype": "bfloat16",
                        "fwd_bwd_ms": slowest, "tokens_per_s": round(BT / (slowest * 1e-3)),
                        "max_peak_MiB_per_gpu": max(r["peak_MiB_above_inputs"] for r in per_rank),
                        "gpu": torch.cuda.get_device_name(device), "ranks": per_rank})
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "vocab_parallel_linear_cross_entropy.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
                print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the JSON lines file")
    parser.add_argument("--shape", type=int, nargs=3, default=(8192, 4096, 128256), metavar=("BT", "H", "V"))
    args = parser.parse_args()
    measure(args.out, tuple(args.shape))
