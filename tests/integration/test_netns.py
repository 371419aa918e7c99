"""The multi-host test bed (tests/netns.py) with real namespaces, veth pairs and tc: every
host's link carries its profile's rate in both directions within 15 %, nothing is left
behind, and a GeoLoCo run goes through it: a coordinator in the hub, 3 workers in their
own namespaces, over shaped links and mutual TLS, to equal digests. Skipped without root or
`ip netns`, unless GEOLOCO_REQUIRE_NETNS=1 (CI) makes that a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from netns import PREFIX, TestBed, require_testbed
from run_processes import (
    ROOT,
    SMALL,
    TOKEN,
    final_coordinator_digest,
    set_flags,
    wait_until,
    worker_reports,
)

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
PROFILES = {"fast": "20mbit", "mid": "10mbit", "slow": "5mbit"}
TOLERANCE = 0.15  # the bound on measured over profile rate
SECONDS = 4.0  # of each transfer


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    require_testbed()


def our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines()
            if line.startswith(f"{PREFIX}-{os.getpid()}-")]


def transfer(bed: TestBed, sender: str, receiver: str, port: int) -> float:
    """Bits per second of one TCP transfer from ``sender`` to ``receiver`` (names or "hub")."""
    probe = [sys.executable, str(HERE / "link_probe.py")]
    sink = bed.popen(receiver, [*probe, "sink", bed.address(receiver), str(port)],
                     stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "listening"
        bed.run(sender, [*probe, "source", bed.address(receiver), str(port), str(SECONDS)],
                check=True, timeout=120)
        out, _ = sink.communicate(timeout=60)
    finally:
        sink.kill()
    measured = json.loads(out)
    return measured["bytes"] * 8 / measured["seconds"]


def test_every_link_carries_its_rate_both_ways_and_nothing_is_left(tmp_path: Path) -> None:
    with TestBed(PROFILES) as bed:
        assert len(our_namespaces()) == 1 + len(PROFILES)
        with ThreadPoolExecutor(len(PROFILES)) as pool:  # the links are separate: all at once
            up = dict(zip(PROFILES, pool.map(lambda h: transfer(bed, h[1], "hub", 7000 + h[0]),
                                             enumerate(PROFILES)), strict=True))
            down = dict(zip(PROFILES, pool.map(lambda h: transfer(bed, "hub", h[1], 7100 + h[0]),
                                               enumerate(PROFILES)), strict=True))
        for host, profile in bed.profiles.items():
            for direction, rates in (("up", up), ("down", down)):
                ratio = rates[host] / profile.rate_bps
                assert abs(ratio - 1) <= TOLERANCE, (host, direction, rates[host], profile)
        tx, rx = bed.link_bytes("slow")  # the counters saw each transfer's bytes on the wire
        one = bed.profiles["slow"].rate_bps / 8 * SECONDS * (1 - TOLERANCE)
        assert tx > one and rx > one, (tx, rx, one)
    assert our_namespaces() == []


def test_a_failure_inside_still_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="in the middle"), TestBed({"a": "1mbit"}):
        assert len(our_namespaces()) == 2
        raise RuntimeError("a test failing in the middle")
    assert our_namespaces() == []


def test_a_run_through_the_test_bed_over_mutual_tls_ends_on_equal_digests(tmp_path: Path) -> None:
    certs, run_dir, reports = tmp_path / "certs", tmp_path / "run", tmp_path / "reports"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
               PYTHONPATH=str(ROOT))
    geoloco = [sys.executable, "-m", "geoloco.cli"]
    with TestBed(PROFILES) as bed:
        subprocess.run([*geoloco, "certs", str(certs), "--san", bed.hub_address, "--workers", "3"],
                       check=True, capture_output=True, env=env, cwd=ROOT)
        tls = ["--tls-ca", str(certs / "ca.pem")]  # the coordinator requires worker certificates
        procs, logs = {}, {}

        def start(name: str, where: str, args: list[str]) -> None:
            logs[name] = tmp_path / f"{name}.log"
            with open(logs[name], "wb") as out:
                procs[name] = bed.popen(where, [*geoloco, *args], stdout=out, stderr=subprocess.STDOUT,
                                        env=env, cwd=ROOT)

        try:
            start("coordinator", "hub", [
                "coordinator", "--listen", f"{bed.hub_address}:0", "--workers", "3", "--rounds", "4",
                "--run-dir", str(run_dir), *tls, "--tls-cert", str(certs / "coordinator.pem"),
                "--tls-key", str(certs / "coordinator.key"),
                *set_flags({**SMALL, "network.wan": "unlimited"})])
            port_file = run_dir / "coordinator.port"
            wait_until(lambda: port_file.exists() and port_file.read_text().strip().isdigit(), 90,
                       "the coordinator's port")
            before = {host: bed.link_bytes(host) for host in PROFILES}
            for i, host in enumerate(PROFILES):
                start(host, host, ["worker", "--coordinator", f"{bed.hub_address}:{port_file.read_text().strip()}",
                                   "--device", "cpu", "--report-dir", str(reports), *tls,
                                   "--tls-cert", str(certs / f"worker-{i}.pem"),
                                   "--tls-key", str(certs / f"worker-{i}.key")])
            deadline = time.monotonic() + 300
            for name, proc in procs.items():
                code = proc.wait(timeout=max(1, deadline - time.monotonic()))
                assert code == 0, logs[name].read_text()[-3000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
        _, digest = final_coordinator_digest(run_dir)
        finished = worker_reports(reports)
        assert sorted(finished) == [0, 1, 2]
        assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
        for host in PROFILES:  # the workers' traffic went over their own links
            sent = bed.link_bytes(host)[0] - before[host][0]
            assert sent > 0
        assert sum(r["bytes_pushed"] for r in finished.values()) <= sum(
            bed.link_bytes(h)[0] - before[h][0] for h in PROFILES)
    assert our_namespaces() == []
