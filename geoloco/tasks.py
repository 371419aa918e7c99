"""Tasks: a GPT-style byte-level decoder and its corpus, split into n training partitions
plus a held-out validation split; the model follows nanoGPT (Karpathy) in a smaller form.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoloco.config import MODEL_PRESETS, ConfigError, TaskConfig

VOCAB_SIZE = 256  # bytes are the tokens: no tokenizer to ship, any text file works
VAL_FRACTION = 0.05  # the last 5 % of the corpus is held out for validation
INIT_STD = 0.02  # GPT-2's weight init; residual projections get 0.02 / sqrt(2 * n_layer)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder. Parameters are about 12 * n_layer * d_model**2 (the blocks)
    plus (VOCAB_SIZE + block_size) * d_model (the embeddings; the head is tied)."""

    n_layer: int
    n_head: int
    d_model: int
    block_size: int  # longest sequence the learned positional embedding covers


# name -> (n_layer, n_head, d_model); the sizes are the parameter counts at seq_len 64.
PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt-tiny": (5, 4, 128),  # ~1.03M: tests and demos on a few CPU cores
    "gpt-small": (6, 6, 384),  # ~10.7M: nanoGPT's shakespeare-char shape
    "gpt-medium": (10, 8, 512),  # ~31.6M
    "gpt-100m": (15, 12, 768),  # ~106M: GPU runs
}
assert tuple(PRESETS) == MODEL_PRESETS, "keep PRESETS in step with geoloco.config.MODEL_PRESETS"


def gpt_config(model: str, seq_len: int) -> GPTConfig:
    """The GPTConfig of a preset name for sequences of ``seq_len`` bytes."""
    if model not in PRESETS:
        raise ConfigError(f"task.model: {model!r} is not one of {', '.join(PRESETS)}")
    n_layer, n_head, d_model = PRESETS[model]
    return GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, block_size=seq_len)


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
    """Byte-level decoder. The output head is tied to the token embedding (logits = h @ wte.T),
    so ``named_parameters()`` lists each tensor once: wte, wpe, blocks.*, ln_f."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (batch, time, VOCAB_SIZE) for byte ids ``idx`` of shape (batch, time)."""
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


def build_model(model: str, seq_len: int, seed: int) -> GPT:
    """A preset model on CPU, initialised from ``seed``; torch's default init runs under a
    forked RNG, so the caller's global RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        gpt = GPT(gpt_config(model, seq_len))
    init_weights(gpt, seed)
    return gpt


def count_parameters(model: str, seq_len: int = 64) -> int:
    """Parameter count of a preset, computed from its shape without building it."""
    cfg = gpt_config(model, seq_len)
    d = cfg.d_model
    per_block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LN 4d
    return (VOCAB_SIZE + cfg.block_size) * d + cfg.n_layer * per_block + 2 * d


# ---------------------------------------------------------------------------- the corpus

_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> Path:
    """The running Python's standard library folder, the default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path, suffix: str) -> list[Path]:
    """Files under ``root`` ending in ``suffix``, sorted by relative path, skipping
    site-packages, __pycache__ and hidden folders (pruned while walking, which keeps it fast)."""
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(root)
        found += [((rel / n).as_posix(), Path(folder, n)) for n in names if n.endswith(suffix)]
    return [path for _, path in sorted(found)]


def _read_text(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of the file if they are non-empty UTF-8 text (a character cut
    at the limit is allowed), else None: binary test data and other encodings are skipped."""
    with path.open("rb") as f:
        data = f.read(limit)
    if not data or b"\x00" in data:
        return None
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return None
    return data


@functools.lru_cache(maxsize=4)
def load_corpus(data: str | None, max_bytes: int) -> bytes:
    """Concatenate text files in sorted order up to ``max_bytes``: the stdlib's ``*.py``
    sources when ``data`` is None, else the file ``data`` or every text file under it.
    Cached per process, since coordinator and workers build the same task."""
    if data is None:
        files = _text_files(stdlib_root(), ".py")
    else:
        path = Path(data)
        files = [path] if path.is_file() else _text_files(path, "")
    parts, total = [], 0
    for f in files:
        text = _read_text(f, max_bytes - total)
        if text is not None:
            parts.append(text)
            total += len(text)
        if total >= max_bytes:
            break
    return b"".join(parts)


# ---------------------------------------------------------------------------- the task


def _step_seed(seed: int, partition: int, step: int) -> int:
    """A 63-bit generator seed that is a fixed function of (seed, partition, step)."""
    digest = hashlib.sha256(f"geoloco-batch/{seed}/{partition}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Task:
    """The corpus split into ``n_partitions`` contiguous training partitions and a held-out
    validation tail, with deterministic batches and the matching model."""

    def __init__(self, cfg: TaskConfig, corpus: bytes, n_partitions: int, seed: int) -> None:
        if n_partitions < 1:
            raise ConfigError(f"n_partitions: {n_partitions} is outside the allowed range 1..")
        self.cfg = cfg
        self.seed = seed
        self.n_partitions = n_partitions
        self.corpus_bytes = len(corpus)
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        self.val_start = self.corpus_bytes - self._val_size()
        self.bounds = self._partition_bounds()
        self.partition_sizes = [end - start for start, end in self.bounds]
        self.val_offsets = self._val_offsets()
        self._val = self._val_batches()

    @property
    def window(self) -> int:
        """Bytes one sequence needs: seq_len inputs plus the shifted target."""
        return self.cfg.seq_len + 1

    def _val_size(self) -> int:
        """5 % of the corpus, and at least room for every validation sequence side by side."""
        needed = self.cfg.val_batches * self.cfg.batch_size * self.window
        return max(math.ceil(VAL_FRACTION * self.corpus_bytes), needed)

    def _partition_bounds(self) -> list[tuple[int, int]]:
        base, extra = divmod(self.val_start, self.n_partitions)
        if base < self.window:
            where = self.cfg.data or f"the stdlib sources ({stdlib_root()})"
            raise ConfigError(
                f"corpus too small: {self.corpus_bytes} bytes from {where} (task.corpus_bytes "
                f"{self.cfg.corpus_bytes}) leave {self.val_start} training bytes for "
                f"{self.n_partitions} partitions of at least {self.window} bytes (seq_len + 1) each "
                f"after a {self.corpus_bytes - self.val_start}-byte validation split; "
                "give more text or a smaller seq_len, batch_size or val_batches"
            )
        bounds, start = [], 0
        for i in range(self.n_partitions):
            end = start + base + (1 if i < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds

    def _windows(self, offsets: Tensor) -> tuple[Tensor, Tensor]:
        chunk = self.data[offsets[:, None] + torch.arange(self.window)].long()
        return chunk[:, :-1], chunk[:, 1:]

    def _val_offsets(self) -> Tensor:
        """Fixed, evenly spaced, non-overlapping windows over the validation split."""
        n = self.cfg.val_batches * self.cfg.batch_size
        last = self.corpus_bytes - self.window
        return torch.linspace(self.val_start, last, n, dtype=torch.float64).long()

    def _val_batches(self) -> list[tuple[Tensor, Tensor]]:
        x, y = self._windows(self.val_offsets)
        return list(zip(x.split(self.cfg.batch_size), y.split(self.cfg.batch_size), strict=True))

    def batch(self, partition: int, step: int) -> tuple[Tensor, Tensor]:
        """Inputs and next-byte targets, both (batch_size, seq_len) int64, at random offsets
        inside ``partition`` drawn from a generator seeded by (seed, partition, step)."""
        return self._windows(self.batch_offsets(partition, step))

    def batch_offsets(self, partition: int, step: int) -> Tensor:
        """Start offsets (into the corpus) of the sequences of ``batch(partition, step)``."""
        if not 0 <= partition < self.n_partitions:
            raise ValueError(f"partition {partition} is outside the allowed range 0..{self.n_partitions - 1}")
        if step < 0:
            raise ValueError(f"step {step} is outside the allowed range 0..")
        start, end = self.bounds[partition]
        gen = torch.Generator().manual_seed(_step_seed(self.seed, partition, step))
        return torch.randint(start, end - self.window + 1, (self.cfg.batch_size,), generator=gen)

    def make_model(self, seed: int | None = None) -> GPT:
        """The configured preset on CPU, initialised from ``seed`` (default: the run's seed)."""
        return build_model(self.cfg.model, self.cfg.seq_len, self.seed if seed is None else seed)

    @staticmethod
    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """Mean next-byte cross-entropy; ``x`` and ``y`` move to the model's device."""
        device = next(model.parameters()).device
        logits = model(x.to(device))
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.to(device).reshape(-1))

    def val_loss(self, model: nn.Module) -> float:
        """Mean loss over the fixed validation batches, in eval mode without gradients."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                losses = [self.loss(model, x, y).item() for x, y in self._val]
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)


def build_task(cfg: TaskConfig, n_partitions: int, seed: int = 0) -> Task:
    """Load the corpus named by ``cfg`` (cached) and split it for ``n_partitions`` workers."""
    corpus = load_corpus(cfg.data, cfg.corpus_bytes)
    if not corpus:
        where = f"task.data {cfg.data!r}" if cfg.data else f"the stdlib folder {stdlib_root()}"
        raise ConfigError(f"empty corpus: {where} holds no non-empty UTF-8 text files")
    return Task(cfg, corpus, n_partitions, seed)
