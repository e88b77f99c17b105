"""Training steps of tests/models.py's transformer under torch.distributed, one process per device.

Launched by tests/test_distributed.py, with torch's launcher for several processes::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_worker.py \\
        --config gpt2-small --runs ddp/eager/bfloat16,fsdp/compile/bfloat16 --out DIR

or as a plain script for the one-process references (``--runs single/eager/bfloat16,...``).
Every run builds the model from the same initialisation, trains ``--steps`` steps on the same
global batch (``token_batch`` with ``--batch`` rows, the same on every rank), and records each
step's loss. A rank of a world of W trains on its 1/W of the rows: the mean of the ranks' losses
is the global batch's mean loss (equal rows, equal tokens per rank), and DDP and FSDP2 average
the ranks' gradients, so in exact arithmetic every run follows the one-process run's trajectory.

A run is ``WRAPPER/MODE/PRECISION[/IMPL]`` (its name in the JSON always has all four):

* WRAPPER: ``single`` (one process, no wrapper), ``ddp`` (``DistributedDataParallel``) or
  ``fsdp`` (FSDP2: ``fully_shard`` on each block, then on the whole model);
* MODE: ``eager`` or ``compile`` (``torch.compile`` of the wrapped model);
* PRECISION: ``bfloat16`` (float32 parameters, bfloat16 autocast), ``float32`` or ``float64``
  (parameters and compute in that dtype, no autocast; the project's kernels take no float64);
* IMPL: the attention and loss, ``project`` or ``torch`` (default ``--impl``, the project's).
 Each rank writes
``OUT/rank<R>.json``: {"world", "backend", "device", "runs": {run: {"losses", "param_norm",
"seconds"}}}, ``losses`` being the rank's own (its rows') losses. ``param_norm`` is the 2-norm of
every parameter after the last step as the rank holds it: a DDP replica (the ranks must agree)
or the whole model gathered from the FSDP2 shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the kernel modules (repository root) and tests/models.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if not torch.cuda.is_available():
    # As conftest.py does: Triton reads TRITON_INTERPRET when the kernel modules decorate their kernels.
    os.environ["TRITON_INTERPRET"] = "1"

from models import CONFIGS, IMPLS, Transformer, make_optimizer, token_batch, train_step  # noqa: E402

WRAPPERS = ("single", "ddp", "fsdp")
MODES = ("eager", "compile")
PRECISIONS = {"bfloat16": (torch.float32, torch.bfloat16), "float32": (torch.float32, None),
              "float64": (torch.float64, None)}  # name -> (parameter dtype, autocast dtype)

# A GPU configuration that trains in seconds: GPT-2 small's width, heads and vocabulary (the LM
# head at its real size, the loss's largest operand), two layers, a short sequence.
EXTRA_CONFIGS = {"gpt2-small": dataclasses.replace(CONFIGS["gpt2"], name="gpt2-small", layers=2, seq=256, batch=8)}


def config_named(name: str):
    configs = {**CONFIGS, **EXTRA_CONFIGS}
    if name not in configs:
        raise SystemExit(f"--config must be one of {sorted(configs)}, got {name!r}")
    return configs[name]


def parse_run(spec: str, impl: str) -> tuple[str, str, str, str]:
    """``WRAPPER/MODE/PRECISION[/IMPL]`` -> (wrapper, mode, precision, impl), IMPL by default ``impl``."""
    parts = tuple(spec.split("/"))
    parts = parts + (impl,) if len(parts) == 3 else parts
    if (len(parts) != 4 or parts[0] not in WRAPPERS or parts[1] not in MODES or parts[2] not in PRECISIONS
            or parts[3] not in IMPLS):
        raise SystemExit(f"--runs: {spec!r} is not WRAPPER/MODE/PRECISION[/IMPL] with WRAPPER one of {WRAPPERS}, "
                         f"MODE one of {MODES}, PRECISION one of {tuple(PRECISIONS)}, IMPL one of {IMPLS}")
    return parts


def wrap(model: torch.nn.Module, wrapper: str, device: torch.device) -> torch.nn.Module:
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        # The root holds the embedding, the final norm and the LM head (tied to the embedding in
        # gpt2's style: one parameter, so both live in the same shard group).
        return fully_shard(model)
    return model


def param_norm(model: torch.nn.Module) -> float:
    """The 2-norm of all parameters; FSDP2's sharded parameters (DTensors) as the whole tensors."""
    squares = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        local = p.full_tensor() if hasattr(p, "full_tensor") else p
        squares += local.detach().double().square().sum()
    return squares.sqrt().item()


def train(config, wrapper: str, mode: str, precision: str, impl: str, steps: int, batch: int,
          device: torch.device, rank: int, world: int) -> dict:
    param_dtype, autocast = PRECISIONS[precision]
    with torch.device(device):
        model = Transformer(config, impl=impl, seed=0).to(param_dtype)
    model = wrap(model, wrapper, device)
    optimizer = make_optimizer(model)
    call = torch.compile(model, dynamic=False) if mode == "compile" else model
    inputs, targets = token_batch(config, device, seed=0, batch=batch)
    rows = batch // world
    inputs, targets = inputs[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows]
    start = time.perf_counter()
    losses = [train_step(call, optimizer, inputs, targets, autocast) for _ in range(steps)]
    losses = torch.stack(losses).tolist()  # one read-back, after the last step
    seconds = time.perf_counter() - start
    norm = param_norm(model)
    if mode == "compile":
        torch._dynamo.reset()  # the next run's model gets graphs of its own
    return {"losses": losses, "param_norm": norm, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help=f"one of {sorted({**CONFIGS, **EXTRA_CONFIGS})}")
    parser.add_argument("--impl", default="project", choices=IMPLS, help="the runs' ops where a run names none")
    parser.add_argument("--runs", required=True, help="comma-separated WRAPPER/MODE/PRECISION[/IMPL]")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="the global batch's rows (default: the config's)")
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<R>.json")
    args = parser.parse_args(argv)
    config = config_named(args.config)
    runs = [parse_run(spec, args.impl) for spec in args.runs.split(",") if spec]
    batch = args.batch or config.batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    distributed = any(run[0] != "single" for run in runs)
    if distributed and "WORLD_SIZE" not in os.environ:
        raise SystemExit("ddp and fsdp runs need torch's launcher (python -m torch.distributed.run)")
    if not distributed and world != 1:
        raise SystemExit("single runs are one process: run them without the launcher")
    if batch % world:
        raise SystemExit(f"--batch {batch} must be a multiple of the world size {world}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if distributed:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        results = {"/".join(run): train(config, *run, steps=args.steps, batch=batch, device=device,
                                        rank=rank, world=world)
                   for run in runs}
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"world": world, "rank": rank, "backend": backend if distributed else None, "device": str(device),
                  "config": args.config, "batch": batch, "runs": results}
        (args.out / f"rank{rank}.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if distributed:
            # Every rank past its last collective before the group goes: without, a rank aborted
            # (std::terminate in gloo) about once in four runs on loaded CPUs.
            dist.barrier()
    except BaseException:
        if distributed:
            dist.destroy_process_group()
        raise
    if distributed:
        # The record is written and every rank is past its collectives: leave without tearing the
        # group and the interpreter down, where gloo's threads still aborted a rank now and then on
        # loaded CPUs after the barrier (std::terminate "without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
