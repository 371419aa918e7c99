"""The language-model task, the one implementation of geoloco.tasks.protocol.Task: the
corpus as one token stream (bytes, or a tokenizer's ids) cut into non-overlapping windows,
a fixed-seed validation set spread over the whole stream, the other windows dealt to n
training partitions (``iid``: shuffled with the run seed; ``contiguous``: one region each),
deterministic batches, and the model ``task.model`` names (docs/decisions.md, "The data
split").
"""

from __future__ import annotations

import functools
import hashlib
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


def _seed_of(*parts: object) -> int:
    """A 63-bit generator seed that is a fixed function of ``parts``."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _step_seed(seed: int, partition: int, step: int) -> int:
    """The seed of batch ``step`` of ``partition``: a fixed function of (seed, partition, step)."""
    return _seed_of("geoloco-batch", seed, partition, step)


def validation_windows(n_windows: int, count: int) -> Tensor:
    """``count`` window indices out of ``n_windows``, sorted: one drawn uniformly from each of
    ``count`` equal strata of the stream, by a hash with a fixed seed (no run seed and no
    torch generator in it, so every run, method and machine scores the same windows)."""
    edges = [n_windows * j // count for j in range(count + 1)]
    strata = enumerate(zip(edges[:-1], edges[1:], strict=True))
    picks = [lo + _seed_of("geoloco-val", j) % (hi - lo) for j, (lo, hi) in strata]
    return torch.tensor(picks, dtype=torch.int64)


def split_windows(train: Tensor, n_partitions: int, partitioning: str, seed: int) -> list[Tensor]:
    """The training windows' indices of each partition. ``iid``: ``train`` shuffled by a
    generator seeded from ``seed`` and dealt round-robin (sizes differ by at most one);
    ``contiguous``: ``train`` in stream order cut into ``n_partitions`` runs."""
    if partitioning == "contiguous":
        return [part.clone() for part in torch.tensor_split(train, n_partitions)]
    gen = torch.Generator().manual_seed(_seed_of("geoloco-deal", seed))
    shuffled = train[torch.randperm(len(train), generator=gen)]
    return [shuffled[p::n_partitions].clone() for p in range(n_partitions)]


class PartitionBatches:
    """geoloco.tasks.protocol.BatchIterator over one partition of an LMTask: batch ``step``
    is ``task.batch(partition, step)``, and the state is the partition, the step and the
    task's split fingerprint (a position saved on other data or another split is refused)."""

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
        return {"partition": self.partition, "step": self.step, "data": self.task.split_fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("data") != self.task.split_fingerprint:
            raise ValueError(f"data position saved for data {state.get('data')!r}, this task's "
                             f"data and split is {self.task.split_fingerprint!r} (task.data, "
                             "task.partitioning, task.seq_len, task.val_windows, workers and seed "
                             "must be those it was saved under)")
        if state.get("partition") != self.partition:
            raise ValueError(f"data position of partition {state.get('partition')!r} loaded into "
                             f"partition {self.partition}")
        self.task.check_position(self.partition, state.get("step"))
        self.step = int(state["step"])


class LMTask:
    """Next-token prediction on a token stream cut into windows of ``seq_len + 1`` tokens: a
    held-out validation set spread over the stream, the rest split between ``n_partitions``
    training partitions (``task.partitioning``), with the matching model."""

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
        self.fingerprint = _fingerprint(tokens, tokenizer.vocab_size)  # the data (task.data_fingerprint)
        self.n_windows = self.n_tokens // self.window
        self._check_size()
        val = validation_windows(self.n_windows, cfg.val_windows)
        train = torch.ones(self.n_windows, dtype=torch.bool)
        train[val] = False
        # window indices of each partition, in the order they were dealt
        self.partition_windows = split_windows(train.nonzero().flatten(), n_partitions,
                                               cfg.partitioning, seed)
        self.partition_sizes = [len(w) for w in self.partition_windows]  # windows per partition
        self.val_offsets = val * self.window  # token offsets of the validation windows, sorted
        # the split: what a saved data position is only valid under
        self.split_fingerprint = _seed_hex("geoloco-split", self.fingerprint, cfg.partitioning,
                                           self.window, cfg.val_windows, n_partitions, seed)

    @property
    def window(self) -> int:
        """Tokens one sequence needs: seq_len inputs plus the shifted target."""
        return self.cfg.seq_len + 1

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _check_size(self) -> None:
        """TaskError unless the stream holds the validation windows and one per partition."""
        needed = self.cfg.val_windows + self.n_partitions
        if self.n_windows >= needed:
            return
        unit = self.unit
        raise TaskError(
            f"corpus too small: {self.n_tokens} {unit} from {describe_source(self.cfg.data)} "
            f"(task.corpus_bytes {self.cfg.corpus_bytes}, tokenizer {self.tokenizer.name}) make "
            f"{self.n_windows} windows of {self.window} {unit} (task.seq_len + 1), fewer than "
            f"task.val_windows {self.cfg.val_windows} plus one for each of {self.n_partitions} "
            "partitions; give more text (task.data, task.corpus_bytes) or a smaller task.seq_len "
            "or task.val_windows"
        )

    def _windows(self, offsets: Tensor) -> Batch:
        chunk = self.data[offsets[:, None] + torch.arange(self.window)].long()
        return chunk[:, :-1], chunk[:, 1:]

    def check_position(self, partition: Any, step: Any) -> None:
        """ValueError unless ``partition`` and ``step`` name a batch of this task."""
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < self.n_partitions:
            raise ValueError(f"partition {partition} is outside the allowed range 0..{self.n_partitions - 1}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step} is outside the allowed range 0..")

    def batch(self, partition: int, step: int) -> Batch:
        """Inputs and next-token targets, both (batch_size, seq_len) int64: windows of
        ``partition`` drawn (with replacement) by a generator seeded by (seed, partition, step)."""
        return self._windows(self.batch_offsets(partition, step))

    def batch_offsets(self, partition: int, step: int) -> Tensor:
        """Start offsets (into the token stream) of the sequences of ``batch(partition, step)``."""
        self.check_position(partition, step)
        windows = self.partition_windows[partition]
        gen = torch.Generator().manual_seed(_step_seed(self.seed, partition, step))
        picks = torch.randint(0, len(windows), (self.cfg.batch_size,), generator=gen)
        return windows[picks] * self.window

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
        """Mean loss over the validation windows (scored batch_size at a time, each batch
        weighted by its windows), in eval mode without gradients."""
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for offsets in self.val_offsets.split(self.cfg.batch_size):
                    total += self.loss(model, self._windows(offsets)).item() * len(offsets)
        finally:
            model.train(was_training)
        return total / len(self.val_offsets)

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


def _seed_hex(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:16]


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
