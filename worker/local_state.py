"""A worker's own state on its own disk, so that a restarted worker carries on: the error
feedback (SparseLoCo's residual, arXiv 2508.15706), the inner AdamW state, each partition's
data position and latest pseudo-gradient, and the RNG state; one file per worker id,
written atomically (docs/protocol.md, "Stopping and restarting"), on a thread of its own
(``StateWriter``) from a copy taken between rounds. In an island under
``fsdp`` each rank's shard of the AdamW state, and under SparseLoCo of the error feedback,
is its own: rank 0's in that file, every other rank's in a file beside it (``rank_path``)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from geoloco.compression import Compressor
from geoloco.run_dir import open_atomic
from geoloco.worker.island import cpu_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PRIVATE_MODE = 0o600  # the worker's files in --state-dir are its own


class LocalStateError(ValueError):
    """A local state file that is unreadable or belongs to another run or model."""


def state_path(state_dir: Path, worker_id: int) -> Path:
    return Path(state_dir) / f"worker-{worker_id}.state.pt"


def rank_path(path: Path, rank: int, round_: int) -> Path:
    """Where rank ``rank`` of an fsdp island keeps its shard of round ``round_`` beside rank
    0's ``path``. The shards are written before rank 0's file and the last two rounds' kept,
    so the round rank 0's file holds has its shards whenever a rank dies."""
    return Path(path).with_name(Path(path).name.replace(".state.pt", f".rank-{rank}.round-{round_}.state.pt"))


SHARDS_KEPT = 2


def _read(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any damage means: start without it
        raise LocalStateError(f"{path} is unreadable ({exc})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise LocalStateError(f"{path} has format {state.get('format_version')!r}, expected {FORMAT_VERSION}")
    return state


def save(path: Path, training: Any, round_: int) -> None:
    """Write ``training``'s state at the start of ``round_`` to ``path`` (write_atomic,
    readable by its owner only)."""
    write_snapshot(path, snapshot(training, round_))


def snapshot(training: Any, round_: int) -> dict:
    """``training``'s state at the start of ``round_``, as CPU tensors of its own: training
    may go on while it is written (StateWriter)."""
    trainer, compressor = training.trainer, training.encoder.compressor
    return {
        "format_version": FORMAT_VERSION,
        "round": round_,
        "layout_digest": training.layout.digest.hex(),
        "data_fingerprint": training.cfg.task.data_fingerprint,
        # state_dict's buffers are copies already
        "error_feedback": cpu_state(compressor.state_dict()) if isinstance(compressor, Compressor) else None,
        "optimizer": cpu_state(trainer.optimizer_state(), copy=True),
        "optimizer_shard": trainer.optimizer_shard(),
        "data": cpu_state(trainer.data_state(), copy=True),
        "latest": cpu_state(training.deltas.latest, copy=True),
        "rng": torch.get_rng_state(),
    }


def write_snapshot(path: Path, state: dict) -> None:
    """A ``snapshot`` to ``path``, serialized straight into the file (no second copy in memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_atomic(path, mode=PRIVATE_MODE) as f:
        torch.save(state, f)


class StateWriter:
    """Writes a worker's ``snapshot``s on a thread of its own, one at a time, so that between
    two rounds a save costs only the copy: under outer.overlap the next inner phase waits on
    that time, and the write (serialization, fsync) took 4-9 % of a round of gpt-tiny.
    ``outcome`` gives a finished write's seconds, or raises its OSError; ``close`` waits for
    the write in flight, so a worker that stops or finishes leaves its last state whole."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-state")
        self._pending: Future[float] | None = None

    @property
    def busy(self) -> bool:
        """A write is in flight."""
        return self._pending is not None and not self._pending.done()

    @property
    def pending(self) -> bool:
        """A write was submitted and its outcome not taken yet."""
        return self._pending is not None

    def submit(self, path: Path, state: dict) -> None:
        """Write ``state`` to ``path`` on the writer's thread (after the write before it:
        take its ``outcome`` first)."""
        if self._pending is not None:
            raise RuntimeError("the previous local state write's outcome was not taken")
        self._pending = self._pool.submit(_timed_write, path, state)

    def outcome(self) -> float | None:
        """Wait for the write in flight; its seconds (None if there was none), or its OSError."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _timed_write(path: Path, state: dict) -> float:
    start = time.monotonic()
    write_snapshot(path, state)
    return time.monotonic() - start


def save_shard(main: Path, rank: int, trainer: Any, round_: int, layout_digest: str, state: Any) -> None:
    """A non-zero rank of an fsdp island: its shard of the AdamW state at the start of
    ``round_``, its pieces of the partitions' latest Δ and of the error feedback (``state``,
    geoloco.worker.island_state.IslandState; the error feedback under SparseLoCo), beside
    rank 0's file ``main`` (``rank_path``); its shards of older rounds but the last
    SHARDS_KEPT go."""
    path = rank_path(main, rank, round_)
    shard = state.shard
    write_snapshot(path, {"format_version": FORMAT_VERSION, "round": round_, "layout_digest": layout_digest,
                  "optimizer_shard": trainer.optimizer_shard(), "optimizer": trainer.optimizer_state(),
                  "error_feedback": shard.state_dict() if shard is not None else None,
                  "island_state": state.state_dict()})
    pattern = rank_path(main, rank, 0).name.replace(".round-0.", ".round-*.")
    saved = sorted(path.parent.glob(pattern), key=lambda p: int(p.name.rsplit(".round-", 1)[1].split(".")[0]))
    for old in saved[:-SHARDS_KEPT]:
        old.unlink(missing_ok=True)


def load_shard(main: Path, rank: int, trainer: Any, round_: int, layout_digest: str, state: Any) -> None:
    """``save_shard``'s inverse, for rank 0's state of ``round_``: LocalStateError if the
    file is missing, unreadable, of another model or sharding (the caller then starts both
    from zero on every rank: geoloco.worker.loop.restore_shards)."""
    path = rank_path(main, rank, round_)
    if not path.exists():
        raise LocalStateError(f"{path} does not exist")
    saved = _read(path)
    if saved["round"] != round_ or saved["layout_digest"] != layout_digest:
        raise LocalStateError(f"{path} is of round {saved['round']}, rank 0's of round {round_} "
                              "(or of another model layout)")
    _load_optimizer(path, saved, trainer)
    if state.shard is not None:
        _load_error_feedback(path, saved.get("error_feedback"), state.shard.compressor)
    try:
        state.load_state_dict(saved["island_state"])
    except (ValueError, KeyError) as exc:
        raise LocalStateError(f"{path}: its pieces of the pseudo-gradients do not fit this rank's ({exc})") from None


def _load_error_feedback(path: Path, saved: dict | None, compressor: Compressor) -> None:
    if saved is None:
        raise LocalStateError(f"{path} holds no error feedback")
    try:
        compressor.load_state_dict(saved)
    except (ValueError, KeyError) as exc:
        raise LocalStateError(f"{path}: its error feedback does not fit this worker's ({exc}; an island "
                              "of another size or a worker that was not one saved it)") from None


def _load_optimizer(path: Path, state: dict, trainer: Any) -> None:
    shard = state.get("optimizer_shard")
    if shard != trainer.optimizer_shard():
        raise LocalStateError(f"{path} holds {_describe_shard(shard)} of the inner AdamW state, this "
                              f"process needs {_describe_shard(trainer.optimizer_shard())}")
    try:
        trainer.load_optimizer_state(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise LocalStateError(f"{path}: its AdamW state does not fit this model ({exc})") from None


def _describe_shard(shard: list[int] | None) -> str:
    return "the whole" if shard is None else f"rank {shard[0]}'s shard of {shard[1]}"


def load(path: Path, training: Any) -> tuple[int, bool]:
    """Put the state in ``path`` into ``training``; returns the round it was saved at and
    whether the inner AdamW state was in it (not when it was saved sharded another way: the
    log says so). LocalStateError if it cannot be read or was saved for another model or data."""
    state = _read(path)
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
        _load_error_feedback(path, state["error_feedback"], compressor)
    try:
        _load_optimizer(path, state, training.trainer)
        adamw = True
    except LocalStateError as exc:
        log.warning("%s: the inner AdamW state starts from zero", exc)
        adamw = False
    training.trainer.load_data_state(state["data"])
    training.deltas.latest = {int(p): delta for p, delta in state["latest"].items()}
    torch.set_rng_state(state["rng"])
    return int(state["round"]), adamw
