"""What a run writes and serves beside its rounds, against a real coordinator and real
workers in this process (docs/monitoring.md, docs/protocol.md): TensorBoard scalars that
are metrics.jsonl's figures round by round, the metrics endpoint bound only where
``monitoring.metrics_host`` says, and a metrics line or registry.json that cannot be
written is one error line each while every round still closes and the run finishes."""

from __future__ import annotations

import json
import logging
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_processes import SMALL, metrics

import geoloco
from geoloco.config import load_config
from geoloco.coordinator.scalars import SCALARS, TENSORBOARD_DIR

pytestmark = pytest.mark.slow
TOKEN = "outputs"
ROUNDS = 3


class ErrorLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def errors_logged() -> Iterator[ErrorLines]:
    handler = ErrorLines()
    logger = logging.getLogger("geoloco.coordinator")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def config(run_dir: Path, **extra: object):
    return load_config(overrides={
        **SMALL, "workers": 2, "rounds": ROUNDS, "run_dir": str(run_dir), "inner.steps": 2,
        "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN,
        "coordinator.checkpoint_every": 0, **extra})


def run_to_the_end(coordinator, before_end=None) -> None:
    """Two in-process workers until the run is over; ``before_end(coordinator)`` runs once
    the rounds are done, while the coordinator still serves."""
    coordinator.start()
    workers = [geoloco.Worker(f"127.0.0.1:{coordinator.port}", TOKEN, device="cpu").start()
               for _ in range(2)]
    try:
        assert coordinator.wait(timeout=240), "the run did not finish"
        for w in workers:
            assert w.wait(timeout=60) and w.exit_code == 0, w.error
        assert not coordinator.failed
        if before_end is not None:
            before_end(coordinator)
    finally:
        for w in workers:
            w.stop(timeout=10)
        coordinator.stop(grace=0.5)


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def line_value(line: dict, key: str) -> float | None:
    """A RoundMetrics figure as metrics.jsonl has it (the mean upload from the per-worker bytes)."""
    if key == "upload_bytes_mean":
        sent = list(line["upload_bytes"].values())
        return sum(sent) / len(sent) if sent else None
    return line.get(key)


def test_tensorboard_scalars_are_the_metrics_lines_and_the_endpoint_binds_its_host(tmp_path) -> None:
    run_dir = tmp_path / "run"
    coordinator = geoloco.Coordinator(config(run_dir, **{
        "monitoring.tensorboard": True, "monitoring.metrics_port": 0,
        "monitoring.metrics_host": "127.0.0.2"}))
    served: dict[str, object] = {}

    def probe(c) -> None:
        port = c.metrics_server.port
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10) as reply:
            served["text"] = reply.read().decode()
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # bound to 127.0.0.2 only: not to every loopback address, nor to all

    run_to_the_end(coordinator, probe)
    assert f"geoloco_rounds_done {float(ROUNDS)}" in served["text"]
    found = scalars(run_dir / TENSORBOARD_DIR)
    lines = metrics(run_dir)
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    assert [v for _, v in found["workers/arrived"]] == [2.0] * ROUNDS
    for tag, key in SCALARS.items():
        wanted = [(m["round"], line_value(m, key)) for m in lines if line_value(m, key) is not None]
        got = found.get(tag, [])
        assert [s for s, _ in got] == [s for s, _ in wanted], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in wanted], rel=1e-6), tag
    assert {"loss/val", "loss/train", "inner/lr", "seconds/round"} <= set(found)


def test_metrics_lines_and_the_registry_that_cannot_be_written_are_error_lines(
        tmp_path, errors_logged) -> None:
    run_dir = tmp_path / "run"
    coordinator = geoloco.Coordinator(config(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "registry.json"):  # a folder where a file must go: every write fails
        (run_dir / name).unlink(missing_ok=True)
        (run_dir / name).mkdir()
    run_to_the_end(coordinator)
    unwritten = [x for x in errors_logged.lines if "its metrics line was not written" in x]
    assert [int(x.split()[1].rstrip(":")) for x in unwritten] == list(range(ROUNDS)), errors_logged.lines
    assert sum("worker registry not saved" in x for x in errors_logged.lines) == 2, errors_logged.lines
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
