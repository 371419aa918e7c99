"""The durable close decisions, so that every round is applied exactly once across
coordinator kills (docs/protocol.md, "Stopping and restarting"): before a round's result is
broadcast, its decision goes to ``roundlog/`` in the run dir, fsynced (the header: which
frames by sender, weight and size, the aggregation and alpha; each frame's sha256 and
bytes; each worker's settlement; the round's metrics line as known at the close; for an
aggregated result, the workers' frames it aggregated, so that a replay advances the
coordinator's error feedback as the round did). A
resumed coordinator replays the rounds logged after its checkpoint instead of redoing them;
a checkpoint removes the entries it covers, so the log holds at most
``coordinator.checkpoint_every`` rounds of frames."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoloco.compression import Layout, decode_frame
from geoloco.coordinator.outer import Update, UpdateFrame
from geoloco.coordinator.rounds import ClosedRound
from geoloco.protos import geoloco_pb2 as pb
from geoloco.run_dir import ROUNDLOG_DIR, write_atomic

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"^round_(\d{8})\.(json|frames)$")


def _path(run_dir: Path, round: int, kind: str) -> Path:
    return Path(run_dir) / ROUNDLOG_DIR / f"round_{round:08d}.{kind}"


@dataclass
class LoggedRound:
    """One logged close decision: enough to broadcast, apply and record the round again."""

    header: pb.RoundHeader
    parts: tuple[bytes, ...]
    settlements: dict[int, pb.Settlement]
    metrics: dict[str, Any]
    sources: tuple[tuple[int, float, bytes], ...] = ()  # an aggregate's (sender, weight, frame)
    source_mode: str = ""

    @property
    def round(self) -> int:
        return self.header.round

    def closed(self) -> ClosedRound:
        """The round result as it was (or was to be) broadcast."""
        return ClosedRound(self.header, self.parts, self.settlements)

    def update(self, layout: Layout) -> Update:
        """The update every replica applies (the frames were checked when they were taken)."""
        frames = [UpdateFrame(info.sender, info.weight, data, decode_frame(data, layout))
                  for info, data in zip(self.header.frames, self.parts, strict=True)]
        return Update(frames, self.header.aggregation or "sum", self.header.alpha)

    def source_frames(self, layout: Layout) -> list[UpdateFrame]:
        """The workers' weighted frames an aggregated result was made of (none otherwise)."""
        return [UpdateFrame(sender, weight, data, decode_frame(data, layout))
                for sender, weight, data in self.sources]


def append(run_dir: Path, entry: LoggedRound) -> None:
    """Make ``entry`` durable: its frames first, then the record that names their hashes
    (the record is the commit: without it the round was not decided)."""
    folder = Path(run_dir) / ROUNDLOG_DIR
    folder.mkdir(parents=True, exist_ok=True)
    sources = [data for _, _, data in entry.sources]
    write_atomic(_path(run_dir, entry.round, "frames"), b"".join([*entry.parts, *sources]))
    record = {
        "round": entry.round,
        "header": base64.b64encode(entry.header.SerializeToString()).decode(),
        "frames_sha256": [hashlib.sha256(p).hexdigest() for p in entry.parts],
        "settlements": {str(w): base64.b64encode(s.SerializeToString()).decode()
                        for w, s in entry.settlements.items()},
        "metrics": entry.metrics,
        "sources": [{"sender": sender, "weight": weight, "nbytes": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()} for sender, weight, data in entry.sources],
        "source_mode": entry.source_mode,
    }
    write_atomic(_path(run_dir, entry.round, "json"), json.dumps(record, sort_keys=True) + "\n")


def read(run_dir: Path, from_round: int) -> list[LoggedRound]:
    """The logged rounds ``from_round``, ``from_round + 1``, ... up to the first one missing
    or damaged (that round and the later ones are redone)."""
    found, round = [], from_round
    while True:
        try:
            found.append(_read(run_dir, round))
        except FileNotFoundError:
            return found
        except (OSError, ValueError, KeyError) as exc:
            log.warning("round log entry of round %d is unreadable (%s); it is redone", round, exc)
            return found
        round += 1


def _read(run_dir: Path, round: int) -> LoggedRound:
    record = json.loads(_path(run_dir, round, "json").read_text())
    header = pb.RoundHeader.FromString(base64.b64decode(record["header"]))
    data, parts, start = _path(run_dir, round, "frames").read_bytes(), [], 0
    for info, digest in zip(header.frames, record["frames_sha256"], strict=True):
        parts.append(_part(data, start, info.nbytes, digest, info.sender))
        start += info.nbytes
    sources = []
    for source in record.get("sources", []):
        sources.append((int(source["sender"]), float(source["weight"]),
                        _part(data, start, source["nbytes"], source["sha256"], source["sender"])))
        start += source["nbytes"]
    settlements = {int(w): pb.Settlement.FromString(base64.b64decode(s))
                   for w, s in record["settlements"].items()}
    if header.round != round:
        raise ValueError(f"holds round {header.round}")
    return LoggedRound(header, tuple(parts), settlements, record["metrics"], tuple(sources),
                       record.get("source_mode", ""))


def _part(data: bytes, start: int, nbytes: int, digest: str, sender: int) -> bytes:
    part = data[start:start + nbytes]
    if hashlib.sha256(part).hexdigest() != digest:
        raise ValueError(f"frame of worker {sender} does not match its sha256")
    return part


def prune(run_dir: Path, before: int) -> None:
    """Remove the entries of the rounds before ``before`` (a checkpoint covers them)."""
    folder = Path(run_dir) / ROUNDLOG_DIR
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        match = _ENTRY.match(path.name)
        if match is not None and int(match.group(1)) < before:
            path.unlink(missing_ok=True)
