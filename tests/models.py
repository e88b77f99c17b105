"""A decoder-only transformer to train, with PyTorch's attention and loss or the project's.

Random initialisation, no download. Configurations (``CONFIGS``):

* ``gpt2``: GPT-2 small's shape (12 layers, 12 heads of 64, width 768, vocabulary 50304, sequence
  1024): learned positions, LayerNorm, a GELU MLP of 4 x width, biases, the LM head tied to the
  token embedding.
* ``llama``: a Llama-3-8B-like block (width 4096, 32 query heads and 8 key/value heads of 128,
  SwiGLU of 14336, vocabulary 128256, sequence 2048): RMSNorm, rotary positions, no biases, an
  untied LM head; as many layers as one 80 GB H100 trains with room (see ``LLAMA_LAYERS``).
* ``tiny-gpt2``, ``tiny-llama``: the same blocks, small enough for the CPU and Triton's interpreter.

``impl`` picks the ops: "torch" (``F.scaled_dot_product_attention`` in (B, H, N, D), the logits
then ``F.cross_entropy``) or "project" (the project's flash attention, ``linear_cross_entropy``
on the last hidden states and the LM head's weight, no logits). Everything else is the same
module code, so a difference between the two is the ops' alone.

    model = Transformer(CONFIGS["gpt2"], impl="project").cuda()
    optimizer = make_optimizer(model)
    inputs, targets = token_batch(model.config, "cuda", seed=0)
    loss = train_step(model, optimizer, inputs, targets)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_softmax_matmul import flash_attention, linear_cross_entropy

IMPLS = ("torch", "project")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape and its block's choices (gpt2 or llama style)."""

    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    mlp_width: int
    vocab: int
    seq: int
    batch: int
    style: str  # "gpt2": learned positions, LayerNorm, GELU, biases, tied head; "llama": RMSNorm, rotary, SwiGLU

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def tokens(self) -> int:
        """Tokens a training step sees (batch x sequence)."""
        return self.batch * self.seq

    def check(self) -> None:
        if self.style not in ("gpt2", "llama"):
            raise ValueError(f"style must be 'gpt2' or 'llama', got {self.style!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (grouped-query)")
        if self.style == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")


# Memory of the llama configuration trained in bfloat16 autocast with fused AdamW (float32
# parameters, gradients and two moments: 16 bytes a parameter), batch 2 x 2048 tokens:
#   embedding and LM head 2 x 128256 x 4096 = 1.05 G parameters; a layer 218 M (attention
#   2 x 4096^2 + 2 x 4096 x 1024 = 42 M, SwiGLU 3 x 4096 x 14336 = 176 M).
#   4 layers: 1.92 G parameters -> 30.7 GB of parameters, gradients and moments; 3.8 GB of
#   autocast's bfloat16 weight copies; ~1 GB of saved activations a layer (~250 KB a token: the
#   float32 residual and norm inputs, each product's bfloat16 input, the SwiGLU's 3 x 14336-wide
#   bfloat16 intermediates, q, k, v and the attention's output); PyTorch's loss adds the float32
#   logits, their log-softmax and gradients (4096 x 128256 x 4 B = 2.1 GB each, ~8 GB at its
#   peak): ~47 GB with torch's ops.
#   8 layers: 2.8 G parameters, ~67 GB: too little room left on an 80 GB card for
#   torch.compile's workspaces and the allocator's fragmentation.
LLAMA_LAYERS = 4

CONFIGS = {
    "gpt2": ModelConfig("gpt2", layers=12, width=768, heads=12, kv_heads=12, mlp_width=3072,
                        vocab=50304, seq=1024, batch=8, style="gpt2"),
    "llama": ModelConfig("llama", layers=LLAMA_LAYERS, width=4096, heads=32, kv_heads=8, mlp_width=14336,
                         vocab=128256, seq=2048, batch=2, style="llama"),
    # Head dim 16 (the smallest the flash kernels take) and a short sequence: the interpreter
    # runs every program of every kernel one after another.
    "tiny-gpt2": ModelConfig("tiny-gpt2", layers=2, width=32, heads=2, kv_heads=2, mlp_width=128,
                             vocab=96, seq=32, batch=2, style="gpt2"),
    "tiny-llama": ModelConfig("tiny-llama", layers=2, width=64, heads=4, kv_heads=2, mlp_width=96,
                              vocab=96, seq=32, batch=2, style="llama"),
}


def parameter_count(config: ModelConfig) -> int:
    """Trainable parameters (a tied head counted once), from the shape alone."""
    w, kv = config.width, config.kv_heads * config.head_dim
    bias = config.style == "gpt2"
    attention = w * (w + 2 * kv) + w * w + (w + 2 * kv + w if bias else 0)
    if config.style == "gpt2":
        mlp = 2 * w * config.mlp_width + (config.mlp_width + w)
        norms = 2 * 2 * w  # weight and bias of two LayerNorms
        outer = config.vocab * w + config.seq * w + 2 * w  # tied embedding, positions, final norm
    else:
        mlp = 3 * w * config.mlp_width
        norms = 2 * w
        outer = 2 * config.vocab * w + w
    return config.layers * (attention + mlp + norms) + outer


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
    """Causal attention, 1/sqrt(head dim) scale. q: (B, H, N, D); k, v: (B, H_kv, N, D) with H a
    multiple of H_kv (grouped-query) -> (B, H, N, D). Both take the views as they lie."""
    attend = F.scaled_dot_product_attention if impl == "torch" else flash_attention
    return attend(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def rotary_tables(seq: int, head_dim: int, base: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq, head_dim) of rotary positions, halves paired as in ``rotate_half``; base
    500000 as Llama 3's."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, N, D) rotated by position; cos, sin: (N, D), taken in x's dtype (autocast's)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Block(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        gpt2 = config.style == "gpt2"
        norm = (lambda: nn.LayerNorm(config.width)) if gpt2 else (lambda: RMSNorm(config.width))
        kv = config.kv_heads * config.head_dim
        self.norm_1, self.norm_2 = norm(), norm()
        self.qkv = nn.Linear(config.width, config.width + 2 * kv, bias=gpt2)
        self.out = nn.Linear(config.width, config.width, bias=gpt2)
        if gpt2:
            self.up = nn.Linear(config.width, config.mlp_width)
        else:
            self.up = nn.Linear(config.width, 2 * config.mlp_width, bias=False)  # gate and up, side by side
        self.down = nn.Linear(config.mlp_width, config.width, bias=gpt2)

    def forward(self, x: torch.Tensor, impl: str, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        c = self.config
        B, N, _ = x.shape
        q, k, v = self.qkv(self.norm_1(x)).split([c.width, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1)
        q = q.view(B, N, c.heads, c.head_dim).transpose(1, 2)
        k = k.view(B, N, c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, N, c.kv_heads, c.head_dim).transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos[:N], sin[:N]), apply_rotary(k, cos[:N], sin[:N])
        y = attention(q, k, v, impl).transpose(1, 2).reshape(B, N, c.width)
        x = x + self.out(y)
        h = self.up(self.norm_2(x))
        if c.style == "gpt2":
            h = F.gelu(h, approximate="tanh")
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return x + self.down(h)


class Transformer(nn.Module):
    """``model(inputs, targets)`` -> the mean next-token loss (float32, 0-d).

    inputs, targets: (batch, n) int64 token ids, n <= config.seq. ``impl`` ("torch" or
    "project") picks the attention and the loss; it may be changed between calls.
    """

    def __init__(self, config: ModelConfig, impl: str = "torch", seed: int = 0):
        super().__init__()
        config.check()
        self.config = config
        self.impl = impl
        self.embed = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.seq, config.width) if config.style == "gpt2" else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width) if config.style == "gpt2" else RMSNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        if config.style == "gpt2":
            self.lm_head.weight = self.embed.weight
            self.rotary = None
        else:
            cos, sin = rotary_tables(config.seq, config.head_dim)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters(seed)

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, impl: str) -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self._impl = impl

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2's initialisation: normal(0, 0.02) weights, the residual stream's output products
        scaled by 1/sqrt(2 x layers) (one sum of 2 x layers terms stays of unit scale), zero
        biases, unit norms. Drawn from ``seed`` on the parameters' device, so two models built
        alike on one device start equal."""
        generator = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, p in self.named_parameters():
            if name.endswith(("out.weight", "down.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            elif p.dim() == 2:
                p.normal_(0.0, 0.02, generator=generator)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """The final norm's output (batch, n, width)."""
        n = inputs.shape[1]
        x = self.embed(inputs)
        rotary = None
        if self.positions is not None:
            x = x + self.positions(torch.arange(n, device=inputs.device))
        else:
            rotary = (self.cos, self.sin)
        for block in self.blocks:
            x = block(x, self.impl, rotary)
        return self.norm(x)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.hidden(inputs).flatten(0, 1)
        targets = targets.flatten()
        if self.impl == "torch":
            # Logits in float32 at least, as autocast would give F.cross_entropy anyway.
            logits = self.lm_head(h)
            return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
        return linear_cross_entropy(h, self.lm_head.weight, targets)


def token_batch(config: ModelConfig, device, seed: int = 0, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): (batch, seq) random token ids and the same sequences shifted by one."""
    batch = config.batch if batch is None else batch
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, config.vocab, (batch, config.seq + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def make_optimizer(model: nn.Module, lr: float = 3e-4) -> torch.optim.Optimizer:
    """AdamW over every parameter, fused (one kernel for all) where the parameters are on CUDA."""
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=fused)


def train_step(model, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               autocast: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """One training step: forward (under autocast to ``autocast`` unless None), backward, the
    optimizer's step, gradients set to None. ``model`` may be torch.compile's wrapper. Returns
    the loss, detached (reading it back is the caller's choice: no host sync here)."""
    context = torch.autocast(inputs.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with context:
        loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
