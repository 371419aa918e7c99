"""Chaos: one pgc-fr training (n = 4, s = 1, gpt-tiny) of real `geoloco coordinator` and
`geoloco worker` processes on loopback, with worker SIGKILLs (each followed by a restart on
the same --state-dir), coordinator SIGKILLs (each followed by `--resume`) and cut-and-restored
links injected during it; beside it the undisturbed run and a coordinator-kills-only run with
the same seed. Every figure is read from the run directories (metrics.jsonl, checkpoints,
the workers' --report-dir files). Prints a table, then one JSON line.

    python -m benchmarks.chaos            # 20 worker kills, 5 coordinator kills, 2 link cuts
    python -m benchmarks.chaos --quick    # 3 worker kills, 1 coordinator kill, 1 link cut

Each worker reaches the coordinator through its own relay (geoloco.links.emulator's
RelayThread, unshaped) in this process: a link cut stops the relay, aborting its
connections, and starts it again after ``--cut-s``. A killed worker is restarted once the
coordinator has marked it dead (coordinator.liveness_s); it takes its slot back and
restores its own state. Faults are one at a time, at rounds spread over the run, each at a
random time within its round (so in the inner loop, a push, a fetch or a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import provenance
from geoloco.config import load_config
from geoloco.coordinator import checkpoint
from geoloco.links.emulator import RelayThread
from geoloco.replica import param_digest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "chaos"
WORKERS = 4
CONFIG = {
    "coding.scheme": "pgc-fr", "coding.stragglers": "1",
    "task.model": "gpt-tiny", "task.seq_len": "32", "task.batch_size": "4",
    "task.val_windows": "8", "task.corpus_bytes": "300000",
    "inner.steps": "8", "inner.warmup_steps": "4", "inner.lr": "3e-3",
    "coordinator.join_timeout_s": "120", "coordinator.checkpoint_every": "1",
}


@dataclass
class Plan:
    """The faults one run injects, in order: 'worker', 'coordinator' or 'link'."""

    faults: list[str]
    rounds: int
    seed: int


@dataclass
class RunFigures:
    name: str
    rounds_done: int
    rounds_applied_twice: int
    max_round_s: float
    deadline_s: float
    final_loss: float | None
    digest: str
    replica_mismatches: int
    injected: dict[str, int]
    wall_s: float
    errors: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One coordinator and its workers as process groups, each worker behind a relay."""

    def __init__(self, work: Path, rounds: int, seed: int, deadline_s: float, liveness_s: float) -> None:
        self.work, self.rounds = work, rounds
        self.run_dir, self.reports, self.state = work / "run", work / "reports", work / "state"
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.port = free_port()
        self.flags = {**CONFIG, "seed": str(seed), "coordinator.deadline_s": str(deadline_s),
                      "coordinator.liveness_s": str(liveness_s)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.coordinator = ""
        self.relays = [RelayThread(("127.0.0.1", self.port)).start() for _ in range(WORKERS)]
        self.starts = 0

    def _start(self, name: str, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        with open(self.logs / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "geoloco.cli", *args], stdout=out,
                                                stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                                start_new_session=True)

    def start_coordinator(self, resume: bool) -> None:
        self.starts += 1
        self.coordinator = f"coordinator-{self.starts}"
        sets = [a for k, v in self.flags.items() for a in ("--set", f"{k}={v}")]
        self._start(self.coordinator, ["coordinator", "--listen", f"127.0.0.1:{self.port}",
                                       "--workers", str(WORKERS), "--rounds", str(self.rounds),
                                       "--run-dir", str(self.run_dir), *(["--resume"] if resume else []),
                                       *sets])

    def start_worker(self, name: str, relay: int) -> None:
        self._start(name, ["worker", "--coordinator", f"127.0.0.1:{self.relays[relay].port}",
                           "--device", "cpu", "--connect-timeout", "180", "--report-dir", str(self.reports),
                           "--state-dir", str(self.state)])

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def reports_by_id(self) -> dict[int, dict[str, Any]]:
        out = {}
        for p in self.reports.glob("worker-*.json"):
            try:
                report = json.loads(p.read_text())
            except (OSError, ValueError):
                continue  # being rewritten
            out[report["worker_id"]] = report
        return out

    def finished(self) -> bool:
        return self.procs[self.coordinator].poll() is not None

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        for relay in self.relays:
            relay.close()


def wait_until(condition: Callable[[], bool], timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def plan_faults(worker_kills: int, coordinator_kills: int, link_cuts: int, rounds: int, seed: int) -> Plan:
    faults = ["worker"] * worker_kills + ["coordinator"] * coordinator_kills + ["link"] * link_cuts
    random.Random(seed).shuffle(faults)
    return Plan(faults, rounds, seed)


def fault_rounds(count: int, rounds: int) -> list[int]:
    """The round (as metrics.jsonl lines done) at which each fault fires: spread over
    1..rounds-3, so that the run ends with every process back."""
    last = max(2, rounds - 3)
    return [1 + (i * (last - 1)) // max(1, count) for i in range(count)]


class Injector:
    """Fires a plan's faults into a running cluster and counts what it injected."""

    def __init__(self, cluster: Cluster, rng: random.Random, cut_s: float, liveness_s: float) -> None:
        self.cluster, self.rng, self.cut_s, self.liveness_s = cluster, rng, cut_s, liveness_s
        self.injected = {"worker_kills": 0, "coordinator_kills": 0, "link_cuts": 0}
        self.errors: list[str] = []
        self.restarts = 0

    def fire(self, fault: str) -> None:
        round_s = self._typical_round_s()
        time.sleep(self.rng.uniform(0.0, round_s))  # a random phase of the round
        if self.cluster.finished():
            return
        getattr(self, f"_{fault}")()

    def _typical_round_s(self) -> float:
        lines = self.cluster.metrics()[-3:]
        return min(5.0, max(0.2, sum(m["round_seconds"] for m in lines) / len(lines))) if lines else 1.0

    def _worker(self) -> None:
        c = self.cluster
        reports = c.reports_by_id()
        live = {r["pid"]: wid for wid, r in reports.items()}
        candidates = [(n, live[p.pid]) for n, p in c.procs.items()
                      if n.startswith("worker") and p.poll() is None and p.pid in live]
        if not candidates:
            self.errors.append("no running worker with a report to kill")
            return
        name, worker_id = self.rng.choice(candidates)
        c.kill(name)
        self.injected["worker_kills"] += 1
        # a Join checks liveness first: once liveness_s has passed the slot is free for it
        time.sleep(self.liveness_s + 1.0)
        if c.finished():
            return
        self.restarts += 1
        restarted = f"worker-r{self.restarts}"
        c.start_worker(restarted, worker_id)
        if not wait_until(lambda: c.reports_by_id().get(worker_id, {}).get("pid") == c.procs[restarted].pid
                          or c.finished(), 120):
            self.errors.append(f"restarted worker {worker_id} did not get its slot back within 120 s")

    def _coordinator(self) -> None:
        c = self.cluster
        c.kill(c.coordinator)
        self.injected["coordinator_kills"] += 1
        time.sleep(0.5)
        c.start_coordinator(resume=True)

    def _link(self) -> None:
        relay = self.rng.choice(self.cluster.relays)
        relay.stop()
        self.injected["link_cuts"] += 1
        time.sleep(self.cut_s)
        relay.start()


def final_digest(run_dir: Path) -> tuple[int, str]:
    ckpt = checkpoint.load_latest(run_dir)
    if ckpt is None:
        return -1, ""
    return ckpt.round, param_digest([t.to(torch.float32) for t in ckpt.params.values()])


def run(name: str, plan: Plan, work: Path, args: argparse.Namespace) -> RunFigures:
    """One training with ``plan``'s faults; the figures from its run directory."""
    t0 = time.monotonic()
    cluster = Cluster(work / name, plan.rounds, plan.seed, args.deadline_s, args.liveness_s)
    injector = Injector(cluster, random.Random(plan.seed * 7919 + len(name)), args.cut_s, args.liveness_s)
    try:
        cluster.start_coordinator(resume=False)
        for i in range(WORKERS):
            cluster.start_worker(f"worker-{i}", i)
        for fault, at in zip(plan.faults, fault_rounds(len(plan.faults), plan.rounds), strict=True):
            wait_until(lambda at=at: len({m["round"] for m in cluster.metrics()}) >= at or cluster.finished(),
                       args.timeout_s)
            if cluster.finished():
                break
            injector.fire(fault)
            done = len({m["round"] for m in cluster.metrics()})
            wait_until(lambda done=done: len({m["round"] for m in cluster.metrics()}) > done
                       or cluster.finished(), args.timeout_s)
        if not wait_until(cluster.finished, args.timeout_s, poll=0.5):
            injector.errors.append(f"the run did not finish within {args.timeout_s}s")
        code = cluster.procs[cluster.coordinator].poll()
        if code != 0:
            injector.errors.append(f"{cluster.coordinator} exited {code}: "
                                   + cluster.log(cluster.coordinator)[-400:].replace("\n", " | "))
        # the workers finish once they have the last round's result
        wait_until(lambda: all(p.poll() is not None for n, p in cluster.procs.items() if n.startswith("worker")),
                   60, poll=0.5)
        return figures(name, cluster, injector, args.deadline_s, time.monotonic() - t0)
    finally:
        cluster.close()


def figures(name: str, cluster: Cluster, injector: Injector, deadline_s: float, wall_s: float) -> RunFigures:
    lines = cluster.metrics()
    rounds = [m["round"] for m in lines]
    _, digest = final_digest(cluster.run_dir)
    reports = cluster.reports_by_id()
    mismatches = sum(1 for wid in range(WORKERS)
                     if reports.get(wid, {}).get("status") != "finished" or reports[wid].get("digest") != digest)
    losses = [m["val_loss"] for m in lines if m.get("val_loss") is not None]
    return RunFigures(
        name=name, rounds_done=len(set(rounds)), rounds_applied_twice=len(rounds) - len(set(rounds)),
        max_round_s=max((m["round_seconds"] for m in lines), default=0.0), deadline_s=deadline_s,
        final_loss=losses[-1] if losses else None, digest=digest, replica_mismatches=mismatches,
        injected=dict(injector.injected), wall_s=wall_s, errors=injector.errors,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 worker kills, 1 coordinator kill, 1 link cut, 45 rounds")
    p.add_argument("--worker-kills", type=int, default=None)
    p.add_argument("--coordinator-kills", type=int, default=None)
    p.add_argument("--link-cuts", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=20.0, help="coordinator.deadline_s")
    p.add_argument("--liveness-s", type=float, default=6.0, help="coordinator.liveness_s")
    p.add_argument("--cut-s", type=float, default=2.0, help="how long a link stays cut")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on a run after this long")
    p.add_argument("--work-dir", help="keep the run directories here (default: a temporary folder)")
    args = p.parse_args(argv)
    quick = (3, 1, 1, 45) if args.quick else (20, 5, 2, 240)
    for key, value in zip(("worker_kills", "coordinator_kills", "link_cuts", "rounds"), quick, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("geoloco.links").setLevel(logging.ERROR)  # a cut link's refusals are expected
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="chaos-"))
    try:
        plans = {
            "undisturbed": plan_faults(0, 0, 0, args.rounds, args.seed),
            "coordinator-only": plan_faults(0, args.coordinator_kills, 0, args.rounds, args.seed),
            "chaos": plan_faults(args.worker_kills, args.coordinator_kills, args.link_cuts, args.rounds, args.seed),
        }
        results = {name: run(name, plan, work, args) for name, plan in plans.items()}
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    chaos, calm, coord = results["chaos"], results["undisturbed"], results["coordinator-only"]
    print(json.dumps({
        **provenance(load_config(overrides=CONFIG).task),
        "rounds_done": chaos.rounds_done,
        "rounds_applied_twice": chaos.rounds_applied_twice,
        "max_round_s_over_deadline": round(chaos.max_round_s - chaos.deadline_s, 3),
        "replica_digest_mismatch_at_end": chaos.replica_mismatches,
        "final_loss": chaos.final_loss,
        "undisturbed_final_loss": calm.final_loss,
        "final_loss_ratio": (chaos.final_loss / calm.final_loss
                             if chaos.final_loss and calm.final_loss else None),
        "injected_faults": chaos.injected,
        "coordinator_only_digest_equal": bool(coord.digest) and coord.digest == calm.digest,
        "coordinator_only_rounds_applied_twice": coord.rounds_applied_twice,
        "rounds": args.rounds, "seed": args.seed,
        "errors": {name: r.errors for name, r in results.items() if r.errors},
    }))
    return 0


def print_table(results: dict[str, RunFigures]) -> None:
    print(f"{'run':<17}{'rounds':>7}{'twice':>6}{'max round s':>12}{'mismatch':>9}{'final loss':>11}"
          f"{'w/c/l faults':>13}{'wall s':>8}  digest")
    for r in results.values():
        faults = "/".join(str(r.injected[k]) for k in ("worker_kills", "coordinator_kills", "link_cuts"))
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
        print(f"{r.name:<17}{r.rounds_done:>7}{r.rounds_applied_twice:>6}{r.max_round_s:>12.2f}"
              f"{r.replica_mismatches:>9}{loss:>11}{faults:>13}{r.wall_s:>8.0f}  {r.digest[:12]}")
        for e in r.errors:
            print(f"  {r.name}: {e}")


if __name__ == "__main__":
    sys.exit(main())
