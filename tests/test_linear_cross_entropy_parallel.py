"""vocab_parallel_linear_cross_entropy: W sharded by rows over a process group, against the unsharded call.

Each test spawns ``world`` processes (tests/vocab_parallel_worker.py's ``check_worker``): gloo on
the CPU with the interpreter (two processes, small shapes: what CI runs), NCCL with one GPU each
(2 and 4 GPUs, skipped with the reason where fewer exist). Every process compares the loss, lse,
dx, its dW shard and its bias shard with the unsharded ``linear_cross_entropy`` it runs itself,
without options and with all of them, for reductions mean / sum / none, with ignored rows and an
uneven split of the vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed
import torch.multiprocessing

from support import ON_GPU
from vocab_parallel_worker import check_worker, shard_sizes

needs_distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def spawn(tmp_path, world: int, backend: str, shape: tuple, dtype: str) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    torch.multiprocessing.spawn(check_worker, args=(world, backend, init, not ON_GPU, shape, dtype), nprocs=world,
                                join=True)


def test_shard_sizes_cover_the_vocabulary_unevenly():
    assert shard_sizes(37, 2) == [19, 18] and shard_sizes(37, 4) == [10, 9, 9, 9] and shard_sizes(8, 4) == [2] * 4


@needs_distributed
@pytest.mark.skipif(ON_GPU or not torch.distributed.is_gloo_available(),
                    reason="the CPU form (gloo, interpreter); on a GPU the NCCL tests run")
def test_two_cpu_processes_match_the_unsharded_call(tmp_path):
    """13 rows (chunks of 8: one ragged), V = 37 split 19 + 18, float32."""
    spawn(tmp_path, 2, "gloo", (13, 16, 37), "float32")


@needs_distributed
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_matches_the_unsharded_call(tmp_path, world):
    """bfloat16 at 1000 x 256 x 5003 (a vocabulary no multiple of the ranks), one GPU per process."""
    if not ON_GPU:
        pytest.skip("needs GPUs running compiled Triton")
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL here")
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible (under pytest-xdist each worker sees "
                    "one: run this file with -n 0)")
    spawn(tmp_path, world, "nccl", (1000, 256, 5003), "bfloat16")


@needs_distributed
def test_without_a_process_group_is_a_clear_error():
    from fused_softmax_matmul import vocab_parallel_linear_cross_entropy

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x = torch.zeros(4, 8, device="cuda" if ON_GPU else "cpu")
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        vocab_parallel_linear_cross_entropy(x, torch.zeros(5, 8, device=x.device), torch.zeros(4, dtype=torch.long,
                                                                                               device=x.device))
