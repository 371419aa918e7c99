"""Atomic coordinator checkpoints (parameters, outer-optimizer state, next round, worker
registry, run totals) and loading the newest one for ``--resume`` (docs/protocol.md)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
FORMAT_VERSION = 1
KEEP_CHECKPOINTS = 3  # older checkpoints are deleted once a newer one is on disk
_NAME = re.compile(r"^round_(\d{8})\.pt$")


@dataclass
class Checkpoint:
    """Everything the coordinator needs to continue a run from the start of ``round``."""

    round: int  # the next round to open; the parameters are those at its start
    params: dict[str, Tensor]
    outer_state: dict[str, Any]
    workers: dict[int, dict[str, Any]]  # worker id -> {"session_sha256": ..., "hostname": ...}
    layout_digest: bytes
    totals: dict[str, Any] = field(default_factory=dict)  # run figures summary.json needs

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "round": self.round,
            "params": self.params,
            "outer_state": self.outer_state,
            "workers": self.workers,
            "layout_digest": self.layout_digest.hex(),
            "totals": self.totals,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Checkpoint:
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"checkpoint format version {version!r}, expected {FORMAT_VERSION}")
        return cls(
            round=int(data["round"]),
            params=data["params"],
            outer_state=data["outer_state"],
            workers={int(k): v for k, v in data["workers"].items()},
            layout_digest=bytes.fromhex(data["layout_digest"]),
            totals=data.get("totals", {}),
        )


def checkpoint_path(run_dir: Path, round: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"round_{round:08d}.pt"


def save(run_dir: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` atomically (temp file, fsync, rename) and prune old checkpoints."""
    path = checkpoint_path(run_dir, ckpt.round)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(ckpt.to_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _prune(path.parent)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files in ``run_dir``, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def load_latest(run_dir: Path) -> Checkpoint | None:
    """The newest readable checkpoint, or None when there is none; an unreadable one is
    logged and skipped for the one before it."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            return Checkpoint.from_dict(data)
        except Exception as exc:  # noqa: BLE001 - any damage means: try the older one
            log.warning("checkpoint %s is unreadable (%s); trying an older one", path, exc)
    return None


def _prune(folder: Path) -> None:
    for old in list_checkpoints(folder.parent)[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)
