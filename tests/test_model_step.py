"""Training steps of the tiny models (tests/models.py): the project's attention and loss give
PyTorch's losses and gradients.

float32 on the CPU (Triton's interpreter), judged against the same model with PyTorch's ops in
float64 from the same initialisation and batch: the project's error may be at most twice
PyTorch's float32 error plus a few float32 roundings (``support.assert_close``, FlashAttention's
rule). Both float32 runs round differently (the flash attention's online softmax, the loss's
chunks), so neither is the other's reference; float64 is both's.
"""

from __future__ import annotations

import pytest
import torch

from models import CONFIGS, Transformer, make_optimizer, token_batch
from support import DEVICE, assert_close

# Three steps: the first's gradients from the shared initialisation, then losses of parameters
# that AdamW moved with each run's own gradients.
STEPS = 3


def train(config: str, impl: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """(the loss at each step, the first step's gradients by parameter name)."""
    with torch.device(DEVICE):
        model = Transformer(CONFIGS[config], impl=impl, seed=0).to(dtype)
    optimizer = make_optimizer(model)
    inputs, targets = token_batch(model.config, DEVICE, seed=0)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(inputs, targets)
        loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), grads


@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama"])
def test_training_steps_match_torch(config):
    ref_losses, ref_grads = train(config, "torch", torch.float64)
    torch_losses, torch_grads = train(config, "torch", torch.float32)
    losses, grads = train(config, "project", torch.float32)
    assert losses.dtype == torch.float32 and grads.keys() == ref_grads.keys()
    assert_close(losses, ref_losses, torch_losses)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, f"{name}: no gradient"
        try:
            assert_close(grad, ref_grads[name], torch_grads[name])
        except AssertionError as e:
            raise AssertionError(f"{config} gradient of {name}: {e}") from None
