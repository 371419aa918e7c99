"""compression.density = "auto" in a real run (a coordinator, two workers on threads, each
behind its own link emulator): every frame's density stays within [density_min,
density_max], the worker on a fast link sends the densest frames allowed, and when its link
slows down mid-run (once both send at density_max; the emulator changes its profile live)
its density falls within three rounds; metrics.jsonl records each worker's density and measured upload rate. Cost: about
40 s."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_processes import SMALL, TOKEN, metrics, run_worker_threads, wait_until

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator
from geoloco.links.emulator import RelayThread
from geoloco.profiles import LinkProfile
from geoloco.replica import param_digest
from geoloco.worker.loop import Worker
from geoloco.worker.session import Session

pytestmark = pytest.mark.slow
LOW, HIGH = 4 / 4096, 256 / 4096
ROUNDS = 16


def test_auto_density_stays_in_bounds_and_follows_a_slower_link(tmp_path: Path) -> None:
    cfg = load_config(overrides={
        **SMALL, "coordinator.token": TOKEN, "workers": "2", "rounds": str(ROUNDS),
        "coordinator.listen": "127.0.0.1:0", "coordinator.checkpoint_every": "0",
        "inner.steps": "2", "task.seq_len": "16", "compression.density": "auto",
        "compression.density_min": str(LOW), "compression.density_max": str(HIGH),
        "compression.target_push_s": "0.25"})
    coordinator = Coordinator(cfg, tmp_path / "run")
    port = coordinator.start()
    relays = [RelayThread(("127.0.0.1", port), LinkProfile.parse("16mbit/2ms")).start() for _ in range(2)]
    changed_at: list[int] = []

    def both_at_high() -> bool:  # the ramp from the first rounds' rates takes a machine-dependent few rounds
        lines = metrics(tmp_path / "run")
        return bool(lines) and list(lines[-1]["density_by_worker"].values()) == [HIGH, HIGH]

    def slow_down_link_0(i: int) -> None:
        if i == 1:  # both threads run: once both send the densest frames, cut worker 0's rate 32-fold
            wait_until(both_at_high, 120, "both workers at density_max")
            relays[0].set_profile(LinkProfile.parse("0.5mbit/2ms"))
            changed_at.append(len(metrics(tmp_path / "run")))

    workers = [Worker(Session(f"127.0.0.1:{r.port}", TOKEN, 30), device="cpu",
                      report_dir=tmp_path / "reports") for r in relays]
    try:
        codes = run_worker_threads(coordinator, workers, 240, started=slow_down_link_0)
    finally:
        for r in relays:
            r.close()
    assert codes == {0: 0, 1: 0}
    assert all(param_digest(w.theta) == param_digest(coordinator.params) for w in workers)
    lines = metrics(tmp_path / "run")
    assert len(lines) == ROUNDS
    density = [{int(k): v for k, v in m["density_by_worker"].items()} for m in lines]
    assert all(LOW <= d <= HIGH for per in density for d in per.values()), density
    assert all(m["upload_rate_by_worker"] for m in lines[1:])
    change, slow = changed_at[0], workers[0].session.worker_id  # the id Join gave relay 0's worker
    assert change + 4 <= ROUNDS, f"the ramp took {change} of {ROUNDS} rounds: too few left to see the reaction"
    fast = 1 - slow
    assert density[change - 1][slow] == HIGH and density[change - 1][fast] == HIGH, density
    for per in density[change + 3:]:  # reacted within three rounds; the fast link is unchanged
        assert per[slow] < HIGH / 2 and per[fast] == HIGH, density
