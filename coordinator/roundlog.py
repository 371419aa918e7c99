"""The durable close decisions, so that every round is applied exactly once across
coordinator kills (docs/protocol.md, "Stopping and restarting"): before a round's result is
broadcast, its decision goes to ``roundlog/`` in the run dir, fsynced (the header: which
frames by sender, weight and size, the aggregation and alpha; each frame's sha256; each
worker's settlement; the round's metrics line as known at the close; for an aggregated
result, the workers' frames it aggregated, so that a replay advances the coordinator's
error feedback as the round did). A resumed coordinator replays the rounds logged after
its checkpoint instead of redoing them; a checkpoint removes the entries it covers, so the
log holds at most ``coordinator.checkpoint_every`` rounds of frames.

The frames themselves are files of their own, ``round_N.<sha256>.frame``, written as they
arrive (``FrameSpool``): a writer thread hashes and writes each accepted frame while the
other pushes come in, so a close waits only for what is not durable yet (the last frame,
an aggregate made at the close) and then commits the small record. Written at the close,
the hashes and the fsync of 64 frames of GPT-2's layout were 0.62 s of its 1.85 s
(docs/benchmarks.md, ``scale.py``)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoloco.compression import Layout, decode_frame
from geoloco.coordinator.outer import Update, UpdateFrame
from geoloco.coordinator.rounds import ClosedRound
from geoloco.protos import geoloco_pb2 as pb
from geoloco.run_dir import ROUNDLOG_DIR, write_atomic

log = logging.getLogger(__name__)

# threads writing frames: sha256, the write and the fsyncs release the GIL, and when the
# last frames of a large round are checked at once, the close waits for the writes behind them
SPOOL_WRITERS = 2
_ENTRY = re.compile(r"^round_(\d{8})\.(json|frames|[0-9a-f]{64}\.frame)$")


def _path(run_dir: Path, round: int, kind: str) -> Path:
    return Path(run_dir) / ROUNDLOG_DIR / f"round_{round:08d}.{kind}"


def _frame_path(run_dir: Path, round: int, sha256: str) -> Path:
    return _path(run_dir, round, f"{sha256}.frame")


class _Write:
    """One frame on its way to ``round_N.<sha256>.frame``: its hash once written, or the
    OSError that stopped it."""

    def __init__(self, round: int, data: bytes) -> None:
        self.round, self.data = round, data
        self.sha256: str | None = None
        self.error: OSError | None = None
        self.done = False

    def run(self, run_dir: Path) -> None:
        sha256 = hashlib.sha256(self.data).hexdigest()
        try:
            (Path(run_dir) / ROUNDLOG_DIR).mkdir(parents=True, exist_ok=True)
            write_atomic(_frame_path(run_dir, self.round, sha256), self.data)
        except OSError as exc:
            self.error = exc
        else:
            self.sha256 = sha256

    def result(self) -> str:
        """The frame's sha256, or the write's OSError raised."""
        if self.sha256 is None:
            raise self.error or OSError(f"the frame of round {self.round} was not written")
        return self.sha256


class FrameSpool:
    """Each accepted frame to the round log as it arrives, on SPOOL_WRITERS threads, so that a
    close finds its frames durable already (``durable``). ``paused``: the round log is off
    until the next checkpoint (a decision could not be written): frames handed over then
    are dropped, and a close after the checkpoint writes what it needs itself. A frame that
    is never named by a decision (late, not chosen, a round redone after a kill) is removed
    with its round by ``prune``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.lock = threading.Condition()
        self.queue: deque[_Write] = deque()
        self.writes: dict[int, _Write] = {}  # id(data) -> its write; the write holds data
        self.paused = False
        self.closed = False
        self.threads = [threading.Thread(target=self._run, name=f"roundlog-frames-{i}", daemon=True)
                        for i in range(SPOOL_WRITERS)]
        for thread in self.threads:
            thread.start()

    def put(self, round: int, data: bytes) -> None:
        """Hand an accepted frame of ``round`` to the writer (returns at once)."""
        with self.lock:
            if self.paused or self.closed:
                return
            write = _Write(round, data)
            self.writes[id(data)] = write
            self.queue.append(write)
            self.lock.notify_all()

    def durable(self, round: int, parts: Sequence[bytes]) -> list[str]:
        """The sha256 of each of ``parts`` once it is durable under ``round``: a frame handed
        over by ``put`` is waited for, any other is written here. Raises the OSError of a
        write that failed."""
        hashes = []
        for data in parts:
            with self.lock:
                write = self.writes.get(id(data))
                if write is not None and (write.data is not data or write.round != round):
                    write = None
                while write is not None and not write.done:
                    self.lock.wait()
            if write is None:
                write = _Write(round, data)
                write.run(self.run_dir)
            hashes.append(write.result())
        return hashes

    def settled(self, round: int) -> None:
        """Forget the frames of the rounds up to ``round`` (decided): the writer's queue
        keeps those it has not written yet."""
        with self.lock:
            for key in [k for k, w in self.writes.items() if w.round <= round]:
                del self.writes[key]

    def close(self) -> None:
        """Stop the writers after the frames they are writing. The rest of the queue is dropped (a
        round no decision names is redone after a restart); a close waiting for one of them
        gets an OSError."""
        with self.lock:
            self.closed = True
            for write in self.queue:
                write.error, write.done = OSError("the coordinator is stopping"), True
            self.queue.clear()
            self.lock.notify_all()
        for thread in self.threads:
            thread.join()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.queue and not self.closed:
                    self.lock.wait()
                if self.closed:
                    return
                write = self.queue.popleft()
            write.run(self.run_dir)
            with self.lock:
                write.done = True
                self.lock.notify_all()


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


def append(run_dir: Path, entry: LoggedRound, spool: FrameSpool | None = None) -> None:
    """Make ``entry`` durable: its frames first (those ``spool`` took on arrival are waited
    for, the others written here), then the record that names their hashes (the record is
    the commit: without it the round was not decided)."""
    spool = spool or _Inline(run_dir)
    sources = [data for _, _, data in entry.sources]
    hashes = spool.durable(entry.round, [*entry.parts, *sources])
    record = {
        "round": entry.round,
        "header": base64.b64encode(entry.header.SerializeToString()).decode(),
        "frames_sha256": hashes[:len(entry.parts)],
        "settlements": {str(w): base64.b64encode(s.SerializeToString()).decode()
                        for w, s in entry.settlements.items()},
        "metrics": entry.metrics,
        "sources": [{"sender": sender, "weight": weight, "nbytes": len(data), "sha256": sha256}
                    for (sender, weight, data), sha256 in zip(entry.sources, hashes[len(entry.parts):],
                                                               strict=True)],
        "source_mode": entry.source_mode,
    }
    write_atomic(_path(run_dir, entry.round, "json"), json.dumps(record, sort_keys=True) + "\n")


class _Inline:
    """``append`` without a spool: every frame written at the close."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def durable(self, round: int, parts: Sequence[bytes]) -> list[str]:
        writes = [_Write(round, data) for data in parts]
        for write in writes:
            write.run(self.run_dir)
        return [write.result() for write in writes]


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
    named = [(info.nbytes, digest, info.sender)
             for info, digest in zip(header.frames, record["frames_sha256"], strict=True)]
    named += [(s["nbytes"], s["sha256"], s["sender"]) for s in record.get("sources", [])]
    frames = _frames(run_dir, round, named)
    parts = tuple(frames[:len(header.frames)])
    sources = tuple((int(s["sender"]), float(s["weight"]), data)
                    for s, data in zip(record.get("sources", []), frames[len(header.frames):], strict=True))
    settlements = {int(w): pb.Settlement.FromString(base64.b64decode(s))
                   for w, s in record["settlements"].items()}
    if header.round != round:
        raise ValueError(f"holds round {header.round}")
    return LoggedRound(header, parts, settlements, record["metrics"], sources,
                       record.get("source_mode", ""))


def _frames(run_dir: Path, round: int, named: list[tuple[int, str, int]]) -> list[bytes]:
    """A logged round's frames, named by (size, sha256, sender) in the record's order: each
    from its own file, or from ``round_N.frames`` (one after another) in a round log
    written before frames had files of their own."""
    joined = _path(run_dir, round, "frames")
    if not joined.exists():
        return [_checked(_own_file(run_dir, round, digest), digest, sender) for _, digest, sender in named]
    data, start, frames = joined.read_bytes(), 0, []
    for nbytes, digest, sender in named:
        frames.append(_checked(data[start:start + nbytes], digest, sender))
        start += nbytes
    return frames


def _own_file(run_dir: Path, round: int, digest: str) -> bytes:
    path = _frame_path(run_dir, round, digest)
    try:
        return path.read_bytes()
    except FileNotFoundError:  # the record names it: a damaged entry, not the log's end
        raise ValueError(f"{path.name} is missing") from None


def _checked(part: bytes, digest: str, sender: int) -> bytes:
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
