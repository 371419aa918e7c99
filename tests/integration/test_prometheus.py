"""A real Prometheus (Debian's package) on loopback scrapes a live coordinator and two
workers every second during a short run; its HTTP query API then gives the rounds counter,
which must equal the rounds done, and every PromQL expression of the Grafana dashboard must
return data. The scraped text never carries the token or a session. Skipped without the
prometheus binary unless GEOLOCO_REQUIRE_PROMETHEUS=1 (CI sets it). About 40 s."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import geoloco
from geoloco.config import RunConfig, validate
from geoloco.metrics_server import MetricsServer
from geoloco.worker.prometheus import worker_registry

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "geoloco.json"
REQUIRE = "GEOLOCO_REQUIRE_PROMETHEUS"
TOKEN = "prometheus-test-token"
ROUNDS = 4
SCRAPE_S = 1
# Grafana's own variables, as Grafana would fill them in for a short window
GRAFANA_VARIABLES = {"$__rate_interval": "10s"}
READY_TIMEOUT_S = 60.0


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but there is no prometheus binary (apt-get install prometheus)")
        pytest.skip("no prometheus binary (apt-get install prometheus); "
                    f"{REQUIRE}=1 makes this a failure")
    return path


def free_port() -> int:
    """A port that was free a moment ago. Racy (another process may bind it before
    Prometheus does), which is why only this module has it: Prometheus cannot listen on
    port 0 and say which port it got, so Prometheus.wait_ready starts it again on another
    port when its log says "address already in use". Our own processes listen on port 0
    and write the port they bound (run_processes.coordinator_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read()


class Prometheus:
    """One Prometheus process with its own config and storage, on a loopback port."""

    def __init__(self, binary: str, workdir: Path, targets: dict[str, list[str]]) -> None:
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]}
                                     for job, t in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.binary, self.workdir = binary, workdir
        self.log_path = workdir / "prometheus.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.start()

    def start(self) -> None:
        """Prometheus cannot listen on port 0 and say which port it got: it takes a free
        one, and wait_ready starts it again on another if that one was taken meanwhile."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text()
                assert "address already in use" in log, log[-3000:]
                self.start()
                continue
            try:
                if get(f"{self.url}/-/ready"):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"prometheus not ready: {self.log_path.read_text()[-3000:]}")

    def wait_scraped(self, targets: int) -> None:
        """Until every target has been scraped once (the first scrape may come seconds late)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self.query("query", query="up == 1")) < targets:
            assert time.monotonic() < deadline, f"targets never scraped: {self.query('query', query='up')}"
            time.sleep(0.2)

    def query(self, path: str, **params: object) -> list[dict]:
        reply = json.loads(get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"))
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def prometheus_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A finished run whose coordinator (and workers' endpoints) Prometheus scraped
    throughout, still serving until Prometheus has its last rounds."""
    binary = prometheus_binary()
    tmp_path = tmp_path_factory.mktemp("prometheus")
    cfg = validate(RunConfig.from_dict({
        "workers": 2, "rounds": ROUNDS, "run_dir": str(tmp_path / "run"),
        "task": {"model": "gpt-tiny", "seq_len": 16, "batch_size": 4, "val_windows": 4,
                 "corpus_bytes": 100_000},
        "inner": {"steps": 3, "warmup_steps": 2},
        "network": {"wan": "1gbit/1ms"},
        "coordinator": {"listen": "127.0.0.1:0", "token": TOKEN, "checkpoint_every": 0},
        "monitoring": {"metrics_port": 0},
    }))
    coordinator = geoloco.Coordinator(cfg)
    coordinator.start()
    workers = [geoloco.Worker(f"127.0.0.1:{coordinator.port}", TOKEN, device="cpu") for _ in range(2)]
    endpoints = [MetricsServer(worker_registry(w.worker), "127.0.0.1", 0) for w in workers]
    prom = Prometheus(binary, tmp_path, {
        "geoloco-coordinator": [f"127.0.0.1:{coordinator.metrics_server.port}"],
        "geoloco-worker": [f"127.0.0.1:{e.port}" for e in endpoints]})
    try:
        prom.wait_ready()
        prom.wait_scraped(len(endpoints) + 1)
        started = time.time()
        for w in workers:
            w.start()
        assert coordinator.wait(timeout=240), "the run did not finish"
        for w in workers:
            assert w.wait(timeout=60) and w.exit_code == 0, w.error
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _rounds(prom) != float(ROUNDS):
            time.sleep(0.5)  # until a scrape after the last round is in
        # query_range evaluates at start, start + step, ...: the last step must come after
        # that scrape, or a series first set in a run shorter than a step (a worker's last
        # frame) has no point in the range
        last_scrape = _scraped_at(prom)
        while time.time() < last_scrape + SCRAPE_S:
            time.sleep(0.1)
        scraped = {"coordinator": get(f"http://127.0.0.1:{coordinator.metrics_server.port}/metrics").decode(),
                   **{f"worker-{i}": get(f"http://127.0.0.1:{e.port}/metrics").decode()
                      for i, e in enumerate(endpoints)}}
        sessions = [w.session.secret for w in workers]  # the coordinator keeps only their hashes
        yield {"prom": prom, "start": started, "end": time.time(), "scraped": scraped,
               "sessions": sessions, "rounds_done": coordinator.totals.rounds}
    finally:
        prom.stop()
        for e in endpoints:
            e.close()
        for w in workers:
            w.stop(timeout=10)
        coordinator.stop(grace=0.5)


def _rounds(prom: Prometheus) -> float | None:
    result = prom.query("query", query='geoloco_rounds_total{job="geoloco-coordinator"}')
    return float(result[0]["value"][1]) if result else None


def _scraped_at(prom: Prometheus) -> float:
    """The time of the coordinator's latest scrape Prometheus holds."""
    result = prom.query("query", query='timestamp(geoloco_rounds_total{job="geoloco-coordinator"})')
    return float(result[0]["value"][1])


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, Grafana variables filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: unknown Grafana variable in {expr}"
            found.append((panel["title"], expr))
    return found


def test_prometheus_counts_the_rounds_done_and_every_dashboard_query_has_data(prometheus_run) -> None:
    prom = prometheus_run["prom"]
    assert prometheus_run["rounds_done"] == ROUNDS
    assert _rounds(prom) == float(ROUNDS)
    up = {r["metric"]["job"]: r["value"][1] for r in prom.query("query", query="up")}
    assert up == {"geoloco-coordinator": "1", "geoloco-worker": "1"}
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    empty = []
    for title, expr in expressions:
        result = prom.query("query_range", query=expr, start=prometheus_run["start"],
                            end=prometheus_run["end"], step=SCRAPE_S)
        if not any(series["values"] for series in result):
            empty.append(f"{title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_metrics_carry_per_worker_series_and_no_secret(prometheus_run) -> None:
    scraped = prometheus_run["scraped"]
    for name, text in scraped.items():
        assert TOKEN not in text, f"{name} exposes the token"
        for session in prometheus_run["sessions"]:
            assert session not in text, f"{name} exposes a session"
    coordinator = scraped["coordinator"]
    for worker in ("0", "1"):
        assert re.search(rf'geoloco_upload_bytes_total{{worker="{worker}"}} [1-9]', coordinator)
        assert f'geoloco_worker_resyncs_total{{worker="{worker}"}} 0.0' in coordinator
    assert f"geoloco_rounds_done {float(ROUNDS)}" in coordinator
    labels = []
    for i in range(2):  # which worker id an endpoint's worker joined as is a race
        text = scraped[f"worker-{i}"]
        found = set(re.findall(r'geoloco_worker_rounds_applied_total\{worker="(\d+)"\} '
                               + re.escape(str(float(ROUNDS))), text))
        assert len(found) == 1, text
        labels.append(found.pop())
        assert f'geoloco_worker_digest_mismatches_total{{worker="{labels[-1]}"}} 0.0' in text
    assert sorted(labels) == ["0", "1"]
