"""GeoLoCo beside torchft's DiLoCo on the same shaped links, side by side in one run: the
multi-host test bed (tests/netns.py: a hub namespace, one namespace per replica, veth pairs
shaped both ways by tc), the same model, data partitions, H, inner AdamW schedule,
clipping and tokens for every system. torchft gets a lighthouse in the hub and one replica
per namespace (benchmarks/torchft_replica.py, Gloo's ring over the veths); GeoLoCo a
coordinator in the hub and one worker per namespace, over mutual TLS (a star). Needs root
and `ip netns`, and torchft (`pip install torchft==0.2.0`, a benchmark-only extra).

    sudo python -m benchmarks.peers                      # 4 replicas at 20 Mbit/s, 3 seeds
    sudo python -m benchmarks.peers --seeds 1 --rounds 6 # a quicker look
    sudo python -m benchmarks.peers --wan 50mbit,20mbit,10mbit,5mbit   # heterogeneous links

Systems: torchft's DiLoCo (fp32, bucketized, ``init_sync=False``), the same with bf16
pseudo-gradients on the wire (``torchft-bf16``: the harness's, benchmarks/torchft_replica.py
``bf16_wire``, since torchft 0.2.0 has none), GeoLoCo's dense DiLoCo,
SparseLoCo at its defaults, SparseLoCo with ``pgc-fr`` (s = 1) and with ``outer.overlap =
eager``. Outer learning rates are the loss issue's tuned ones (benchmarks/parity_tuned.json:
dense DiLoCo's for torchft and GeoLoCo alike).

Per system: round time split into compute and communication, wire bytes per replica per
round (from `ip -s link` on each namespace's interface, sampled through the run and read at
the steady rounds' ends), and the validation loss every ``--val-every`` rounds against wall
time since round 0 opened and against the wire bytes so far. From those curves: the loss at
the end (equal tokens), the loss at equal wall time (when the quickest system of the seed
ended), and the wall time to torchft's final loss. Prints a table, writes a PNG of the
curves (``--plot``), then one JSON line with ``speedup_vs_torchft`` (torchft's round over
GeoLoCo SparseLoCo's), ``time_to_loss_ratio_vs_torchft``, ``bytes_ratio_vs_torchft`` and
``loss_ratio_vs_torchft`` (SparseLoCo over torchft, mean over seeds). What differs between
the systems: torchft all-reduces over a ring, GeoLoCo sends to a coordinator that
broadcasts (a star); Gloo reduces in fp32 as GeoLoCo's dense frames here do, and in bf16
for ``torchft-bf16`` (rounding at every hop of the ring; torchft 0.2.0's own
``should_quantize`` is fp8 through Triton, on CUDA);
without netem in the kernel the links have rates but no added delay (the JSON says which),
the same for both; GeoLoCo's coordinator measures the validation loss after it has sent the
round out, torchft's replica 0 before its next inner phase. At the same settings GeoLoCo's
dense DiLoCo and torchft's train the same model: the final validation losses agree (the
JSON's ``diloco_vs_torchft``).

The fault row (``--fault-round``): torchft, dense DiLoCo, SparseLoCo and SparseLoCo with
``pgc-fr`` run again on seed 0,
clean and with replica 1 SIGKILLed during that round's communication and started again at
once with the same command: a GeoLoCo worker takes its slot back from its --state-dir
(both runs keep one), a torchft replica heals from its peers at its first quorum (its
step, data position and learning rate follow torchft's step). The row gives the wall time
each fault cost, in seconds and in clean rounds: a clean run's wall time itself varies by a
round or two, so ``--fault-repeats N`` runs N clean and fault pairs and gives their mean
and each pair's figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from netns import TestBed, unavailable  # noqa: E402 - the test bed lives with the tests

TOKEN = "peers-benchmark"
SYSTEMS = ("torchft", "torchft-bf16", "diloco", "sparseloco", "pgc-fr", "eager")
TORCHFT = {"torchft": "fp32", "torchft-bf16": "bf16"}  # torchft's systems -> the pseudo-gradients' wire dtype
GEOLOCO = {  # system -> its compression method and settings besides the task's
    "diloco": ("diloco", {}),
    "sparseloco": ("sparseloco", {}),
    "pgc-fr": ("sparseloco", {"coding.scheme": "pgc-fr", "coding.stragglers": 1}),
    "eager": ("sparseloco", {"outer.overlap": "eager"}),
}
TUNED = ROOT / "benchmarks" / "parity_tuned.json"
COMMITTED = re.compile(r"torchft_replica: round \d+: .*loss [0-9.naif]+$", re.MULTILINE)  # not "(not committed)"
FAULT_SYSTEMS = ("torchft", "diloco", "sparseloco", "pgc-fr")
LIGHTHOUSE = """
import sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind=sys.argv[1] + ":0", min_replicas=int(sys.argv[2]))
print(server.address().rsplit(":", 1)[1], flush=True)
time.sleep(86400)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--wan", default="20mbit", help="every replica's link (rate; delay needs netem), or one "
                   "per replica, comma-separated")
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--inner-steps", type=int, default=5, help="H: small, so that the dense transfer "
                   "takes at least 10x the compute at 20 Mbit/s (the JSON gives the measured ratio)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup-rounds", type=int, default=2, help="first rounds left out of times and bytes")
    p.add_argument("--seeds", type=int, default=3, help="seeds of the comparison (0: the fault row alone)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--diloco-outer-lr", type=float, default=None,
                   help="dense DiLoCo's outer lr for torchft and GeoLoCo alike (default: the tuned one)")
    p.add_argument("--sparseloco-outer-lr", type=float, default=None,
                   help="SparseLoCo's outer lr (default: the tuned one)")
    p.add_argument("--tuned", type=Path, default=TUNED, help="the loss issue's tuned settings")
    p.add_argument("--val-every", type=int, default=2, help="rounds between validation losses")
    p.add_argument("--plot", type=Path, default=None, help="the curves' PNG (default: RUN_DIR/peers.png)")
    p.add_argument("--torchft-timeout-s", type=float, default=30.0,
                   help="torchft's connect and collective timeouts (its quorum's is 3x), sized to the "
                   "slowest link (about 10x a dense all-reduce of gpt-tiny at 20 Mbit/s)")
    p.add_argument("--fault-round", type=int, default=None,
                   help="the fault row: each of torchft, diloco, sparseloco and pgc-fr runs again on seed 0, clean and "
                   "with replica 1 SIGKILLed in this round's communication and started again at once "
                   "(default: half the rounds; a negative value: no fault row)")
    p.add_argument("--fault-repeats", type=int, default=1,
                   help="clean and fault run pairs per system in the fault row: the row gives their mean "
                   "and each pair's figure (one clean run's wall time varies by a round or two)")
    p.add_argument("--run-dir", default="runs/bench-peers")
    args = p.parse_args(argv)
    tuned = json.loads(args.tuned.read_text())["tuned"]
    if args.diloco_outer_lr is None:
        args.diloco_outer_lr = tuned["diloco"]["outer.lr"]
    if args.sparseloco_outer_lr is None:
        args.sparseloco_outer_lr = tuned["sparseloco"]["outer.lr"]
    args.links = args.wan.split(",")
    if len(args.links) not in (1, args.replicas):
        p.error(f"--wan gives {len(args.links)} links for {args.replicas} replicas: give one, or one each")
    if args.val_every < 1:
        p.error("--val-every must be at least 1")
    if args.fault_round is None:
        args.fault_round = args.rounds // 2
    if args.fault_round >= args.rounds or (args.fault_round >= 0 and args.replicas < 2):
        p.error("--fault-round must be below --rounds, with at least 2 replicas")
    if args.fault_repeats < 1:
        p.error("--fault-repeats must be at least 1")
    if args.seeds < 0 or (args.seeds == 0 and args.fault_round < 0):
        p.error("--seeds 0 runs the fault row alone: give --fault-round too")
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def config(args: argparse.Namespace, system: str, seed: int, run_dir: Path) -> RunConfig:
    """One task for every system; torchft runs the dense DiLoCo config."""
    method, extra = GEOLOCO.get(system, ("diloco", {}))
    extra = {**extra, "outer.lr": args.diloco_outer_lr if method == "diloco" else args.sparseloco_outer_lr}
    return load_config(overrides={
        "workers": args.replicas, "rounds": args.rounds, "seed": seed, "run_dir": str(run_dir),
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": 64, "inner.steps": args.inner_steps, "inner.warmup_steps": 0,
        "inner.lr": 3e-3, "compression.method": method, "compression.dense_dtype": "fp32",
        "network.wan": "unlimited", "coordinator.deadline_s": 3600.0,
        "coordinator.checkpoint_every": 0, "coordinator.val_every": args.val_every, **extra,
    })


class ByteSampler:
    """Each host's (time, bytes sent + received) every ``period_s``, on a thread."""

    def __init__(self, bed: TestBed, period_s: float = 0.5) -> None:
        self.bed, self.period_s = bed, period_s
        self.samples: dict[str, list[tuple[float, int]]] = {h: [] for h in bed.hosts}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ByteSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            for host in self.bed.hosts:
                tx, rx = self.bed.link_bytes(host)
                self.samples[host].append((time.time(), tx + rx))
            if self._stop.wait(self.period_s):
                return

    def at(self, host: str, t: float) -> float:
        """Bytes on ``host``'s link at time ``t``, interpolated between samples."""
        samples = self.samples[host]
        i = min(max(bisect_left([s[0] for s in samples], t), 1), len(samples) - 1)
        (t0, b0), (t1, b1) = samples[i - 1], samples[i]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b1

    def since(self, start: float, t: float) -> float:
        """Mean wire bytes per host between two times."""
        return statistics.mean(self.at(h, t) - self.at(h, start) for h in self.bed.hosts)

    def per_round(self, start: float, end: float, rounds: int) -> float:
        """Mean wire bytes per host and round between two round ends."""
        return statistics.mean(self.at(h, end) - self.at(h, start) for h in self.bed.hosts) / rounds


def wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for name, proc in procs.items():
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise SystemExit(f"{name} exited {code}; its log {logs[name]}:\n{logs[name].read_text()[-2000:]}")


@dataclass(frozen=True)
class Fault:
    """Replica ``replica`` SIGKILLed ``delay_s`` after round ``round`` began (aimed at its
    communication: the clean run's compute plus a quarter of its communication), then started
    again at once with the same command."""

    round: int
    delay_s: float
    replica: int = 1


def inject(fault: Fault, rounds_done: Callable[[], int], procs: dict[str, subprocess.Popen], name: str,
           restart: Callable[[], None], timeout_s: float = 3600) -> float:
    """Wait for ``fault.round`` rounds to be done, then kill and restart ``name``; returns the
    wall time of the kill."""
    deadline = time.monotonic() + timeout_s
    while rounds_done() < fault.round:
        if failed := [n for n, proc in procs.items() if proc.poll() not in (None, 0)]:
            raise SystemExit(f"{failed} exited before the fault was injected")
        if time.monotonic() > deadline:
            raise SystemExit(f"round {fault.round} was not reached in {timeout_s:.0f} s")
        time.sleep(0.01)
    time.sleep(fault.delay_s)
    procs[name].kill()
    procs[name].wait()
    killed = time.time()
    restart()
    return killed


def run_geoloco(bed: TestBed, cfg: RunConfig, workdir: Path, args: argparse.Namespace,
                fault: Fault | None = None, state: bool = False) -> dict[str, Any]:
    """One GeoLoCo run; ``state``: each worker keeps a --state-dir (what a worker started
    again after a kill takes its slot back with); ``fault``: the fault row's run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
               PYTHONPATH=str(ROOT))
    geoloco, certs, run_dir = [sys.executable, "-m", "geoloco.cli"], workdir / "certs", Path(cfg.run_dir)
    subprocess.run([*geoloco, "certs", str(certs), "--san", bed.hub_address, "--workers", str(cfg.workers)],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    (workdir / "run.json").write_text(cfg.to_json())
    tls = ["--tls-ca", str(certs / "ca.pem")]
    procs, logs = {}, {}

    def start(name: str, where: str, argv: list[str], mode: str = "wb") -> None:
        logs[name] = workdir / f"{name}.log"
        with open(logs[name], mode) as out:
            procs[name] = bed.popen(where, [*geoloco, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def rounds_done() -> int:
        metrics = run_dir / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    try:
        start("coordinator", "hub", ["coordinator", "--config", str(workdir / "run.json"), "--overwrite", "--listen",
                                     f"{bed.hub_address}:0", "--run-dir", str(run_dir), *tls,
                                     "--tls-cert", str(certs / "coordinator.pem"),
                                     "--tls-key", str(certs / "coordinator.key")])
        port_file = run_dir / "coordinator.port"
        while not (port_file.exists() and port_file.read_text().strip().isdigit()):
            if procs["coordinator"].poll() is not None:
                raise SystemExit(f"the coordinator exited; see {logs['coordinator']}")
            time.sleep(0.2)
        workers = {}
        for i, host in enumerate(bed.hosts):
            state_dir = ["--state-dir", str(workdir / "state" / f"worker-{i}")] if state else []
            workers[f"worker-{i}"] = host, ["worker", "--coordinator", f"{bed.hub_address}:{port_file.read_text().strip()}",
                                            "--device", "cpu", *tls, "--tls-cert", str(certs / f"worker-{i}.pem"),
                                            "--tls-key", str(certs / f"worker-{i}.key"), *state_dir]
        with ByteSampler(bed) as sampler:
            for name, (host, argv) in workers.items():
                start(name, host, argv)
            if fault is not None:
                victim = f"worker-{fault.replica}"
                killed = inject(fault, rounds_done, procs, victim, lambda: start(victim, *workers[victim], mode="ab"))
            wait_all(procs, logs, 3600)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = lines[args.warmup_rounds:]
    start_t, end_t = lines[args.warmup_rounds - 1]["time"], lines[-1]["time"]
    opened = lines[0]["time"] - lines[0]["round_seconds"]  # round 0 opened
    if fault is not None:
        return {"wall_s": lines[-1]["time"] - opened, "killed_at_s": killed - opened,
                "final_val_loss": summary["final_val_loss"], "rounds": len(lines)}
    points = [(m["time"], m["val_loss"]) for m in lines if m.get("val_loss") is not None]
    return {
        "round_s": statistics.mean(m["round_seconds"] for m in steady),
        "compute_s": statistics.mean(m["compute_seconds_max"] for m in steady),
        "final_val_loss": summary["final_val_loss"],
        "wire_bytes_per_replica_round": sampler.per_round(start_t, end_t, len(steady)),
        "curve": curve(sampler, opened, summary["initial_val_loss"], points,
                       (lines[-1]["time"], summary["final_val_loss"])),
    }


def curve(sampler: ByteSampler, opened: float, initial: float, points: list[tuple[float, float]],
          final: tuple[float, float]) -> list[list[float]]:
    """[seconds since round 0 opened, validation loss, wire bytes per replica so far], from
    the initial parameters to the end (the final loss added where the last round had none)."""
    if not points or points[-1][0] < final[0]:
        points = [*points, final]
    return [[0.0, initial, 0.0]] + [[t - opened, loss, sampler.since(opened, t)] for t, loss in points]


def run_torchft(bed: TestBed, cfg: RunConfig, workdir: Path, args: argparse.Namespace,
                fault: Fault | None = None, state: bool = False, wire_dtype: str = "fp32") -> dict[str, Any]:
    """One torchft run (``state`` is GeoLoCo's: torchft heals a restarted replica from its
    peers); ``fault``: the fault row's run, replica 0's figures, whether the replicas agree;
    ``wire_dtype``: the pseudo-gradients' on the wire."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               GLOO_SOCKET_IFNAME="eth0")
    (workdir / "run.json").write_text(cfg.to_json())
    lighthouse = bed.popen("hub", [sys.executable, "-c", LIGHTHOUSE, bed.hub_address, str(cfg.workers)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    procs, logs = {}, {}
    try:
        url = f"http://{bed.hub_address}:{lighthouse.stdout.readline().strip()}"
        def start(i: int, host: str, mode: str = "wb") -> None:
            logs[host] = workdir / f"replica-{i}.log"
            with open(logs[host], mode) as out:
                procs[host] = bed.popen(host, [
                    sys.executable, "-m", "benchmarks.torchft_replica", "--config", str(workdir / "run.json"),
                    "--replica", str(i), "--lighthouse", url, "--host", bed.address(host),
                    "--val-every", str(args.val_every), "--timeout-s", str(args.torchft_timeout_s),
                    "--wire-dtype", wire_dtype,
                    "--out", str(workdir / f"replica-{i}.json")], stdout=out, stderr=subprocess.STDOUT,
                    env=env, cwd=ROOT)

        def rounds_done() -> int:  # replica 0's committed rounds, from its log
            return len(COMMITTED.findall(logs[next(iter(bed.hosts))].read_text()))

        with ByteSampler(bed) as sampler:
            for i, host in enumerate(bed.hosts):
                start(i, host)
            if fault is not None:
                victim = list(bed.hosts)[fault.replica]
                killed = inject(fault, rounds_done, procs, victim, lambda: start(fault.replica, victim, mode="ab"))
            wait_all(procs, logs, 3600)
    finally:
        for proc in [*procs.values(), lighthouse]:
            if proc.poll() is None:
                proc.kill()
    replicas = [json.loads((workdir / f"replica-{i}.json").read_text()) for i in range(cfg.workers)]
    agree = len({r["digest"] for r in replicas}) == 1
    if fault is not None:
        first = replicas[0]["rounds"]
        opened = first[0]["time"] - first[0]["round_s"]
        return {"wall_s": first[-1]["time"] - opened, "killed_at_s": killed - opened,
                "final_val_loss": replicas[0]["final_val_loss"], "rounds": len(first), "replicas_agree": agree}
    if not agree:
        raise SystemExit(f"torchft replicas ended on different parameters; see {workdir}")
    steady = [r["rounds"][args.warmup_rounds:] for r in replicas]
    rounds = [max(r[k]["round_s"] for r in steady) for k in range(len(steady[0]))]
    first = replicas[0]["rounds"]
    opened = first[0]["time"] - first[0]["round_s"]
    return {
        "round_s": statistics.mean(rounds),
        "compute_s": statistics.mean(max(r[k]["compute_s"] for r in steady) for k in range(len(rounds))),
        "final_val_loss": replicas[0]["final_val_loss"],
        "wire_bytes_per_replica_round": sampler.per_round(first[args.warmup_rounds - 1]["time"],
                                                          first[-1]["time"], len(rounds)),
        "curve": curve(sampler, opened, replicas[0]["initial_val_loss"],
                       [(r["time"], r["val_loss"]) for r in first if "val_loss" in r],
                       (first[-1]["time"], replicas[0]["final_val_loss"])),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (reason := unavailable()) is not None:
        raise SystemExit(f"benchmarks.peers needs the network-namespace test bed: {reason}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    root = Path(args.run_dir).resolve()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    load = [os.getloadavg()[0]]
    links = args.links * args.replicas if len(args.links) == 1 else args.links
    with TestBed({f"replica{i}": link for i, link in enumerate(links)}) as bed:
        for seed in range(args.seeds):
            for system in args.systems:  # interleaved by seed: a change of load hits every system
                workdir = root / f"{system}-seed{seed}"
                workdir.mkdir(parents=True, exist_ok=True)
                cfg = config(args, system, seed, workdir / "run")
                if system in TORCHFT:
                    runs[system].append(run_torchft(bed, cfg, workdir, args, wire_dtype=TORCHFT[system]))
                else:
                    runs[system].append(run_geoloco(bed, cfg, workdir, args))
                load.append(os.getloadavg()[0])
                brief = {k: v for k, v in runs[system][-1].items() if k != "curve"}
                print(f"seed {seed} {system}: {brief}", file=sys.stderr, flush=True)
        faults = fault_row(bed, args, root) if args.fault_round >= 0 else {}
        netem = bed.netem
    result = summarize(runs) if args.seeds else {}
    if faults:
        result["fault"] = faults
    result.update(replicas=args.replicas, wan=args.wan, netem=netem, rounds=args.rounds, seeds=args.seeds,
                  inner_steps=args.inner_steps, val_every=args.val_every, fault_round=args.fault_round,
                  fault_repeats=args.fault_repeats, outer_lr={"diloco": args.diloco_outer_lr, "sparseloco": args.sparseloco_outer_lr},
                  load_average=[round(min(load), 2), round(max(load), 2)])
    print(table(result, args.systems if args.seeds else []))
    plot = args.plot or root / "peers.png"
    if args.seeds and draw(runs, plot, f"{args.replicas} replicas, {args.wan}, H = {args.inner_steps}"):
        print(f"curves: {plot}")
    print(json.dumps({**result, **provenance(config(args, "sparseloco", 0, root).task)}))
    return 0


def fault_row(bed: TestBed, args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    """Each of FAULT_SYSTEMS on seed 0, clean and then with replica 1 killed during round
    ``--fault-round``'s communication and started again at once (GeoLoCo's workers on a
    --state-dir both times), ``--fault-repeats`` pairs; the wall time the fault cost, in
    seconds and in clean rounds: the mean over pairs, and each pair's."""
    row = {}
    for system in [s for s in args.systems if s in FAULT_SYSTEMS]:
        pairs = [fault_pair(bed, args, root / (system if args.fault_repeats == 1 else f"{system}-{i}"), system)
                 for i in range(args.fault_repeats)]
        row[system] = {key: round(statistics.mean(p[key] for p in pairs), 3)
                       for key in pairs[0] if not isinstance(pairs[0][key], bool)}
        row[system]["lost_rounds"] = round(row[system]["lost_rounds"], 2)
        if args.fault_repeats > 1:
            row[system]["lost_s_by_pair"] = [p["lost_s"] for p in pairs]
            row[system]["lost_rounds_by_pair"] = [p["lost_rounds"] for p in pairs]
        if "replicas_agree" in pairs[0]:
            row[system]["replicas_agree"] = all(p["replicas_agree"] for p in pairs)
        print(f"fault {system}: {row[system]}", file=sys.stderr, flush=True)
    return row


def fault_pair(bed: TestBed, args: argparse.Namespace, root: Path, system: str) -> dict[str, Any]:
    """One clean run of ``system`` and one with the fault, under ``root``-clean and -fault."""
    run = run_torchft if system == "torchft" else run_geoloco
    clean_dir, fault_dir = Path(f"{root}-clean"), Path(f"{root}-fault")
    for folder in (clean_dir, fault_dir):
        folder.mkdir(parents=True, exist_ok=True)
    clean = run(bed, config(args, system, 0, clean_dir / "run"), clean_dir, args, state=True)
    fault = Fault(args.fault_round, clean["compute_s"] + 0.25 * (clean["round_s"] - clean["compute_s"]))
    hit = run(bed, config(args, system, 0, fault_dir / "run"), fault_dir, args, fault=fault, state=True)
    clean_wall = clean["curve"][-1][0]
    pair = {"clean_wall_s": round(clean_wall, 3), "fault_wall_s": round(hit["wall_s"], 3),
            "lost_s": round(hit["wall_s"] - clean_wall, 3),
            "lost_rounds": round((hit["wall_s"] - clean_wall) / clean["round_s"], 2),
            "killed_at_s": round(hit["killed_at_s"], 3), "kill_delay_s": round(fault.delay_s, 3),
            "final_val_loss": round(hit["final_val_loss"], 5),
            "clean_final_val_loss": round(clean["final_val_loss"], 5)}
    if "replicas_agree" in hit:
        pair["replicas_agree"] = hit["replicas_agree"]
    return pair


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system the means over seeds, the loss at equal wall time (each seed's quickest
    system's end) and the wall time to torchft's final loss of the same seed; then the
    ratios against torchft."""
    seeds = range(len(next(iter(runs.values()))))
    ends = [min(runs[s][i]["curve"][-1][0] for s in runs) for i in seeds]
    result: dict[str, Any] = {}
    for system, values in runs.items():
        r = {key: round(statistics.mean(v[key] for v in values), 5) for key in values[0] if key != "curve"}
        r["final_val_loss_by_seed"] = [round(v["final_val_loss"], 5) for v in values]
        r["communication_s"] = round(r["round_s"] - r["compute_s"], 5)
        r["wall_s"] = round(statistics.mean(v["curve"][-1][0] for v in values), 3)
        r["loss_at_equal_time"] = round(statistics.mean(loss_at(v["curve"], t) for v, t in zip(values, ends, strict=True)), 5)
        if "torchft" in runs:
            reached = [time_to(v["curve"], runs["torchft"][i]["final_val_loss"]) for i, v in enumerate(values)]
            r["time_to_torchft_loss_s"] = [None if t is None else round(t, 3) for t in reached]
        r["curve_by_seed"] = [[[round(x, 5) for x in point] for point in v["curve"]] for v in values]
        result[system] = r
    if "torchft" in result and "sparseloco" in result:
        t, s = result["torchft"], result["sparseloco"]
        result["speedup_vs_torchft"] = round(t["round_s"] / s["round_s"], 3)
        result["bytes_ratio_vs_torchft"] = round(s["wire_bytes_per_replica_round"] / t["wire_bytes_per_replica_round"], 5)
        result["loss_ratio_vs_torchft"] = round(statistics.mean(
            a["final_val_loss"] / b["final_val_loss"] for a, b in zip(runs["sparseloco"], runs["torchft"], strict=True)), 4)
        pairs = list(zip(s["time_to_torchft_loss_s"], t["time_to_torchft_loss_s"], strict=True))
        result["time_to_loss_ratio_vs_torchft"] = (None if any(a is None for a, _ in pairs) else
                                                   round(statistics.mean(a / b for a, b in pairs), 4))
        result["dense_transfer_over_compute"] = round(t["communication_s"] / t["compute_s"], 2)
    if "torchft-bf16" in result and "sparseloco" in result:
        t, s = result["torchft-bf16"], result["sparseloco"]
        result["speedup_vs_torchft_bf16"] = round(t["round_s"] / s["round_s"], 3)
        result["bytes_ratio_vs_torchft_bf16"] = round(s["wire_bytes_per_replica_round"]
                                                      / t["wire_bytes_per_replica_round"], 5)
    if "torchft" in result and "diloco" in result:
        result["diloco_vs_torchft"] = [round(a["final_val_loss"] / b["final_val_loss"], 6)
                                       for a, b in zip(runs["diloco"], runs["torchft"], strict=True)]
    return result


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first wall time the curve reaches ``target`` (linear between its points), or
    None where it never does."""
    if curve[0][1] <= target:
        return curve[0][0]
    for (t0, l0, _), (t1, l1, _) in pairwise(curve):
        if l1 <= target:  # l0 > target >= l1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def loss_at(curve: list[list[float]], t: float) -> float:
    """The curve's loss at wall time ``t`` (linear between its points; the last past its end)."""
    for (t0, l0, _), (t1, l1, _) in pairwise(curve):
        if t <= t1:
            return l0 + (l1 - l0) * (t - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][1]


def draw(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> bool:
    """Validation loss against wall time and against wire bytes, every system overlaid
    (one line per seed); False, and a note, without matplotlib (the `plots` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'geoloco[plots]')", file=sys.stderr)
        return False
    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (system, values) in enumerate(runs.items()):
        for seed, v in enumerate(values):
            t, loss, wire = zip(*v["curve"], strict=True)
            label = system if seed == 0 else None
            by_time.plot(t, loss, color=f"C{i}", alpha=0.8, label=label)
            by_bytes.plot([b / 1e6 for b in wire], loss, color=f"C{i}", alpha=0.8, label=label)
    by_time.set(xlabel="wall time since round 0 (s)", ylabel="validation loss", xscale="symlog")
    by_bytes.set(xlabel="wire MB per replica", ylabel="validation loss", xscale="symlog")
    by_time.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def table(result: dict[str, Any], systems: list[str]) -> str:
    lines = [f"{'system':<14}{'round s':>9}{'compute s':>11}{'comm s':>9}{'wire B/replica/round':>22}"
             f"{'final loss':>12}{'loss at equal time':>20}{'wall s':>9}{'s to torchft loss':>19}"]
    for system in systems:
        r = result[system]
        reached = r.get("time_to_torchft_loss_s", [])
        to_loss = ("-" if not reached else "not reached" if None in reached
                   else f"{statistics.mean(reached):.1f}")
        lines.append(f"{system:<14}{r['round_s']:>9.3f}{r['compute_s']:>11.3f}{r['communication_s']:>9.3f}"
                     f"{r['wire_bytes_per_replica_round']:>22,.0f}{r['final_val_loss']:>12.4f}"
                     f"{r['loss_at_equal_time']:>20.4f}{r['wall_s']:>9.1f}{to_loss:>19}")
    if "fault" in result:
        repeats = result.get("fault_repeats", 1)
        lines.append(f"\nfault row: replica 1 SIGKILLed in round {result['fault_round']}'s communication, "
                     f"started again at once (seed 0; {'the mean of ' + str(repeats) + ' pairs' if repeats > 1 else 'one pair'})")
        lines.append(f"{'system':<14}{'clean wall s':>14}{'fault wall s':>14}{'lost s':>9}{'lost rounds':>13}"
                     f"{'final loss':>12}")
        for system, f in result["fault"].items():
            lines.append(f"{system:<14}{f['clean_wall_s']:>14.1f}{f['fault_wall_s']:>14.1f}{f['lost_s']:>9.1f}"
                         f"{f['lost_rounds']:>13.2f}{f['final_val_loss']:>12.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
