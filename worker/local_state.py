"""A worker's own state on its own disk, so that a restarted worker carries on: the error
feedback (SparseLoCo's residual, arXiv 2508.15706), the inner AdamW state, each partition's
data position and latest pseudo-gradient, and the RNG state; one file per worker id,
written atomically (docs/protocol.md, "Stopping and restarting")."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

import torch

from geoloco.compression import Compressor

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class LocalStateError(ValueError):
    """A local state file that is unreadable or belongs to another run or model."""


def state_path(state_dir: Path, worker_id: int) -> Path:
    return Path(state_dir) / f"worker-{worker_id}.state.pt"


def save(path: Path, training: Any, round_: int) -> None:
    """Write ``training``'s state at the start of ``round_`` to ``path`` (a temporary file,
    fsynced, renamed into place)."""
    trainer, compressor = training.trainer, training.encoder.compressor
    state = {
        "format_version": FORMAT_VERSION,
        "round": round_,
        "layout_digest": training.layout.digest.hex(),
        "data_fingerprint": training.cfg.task.data_fingerprint,
        "error_feedback": compressor.state_dict() if isinstance(compressor, Compressor) else None,
        "optimizer": trainer.optimizer.state_dict(),
        "data": trainer.data_state(),
        "latest": training.deltas.latest,
        "rng": torch.get_rng_state(),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def load(path: Path, training: Any) -> int:
    """Put the state in ``path`` into ``training``; returns the round it was saved at.
    LocalStateError if it cannot be read or was saved for another model or data."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any damage means: start without it
        raise LocalStateError(f"{path} is unreadable ({exc})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise LocalStateError(f"{path} has format {state.get('format_version')!r}, expected {FORMAT_VERSION}")
    if state["layout_digest"] != training.layout.digest.hex():
        raise LocalStateError(f"{path} was saved for another model layout")
    if state["data_fingerprint"] != training.cfg.task.data_fingerprint:
        raise LocalStateError(f"{path} was saved for other data")
    split = training.trainer.task.split_fingerprint
    if any(position.get("data") != split for position in state["data"].values()):
        raise LocalStateError(f"{path} was saved under another split of the data (task.partitioning, "
                              "task.seq_len, task.val_windows, workers or seed)")
    compressor = training.encoder.compressor
    if isinstance(compressor, Compressor) and state["error_feedback"] is not None:
        compressor.load_state_dict(state["error_feedback"])
    training.trainer.optimizer.load_state_dict(state["optimizer"])
    training.trainer.load_data_state(state["data"])
    training.deltas.latest = {int(p): delta for p, delta in state["latest"].items()}
    torch.set_rng_state(state["rng"])
    return int(state["round"])
