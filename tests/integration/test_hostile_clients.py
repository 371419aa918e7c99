"""A real coordinator process and two real worker processes training over mutual TLS, while
a hostile client holding a certificate of the run, but not the token, holds 200 idle Push
streams open and sends 1,000 wrong-token Joins over 10 s. The health service must keep
answering, every round must close with both workers, the coordinator's memory must stay
put; and nothing a user can read (ps, config.json, checkpoints, logs) holds the token or a
session. The run outlasts the attack by construction: once two rounds have closed under
attack, worker 1 is held (SIGSTOP) until the attacker exits, so the open round waits for it.
One run (about a minute) serves every test here."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from run_processes import SMALL, Processes, coordinator_port, metrics, set_flags, wait_until

from geoloco import certs
from geoloco.config import TlsConfig
from geoloco.tls import channel_security
from geoloco.transport import open_channel
from geoloco.worker.container import join_coordinator

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
ROUNDS = 12  # the rounds that close under attack, and a few after worker 1 is continued
ATTACK_ROUNDS = 2  # rounds that must close under attack before worker 1 is held
STREAMS, JOINS, ATTACK_S = 200, 1000, 10.0
HEALTH_EVERY_S = 0.02
# a wide bound: starved, the health service would time out (5 s); the figure is printed
# (31.8 ms measured at p99 on 2 loaded cores)
HEALTH_P99_S = 1.0
RSS_GROWTH_MB = 200  # the attack may cost the coordinator this much memory at most
RUN = {**SMALL, "inner.steps": "6", "coordinator.checkpoint_every": "20", "coordinator.deadline_s": "120"}


@dataclass
class Observed:
    run_dir: Path
    certs: Path
    token: str
    sessions: list[str]
    identity_files: list[Path]
    attack: dict = field(default_factory=dict)
    health_s: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    ps: list[str] = field(default_factory=list)
    attack_rounds: list[int] = field(default_factory=list)  # rounds that closed during the attack
    logs: dict[str, str] = field(default_factory=dict)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def tls(pki: Path, name: str) -> TlsConfig:
    return TlsConfig(ca=str(pki / certs.CA_CERT), cert=str(pki / f"{name}.pem"), key=str(pki / f"{name}.key"))


def tls_flags(pki: Path, name: str) -> list[str]:
    t = tls(pki, name)
    return ["--tls-ca", t.ca, "--tls-cert", t.cert, "--tls-key", t.key,
            "--token-file", str(pki / certs.TOKEN_FILE)]


def watch_health(address: str, security, stop: threading.Event, seen: Observed) -> None:
    with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            start = time.monotonic()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    seen.health_failures.append(str(reply.status))
            except grpc.RpcError as exc:
                seen.health_failures.append(exc.code().name)
            seen.health_s.append(time.monotonic() - start)
            stop.wait(HEALTH_EVERY_S)


def scenario(tmp: Path) -> Observed:
    pki, run_dir = tmp / "certs", tmp / "run"
    certs.make_run_credentials(pki, None, 3)  # worker-2's certificate is the attacker's
    token = (pki / certs.TOKEN_FILE).read_text().strip()
    processes = Processes(tmp / "logs")
    try:
        coordinator = processes.start("coordinator", [
            "coordinator", "--listen", "127.0.0.1:0", "--workers", "2", "--rounds", str(ROUNDS),
            "--run-dir", str(run_dir), *tls_flags(pki, "coordinator"), *set_flags(RUN)])
        address = f"127.0.0.1:{coordinator_port(run_dir)}"
        identities = []
        for i in range(2):  # as the container's root step does: join, write the identity 0600
            ident = join_coordinator(address, token, 120, channel_security(tls(pki, f"worker-{i}"), address))
            path = tmp / f"identity-{i}.json"
            ident.write(path)
            identities.append((ident, path))
        seen = Observed(run_dir, pki, token, [i.session for i, _ in identities], [p for _, p in identities])
        for i, (_, path) in enumerate(identities):
            processes.start(f"worker-{i}", ["worker", "--coordinator", address, "--identity-file", str(path),
                                            "--device", "cpu", *tls_flags(pki, f"worker-{i}")])
        wait_until(lambda: len(metrics(run_dir)) >= 2, 240, "round 1 to close")
        seen.rss_before_mb = rss_mb(coordinator.pid)
        stop = threading.Event()
        health = threading.Thread(target=watch_health, args=(
            address, channel_security(tls(pki, "coordinator"), address), stop, seen), daemon=True)
        health.start()
        worker_1 = processes.procs["worker-1"].pid
        os.killpg(worker_1, signal.SIGSTOP)  # until the attack is on: no round closes before it
        attacker = subprocess.Popen(
            [sys.executable, str(HERE / "hostile_client.py"), address, "--ca", str(pki / certs.CA_CERT),
             "--cert", str(pki / certs.worker_cert(2)), "--key", str(pki / certs.worker_key(2)),
             "--streams", str(STREAMS), "--joins", str(JOINS), "--seconds", str(ATTACK_S)],
            stdout=subprocess.PIPE, text=True)
        wait_until(lambda: "refused: " in processes.log("coordinator") or attacker.poll() is not None,
                   120, "the attack to start")
        first = len(metrics(run_dir))
        os.killpg(worker_1, signal.SIGCONT)
        polls, held = 0, False
        while attacker.poll() is None:
            assert coordinator.poll() is None, "the run ended before the attack"
            if not held and len(metrics(run_dir)) >= first + ATTACK_ROUNDS:
                os.killpg(worker_1, signal.SIGSTOP)  # the open round waits for it until the attack ends
                seen.attack_rounds = [m["round"] for m in metrics(run_dir)[first:]]
                held = True
            seen.rss_peak_mb = max(seen.rss_peak_mb, rss_mb(coordinator.pid))
            if polls % 5 == 0:
                seen.ps.append(subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout)
            polls += 1
            time.sleep(0.1)
        os.killpg(worker_1, signal.SIGCONT)
        stop.set()
        health.join()
        seen.attack = json.loads(attacker.stdout.read())
        for name in ("worker-0", "worker-1", "coordinator"):
            assert processes.wait(name, timeout=300) == 0, processes.log(name)[-3000:]
        seen.logs = {name: processes.log(name) for name in ("coordinator", "worker-0", "worker-1")}
        return seen
    finally:
        processes.cleanup()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Observed:
    return scenario(tmp_path_factory.mktemp("hostile"))


def test_the_health_service_answers_within_1s_at_p99_under_attack(run: Observed, capsys) -> None:
    latencies = sorted(run.health_s)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(0.99 * (len(latencies) - 1))]
    with capsys.disabled():
        print(f"\nstarvation: {len(latencies)} health checks during the attack: p50 {p50 * 1e3:.1f} ms, "
              f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms; coordinator RSS "
              f"{run.rss_before_mb:.0f} MB before, {run.rss_peak_mb:.0f} MB at the peak of the attack; "
              f"attacker: {run.attack}")
    assert not run.health_failures
    assert len(latencies) > ATTACK_S / (HEALTH_EVERY_S + HEALTH_P99_S)
    assert p99 < HEALTH_P99_S


def test_every_idle_or_forged_push_is_refused_at_once_and_joins_are_rate_limited(run: Observed) -> None:
    pushes, joins = run.attack["pushes"], run.attack["joins"]["codes"]
    assert pushes["ended"] == STREAMS and pushes["codes"] == {"UNAUTHENTICATED": STREAMS}
    assert pushes["last_ended_s"] < ATTACK_S / 2  # not held until the client gave up
    assert sum(joins.values()) == JOINS and "OK" not in joins
    assert joins.get("RESOURCE_EXHAUSTED", 0) >= JOINS * 0.9


def test_every_round_closes_with_both_workers_and_memory_stays_bounded(run: Observed) -> None:
    lines = metrics(run.run_dir)
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    for m in lines:
        assert m["arrived"] == [0, 1] and m["close_reason"] == "all arrived", m
    assert len(run.attack_rounds) >= ATTACK_ROUNDS, "no round closed during the attack"
    assert run.rss_peak_mb - run.rss_before_mb < RSS_GROWTH_MB


def test_no_token_or_session_in_ps_config_checkpoints_or_logs(run: Observed) -> None:
    secrets = [run.token, *run.sessions]
    assert run.ps and all("geoloco" in snapshot for snapshot in run.ps)
    for snapshot in run.ps:
        assert not any(s in snapshot for s in secrets)
    config = (run.run_dir / "config.json").read_text()
    checkpoints = sorted(p for p in (run.run_dir / "checkpoints").rglob("*") if p.is_file())
    assert checkpoints
    stored = [p.read_bytes().decode("latin-1") for p in checkpoints]
    for text in [config, *stored, *run.logs.values()]:
        assert not any(s in text for s in secrets)
    for session in run.sessions:  # the registry went into the checkpoints as hashes
        assert any(hashlib.sha256(session.encode()).hexdigest() in text for text in stored)
    for path in [run.certs / certs.TOKEN_FILE, run.certs / certs.CA_KEY, *run.identity_files]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
