"""The pinned corpus: about 4 MB of CPython 3.11 standard-library sources (PSF-2.0, the
licence beside it), shipped with the package so every machine and Python reads the same
bytes, checked against a pinned SHA-256 on load (docs/decisions.md, "The pinned corpus").

    python -m geoloco.tasks.corpus /usr/lib/python3.11   # rebuild the file (prints its sha)
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
import os
import sys
from pathlib import Path

from geoloco.run_dir import write_atomic
from geoloco.tasks.protocol import TaskError

CORPUS_FILE = Path(__file__).with_name("stdlib311.jsonl.xz")  # {"path", "text"} per line
LICENSE_FILE = Path(__file__).with_name("stdlib311.LICENSE.txt")  # the PSF licence, verbatim
# SHA-256 of the decompressed JSON Lines: the pinned bytes (what the build printed)
CORPUS_SHA256 = "af14593ead583c3f3e5d81c3c8a0d087f852ea778243a8c0651033cb91527274"
TARGET_BYTES = 4_000_000  # files are taken until their text reaches this (task.corpus_bytes' default)
_PICK_SALT = "geoloco-pinned-corpus/1"  # the order files are picked in: sha256(salt/path)
# machine-generated (_sysconfigdata: the build's paths) or one huge prose table (topics.py)
_LEFT_OUT = ("_sysconfigdata", "pydoc_data/topics.py", "config-3.")
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def _pick_key(rel: str) -> str:
    return hashlib.sha256(f"{_PICK_SALT}/{rel}".encode()).hexdigest()


def _sources(root: Path) -> list[str]:
    """Every ``*.py`` under ``root`` (relative POSIX paths), less the left-out ones."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(root)
        found += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    return [r for r in found if not any(r.startswith(x) or f"/{x}" in r for x in _LEFT_OUT)]


def build_corpus(root: Path, target: int = TARGET_BYTES) -> bytes:
    """The JSON Lines of the pinned corpus, from the standard library at ``root``: UTF-8
    sources taken in the order of a salted hash of their path (a sample spread over the
    whole library, in no alphabetical run) until their text reaches ``target`` bytes."""
    lines, total = [], 0
    for rel in sorted(_sources(root), key=_pick_key):
        raw = (root / rel).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text or "\x00" in text:
            continue
        lines.append(json.dumps({"path": rel, "text": text}, ensure_ascii=False, sort_keys=True))
        total += len(raw)
        if total >= target:
            break
    return ("\n".join(lines) + "\n").encode()


def _corrupt(problem: str) -> TaskError:
    return TaskError(f"the pinned corpus {CORPUS_FILE} is corrupt ({problem}); reinstall geoloco, "
                     "or set task.data to other text (task.data = \"stdlib\": this Python's sources)")


@functools.lru_cache(maxsize=1)
def pinned_documents() -> tuple[str, ...]:
    """The pinned corpus's files' texts in corpus order, after checking its SHA-256."""
    try:
        raw = lzma.decompress(CORPUS_FILE.read_bytes())
    except FileNotFoundError:
        raise _corrupt("the file is missing") from None
    except lzma.LZMAError as exc:
        raise _corrupt(f"not an xz stream: {exc}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise _corrupt(f"SHA-256 {digest[:16]}…, pinned {CORPUS_SHA256[:16]}…")
    return tuple(json.loads(line)["text"] for line in raw.decode().splitlines())


def pinned_paths() -> tuple[str, ...]:
    """The standard-library paths of the pinned corpus's files, in corpus order."""
    raw = lzma.decompress(CORPUS_FILE.read_bytes())
    return tuple(json.loads(line)["path"] for line in raw.decode().splitlines())


@functools.lru_cache(maxsize=1)
def pinned_bytes() -> bytes:
    """The pinned corpus as one byte stream: the files' UTF-8 texts back to back."""
    return "".join(pinned_documents()).encode()


def corpus_fingerprint() -> str:
    """The pinned corpus's identity for benchmark records: its SHA-256, shortened."""
    return CORPUS_SHA256[:16]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    data = build_corpus(Path(argv[0]))
    write_atomic(CORPUS_FILE, lzma.compress(data, preset=9 | lzma.PRESET_EXTREME), mode=0o644)
    files = data.count(b"\n")
    print(f"{CORPUS_FILE.name}: {files} files, {len(data)} bytes of JSON Lines, "
          f"{CORPUS_FILE.stat().st_size} compressed, sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
