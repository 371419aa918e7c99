"""Atomic coordinator checkpoints and loading the newest one for ``--resume``
(docs/protocol.md). A checkpoint is a folder others can read: the weights as safetensors
next to the model's config.json (and tokenizer.json), plus a sidecar with the outer
optimizer's state, the next round, the worker registry and the run totals."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from geoloco.run_dir import (
    CHECKPOINT_DIR,
    DEFAULT_MODE,
    ROUNDLOG_DIR,
    fsync_path,
    open_atomic,
    remove_stale_temps,
    write_atomic,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: one torch.save file round_XXXXXXXX.pt (still read)
KEEP_CHECKPOINTS = 3  # older checkpoints are deleted once a newer one is on disk
WEIGHTS_FILE = "model.safetensors"  # the name transformers' from_pretrained looks for
STATE_FILE = "state.pt"  # the sidecar, written last: a folder without it is not a checkpoint
_NAME = re.compile(r"^round_(\d{8})(\.pt)?$")
# what a killed write leaves: a checkpoint's temporary or set-aside folder
_STALE_CHECKPOINT = re.compile(r"^round_\d{8}\.(tmp|old)\d+$")


@dataclass
class Checkpoint:
    """Everything the coordinator needs to continue a run from the start of ``round``."""

    round: int  # the next round to open; the parameters are those at its start
    params: dict[str, Tensor]
    outer_state: dict[str, Any]
    workers: dict[int, dict[str, Any]]  # worker id -> {"session_sha256": ..., "hostname": ...}
    layout_digest: bytes
    totals: dict[str, Any] = field(default_factory=dict)  # run figures summary.json needs
    # the model's tensors outside the layout (frozen parameters, integer buffers), so that
    # the weights file holds the whole model
    fixed: dict[str, Tensor] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # config.json, tokenizer.json: name -> text
    # the frame bounds' memory: worker -> (round, norm) of its latest counted frame
    guard_norms: dict[int, tuple[int, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The sidecar: everything but the tensors of the weights file."""
        return {
            "format_version": FORMAT_VERSION,
            "round": self.round,
            "param_names": list(self.params),
            "outer_state": self.outer_state,
            "workers": self.workers,
            "layout_digest": self.layout_digest.hex(),
            "totals": self.totals,
            "guard_norms": {str(w): [r, n] for w, (r, n) in sorted(self.guard_norms.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], weights: dict[str, Tensor] | None = None) -> Checkpoint:
        """From the sidecar and the weights file (format 1 kept the parameters inside)."""
        version = data.get("format_version")
        if version not in (1, FORMAT_VERSION):
            raise ValueError(f"checkpoint format version {version!r}, expected {FORMAT_VERSION}")
        if version == 1:
            params, fixed = data["params"], {}
        else:
            names = data["param_names"]
            params = {name: weights[name] for name in names}
            fixed = {name: t for name, t in weights.items() if name not in params}
        return cls(
            round=int(data["round"]),
            params=params,
            outer_state=data["outer_state"],
            workers={int(k): v for k, v in data["workers"].items()},
            layout_digest=bytes.fromhex(data["layout_digest"]),
            totals=data.get("totals", {}),
            fixed=fixed,
            guard_norms={int(w): (int(r), float(n)) for w, (r, n) in data.get("guard_norms", {}).items()},
        )


def checkpoint_path(run_dir: Path, round: int) -> Path:
    """The folder of the checkpoint at the start of ``round``."""
    return Path(run_dir) / CHECKPOINT_DIR / f"round_{round:08d}"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions); nothing of it is left."""


def save(run_dir: Path, ckpt: Checkpoint, after_weights: Callable[[], None] | None = None) -> Path:
    """Write ``ckpt`` atomically (a temporary folder, each file fsynced, the sidecar last,
    then renamed into place) and prune old checkpoints; returns its folder. When a write
    fails the temporary folder is removed and CheckpointWriteError says why.
    ``after_weights`` is called once the weights are in the temporary folder (the
    exactly-once tests' seam: a kill there leaves a half-written checkpoint)."""
    path = checkpoint_path(run_dir, ckpt.round)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        _write_folder(tmp, ckpt, after_weights)
        _replace_folder(tmp, path)
    except Exception as exc:  # noqa: BLE001 - torch and safetensors wrap the OSError
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint before round {ckpt.round} not written to {path}: "
                                   f"{_reason(exc)}") from None
    _prune(path.parent)
    return path


def _write_folder(tmp: Path, ckpt: Checkpoint, after_weights: Callable[[], None] | None = None) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {name: t.detach().cpu().contiguous() for name, t in {**ckpt.params, **ckpt.fixed}.items()}
    save_weights(weights, tmp / WEIGHTS_FILE, {"format": "pt", "geoloco_round": str(ckpt.round)})
    fsync_path(tmp / WEIGHTS_FILE)
    if after_weights is not None:
        after_weights()
    for name, text in ckpt.files.items():
        write_atomic(tmp / name, text)
    with open_atomic(tmp / STATE_FILE) as f:  # streamed: no copy of the outer state in memory
        torch.save(ckpt.to_dict(), f)


def save_weights(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``tensors`` as a safetensors file, readable like every file of a run but its secrets
    (docs/security.md): safetensors writes through a temporary file of mode 0600, so the
    mode becomes what open() gives (readable_mode)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, readable_mode())


def readable_mode() -> int:
    """The mode open() gives a new file: DEFAULT_MODE less this process's umask (read from
    /proc without changing it; elsewhere set and set back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return DEFAULT_MODE & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return DEFAULT_MODE & ~mask


def _reason(exc: BaseException) -> str:
    """The OSError at the root of ``exc`` as "No space left on device (errno 28)", else
    the first line of ``exc``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror} (errno {seen.errno})"
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _replace_folder(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; a checkpoint already there (the same round saved again)
    is moved aside first and removed after."""
    old = path.with_name(f"{path.name}.old{os.getpid()}") if path.exists() else None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    os.replace(tmp, path)
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints in ``run_dir`` (folders, and format 1 files), oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _NAME.match(p.name)
             and (p.is_file() if p.suffix == ".pt" else p.is_dir())]
    return sorted(found, key=lambda p: (int(_NAME.match(p.name).group(1)), p.is_dir()))


def load(path: Path) -> Checkpoint:
    """The checkpoint in folder ``path`` (or a format 1 file); any damage raises."""
    path = Path(path)
    if path.is_file():
        return Checkpoint.from_dict(torch.load(path, map_location="cpu", weights_only=True))
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    return Checkpoint.from_dict(state, load_file(str(path / WEIGHTS_FILE)))


def starts(next_round: int) -> str:
    """What a checkpoint named ``round_N`` holds, in words: the model before round N, the
    round a resume runs first (rounds are numbered from 0 everywhere; docs/protocol.md)."""
    done = "no round done yet" if next_round == 0 else f"rounds 0-{next_round - 1} done"
    return f"before round {next_round}; {done}"


def latest_round(run_dir: Path) -> int | None:
    """The round the newest readable checkpoint starts (its sidecar alone is read), or None."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = torch.load(path / STATE_FILE if path.is_dir() else path, map_location="cpu",
                               weights_only=True)
            return int(state["round"])
        except Exception as exc:  # noqa: BLE001 - any damage means: try the older one
            log.warning("checkpoint %s is unreadable (%s); trying an older one", path, exc)
    return None


def latest_path(run_dir: Path) -> Path | None:
    """The newest readable checkpoint's path, or None; an unreadable one is logged and
    skipped for the one before it."""
    found = _latest(run_dir)
    return found[0] if found else None


def load_latest(run_dir: Path) -> Checkpoint | None:
    """The newest readable checkpoint, or None when there is none; an unreadable one is
    logged and skipped for the one before it."""
    found = _latest(run_dir)
    return found[1] if found else None


def _latest(run_dir: Path) -> tuple[Path, Checkpoint] | None:
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load(path)
        except Exception as exc:  # noqa: BLE001 - any damage means: try the older one
            log.warning("checkpoint %s is unreadable (%s); trying an older one", path, exc)
    return None


def remove_stale(run_dir: Path) -> list[Path]:
    """Remove what writes killed before their rename left in ``run_dir`` and its
    checkpoints folder; returns the paths removed."""
    run_dir = Path(run_dir)
    found = [p for p in (run_dir / CHECKPOINT_DIR).glob("round_*") if _STALE_CHECKPOINT.match(p.name)]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found + remove_stale_temps(run_dir) + remove_stale_temps(run_dir / ROUNDLOG_DIR)


def _prune(folder: Path) -> None:
    for old in list_checkpoints(folder.parent)[:-KEEP_CHECKPOINTS]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
