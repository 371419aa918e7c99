"""Run metrics: one JSON line per round in ``metrics.jsonl`` and the end-of-run
``summary.json`` (rounds, losses, bytes, where a round's time went, when; docs/protocol.md)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from geoloco.coordinator.outer import COORDINATOR_SENDER
from geoloco.coordinator.rounds import ClosedRound, RoundState
from geoloco.run_dir import METRICS_FILE, SUMMARY_FILE, write_atomic


@dataclass
class RoundMetrics:
    """What one closed round cost and achieved, as seen by the coordinator."""

    round: int
    val_loss: float | None  # None when not measured this round
    train_loss: float | None  # mean of the arrived workers' inner-loop losses
    arrived: list[int]
    chosen: list[int]
    close_reason: str
    upload_bytes: dict[int, int]  # worker -> frame bytes it pushed this round
    download_bytes_per_worker: int  # round header + chosen frames sent to each worker
    round_seconds: float  # from the previous round's broadcast to this one's
    compute_seconds: float | None  # mean over arrived workers
    wait_seconds: float | None  # mean of round_seconds - compute_seconds over arrived
    rejected_frames: int
    late_frames: int
    partitions_trained: dict[int, int] = field(default_factory=dict)  # arrived worker -> count
    # Where the round's time went (None: nothing arrived). Worker figures come with the
    # pushes; the coordinator's are its own clock.
    compute_seconds_max: float | None = None  # the slowest arrived worker's inner loop
    encode_seconds: float | None = None  # mean compression time of the arrived frames
    encode_seconds_max: float | None = None
    worker_apply_seconds_max: float | None = None  # slowest apply of the previous result
    close_seconds: float | None = None  # last frame's bytes in -> broadcast (the coordinator's share)
    coordinator_apply_seconds: float | None = None  # apply + digest, after the broadcast
    decode_seconds: float | None = None  # mean check-and-decode time of the arrived frames
    decode_seconds_by_worker: dict[int, float] = field(default_factory=dict)
    # Each arrived worker's round as the coordinator saw it, from the round's opening (the
    # previous broadcast): its own work (apply the previous result, train, encode), the
    # rest until its frame was in (the result's download, the push's upload, an emulated
    # straggler's sleep), then waiting for the round to close (round_seconds in all).
    compute_seconds_by_worker: dict[int, float] = field(default_factory=dict)
    send_seconds_by_worker: dict[int, float] = field(default_factory=dict)
    wait_seconds_by_worker: dict[int, float] = field(default_factory=dict)
    max_coefficient: float | None = None  # the largest |a_i| the round decoded with
    lr: float | None = None  # the inner learning rate at the round's first inner step
    time: float | None = None  # wall clock (Unix seconds) at the broadcast
    elapsed_seconds: float | None = None  # since the run started (a resume carries it on)
    # Frames refused (bad header, bad frame, above the bounds; not late) and frames scaled
    # down by the bounds, per worker (geoloco.coordinator.bounds); the bounds' reference.
    rejected_by_worker: dict[int, int] = field(default_factory=dict)
    clipped_by_worker: dict[int, int] = field(default_factory=dict)
    median_frame_norm: float | None = None
    # what each arrived worker process reported of its replica checks so far
    digest_mismatches_by_worker: dict[int, int] = field(default_factory=dict)
    resyncs_by_worker: dict[int, int] = field(default_factory=dict)
    # the top-k density of each arrived sparse frame and the upload rate (bytes/s) its
    # worker measured on its previous push (compression.density "auto": worker/density.py)
    density_by_worker: dict[int, float] = field(default_factory=dict)
    upload_rate_by_worker: dict[int, float] = field(default_factory=dict)
    # what the round result carried (coordinator.broadcast): "frames", the workers' own, or
    # "aggregate", one frame the coordinator made (SparseLoCo's aggregated result, DiLoCo's
    # dense update); None where nothing was applied
    broadcast: str | None = None
    # where the close went, phase by phase, in order (ClosePhases): seconds of each, and the
    # coordinator's resident bytes at the end of each (None where /proc cannot be read)
    close_phases: dict[str, float] = field(default_factory=dict)
    close_rss_bytes: dict[str, int | None] = field(default_factory=dict)

    @property
    def upload_bytes_mean(self) -> float | None:
        values = list(self.upload_bytes.values())
        return sum(values) / len(values) if values else None

    def to_json(self) -> str:
        data = asdict(self)
        data["upload_bytes"] = {str(k): v for k, v in self.upload_bytes.items()}
        data["upload_bytes_per_worker"] = self.upload_bytes_mean
        for name in ("partitions_trained", "decode_seconds_by_worker", "compute_seconds_by_worker",
                     "send_seconds_by_worker", "wait_seconds_by_worker", "rejected_by_worker",
                     "clipped_by_worker", "digest_mismatches_by_worker", "resyncs_by_worker",
                     "density_by_worker", "upload_rate_by_worker"):
            data[name] = {str(k): v for k, v in getattr(self, name).items()}
        trained = list(self.partitions_trained.values())
        data["partitions_per_worker_round"] = sum(trained) / len(trained) if trained else None
        return json.dumps(_finite(data), sort_keys=True)


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CLOSE_PHASES = ("bounds", "aggregate", "log", "publish", "apply", "digest")  # run_round's order


def resident_bytes() -> int | None:
    """This process's resident set now (/proc/self/statm), None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class ClosePhases:
    """Seconds and resident bytes at the end of each phase of a round's close (CLOSE_PHASES:
    the frame guard, the outer step, the round log's write, the hand-over to the Rounds
    streams, the apply, the digest), each phase from the end of the one before; the first
    from the moment the round's close was decided."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.rss: dict[str, int | None] = {}
        self._mark = time.monotonic()

    def end(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = now - self._mark
        self.rss[phase] = resident_bytes()
        self._mark = now


@dataclass
class RoundTiming:
    """The coordinator's clock for one round after it closed: monotonic readings, the wall
    clock at the broadcast, the run's elapsed time then, and the close's phases."""

    published_at: float
    applied_at: float = 0.0
    wall_time: float | None = None
    elapsed_seconds: float | None = None
    phases: ClosePhases | None = None


def round_metrics(rs: RoundState, closed: ClosedRound, timing: RoundTiming,
                  val_loss: float | None, lr: float | None = None) -> RoundMetrics:
    """The metrics line of the closed round ``rs``, broadcast as ``closed``."""
    opened = rs.opened_at or timing.published_at
    seconds = timing.published_at - opened
    arrivals = list(rs.arrivals.values())
    computes = [a.compute_seconds for a in arrivals]
    encodes = [a.encode_seconds for a in arrivals]
    arrived_after = {a.worker: max(0.0, a.received_at - opened) for a in arrivals}
    # a worker that had the state before the round opened (round 0: the first to fetch it)
    # started its work early; only the part inside the round counts
    work = {a.worker: min(a.apply_seconds + a.compute_seconds + a.encode_seconds, arrived_after[a.worker])
            for a in arrivals}
    losses = [a.train_loss for a in arrivals if a.train_loss == a.train_loss]
    chosen = [a for a, _ in rs.chosen()]
    return RoundMetrics(
        round=rs.round, val_loss=val_loss,
        train_loss=sum(losses) / len(losses) if losses else None,
        arrived=sorted(rs.arrivals), chosen=sorted(rs.decision.coefficients),
        close_reason=rs.decision.reason,
        upload_bytes={a.worker: len(a.data) for a in arrivals},
        download_bytes_per_worker=closed.header.ByteSize() + closed.nbytes,
        round_seconds=seconds,
        compute_seconds=_mean(computes),
        wait_seconds=_mean([seconds - c for c in computes]),
        rejected_frames=rs.rejected, late_frames=rs.late,
        partitions_trained={a.worker: len(a.partitions) for a in arrivals},
        compute_seconds_max=max(computes, default=None),
        encode_seconds=_mean(encodes), encode_seconds_max=max(encodes, default=None),
        worker_apply_seconds_max=max((a.apply_seconds for a in arrivals), default=None),
        close_seconds=(timing.published_at - max(a.received_at for a in chosen)
                       if chosen else None),
        coordinator_apply_seconds=timing.applied_at - timing.published_at,
        decode_seconds=_mean([a.decode_seconds for a in arrivals]),
        decode_seconds_by_worker={a.worker: a.decode_seconds for a in arrivals},
        compute_seconds_by_worker=work,
        send_seconds_by_worker={w: max(0.0, t - work[w]) for w, t in arrived_after.items()},
        wait_seconds_by_worker={w: max(0.0, seconds - t) for w, t in arrived_after.items()},
        max_coefficient=max((abs(a) for a in rs.decision.coefficients.values()), default=None),
        lr=lr, time=timing.wall_time, elapsed_seconds=timing.elapsed_seconds,
        rejected_by_worker=dict(rs.rejected_by), clipped_by_worker=dict(rs.clipped_by),
        digest_mismatches_by_worker={a.worker: a.digest_mismatches for a in arrivals},
        resyncs_by_worker={a.worker: a.resyncs for a in arrivals},
        density_by_worker={a.worker: a.density for a in arrivals if a.density},
        upload_rate_by_worker={a.worker: a.upload_rate for a in arrivals if a.upload_rate},
        broadcast=broadcast_of(closed),
        close_phases=dict(timing.phases.seconds) if timing.phases else {},
        close_rss_bytes=dict(timing.phases.rss) if timing.phases else {},
    )


BROADCAST_MODES = ("frames", "aggregate")  # RoundMetrics.broadcast


def broadcast_of(closed: ClosedRound) -> str | None:
    """"aggregate" where the result is the coordinator's frames (one, or
    coordinator.broadcast_passes), else "frames"."""
    senders = [f.sender for f in closed.header.frames]
    if not senders:
        return None
    return "aggregate" if all(s == COORDINATOR_SENDER for s in senders) else "frames"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class RunTotals:
    """Running totals kept across rounds (and across a resume, via the checkpoint)."""

    rounds: int = 0
    initial_val_loss: float | None = None
    final_val_loss: float | None = None
    upload_bytes: int = 0
    uploads: int = 0
    download_bytes: int = 0
    downloads: int = 0
    rejected_frames: int = 0
    late_frames: int = 0
    extra_state_fetches: int = 0  # FetchState calls after a worker's first (resyncs)
    partitions_trained: int = 0  # over the arrived frames: sum of partitions each trained
    partition_reports: int = 0  # ... and how many frames reported them
    wall_seconds: float = 0.0
    rejected_by_worker: dict[int, int] = field(default_factory=dict)
    clipped_by_worker: dict[int, int] = field(default_factory=dict)
    # the largest counts each worker id reported with its pushes
    digest_mismatches_by_worker: dict[int, int] = field(default_factory=dict)
    resyncs_by_worker: dict[int, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, m: RoundMetrics, n_receivers: int) -> None:
        self.rounds = m.round + 1
        if m.val_loss is not None:
            self.final_val_loss = m.val_loss
        self.upload_bytes += sum(m.upload_bytes.values())
        self.uploads += len(m.upload_bytes)
        self.download_bytes += m.download_bytes_per_worker * n_receivers
        self.downloads += n_receivers
        self.rejected_frames += m.rejected_frames
        self.late_frames += m.late_frames
        self.partitions_trained += sum(m.partitions_trained.values())
        self.partition_reports += len(m.partitions_trained)
        for mine, theirs in ((self.rejected_by_worker, m.rejected_by_worker),
                             (self.clipped_by_worker, m.clipped_by_worker)):
            for worker, count in theirs.items():
                mine[worker] = mine.get(worker, 0) + count
        for mine, theirs in ((self.digest_mismatches_by_worker, m.digest_mismatches_by_worker),
                             (self.resyncs_by_worker, m.resyncs_by_worker)):
            for worker, count in theirs.items():
                mine[worker] = max(mine.get(worker, 0), count)

    def summary(self, dense_fp32_bytes: int) -> dict[str, Any]:
        up = self.upload_bytes / self.uploads if self.uploads else None
        down = self.download_bytes / self.downloads if self.downloads else None
        return _finite({
            "rounds": self.rounds,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": self.final_val_loss,
            "upload_bytes_per_worker_round": up,
            "download_bytes_per_worker_round": down,
            "dense_fp32_bytes": dense_fp32_bytes,
            "upload_ratio_vs_dense_fp32": up / dense_fp32_bytes if up and dense_fp32_bytes else None,
            # as the workers reported them with their pushes (`local` recounts from their reports)
            "digest_mismatches": sum(self.digest_mismatches_by_worker.values()),
            "worker_resyncs": sum(self.resyncs_by_worker.values()),
            "resync_state_fetches": self.extra_state_fetches,
            "rejected_frames": self.rejected_frames,
            "late_frames": self.late_frames,
            "partitions_per_worker_round": (self.partitions_trained / self.partition_reports
                                            if self.partition_reports else None),
            "wall_seconds": self.wall_seconds,
            "rejected_by_worker": {str(k): v for k, v in sorted(self.rejected_by_worker.items())},
            "clipped_by_worker": {str(k): v for k, v in sorted(self.clipped_by_worker.items())},
            **self.extra,
        })


class MetricsWriter:
    """Appends round lines to ``run_dir/metrics.jsonl`` and writes ``summary.json``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def write_round(self, m: RoundMetrics) -> None:
        """Append the round's line; a failed write (disk full) leaves no partial line."""
        line = (m.to_json() + "\n").encode()
        with open(self.run_dir / METRICS_FILE, "ab", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                written = 0
                while written < len(line):
                    written += f.write(line[written:])
            except OSError:
                f.truncate(end)
                raise

    def drop_rounds_from(self, round: int) -> int:
        """Remove the lines of ``round`` and later (a resumed run redoes those rounds) and
        a partial last line; returns how many lines went."""
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return 0
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if _round_of(line) is not None and _round_of(line) < round]
        if len(kept) < len(lines):
            write_atomic(path, "".join(line + "\n" for line in kept))
        return len(lines) - len(kept)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        return write_atomic(self.run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, sort_keys=True) + "\n")


def _round_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["round"])
    except (ValueError, KeyError, TypeError):
        return None


def _finite(value: Any) -> Any:
    """JSON has no NaN: non-finite floats become None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
