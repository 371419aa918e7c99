"""A worker's own Prometheus metrics (docs/monitoring.md), read from its counters at each
scrape: rounds applied, resyncs, digest mismatches, reconnects, refused pushes, bytes, the
round it is at. Labelled with the worker id once it has joined; no token, no session."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from geoloco.worker.loop import Worker

# metric name (without _total) -> (help, Counters attribute)
COUNTERS = {
    "geoloco_worker_rounds_applied": ("Round results applied", "rounds_applied"),
    "geoloco_worker_local_resyncs": ("State fetches after the first (any cause)", "resyncs"),
    "geoloco_worker_digest_mismatches": ("Parameters that failed the coordinator's digest", "digest_mismatches"),
    "geoloco_worker_reconnects": ("Rounds streams opened again after a break", "reconnects"),
    "geoloco_worker_rejected_pushes": ("Frames the coordinator refused", "rejected_pushes"),
    "geoloco_worker_pushed_bytes": ("Frame bytes the coordinator accepted", "bytes_pushed"),
    "geoloco_worker_received_bytes": ("Round-result and state bytes received", "bytes_received"),
}


class WorkerCollector:
    """Collects ``worker``'s counters; register it in a CollectorRegistry."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        worker_id = self.worker.session.worker_id
        labels = [] if worker_id is None else [str(worker_id)]
        counters = self.worker.counters
        for name, (documentation, attribute) in COUNTERS.items():
            family = CounterMetricFamily(name, documentation, labels=["worker"])
            if labels:
                family.add_metric(labels, getattr(counters, attribute))
            yield family
        at = GaugeMetricFamily("geoloco_worker_round", "The round this worker is at", labels=["worker"])
        apply = GaugeMetricFamily("geoloco_worker_apply_seconds", "Applying the last round result",
                                  labels=["worker"])
        density = GaugeMetricFamily("geoloco_worker_frame_density",
                                    "Top-k density of this worker's last frame (0: dense)", labels=["worker"])
        if labels:
            at.add_metric(labels, self.worker.round)
            apply.add_metric(labels, self.worker.apply_s)
            density.add_metric(labels, self.worker.density)
        yield at
        yield apply
        yield density


def worker_registry(worker: Worker) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    return registry
