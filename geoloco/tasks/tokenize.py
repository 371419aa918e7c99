"""Text to token ids: byte-level (the default, 256 ids, nothing to ship), a local
``tokenizer.json`` read by Hugging Face ``tokenizers``, or a byte-level BPE tokenizer
trained on the run's own corpus with ``tokenizers`` in seconds (Sennrich et al. 2016).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geoloco.tasks.hf import require
from geoloco.tasks.protocol import TaskError

BYTES = "bytes"
AUTO = "auto"
TRAIN_PREFIX = "train:"
END_OF_TEXT = "<|endoftext|>"  # the trained tokenizer's one special token, between documents
# the first of these a loaded tokenizer knows separates documents (none: they just abut)
SEPARATORS = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>")


class ByteTokenizer:
    """Bytes are the tokens (UTF-8 text as it is on disk)."""

    name = BYTES
    vocab_size = 256

    def to_json(self) -> str | None:
        return None


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` (BPE, WordPiece, Unigram, ...) and where it came from."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.separator: int | None = next(
            (i for i in (tokenizer.token_to_id(t) for t in SEPARATORS) if i is not None), None)

    def encode(self, documents: Sequence[str]) -> Tensor:
        """The documents' ids end to end (the separator after each, when there is one), int32."""
        sep = [] if self.separator is None else [self.separator]
        ids = [e.ids + sep for e in self.tokenizer.encode_batch(list(documents))]
        return torch.from_numpy(np.fromiter((i for doc in ids for i in doc), dtype=np.int32))

    def to_json(self) -> str:
        return self.tokenizer.to_str()


Tokenizer = ByteTokenizer | TextTokenizer


def is_byte_level(spec: str, model_folder: Path | None) -> bool:
    """Whether ``task.tokenizer`` ``spec`` means bytes (``auto``: unless the hf: model's
    folder ships a tokenizer.json)."""
    return spec == BYTES or (spec == AUTO and _folder_tokenizer(model_folder) is None)


def load_tokenizer(spec: str, documents: Sequence[str], model_folder: Path | None) -> TextTokenizer:
    """The tokenizer ``spec`` names (not byte-level): ``train:N`` trains one with at most N
    tokens on ``documents``; a path is a tokenizer.json (or a folder holding one); ``auto``
    takes the hf: model folder's tokenizer.json."""
    if spec.startswith(TRAIN_PREFIX):
        return TextTokenizer(train_bpe(tuple(documents), int(spec.removeprefix(TRAIN_PREFIX))), spec)
    path = _folder_tokenizer(model_folder) if spec == AUTO else Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    tokenizers = require("tokenizers", f"task.tokenizer {spec!r}")
    if not path.is_file():
        raise TaskError(f"task.tokenizer {spec!r}: {path} does not exist (a tokenizer.json, a folder "
                        f"holding one, {BYTES}, {AUTO} or {TRAIN_PREFIX}VOCAB)")
    try:
        return TextTokenizer(tokenizers.Tokenizer.from_file(str(path)), str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on a bad file
        raise TaskError(f"task.tokenizer: {path} is not a tokenizers JSON file ({exc})") from None


@functools.lru_cache(maxsize=4)
def train_bpe(documents: tuple[str, ...], vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer) with at most ``vocab_size`` tokens,
    trained on ``documents``. Training is deterministic, so the coordinator and every worker
    get the same tokenizer from the same corpus; cached per process."""
    tokenizers = require("tokenizers", f"task.tokenizer {TRAIN_PREFIX}{vocab_size}")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[END_OF_TEXT])
    tok.train_from_iterator(documents, trainer)
    return tok


def _folder_tokenizer(folder: Path | None) -> Path | None:
    path = folder / "tokenizer.json" if folder is not None else None
    return path if path is not None and path.is_file() else None
