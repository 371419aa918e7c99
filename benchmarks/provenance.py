"""What a benchmark's figures were measured on, for its last JSON line: the corpus
fingerprint (the tokenized corpus, ``LMTask.fingerprint``: the same bytes, tokenizer and
cap give the same value on every machine) and the software versions (Python, torch,
numpy, numba, geoloco, the git commit). Figures with other provenance are not comparable.
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from geoloco.config import TaskConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "numpy", "numba", "geoloco")


def versions() -> dict[str, str | None]:
    """Python and the installed versions of PACKAGES (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it; None
    outside a git checkout or without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def corpus(task: TaskConfig) -> dict[str, Any]:
    """Which text ``task`` reads (``pinned``: geoloco.tasks.corpus, with its SHA-256
    prefix; else the task.data path) and the fingerprint of the token stream it trains on
    (after the task.corpus_bytes cap and the tokenizer; the stream is cached per process)."""
    from geoloco.tasks import build_task
    from geoloco.tasks.corpus import corpus_fingerprint

    source = f"pinned:{corpus_fingerprint()}" if task.data is None else task.data
    return {"corpus": source, "data_fingerprint": build_task(task, 1).fingerprint}


# the checkout as the benchmark's process started (it imports this module at its start): the
# code that ran, whatever is committed while it runs
COMMIT_AT_START = git_commit()


def provenance(task: TaskConfig | None = None) -> dict[str, Any]:
    """``{"corpus", "data_fingerprint", "versions"}`` for a benchmark's JSON line;
    ``task`` None for a benchmark that reads no corpus (synthetic tensors: both None).
    ``versions.commit`` is the checkout when the process started; where it has moved since,
    ``versions.commit_at_end`` says to what."""
    data = corpus(task) if task is not None else {"corpus": None, "data_fingerprint": None}
    found: dict[str, Any] = {**versions(), "commit": COMMIT_AT_START}
    now = git_commit()
    if now != COMMIT_AT_START:
        found["commit_at_end"] = now
    return {**data, "versions": found}
