"""Chaos: one pgc-fr training (n = 4, s = 1, gpt-tiny) of real `geoloco coordinator` and
`geoloco worker` processes on loopback, with worker SIGKILLs (each followed by a restart on
the same --state-dir), coordinator SIGKILLs (each followed by `--resume`) and cut-and-restored
links injected during it; beside it the undisturbed run of the same seed. Every figure is
read from the run directories (metrics.jsonl, checkpoints, the workers' --report-dir files).
Prints a table, then one JSON line.

    python -m benchmarks.chaos            # 240 rounds: 20 worker kills, 5 coordinator kills, 2 link cuts
    python -m benchmarks.chaos --quick    # 60 rounds: 3 worker kills, 2 coordinator kills, 1 link cut
    python -m benchmarks.chaos --short    # 16 rounds: 1 of each (make test: tests/integration/test_chaos.py)
    python -m benchmarks.chaos --state-cost --seeds 3   # what losing a worker's --state-dir costs

--state-cost measures what a worker's local state (error feedback, inner AdamW, data
position) is worth: per seed the undisturbed pgc-fr run, and one worker killed three times,
restarted on its --state-dir ("kept") or without one ("lost": a new process that takes the
dead slot once coordinator.liveness_s has passed, its state from zero); the final losses
paired by seed.

Each worker reaches the coordinator through its own relay (geoloco.links.emulator's
RelayThread, unshaped) in this process: a link cut stops the relay, aborting its
connections, and starts it again after ``--cut-s``. A killed worker is restarted at once on
the same --state-dir: it proves its identity, takes its slot back and restores its own
state. Faults come one at a time, at rounds spread over the run. A worker kill or a link cut
comes at a random time within its round (the inner loop, a push, a fetch or a local-state
save); the coordinator kills cycle through the points of KILL_POINTS: at a random time, and
through the coordinator's crash seam (--crash-at) just after a round's close decision is
logged, after its broadcast (before its own apply and checkpoint) and halfway through the
checkpoint after it.

Bit-exactness needs a run that can be repeated: pgc-fr closes a round on the first
decodable frames, so which frames a round uses, and so the final parameters, depend on
arrival order, and two undisturbed pgc-fr runs of one seed differ. The exactly-once check is
therefore a second pair with a close that waits for every frame (EXACT: coding.scheme none):
the undisturbed run, and the same seed with the coordinator kills; their final digests must
be equal, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.parity import paired_bounds
from benchmarks.provenance import provenance
from geoloco.config import load_config
from geoloco.coordinator import checkpoint
from geoloco.links.emulator import RelayThread
from geoloco.replica import param_digest
from geoloco.run_dir import PORT_FILE

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "chaos"
WORKERS = 4
CONFIG = {
    "coding.scheme": "pgc-fr", "coding.stragglers": "1",
    "task.model": "gpt-tiny", "task.seq_len": "32", "task.batch_size": "4",
    "task.val_windows": "32", "task.corpus_bytes": "300000",
    # 24 inner steps: a round of ~1.5 s here, so a kill at a random time lands mid-round
    "inner.steps": "24", "inner.warmup_steps": "8", "inner.lr": "3e-3",
    "coordinator.join_timeout_s": "120", "coordinator.checkpoint_every": "1",
}
STATE_COST_ROUNDS = 60  # --state-cost: 3 kills of one worker in 60 rounds of ~1.5 s
EXACT = {"coding.scheme": "none", "coding.stragglers": "0"}  # the exactly-once pair: waits for every frame
# where the coordinator kills land, in turn: "random" is a SIGKILL from outside at a random time
# of its round; the others are the coordinator's crash seam (--crash-at STAGE:ROUND)
KILL_POINTS = ("random", "decision", "checkpoint", "broadcast")
FORMS = {  # worker kills, coordinator kills, link cuts, rounds, rounds of the exactly-once pair
    "full": (20, 5, 2, 240, 40),
    "quick": (3, 2, 1, 60, 16),
    "short": (1, 1, 1, 16, 8),
}


@dataclass
class Plan:
    """The faults one run injects, in order: 'worker', 'coordinator' or 'link', and the
    round (as metrics.jsonl lines done) at which each fires."""

    faults: list[str]
    rounds: int
    seed: int
    flags: dict[str, str] = field(default_factory=lambda: dict(CONFIG))
    state: bool = True  # restarted workers keep their --state-dir
    victim: int | None = None  # the one worker every worker kill takes (None: one at random each time)

    @property
    def at(self) -> list[int]:
        return fault_rounds(len(self.faults), self.rounds)

    def planned(self) -> dict[str, int]:
        return {f"{kind}_kills" if kind != "link" else "link_cuts": self.faults.count(kind)
                for kind in ("worker", "coordinator", "link")}

    def coordinator_kills(self) -> list[tuple[str, int]]:
        """Each coordinator kill's point (KILL_POINTS in turn) and planned round."""
        rounds = [at for fault, at in zip(self.faults, self.at, strict=True) if fault == "coordinator"]
        return [(KILL_POINTS[i % len(KILL_POINTS)], at) for i, at in enumerate(rounds)]


@dataclass
class RunFigures:
    name: str
    rounds_done: int
    rounds_applied_twice: int
    planned: dict[str, int]
    max_round_s: float
    deadline_s: float
    final_loss: float | None
    digest: str
    replica_mismatches: int
    injected: dict[str, int]
    kill_points: list[str]
    wall_s: float
    errors: list[str] = field(default_factory=list)


class Cluster:
    """One coordinator and its workers as process groups, each worker behind a relay."""

    def __init__(self, work: Path, plan: Plan, deadline_s: float, liveness_s: float) -> None:
        self.work, self.rounds = work, plan.rounds
        self.run_dir, self.reports, self.state = work / "run", work / "reports", work / "state"
        self.keep_state = plan.state
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.port: int | None = None  # the coordinator's: bound on port 0 first, then again on resume
        self.flags = {**plan.flags, "seed": str(plan.seed), "coordinator.deadline_s": str(deadline_s),
                      "coordinator.liveness_s": str(liveness_s)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.coordinator = ""
        self.relays: list[RelayThread] = []  # made once the coordinator's port is known
        self.starts = 0

    def _start(self, name: str, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        with open(self.logs / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "geoloco.cli", *args], stdout=out,
                                                stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                                start_new_session=True)

    def start_coordinator(self, resume: bool, crash_at: str | None = None) -> None:
        """The coordinator (``--resume``: again, on the same port and run directory), armed
        with its crash seam at ``crash_at`` ("STAGE:ROUND") if given."""
        self.starts += 1
        self.coordinator = f"coordinator-{self.starts}"
        sets = [a for k, v in self.flags.items() for a in ("--set", f"{k}={v}")]
        self._start(self.coordinator, ["coordinator", "--listen", f"127.0.0.1:{self.port or 0}",
                                       "--workers", str(WORKERS), "--rounds", str(self.rounds),
                                       "--run-dir", str(self.run_dir), *(["--resume"] if resume else []),
                                       *(["--crash-at", crash_at] if crash_at else []), *sets])
        if self.port is None:  # the port it bound (a port picked here could go to a relay first)
            port_file, proc = self.run_dir / PORT_FILE, self.procs[self.coordinator]
            if not wait_until(lambda: proc.poll() is not None
                              or (port_file.exists() and port_file.read_text().strip().isdigit()), 120):
                raise RuntimeError(f"{self.coordinator} wrote no {PORT_FILE} within 120 s")
            if proc.poll() is not None:
                raise RuntimeError(f"{self.coordinator} exited {proc.returncode}: "
                                   + self.log(self.coordinator)[-1500:])
            self.port = int(port_file.read_text())
            self.relays = [RelayThread(("127.0.0.1", self.port)).start() for _ in range(WORKERS)]

    def rounds_done(self) -> int:
        return len({m["round"] for m in self.metrics()})

    def start_worker(self, name: str, relay: int) -> None:
        self._start(name, ["worker", "--coordinator", f"127.0.0.1:{self.relays[relay].port}",
                           "--device", "cpu", "--connect-timeout", "180", "--report-dir", str(self.reports),
                           *(["--state-dir", str(self.state)] if self.keep_state else [])])

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
        """The coordinator has ended the run (one SIGKILLed is down, not finished)."""
        code = self.procs[self.coordinator].poll()
        return code is not None and code != -signal.SIGKILL

    def down(self) -> bool:
        return self.procs[self.coordinator].poll() == -signal.SIGKILL

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


def plan_faults(worker_kills: int, coordinator_kills: int, link_cuts: int, rounds: int, seed: int,
                flags: dict[str, str] = CONFIG) -> Plan:
    faults = ["worker"] * worker_kills + ["coordinator"] * coordinator_kills + ["link"] * link_cuts
    random.Random(seed).shuffle(faults)
    return Plan(faults, rounds, seed, dict(flags))


def fault_rounds(count: int, rounds: int) -> list[int]:
    """The round (as metrics.jsonl lines done) at which each fault fires: spread over
    1..rounds-3, so that the run ends with every process back."""
    last = max(2, rounds - 3)
    return [1 + (i * (last - 1)) // max(1, count) for i in range(count)]


class Injector:
    """Fires a plan's faults into a running cluster and counts the ones that landed: a
    worker kill once the restarted worker has its slot back, a coordinator kill once the
    killed process is gone and the resumed one serves, a link cut once the relay is back."""

    def __init__(self, cluster: Cluster, plan: Plan, rng: random.Random, cut_s: float,
                 timeout_s: float) -> None:
        self.cluster, self.rng, self.cut_s, self.timeout_s = cluster, rng, cut_s, timeout_s
        self.injected = {"worker_kills": 0, "coordinator_kills": 0, "link_cuts": 0}
        self.errors: list[str] = []
        self.restarts = 0
        self.kills = plan.coordinator_kills()  # (point, round) of those still to come
        self.victim = plan.victim
        self.kill_points: list[str] = []  # where each landed coordinator kill landed
        self.coordinator_faults = 0  # coordinator kills handled, in the plan's order

    def start(self) -> None:
        self.cluster.start_coordinator(resume=False, crash_at=self._arm())

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        """wait_until ``condition``, resuming meanwhile a coordinator whose crash seam fired
        before its fault's turn (the faults before it took longer than their rounds)."""
        def check() -> bool:
            if self.cluster.down() and self.kills and self.kills[0][0] != "random":
                self._coordinator()
            return condition()
        return wait_until(check, timeout)

    def _arm(self) -> str | None:
        """The crash seam for the next coordinator kill, when it is a seam's: at its planned
        round, or two rounds on if the run is already past it."""
        if not self.kills or self.kills[0][0] == "random":
            return None
        point, at = self.kills[0]
        return f"{point}:{max(at, self.cluster.rounds_done() + 2)}"

    def fire(self, fault: str) -> None:
        if fault != "coordinator" or self.kills[0][0] == "random":
            time.sleep(self.rng.uniform(0.0, self._typical_round_s()))  # a random phase of the round
        if self.cluster.finished() and fault != "coordinator":
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
        if self.victim is not None:
            candidates = [(n, wid) for n, wid in candidates if wid == self.victim]
            if not candidates:
                self.errors.append(f"worker {self.victim} is not running")
                return
        name, worker_id = self.rng.choice(candidates)
        c.kill(name)
        # restarted at once: on the same --state-dir it proves its identity and reclaims the
        # slot; without one it is a new worker, let in once the slot is marked dead
        self.restarts += 1
        restarted = f"worker-r{self.restarts}"
        c.start_worker(restarted, worker_id)
        if self.wait(lambda: c.reports_by_id().get(worker_id, {}).get("pid") == c.procs[restarted].pid
                     or c.finished(), self.timeout_s):
            if not c.finished():
                self.injected["worker_kills"] += 1
        else:
            self.errors.append(f"restarted worker {worker_id} did not get its slot back within {self.timeout_s} s")

    def _coordinator(self) -> None:
        c = self.cluster
        point, at = self.kills.pop(0)
        self.coordinator_faults += 1
        proc = c.procs[c.coordinator]
        if point == "random":
            c.kill(c.coordinator)
        elif not wait_until(lambda: proc.poll() is not None, self.timeout_s):
            self.errors.append(f"the coordinator did not reach its crash point {point} (round {at})")
            c.kill(c.coordinator)
        code = proc.wait()
        if code != -signal.SIGKILL:  # it ended on its own: the run is over
            self.errors.append(f"{c.coordinator} exited {code} before its {point} kill")
            return
        if point != "random" and f"crash point {point} of round" not in c.log(c.coordinator):
            self.errors.append(f"{c.coordinator} was killed, but not at its {point} crash point")
        done = c.rounds_done()
        c.start_coordinator(resume=True, crash_at=self._arm())
        # landed once the resumed coordinator serves: it closes a round, or ends the run
        if wait_until(lambda: c.rounds_done() > done or c.finished(), self.timeout_s):
            self.injected["coordinator_kills"] += 1
            self.kill_points.append(point)
        else:
            self.errors.append(f"the resumed coordinator closed no round within {self.timeout_s} s")

    def _link(self) -> None:
        relay = self.rng.choice(self.cluster.relays)
        relay.stop()
        time.sleep(self.cut_s)
        relay.start()
        self.injected["link_cuts"] += 1


def final_digest(run_dir: Path) -> tuple[int, str]:
    ckpt = checkpoint.load_latest(run_dir)
    if ckpt is None:
        return -1, ""
    return ckpt.round, param_digest([t.to(torch.float32) for t in ckpt.params.values()])


def run(name: str, plan: Plan, work: Path, args: argparse.Namespace) -> RunFigures:
    """One training with ``plan``'s faults; the figures from its run directory."""
    t0 = time.monotonic()
    cluster = Cluster(work / name, plan, args.deadline_s, args.liveness_s)
    injector = Injector(cluster, plan, random.Random(plan.seed * 7919 + len(name)), args.cut_s,
                        args.fault_timeout_s)
    try:
        injector.start()
        for i in range(WORKERS):
            cluster.start_worker(f"worker-{i}", i)
        coordinator_faults = 0
        for fault, at in zip(plan.faults, plan.at, strict=True):
            injector.wait(lambda at=at: cluster.rounds_done() >= at or cluster.finished(), args.timeout_s)
            if cluster.finished():
                break
            if fault == "coordinator":
                coordinator_faults += 1
                if coordinator_faults <= injector.coordinator_faults:
                    continue  # its crash seam fired early, and it was resumed then
            injector.fire(fault)
            done = cluster.rounds_done()
            injector.wait(lambda done=done: cluster.rounds_done() > done or cluster.finished(), args.timeout_s)
        if not injector.wait(cluster.finished, args.timeout_s):
            injector.errors.append(f"the run did not finish within {args.timeout_s}s")
        code = cluster.procs[cluster.coordinator].poll()
        if code != 0:
            injector.errors.append(f"{cluster.coordinator} exited {code}: "
                                   + cluster.log(cluster.coordinator)[-400:].replace("\n", " | "))
        # the workers finish once they have the last round's result
        wait_until(lambda: all(p.poll() is not None for n, p in cluster.procs.items() if n.startswith("worker")),
                   60, poll=0.5)
        missed = {k: n - injector.injected[k] for k, n in plan.planned().items() if injector.injected[k] < n}
        if missed:
            injector.errors.append(f"faults that did not land: {missed}")
        return figures(name, plan, cluster, injector, args.deadline_s, time.monotonic() - t0)
    finally:
        cluster.close()


def figures(name: str, plan: Plan, cluster: Cluster, injector: Injector, deadline_s: float,
            wall_s: float) -> RunFigures:
    lines = cluster.metrics()
    rounds = [m["round"] for m in lines]
    _, digest = final_digest(cluster.run_dir)
    reports = cluster.reports_by_id()
    mismatches = sum(1 for wid in range(WORKERS)
                     if reports.get(wid, {}).get("status") != "finished" or reports[wid].get("digest") != digest)
    losses = [m["val_loss"] for m in lines if m.get("val_loss") is not None]
    return RunFigures(
        name=name, rounds_done=len(set(rounds)), rounds_applied_twice=len(rounds) - len(set(rounds)),
        planned=plan.planned(), kill_points=injector.kill_points,
        max_round_s=max((m["round_seconds"] for m in lines), default=0.0), deadline_s=deadline_s,
        final_loss=losses[-1] if losses else None, digest=digest, replica_mismatches=mismatches,
        injected=dict(injector.injected), wall_s=wall_s, errors=injector.errors,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    form = p.add_mutually_exclusive_group()
    form.add_argument("--quick", action="store_true", help="3 worker kills, 2 coordinator kills, 1 link cut, 60 rounds")
    form.add_argument("--short", action="store_true", help="1 of each fault, 16 rounds (the make test form)")
    p.add_argument("--worker-kills", type=int, default=None)
    p.add_argument("--coordinator-kills", type=int, default=None)
    p.add_argument("--link-cuts", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--exact-rounds", type=int, default=None, help="rounds of the exactly-once pair")
    p.add_argument("--seed", type=int, default=0, help="the (first) seed")
    p.add_argument("--state-cost", action="store_true",
                   help="measure what losing a worker's --state-dir costs (3 kills of one worker, kept vs lost)")
    p.add_argument("--seeds", type=int, default=3, help="--state-cost: seeds from --seed on")
    p.add_argument("--deadline-s", type=float, default=20.0, help="coordinator.deadline_s")
    p.add_argument("--liveness-s", type=float, default=6.0, help="coordinator.liveness_s")
    p.add_argument("--cut-s", type=float, default=2.0, help="how long a link stays cut")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on a run after this long")
    p.add_argument("--fault-timeout-s", type=float, default=180.0,
                   help="give up on one fault landing (a restarted worker back, a resumed coordinator serving)")
    p.add_argument("--work-dir", help="keep the run directories here (default: a temporary folder)")
    args = p.parse_args(argv)
    form = FORMS["quick" if args.quick else "short" if args.short else "full"]
    if args.state_cost and args.rounds is None:
        args.rounds = STATE_COST_ROUNDS
    for key, value in zip(("worker_kills", "coordinator_kills", "link_cuts", "rounds", "exact_rounds"), form,
                          strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rounds < 8 or args.exact_rounds < 4:
        p.error("--rounds must be at least 8 and --exact-rounds at least 4: faults keep off the last 3 rounds")
    return args


def state_cost(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Per seed: undisturbed, and worker 1 killed three times with its state kept or lost."""
    losses: dict[str, list[float]] = {"undisturbed": [], "kept": [], "lost": []}
    errors: dict[str, list[str]] = {}
    print(f"{'seed':>5}{'undisturbed':>13}{'kept':>9}{'lost':>9}{'lost - kept':>13}")
    for seed in range(args.seed, args.seed + args.seeds):
        plans = {"undisturbed": plan_faults(0, 0, 0, args.rounds, seed),
                 "kept": plan_faults(3, 0, 0, args.rounds, seed),
                 "lost": plan_faults(3, 0, 0, args.rounds, seed)}
        plans["kept"].victim = plans["lost"].victim = 1
        plans["lost"].state = False
        row = {}
        for name, plan in plans.items():
            r = run(f"{name}-{seed}", plan, work, args)
            if r.errors or r.final_loss is None or r.replica_mismatches:
                errors[r.name] = r.errors or [f"final loss {r.final_loss}, {r.replica_mismatches} replicas off"]
            row[name] = r.final_loss if r.final_loss is not None else math.nan
            losses[name].append(row[name])
        print(f"{seed:>5}{row['undisturbed']:>13.4f}{row['kept']:>9.4f}{row['lost']:>9.4f}"
              f"{row['lost'] - row['kept']:>+13.4f}", flush=True)

    def paired(a: str, b: str) -> dict[str, float | None]:
        return paired_bounds([x - y for x, y in zip(losses[a], losses[b], strict=True)])

    return {"state_cost": {"final_loss": {k: [round(v, 5) for v in vs] for k, vs in losses.items()},
                           "lost_minus_kept": paired("lost", "kept"),
                           "kept_minus_undisturbed": paired("kept", "undisturbed"),
                           "lost_minus_undisturbed": paired("lost", "undisturbed")},
            "seeds": args.seeds, "rounds": args.rounds, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("geoloco.links").setLevel(logging.ERROR)  # a cut link's refusals are expected
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="chaos-"))
    if args.state_cost:
        try:
            result = state_cost(args, work)
        finally:
            if not args.work_dir:
                shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({**provenance(load_config(overrides=CONFIG).task), **result}))
        return 0
    exact = {**CONFIG, **EXACT}
    plans = {
        "undisturbed": plan_faults(0, 0, 0, args.rounds, args.seed),
        "chaos": plan_faults(args.worker_kills, args.coordinator_kills, args.link_cuts, args.rounds, args.seed),
        "exact-undisturbed": plan_faults(0, 0, 0, args.exact_rounds, args.seed, exact),
        "exact-coordinator": plan_faults(0, args.coordinator_kills, 0, args.exact_rounds, args.seed, exact),
    }
    try:
        results = {}
        for name, plan in plans.items():
            print(f"{name}: {plan.rounds} rounds, faults {plan.planned()}", file=sys.stderr, flush=True)
            results[name] = run(name, plan, work, args)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    chaos, calm = results["chaos"], results["undisturbed"]
    exact_calm, exact_coord = results["exact-undisturbed"], results["exact-coordinator"]
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
        "planned_faults": chaos.planned,
        "coordinator_kill_points": chaos.kill_points,
        "coordinator_only_digest_equal": bool(exact_coord.digest) and exact_coord.digest == exact_calm.digest,
        "coordinator_only_rounds_applied_twice": exact_coord.rounds_applied_twice,
        "coordinator_only_injected": exact_coord.injected["coordinator_kills"],
        "coordinator_only_kill_points": exact_coord.kill_points,
        "coordinator_only_replica_mismatch": exact_coord.replica_mismatches + exact_calm.replica_mismatches,
        "exactly_once_settings": EXACT,
        "rounds": args.rounds, "exact_rounds": args.exact_rounds, "seed": args.seed,
        "wall_s": {name: round(r.wall_s, 1) for name, r in results.items()},
        "errors": {name: r.errors for name, r in results.items() if r.errors},
    }))
    return 0


def print_table(results: dict[str, RunFigures]) -> None:
    print(f"{'run':<18}{'rounds':>7}{'twice':>6}{'max round s':>12}{'mismatch':>9}{'final loss':>11}"
          f"{'w/c/l landed/planned':>22}{'wall s':>8}  digest")
    for r in results.values():
        faults = "/".join(f"{r.injected[k]}" for k in ("worker_kills", "coordinator_kills", "link_cuts"))
        planned = "/".join(f"{r.planned[k]}" for k in ("worker_kills", "coordinator_kills", "link_cuts"))
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
        print(f"{r.name:<18}{r.rounds_done:>7}{r.rounds_applied_twice:>6}{r.max_round_s:>12.2f}"
              f"{r.replica_mismatches:>9}{loss:>11}{faults + ' / ' + planned:>22}{r.wall_s:>8.0f}  {r.digest[:12]}")
        for e in r.errors:
            print(f"  {r.name}: {e}")


if __name__ == "__main__":
    sys.exit(main())
