"""The project's attention and loss under torch.distributed: DDP and FSDP2 train like one device.

tests/distributed_worker.py trains tests/models.py's transformer a few steps on the same global
batch, split over two processes by torch's launcher (``python -m torch.distributed.run``), with
``DistributedDataParallel`` and with FSDP2 (``fully_shard``); the same function trains it in this
process on one device. The mean of the ranks' losses at each step must be the one-device run's
within the rounding noise of the precision trained in:

    noise = max over steps |one device's loss - the same steps in a higher precision|
    max over steps |distributed loss - one device's loss| <= 2 x noise + 4 float32 roundings of the loss

A distributed run is another rounding of the same sums (the gradients all-reduced or
reduce-scattered, each rank's products over its own rows): it may be as far from the exact losses
as the one-device run is, in the other direction, hence twice. The floor covers steps where the
two precisions happen to agree. The higher precision is PyTorch's ops (the project's kernels
take no float64), from the same initialisation and batch. The one-device run must move its loss
by more than the bound over the steps, so a distributed run that did not train alike (a rank
keeping its own gradients) cannot pass; DDP's replicas must also end with equal parameters.

* GPU (two or more, NCCL, one process per GPU): a two-layer model of GPT-2 small's width and
  vocabulary, sequence 256, global batch 8, five steps in bfloat16 autocast (noise: against
  float32), eager and ``torch.compile(model)``, each against the one-GPU run of the same mode.
* CPU (Triton's interpreter, gloo, two processes): the tiny gpt2-style config in float32 (noise:
  against float64), three steps, DDP and FSDP2 eager (torch 2.13's FSDP2 runs on the CPU with gloo). Compiled runs are not: Inductor compiles C++ for tens
  of seconds on the CPU.

Under pytest-xdist the launched processes see every GPU the run was given, not only the worker's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import WORKER_GPUS_ENV
from distributed_worker import config_named, train
from support import DEVICE, ON_GPU, UNIT_ROUNDOFF

WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
WORLD = 2

if ON_GPU:
    CONFIG, LOW, HIGH = "gpt2-small", "bfloat16", "float32"
    RUNS = [(wrapper, mode) for mode in ("eager", "compile") for wrapper in ("ddp", "fsdp")]
    BACKEND = "nccl"
    STEPS = 5
    TIMEOUT_S = 540  # four models built and trained, two of them compiled, per process
else:
    CONFIG, LOW, HIGH = "tiny-gpt2", "float32", "float64"
    RUNS = [("ddp", "eager"), ("fsdp", "eager")]
    BACKEND = "gloo"
    STEPS = 3  # the interpreter's kernels are most of the test's time
    TIMEOUT_S = 180  # about 20 s on two loaded cores


def run_gpus() -> str | None:
    """Under pytest-xdist, the run's GPUs (CUDA_VISIBLE_DEVICES' entries) of which this worker sees one."""
    return os.environ.get(WORKER_GPUS_ENV) or None


def gpu_count() -> int:
    return len(run_gpus().split(",")) if run_gpus() else torch.cuda.device_count()


def skip_reason() -> str | None:
    if ON_GPU and gpu_count() < WORLD:
        return f"needs {WORLD} GPUs, this run has {gpu_count()}"
    if not dist.is_available() or not (dist.is_nccl_available() if ON_GPU else dist.is_gloo_available()):
        return f"this torch has no {BACKEND} backend"
    return None


def launch(runs: list[str], out: Path) -> list[dict]:
    """The worker under torch's launcher, WORLD processes; each rank's record."""
    env = dict(os.environ)  # NCCL's, NVSHMEM's and torch's settings of this machine pass through
    if ON_GPU and run_gpus():
        env["CUDA_VISIBLE_DEVICES"] = run_gpus()  # the launched processes take the run's GPUs, not the worker's one
    elif not ON_GPU:
        env["TRITON_INTERPRET"] = "1"  # read when the kernel modules import, in each process
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               str(WORKER), "--config", CONFIG, "--steps", str(STEPS), "--runs", ",".join(runs), "--out", str(out)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(command)} did not end in {TIMEOUT_S} s; its output:\n"
                             f"{(e.stdout or '')[-3000:]}{(e.stderr or '')[-3000:]}") from None
    if done.returncode:
        raise AssertionError(f"{' '.join(command)} exited with {done.returncode}; its output ends:\n"
                             f"{(done.stdout + done.stderr)[-6000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in range(WORLD)]


def one_device(mode: str, precision: str, impl: str = "project") -> dict:
    config = config_named(CONFIG)
    return train(config, "single", mode, precision, impl, steps=STEPS, batch=config.batch,
                 device=torch.device(DEVICE, torch.cuda.current_device()) if ON_GPU else torch.device("cpu"),
                 rank=0, world=1)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_distributed_training_matches_one_device(tmp_path):
    names = {run: f"{run[0]}/{run[1]}/{LOW}/project" for run in RUNS}
    ranks = launch(list(names.values()), tmp_path)
    assert [r["world"] for r in ranks] == [WORLD] * WORLD and {r["backend"] for r in ranks} == {BACKEND}

    high = one_device("eager", HIGH, impl="torch")["losses"]
    problems = []
    for mode in dict.fromkeys(mode for _, mode in RUNS):
        single = one_device(mode, LOW)
        noise = max_abs_diff(single["losses"], high)
        bound = 2 * noise + 4 * UNIT_ROUNDOFF[torch.float32] * max(map(abs, high))
        moved = abs(single["losses"][-1] - single["losses"][0])
        assert moved > bound, (f"{CONFIG} {mode}: the one-device loss moved {moved:.3e} over {STEPS} steps, not more "
                               f"than the bound {bound:.3e}: the test could not tell a run that did not train")
        for run, name in names.items():
            if run[1] != mode:
                continue
            per_rank = [r["runs"][name] for r in ranks]
            losses = [sum(step) / WORLD for step in zip(*(r["losses"] for r in per_rank))]
            diff = max_abs_diff(losses, single["losses"])
            # The record of the run (pytest -rP shows it): what the bound was met or missed by.
            print(f"{name} ({BACKEND}, {WORLD} processes, {STEPS} steps): losses {[f'{v:.6f}' for v in losses]}, "
                  f"one device {[f'{v:.6f}' for v in single['losses']]}, max diff {diff:.3e}, bound {bound:.3e} "
                  f"(noise {noise:.3e}), {max(r['seconds'] for r in per_rank):.1f} s")
            if diff > bound:
                problems.append(f"{name}: losses {losses} are {diff:.3e} from one device's {single['losses']}, more "
                                f"than twice its {LOW} noise {noise:.3e} (against {HIGH}) plus the floor: {bound:.3e}")
            norms = [r["param_norm"] for r in per_rank]
            if run[0] == "ddp" and len(set(norms)) != 1:
                problems.append(f"{name}: the ranks' replicas differ after {STEPS} steps (parameter norms {norms})")
    assert not problems, "\n".join(problems)
