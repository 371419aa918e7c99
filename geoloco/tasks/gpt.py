"""The built-in model: a GPT-style decoder following nanoGPT (Karpathy) in a smaller form,
in four preset sizes; byte-level (256 tokens) unless the task has a tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoloco.config import MODEL_PRESETS, ConfigError

VOCAB_SIZE = 256  # byte-level: bytes are the tokens, no tokenizer to ship, any text file works
INIT_STD = 0.02  # GPT-2's weight init; residual projections get 0.02 / sqrt(2 * n_layer)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder. Parameters are about 12 * n_layer * d_model**2 (the blocks)
    plus (vocab_size + block_size) * d_model (the embeddings; the head is tied)."""

    n_layer: int
    n_head: int
    d_model: int
    block_size: int  # longest sequence the learned positional embedding covers
    vocab_size: int = VOCAB_SIZE


# name -> (n_layer, n_head, d_model); the sizes are the parameter counts at seq_len 64.
PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt-nano": (2, 2, 64),  # ~0.12M: hundreds of simulated workers in one process (benchmarks.simclock)
    "gpt-tiny": (5, 4, 128),  # ~1.03M: tests and demos on a few CPU cores
    "gpt-small": (6, 6, 384),  # ~10.7M: nanoGPT's shakespeare-char shape
    "gpt-medium": (10, 8, 512),  # ~31.6M
    "gpt-100m": (15, 12, 768),  # ~106M: GPU runs
}
assert tuple(PRESETS) == MODEL_PRESETS, "keep PRESETS in step with geoloco.config.MODEL_PRESETS"


def gpt_config(model: str, seq_len: int, vocab_size: int = VOCAB_SIZE) -> GPTConfig:
    """The GPTConfig of a preset name for sequences of ``seq_len`` tokens."""
    if model not in PRESETS:
        raise ConfigError(f"task.model: {model!r} is not one of {', '.join(PRESETS)}")
    n_layer, n_head, d_model = PRESETS[model]
    return GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, block_size=seq_len,
                     vocab_size=vocab_size)


# ---------------------------------------------------------------------------- the model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (fused by scaled_dot_product_attention)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    """Position-wise feed-forward: d -> 4d -> GELU -> d."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. The output head is tied to the token embedding (logits = h @ wte.T),
    so ``named_parameters()`` lists each tensor once: wte, wpe, blocks.*, ln_f."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (batch, time, vocab_size) for token ids ``idx`` of shape (batch, time)."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def init_weights(model: GPT, seed: int) -> None:
    """GPT-2 init from one CPU generator, walking parameters in their stable order, so the
    same seed gives bit-identical weights on any machine and independent of torch's global RNG."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * model.cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("ln") or ".ln" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith("proj.weight") else INIT_STD
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))


def build_model(model: str, seq_len: int, seed: int, vocab_size: int = VOCAB_SIZE) -> GPT:
    """A preset model on CPU, initialised from ``seed``; torch's default init runs under a
    forked RNG, so the caller's global RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        gpt = GPT(gpt_config(model, seq_len, vocab_size))
    init_weights(gpt, seed)
    return gpt


def count_parameters(model: str, seq_len: int = 64, vocab_size: int = VOCAB_SIZE) -> int:
    """Parameter count of a preset, computed from its shape without building it."""
    cfg = gpt_config(model, seq_len, vocab_size)
    d = cfg.d_model
    per_block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LN 4d
    return (cfg.vocab_size + cfg.block_size) * d + cfg.n_layer * per_block + 2 * d
