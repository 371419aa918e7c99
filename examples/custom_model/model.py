"""A model of your own for GeoLoCo: any ``nn.Module`` from a factory named in the run config
as ``task.model = "examples/custom_model/model.py:make_model"``.

The factory gets a ``geoloco.tasks.ModelSpec`` (``vocab_size``, ``seq_len``, ``seed``;
torch's RNG is already seeded from ``seed``) and returns the model, or ``(model, loss)``
where ``loss(model, (inputs, targets))`` is the scalar the inner loop minimises and the
validation loss reports. Inputs and targets are (batch, seq_len) int64 token ids, the
targets the inputs shifted by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Z_LOSS = 1e-4  # PaLM's z-loss: keeps the softmax normaliser near 1 (Chowdhery et al. 2022)


class GRULanguageModel(nn.Module):
    """Embedding, a two-layer GRU, and an output head tied to the embedding."""

    def __init__(self, vocab_size: int, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.rnn = nn.GRU(width, width, num_layers=layers, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: the replicas share it once
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits at the start: loss ~ ln(vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(self.norm(hidden))


def cross_entropy_with_z_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    inputs, targets = batch
    device = next(model.parameters()).device
    logits = model(inputs.to(device)).float()
    flat = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat, targets.to(device).reshape(-1))
    return ce + Z_LOSS * torch.logsumexp(flat, dim=-1).pow(2).mean()


def make_model(spec):  # spec: geoloco.tasks.ModelSpec
    return GRULanguageModel(spec.vocab_size), cross_entropy_with_z_loss
