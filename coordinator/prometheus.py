"""The coordinator's Prometheus metrics (docs/monitoring.md): counters and histograms fed by
every closed round's RoundMetrics, and gauges read from the live state at each scrape.
Labels are worker ids and close reasons only: no token, no session, no host name."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from geoloco.config import RunConfig
from geoloco.coordinator.metrics import BROADCAST_MODES, RoundMetrics
from geoloco.coordinator.rounds import CLOSE_REASONS
from geoloco.coordinator.state import CoordinatorState

FRAME_BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 16))  # 1 kB .. 1 GB
SECONDS_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)


class CoordinatorMetrics:
    """A registry of the run's metrics; the round loop calls ``write_round`` (it is a
    RoundObserver), and a scrape reads the rest from ``state``."""

    def __init__(self, state: CoordinatorState, cfg: RunConfig, worst_coefficient: float) -> None:
        self.registry = CollectorRegistry()
        self.cfg = cfg
        r, w = self.registry, ["worker"]
        self.rounds = Counter("geoloco_rounds", "Rounds closed by this coordinator process", registry=r)
        self.closes = Counter("geoloco_round_closes", "Closed rounds by why they closed", ["reason"], registry=r)
        self.broadcasts = Counter("geoloco_round_broadcasts", "Round results by what they carried "
                                  "(coordinator.broadcast)", ["mode"], registry=r)
        self.upload = Counter("geoloco_upload_bytes", "Frame bytes received", w, registry=r)
        self.download = Counter("geoloco_download_bytes", "Round-result bytes sent", w, registry=r)
        self.rejected = Counter("geoloco_frames_rejected", "Frames refused: bad header, frame or round", registry=r)
        self.late = Counter("geoloco_frames_late", "Frames for a round that had closed", registry=r)
        self.clipped = Counter("geoloco_frames_clipped", "Frames scaled down by the frame bounds", w, registry=r)
        self.missed = Counter("geoloco_worker_missed_rounds", "Rounds that closed without the worker's frame", w, registry=r)
        self.compute = Counter("geoloco_worker_compute_seconds", "Apply, train and encode time", w, registry=r)
        self.send = Counter("geoloco_worker_send_seconds", "Time from its own work done to its frame in", w, registry=r)
        self.wait = Counter("geoloco_worker_wait_seconds", "Time from its frame in to the round's close", w, registry=r)
        self.last_seen = Gauge("geoloco_worker_last_seen_timestamp_seconds", "When its last frame came in", w, registry=r)
        self.val_loss = Gauge("geoloco_val_loss", "Validation loss after the last measured round", registry=r)
        self.train_loss = Gauge("geoloco_train_loss", "Mean inner-loop loss of the last round's frames", registry=r)
        self.lr = Gauge("geoloco_inner_lr", "Inner learning rate at the last round's first step", registry=r)
        self.stragglers = Gauge("geoloco_round_stragglers", "Workers whose frame the last round closed without", registry=r)
        self.density = Gauge("geoloco_worker_density", "Top-k density of the worker's last frame", w, registry=r)
        self.coefficient = Gauge("geoloco_round_max_coefficient", "Largest |decoding coefficient| of the last round", registry=r)
        self.round_seconds = Histogram("geoloco_round_duration_seconds", "Round times, broadcast to broadcast",
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.close_seconds = Histogram("geoloco_round_close_seconds", "Last chosen frame in to the broadcast",
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.apply_seconds = Histogram("geoloco_round_apply_seconds", "The coordinator's apply and digest",
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.decode_seconds = Histogram("geoloco_frame_decode_seconds", "Checking and decoding one frame",
                                        buckets=SECONDS_BUCKETS, registry=r)
        self.frame_bytes = Histogram("geoloco_frame_bytes", "Sizes of the frames received",
                                     buckets=FRAME_BYTES_BUCKETS, registry=r)
        r.register(StateCollector(state, cfg, worst_coefficient))
        self.state = state
        for counter in (self.upload, self.download, self.clipped, self.missed, self.compute,
                        self.send, self.wait):
            for worker in range(cfg.workers):  # every worker's series from the first scrape
                counter.labels(str(worker))
        for reason in CLOSE_REASONS:  # a rate over the reasons has data from the first close
            self.closes.labels(reason)
        for mode in BROADCAST_MODES:
            self.broadcasts.labels(mode)

    def write_round(self, m: RoundMetrics) -> None:
        self.rounds.inc()
        self.closes.labels(m.close_reason).inc()
        if m.broadcast is not None:
            self.broadcasts.labels(m.broadcast).inc()
        receivers = self.state.overview().live
        for worker in receivers:
            self.download.labels(str(worker)).inc(m.download_bytes_per_worker)
        for worker, nbytes in m.upload_bytes.items():
            self.upload.labels(str(worker)).inc(nbytes)
            self.frame_bytes.observe(nbytes)
        for worker in set(range(self.cfg.workers)) - set(m.arrived):
            self.missed.labels(str(worker)).inc()
        self.rejected.inc(m.rejected_frames)
        self.late.inc(m.late_frames)
        # per-worker counts of frames the bounds scaled down, where the coordinator bounds them
        for worker, count in (getattr(m, "clipped_by_worker", None) or {}).items():
            self.clipped.labels(str(worker)).inc(count)
        self._write_timeline(m)
        self._write_round_gauges(m)

    def _write_timeline(self, m: RoundMetrics) -> None:
        for worker, seconds in m.compute_seconds_by_worker.items():
            self.compute.labels(str(worker)).inc(seconds)
        for worker, seconds in m.send_seconds_by_worker.items():
            self.send.labels(str(worker)).inc(seconds)
        now = m.time if m.time is not None else time.time()
        for worker, seconds in m.wait_seconds_by_worker.items():
            self.wait.labels(str(worker)).inc(seconds)
            self.last_seen.labels(str(worker)).set(now - seconds)
        for seconds in m.decode_seconds_by_worker.values():
            self.decode_seconds.observe(seconds)

    def _write_round_gauges(self, m: RoundMetrics) -> None:
        if m.val_loss is not None:
            self.val_loss.set(m.val_loss)
        self.train_loss.set(m.train_loss if m.train_loss is not None else math.nan)
        if m.lr is not None:
            self.lr.set(m.lr)
        self.stragglers.set(self.cfg.workers - len(m.arrived))
        for worker, density in m.density_by_worker.items():
            self.density.labels(str(worker)).set(density)
        self.coefficient.set(m.max_coefficient if m.max_coefficient is not None else math.nan)
        self.round_seconds.observe(m.round_seconds)
        if m.close_seconds is not None:
            self.close_seconds.observe(m.close_seconds)
        if m.coordinator_apply_seconds is not None:
            self.apply_seconds.observe(m.coordinator_apply_seconds)


class StateCollector:
    """The gauges of this moment, read from the coordinator's state at each scrape."""

    def __init__(self, state: CoordinatorState, cfg: RunConfig, worst_coefficient: float) -> None:
        self.state = state
        self.cfg = cfg
        self.worst_coefficient = worst_coefficient

    def collect(self) -> Iterator[Metric]:
        view = self.state.overview()
        yield _gauge("geoloco_open_round", "The round open now (or waiting to open)", view.round)
        yield _gauge("geoloco_rounds_done", "Rounds done in this run, those before a resume too",
                     view.rounds_done)
        yield _gauge("geoloco_rounds_planned", "Rounds the run has", self.cfg.rounds)
        yield _gauge("geoloco_round_deadline_seconds", "A round's time limit", self.cfg.coordinator.deadline_s)
        open_for = time.monotonic() - view.opened_at if view.opened_at is not None else 0.0
        yield _gauge("geoloco_round_open_seconds", "How long the open round has been open", open_for)
        yield _gauge("geoloco_round_arrived", "Frames in for the open round", view.arrived)
        yield _gauge("geoloco_workers_expected", "Workers the run has", self.cfg.workers)
        yield _gauge("geoloco_workers_live", "Workers joined since this process started", len(view.live))
        yield _gauge("geoloco_worst_decoding_coefficient",
                     "The gradient code's worst-case |decoding coefficient|", self.worst_coefficient)
        if view.initial_val_loss is not None:
            yield _gauge("geoloco_initial_val_loss", "Validation loss before round 0", view.initial_val_loss)
        following = GaugeMetricFamily("geoloco_worker_following", "1 while the worker's Rounds stream is open",
                                      labels=["worker"])
        for worker in view.live:
            following.add_metric([str(worker)], 1.0 if worker in view.following else 0.0)
        yield following
        resyncs = CounterMetricFamily("geoloco_worker_resyncs", "FetchState calls after the worker's first",
                                      labels=["worker"])
        for worker, fetches in sorted(view.state_fetches.items()):
            resyncs.add_metric([str(worker)], max(0, fetches - 1))
        yield resyncs


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
