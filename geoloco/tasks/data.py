"""Reading the corpus: the pinned corpus by default (geoloco.tasks.corpus), text files and
folders of them (``stdlib``: the running Python's standard library), or JSONL/JSON and Parquet
records read by Hugging Face ``datasets`` from local files, in sorted order up to a byte cap.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path

from geoloco.config import STDLIB_CORPUS
from geoloco.tasks.corpus import CORPUS_FILE, corpus_fingerprint, pinned_bytes, pinned_documents
from geoloco.tasks.hf import require
from geoloco.tasks.protocol import TaskError

RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> Path:
    """The running Python's standard library folder (``task.data = "stdlib"``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def describe_source(data: str | None) -> str:
    """Where the corpus comes from, for messages."""
    if data is None:
        return f"the pinned corpus ({CORPUS_FILE.name}, {corpus_fingerprint()})"
    if data == STDLIB_CORPUS:
        return f"this Python's stdlib sources ({stdlib_root()})"
    return f"task.data {data!r}"


def _files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` ending in one of ``suffixes`` ("" for any), sorted by relative
    path, skipping site-packages, __pycache__ and hidden folders (pruned while walking)."""
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(root)
        found += [((rel / n).as_posix(), Path(folder, n)) for n in names if n.endswith(suffixes)]
    return [path for _, path in sorted(found)]


def record_files(data: str | None) -> list[Path]:
    """The JSONL/JSON/Parquet files ``data`` names (a record file, or a folder holding
    some); empty when the corpus is plain text."""
    if data in (None, STDLIB_CORPUS):
        return []
    path = Path(data)
    if path.is_file():
        return [path] if path.suffix in RECORD_SUFFIXES else []
    return _files(path, tuple(RECORD_SUFFIXES))


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


def _text_chunks(data: str | None, max_bytes: int) -> list[bytes]:
    """The text files' contents in sorted order, up to ``max_bytes`` in all: the stdlib's
    ``*.py`` sources when ``data`` is "stdlib", else the file ``data`` or every text file
    under it."""
    if data == STDLIB_CORPUS:
        files = _files(stdlib_root(), (".py",))
    else:
        path = Path(data)
        files = [path] if path.is_file() else _files(path, ("",))
    chunks, total = [], 0
    for f in files:
        text = _read_text(f, max_bytes - total)
        if text is not None:
            chunks.append(text)
            total += len(text)
        if total >= max_bytes:
            break
    return chunks


@functools.lru_cache(maxsize=4)
def load_corpus(data: str | None, max_bytes: int) -> bytes:
    """The text files concatenated, up to ``max_bytes`` (byte-level training reads this).
    Cached per process, since coordinator and workers build the same task. The pinned
    corpus (``data`` None) is cut at ``max_bytes`` too."""
    if data is None:
        return pinned_bytes()[:max_bytes]
    return b"".join(_text_chunks(data, max_bytes))


@functools.lru_cache(maxsize=4)
def load_documents(data: str | None, text_field: str, max_bytes: int) -> tuple[str, ...]:
    """The corpus as documents, up to ``max_bytes`` of UTF-8 text: one per record of the
    JSONL/Parquet files, else one per text file (load_corpus's files and order)."""
    if data is None:
        return _capped(pinned_documents(), max_bytes)
    files = record_files(data)
    if not files:
        return tuple(chunk.decode(errors="ignore") for chunk in _text_chunks(data, max_bytes))
    return _capped((text for path in files for text in _read_records(path, text_field)), max_bytes)


def _capped(texts: Iterable[str], max_bytes: int) -> tuple[str, ...]:
    """The non-empty texts in order up to ``max_bytes`` of UTF-8, the last one cut there."""
    docs: list[str] = []
    total = 0
    for text in texts:
        raw = text.encode()
        if total + len(raw) >= max_bytes:
            docs.append(raw[: max_bytes - total].decode(errors="ignore"))
            break
        docs.append(text)
        total += len(raw)
    return tuple(d for d in docs if d)


def _read_records(path: Path, text_field: str) -> list[str]:
    """The ``text_field`` column of one JSONL/JSON/Parquet file, read by ``datasets`` into
    memory (its cache goes to a temporary folder, removed after)."""
    datasets = require("datasets", f"task.data {str(path)!r}")
    datasets.disable_progress_bars()
    kind = RECORD_SUFFIXES[path.suffix]
    reader = datasets.Dataset.from_json if kind == "json" else datasets.Dataset.from_parquet
    with tempfile.TemporaryDirectory(prefix="geoloco-datasets-") as cache:
        try:
            table = reader(str(path), keep_in_memory=True, cache_dir=cache)
        except Exception as exc:  # noqa: BLE001 - datasets and pyarrow raise many kinds
            problem = (_bad_json_line(path) if kind == "json" else None) or _root_cause(exc)
            raise TaskError(f"task.data: {path} is not a readable {kind} file: {problem}") from None
    if text_field not in table.column_names:
        raise TaskError(f"task.data: {path} has no column {text_field!r} (its columns: "
                        f"{', '.join(table.column_names) or 'none'}); set task.text_field")
    texts = list(table[text_field])
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise TaskError(f"task.data: {path} row {row}: {text_field!r} is "
                            f"{type(text).__name__}, expected text")
    return texts


def _bad_json_line(path: Path) -> str | None:
    """Where a JSON Lines file first fails to parse (datasets' own message may be about a
    fallback reader), or None when every line parses."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as exc:
                return f"line {number} is not JSON ({exc})"
    return None


def _root_cause(exc: BaseException) -> str:
    """The innermost exception's message (datasets wraps pyarrow's parse errors)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {exc}"
