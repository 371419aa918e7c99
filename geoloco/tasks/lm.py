"""The language-model task, the one implementation of geoloco.tasks.protocol.Task: the
corpus as one token stream (bytes, or a tokenizer's ids) cut into n contiguous training
partitions with no overlap and no gap plus a held-out validation tail, deterministic
batches, and the model ``task.model`` names.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from geoloco.config import TaskConfig
from geoloco.tasks.data import describe_source, load_corpus, load_documents, record_files
from geoloco.tasks.hf import HFModel
from geoloco.tasks.models import ModelSource, model_source, next_token_loss
from geoloco.tasks.protocol import Batch, LossFn, ModelSpec, TaskError
from geoloco.tasks.tokenize import ByteTokenizer, Tokenizer, is_byte_level, load_tokenizer

VAL_FRACTION = 0.05  # the last 5 % of the token stream is held out for validation


def _step_seed(seed: int, partition: int, step: int) -> int:
    """A 63-bit generator seed that is a fixed function of (seed, partition, step)."""
    digest = hashlib.sha256(f"geoloco-batch/{seed}/{partition}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class PartitionBatches:
    """geoloco.tasks.protocol.BatchIterator over one partition of an LMTask: batch ``step``
    is ``task.batch(partition, step)``, and the state is the partition, the step and the
    task's data fingerprint (a position saved on other data is refused)."""

    def __init__(self, task: LMTask, partition: int, step: int = 0) -> None:
        task.check_position(partition, step)
        self.task = task
        self.partition = partition
        self.step = step

    def __iter__(self) -> PartitionBatches:
        return self

    def __next__(self) -> Batch:
        batch = self.task.batch(self.partition, self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "step": self.step, "data": self.task.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("data") != self.task.fingerprint:
            raise ValueError(f"data position saved for data {state.get('data')!r}, this task's "
                             f"data is {self.task.fingerprint!r}")
        if state.get("partition") != self.partition:
            raise ValueError(f"data position of partition {state.get('partition')!r} loaded into "
                             f"partition {self.partition}")
        self.task.check_position(self.partition, state.get("step"))
        self.step = int(state["step"])


class LMTask:
    """Next-token prediction on a token stream split into ``n_partitions`` contiguous
    training partitions and a held-out validation tail, with the matching model."""

    def __init__(self, cfg: TaskConfig, tokens: Tensor, tokenizer: Tokenizer, source: ModelSource,
                 n_partitions: int, seed: int) -> None:
        if n_partitions < 1:
            raise TaskError(f"n_partitions: {n_partitions} is outside the allowed range 1..")
        self.cfg = cfg
        self.seed = seed
        self.n_partitions = n_partitions
        self.tokenizer = tokenizer
        self.source = source
        self.loss_fn: LossFn = next_token_loss  # the factory's own loss, once make_model ran
        self.data = tokens  # 1-D: uint8 for bytes, int32 for a tokenizer's ids
        self.n_tokens = len(tokens)
        self.unit = "bytes" if isinstance(tokenizer, ByteTokenizer) else "tokens"
        self.fingerprint = _fingerprint(tokens, tokenizer.vocab_size)
        self.val_start = self.n_tokens - self._val_size()
        self.bounds = self._partition_bounds()
        self.partition_sizes = [end - start for start, end in self.bounds]
        self.val_offsets = self._val_offsets()
        self._val = self._val_batches()

    @property
    def window(self) -> int:
        """Tokens one sequence needs: seq_len inputs plus the shifted target."""
        return self.cfg.seq_len + 1

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _val_size(self) -> int:
        """5 % of the tokens, and at least room for every validation sequence side by side."""
        needed = self.cfg.val_batches * self.cfg.batch_size * self.window
        return max(math.ceil(VAL_FRACTION * self.n_tokens), needed)

    def _partition_bounds(self) -> list[tuple[int, int]]:
        base, extra = divmod(self.val_start, self.n_partitions)
        if base < self.window:
            unit = self.unit
            raise TaskError(
                f"corpus too small: {self.n_tokens} {unit} from {describe_source(self.cfg.data)} "
                f"(task.corpus_bytes {self.cfg.corpus_bytes}, tokenizer {self.tokenizer.name}) leave "
                f"{max(self.val_start, 0)} training {unit} for {self.n_partitions} partitions of at "
                f"least {self.window} {unit} (seq_len + 1) each after a "
                f"{self.n_tokens - self.val_start}-{unit} validation split; "
                "give more text or a smaller seq_len, batch_size or val_batches"
            )
        bounds, start = [], 0
        for i in range(self.n_partitions):
            end = start + base + (1 if i < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds

    def _windows(self, offsets: Tensor) -> Batch:
        chunk = self.data[offsets[:, None] + torch.arange(self.window)].long()
        return chunk[:, :-1], chunk[:, 1:]

    def _val_offsets(self) -> Tensor:
        """Fixed, evenly spaced, non-overlapping windows over the validation split."""
        n = self.cfg.val_batches * self.cfg.batch_size
        last = self.n_tokens - self.window
        return torch.linspace(self.val_start, last, n, dtype=torch.float64).long()

    def _val_batches(self) -> list[Batch]:
        x, y = self._windows(self.val_offsets)
        return list(zip(x.split(self.cfg.batch_size), y.split(self.cfg.batch_size), strict=True))

    def check_position(self, partition: Any, step: Any) -> None:
        """ValueError unless ``partition`` and ``step`` name a batch of this task."""
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < self.n_partitions:
            raise ValueError(f"partition {partition} is outside the allowed range 0..{self.n_partitions - 1}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step} is outside the allowed range 0..")

    def batch(self, partition: int, step: int) -> Batch:
        """Inputs and next-token targets, both (batch_size, seq_len) int64, at random offsets
        inside ``partition`` drawn from a generator seeded by (seed, partition, step)."""
        return self._windows(self.batch_offsets(partition, step))

    def batch_offsets(self, partition: int, step: int) -> Tensor:
        """Start offsets (into the token stream) of the sequences of ``batch(partition, step)``."""
        self.check_position(partition, step)
        start, end = self.bounds[partition]
        gen = torch.Generator().manual_seed(_step_seed(self.seed, partition, step))
        return torch.randint(start, end - self.window + 1, (self.cfg.batch_size,), generator=gen)

    def batches(self, partition: int, step: int = 0) -> PartitionBatches:
        return PartitionBatches(self, partition, step)

    def model_spec(self, seed: int | None = None) -> ModelSpec:
        return ModelSpec(self.vocab_size, self.cfg.seq_len, self.seed if seed is None else seed)

    def make_model(self, seed: int | None = None) -> nn.Module:
        """The model ``task.model`` names on CPU, initialised from ``seed`` (default: the
        run's seed); TaskError if its input embedding is smaller than the vocabulary."""
        model, loss = self.source.build(self.model_spec(seed))
        if loss is not None:
            self.loss_fn = loss
        rows = _embedding_rows(model)
        if rows is not None and rows < self.vocab_size:
            raise TaskError(f"the tokenizer ({self.tokenizer.name}) has {self.vocab_size} tokens, more than "
                            f"the {rows} rows of the input embedding of task.model {self.source.name!r}; "
                            "give the model a larger vocabulary or the tokenizer a smaller one")
        if not any(p.requires_grad for p in model.parameters()):
            raise TaskError(f"task.model {self.source.name!r} has no parameter that trains")
        return model

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """The model's loss of one batch (mean next-token cross-entropy unless the factory
        gave its own)."""
        return self.loss_fn(model, batch)

    def val_loss(self, model: nn.Module) -> float:
        """Mean loss over the fixed validation batches, in eval mode without gradients."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                losses = [self.loss(model, batch).item() for batch in self._val]
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)

    def model_files(self, model: nn.Module) -> dict[str, str]:
        """What a checkpoint keeps beside the weights: the model's config.json, and the
        tokenizer.json when the task has a tokenizer."""
        files = {"config.json": self.source.config_json(model, self.model_spec())}
        tokenizer = self.tokenizer.to_json()
        if tokenizer is not None:
            files["tokenizer.json"] = tokenizer
        return files


def _embedding_rows(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (``get_input_embeddings()``, else its first
    nn.Embedding), or None when it has none."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def _fingerprint(tokens: Tensor, vocab_size: int) -> str:
    h = hashlib.sha256(f"geoloco-tokens/{vocab_size}/{tokens.dtype}\n".encode())
    h.update(memoryview(tokens.contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def _token_stream(data: str | None, text_field: str, corpus_bytes: int, tokenizer: str,
                  model_folder: Path | None) -> tuple[Tensor, Tokenizer]:
    """The corpus as token ids and the tokenizer that made them (cached per process)."""
    if is_byte_level(tokenizer, model_folder):
        if record_files(data):
            corpus = "\n".join(load_documents(data, text_field, corpus_bytes)).encode()
        else:
            corpus = load_corpus(data, corpus_bytes)
        if not corpus:
            raise _empty(data)
        return torch.frombuffer(bytearray(corpus), dtype=torch.uint8), ByteTokenizer()
    documents = load_documents(data, text_field, corpus_bytes)
    if not documents:
        raise _empty(data)
    text_tokenizer = load_tokenizer(tokenizer, documents, model_folder)
    return text_tokenizer.encode(documents), text_tokenizer


def _empty(data: str | None) -> TaskError:
    return TaskError(f"empty corpus: {describe_source(data)} holds no non-empty UTF-8 text")


def build_task(cfg: TaskConfig, n_partitions: int, seed: int = 0) -> LMTask:
    """Read and tokenize the corpus ``cfg`` names (cached) and split it for ``n_partitions``."""
    source = model_source(cfg.model)
    folder = source.folder if isinstance(source, HFModel) else None
    tokens, tokenizer = _token_stream(cfg.data, cfg.text_field, cfg.corpus_bytes, cfg.tokenizer, folder)
    return LMTask(cfg, tokens, tokenizer, source, n_partitions, seed)
