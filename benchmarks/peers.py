"""GeoLoCo beside torchft's DiLoCo on the same shaped links, side by side in one run: the
multi-host test bed (tests/netns.py: a hub namespace, one namespace per replica, veth pairs
shaped both ways by tc), the same model, data partitions, H, inner AdamW schedule,
clipping and tokens for every system. torchft gets a lighthouse in the hub and one replica
per namespace (benchmarks/torchft_replica.py, Gloo's ring over the veths); GeoLoCo a
coordinator in the hub and one worker per namespace, over mutual TLS (a star). Needs root
and `ip netns`, and torchft (`pip install torchft==0.2.0`, a benchmark-only extra).

    sudo python -m benchmarks.peers                      # 4 replicas at 20 Mbit/s, 3 seeds
    sudo python -m benchmarks.peers --seeds 1 --rounds 6 # a quicker look

Per system: round time split into compute and communication, the validation loss at equal
tokens, and wire bytes per replica per round, from `ip -s link` on each namespace's
interface sampled through the run and read at the steady rounds' ends. Prints a table, then
one JSON line with ``speedup_vs_torchft`` (torchft's round over GeoLoCo SparseLoCo's),
``bytes_ratio_vs_torchft`` and ``loss_ratio_vs_torchft`` (SparseLoCo over torchft, mean over
seeds). What differs between the systems: torchft all-reduces over a ring, GeoLoCo sends
to a coordinator that broadcasts (a star); Gloo reduces in fp32 as GeoLoCo's dense frames
here do; without netem in the kernel the links have rates but no added delay (the JSON
says which), the same for both. At the same settings GeoLoCo's dense DiLoCo and torchft's
train the same model: the final validation losses agree (the JSON's ``diloco_vs_torchft``).
Not measured yet: loss against wall time (time to a target loss, the plot), the fault row
and the heterogeneous links of issue 28.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any

from benchmarks.provenance import provenance
from geoloco.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from netns import TestBed, unavailable  # noqa: E402 - the test bed lives with the tests

TOKEN = "peers-benchmark"
SYSTEMS = ("torchft", "diloco", "sparseloco")
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
    p.add_argument("--wan", default="20mbit", help="every replica's link (rate; delay needs netem)")
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--inner-steps", type=int, default=5, help="H: small, so that the dense transfer "
                   "takes at least 10x the compute at 20 Mbit/s (the JSON gives the measured ratio)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup-rounds", type=int, default=2, help="first rounds left out of times and bytes")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--diloco-outer-lr", type=float, default=0.5,
                   help="dense DiLoCo's outer lr for torchft and GeoLoCo alike (benchmarks/parity_tuned.json)")
    p.add_argument("--run-dir", default="runs/bench-peers")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds")
    return args


def config(args: argparse.Namespace, system: str, seed: int, run_dir: Path) -> RunConfig:
    """One task for every system; torchft runs the dense DiLoCo config."""
    method = "sparseloco" if system == "sparseloco" else "diloco"
    extra = {"outer.lr": args.diloco_outer_lr} if method == "diloco" else {}
    return load_config(overrides={
        "workers": args.replicas, "rounds": args.rounds, "seed": seed, "run_dir": str(run_dir),
        "task.model": args.model, "task.seq_len": args.seq_len, "task.batch_size": args.batch_size,
        "task.val_windows": 64, "inner.steps": args.inner_steps, "inner.warmup_steps": 0,
        "inner.lr": 3e-3, "compression.method": method, "compression.dense_dtype": "fp32",
        "network.wan": "unlimited", "coordinator.deadline_s": 3600.0,
        "coordinator.checkpoint_every": 0, "coordinator.val_every": 0, **extra,
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

    def per_round(self, start: float, end: float, rounds: int) -> float:
        """Mean wire bytes per host and round between two round ends."""
        return statistics.mean(self.at(h, end) - self.at(h, start) for h in self.bed.hosts) / rounds


def wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for name, proc in procs.items():
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise SystemExit(f"{name} exited {code}; its log {logs[name]}:\n{logs[name].read_text()[-2000:]}")


def run_geoloco(bed: TestBed, cfg: RunConfig, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
               PYTHONPATH=str(ROOT))
    geoloco, certs, run_dir = [sys.executable, "-m", "geoloco.cli"], workdir / "certs", Path(cfg.run_dir)
    subprocess.run([*geoloco, "certs", str(certs), "--san", bed.hub_address, "--workers", str(cfg.workers)],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    (workdir / "run.json").write_text(cfg.to_json())
    tls = ["--tls-ca", str(certs / "ca.pem")]
    procs, logs = {}, {}

    def start(name: str, where: str, argv: list[str]) -> None:
        logs[name] = workdir / f"{name}.log"
        with open(logs[name], "wb") as out:
            procs[name] = bed.popen(where, [*geoloco, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

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
        with ByteSampler(bed) as sampler:
            for i, host in enumerate(bed.hosts):
                start(f"worker-{i}", host, ["worker", "--coordinator", f"{bed.hub_address}:{port_file.read_text().strip()}",
                                            "--device", "cpu", *tls, "--tls-cert", str(certs / f"worker-{i}.pem"),
                                            "--tls-key", str(certs / f"worker-{i}.key")])
            wait_all(procs, logs, 3600)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = lines[args.warmup_rounds:]
    start_t, end_t = lines[args.warmup_rounds - 1]["time"], lines[-1]["time"]
    return {
        "round_s": statistics.mean(m["round_seconds"] for m in steady),
        "compute_s": statistics.mean(m["compute_seconds_max"] for m in steady),
        "final_val_loss": json.loads((run_dir / "summary.json").read_text())["final_val_loss"],
        "wire_bytes_per_replica_round": sampler.per_round(start_t, end_t, len(steady)),
    }


def run_torchft(bed: TestBed, cfg: RunConfig, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               GLOO_SOCKET_IFNAME="eth0")
    (workdir / "run.json").write_text(cfg.to_json())
    lighthouse = bed.popen("hub", [sys.executable, "-c", LIGHTHOUSE, bed.hub_address, str(cfg.workers)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    procs, logs = {}, {}
    try:
        url = f"http://{bed.hub_address}:{lighthouse.stdout.readline().strip()}"
        with ByteSampler(bed) as sampler:
            for i, host in enumerate(bed.hosts):
                logs[host] = workdir / f"replica-{i}.log"
                with open(logs[host], "wb") as out:
                    procs[host] = bed.popen(host, [
                        sys.executable, "-m", "benchmarks.torchft_replica", "--config", str(workdir / "run.json"),
                        "--replica", str(i), "--lighthouse", url, "--host", bed.address(host),
                        "--out", str(workdir / f"replica-{i}.json")], stdout=out, stderr=subprocess.STDOUT,
                        env=env, cwd=ROOT)
            wait_all(procs, logs, 3600)
    finally:
        for proc in [*procs.values(), lighthouse]:
            if proc.poll() is None:
                proc.kill()
    replicas = [json.loads((workdir / f"replica-{i}.json").read_text()) for i in range(cfg.workers)]
    if len({r["digest"] for r in replicas}) != 1:
        raise SystemExit(f"torchft replicas ended on different parameters; see {workdir}")
    steady = [r["rounds"][args.warmup_rounds:] for r in replicas]
    rounds = [max(r[k]["round_s"] for r in steady) for k in range(len(steady[0]))]
    first = replicas[0]["rounds"]
    return {
        "round_s": statistics.mean(rounds),
        "compute_s": statistics.mean(max(r[k]["compute_s"] for r in steady) for k in range(len(rounds))),
        "final_val_loss": replicas[0]["final_val_loss"],
        "wire_bytes_per_replica_round": sampler.per_round(first[args.warmup_rounds - 1]["time"],
                                                          first[-1]["time"], len(rounds)),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (reason := unavailable()) is not None:
        raise SystemExit(f"benchmarks.peers needs the network-namespace test bed: {reason}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    root = Path(args.run_dir).resolve()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    load = [os.getloadavg()[0]]
    with TestBed({f"replica{i}": args.wan for i in range(args.replicas)}) as bed:
        for seed in range(args.seeds):
            for system in args.systems:  # interleaved by seed: a change of load hits every system
                workdir = root / f"{system}-seed{seed}"
                workdir.mkdir(parents=True, exist_ok=True)
                cfg = config(args, system, seed, workdir / "run")
                run = run_torchft if system == "torchft" else run_geoloco
                runs[system].append(run(bed, cfg, workdir, args))
                load.append(os.getloadavg()[0])
                print(f"seed {seed} {system}: {runs[system][-1]}", file=sys.stderr, flush=True)
        netem = bed.netem
    result: dict[str, Any] = {}
    for system, values in runs.items():
        result[system] = {key: round(statistics.mean(v[key] for v in values), 5) for key in values[0]}
        result[system]["final_val_loss_by_seed"] = [round(v["final_val_loss"], 5) for v in values]
        result[system]["communication_s"] = round(result[system]["round_s"] - result[system]["compute_s"], 5)
    if "torchft" in result and "sparseloco" in result:
        t, s = result["torchft"], result["sparseloco"]
        result["speedup_vs_torchft"] = round(t["round_s"] / s["round_s"], 3)
        result["bytes_ratio_vs_torchft"] = round(s["wire_bytes_per_replica_round"] / t["wire_bytes_per_replica_round"], 5)
        result["loss_ratio_vs_torchft"] = round(statistics.mean(
            a["final_val_loss"] / b["final_val_loss"] for a, b in zip(runs["sparseloco"], runs["torchft"], strict=True)), 4)
        result["dense_transfer_over_compute"] = round(t["communication_s"] / t["compute_s"], 2)
    if "torchft" in result and "diloco" in result:
        result["diloco_vs_torchft"] = [round(a["final_val_loss"] / b["final_val_loss"], 6)
                                       for a, b in zip(runs["diloco"], runs["torchft"], strict=True)]
    result.update(replicas=args.replicas, wan=args.wan, netem=netem, rounds=args.rounds, seeds=args.seeds,
                  inner_steps=args.inner_steps, load_average=[round(min(load), 2), round(max(load), 2)])
    print(table(result, args.systems))
    print(json.dumps({**result, **provenance(config(args, "sparseloco", 0, root).task)}))
    return 0


def table(result: dict[str, Any], systems: list[str]) -> str:
    lines = [f"{'system':<12}{'round s':>9}{'compute s':>11}{'comm s':>9}{'wire B/replica/round':>22}{'final loss':>12}"]
    for system in systems:
        r = result[system]
        lines.append(f"{system:<12}{r['round_s']:>9.3f}{r['compute_s']:>11.3f}{r['communication_s']:>9.3f}"
                     f"{r['wire_bytes_per_replica_round']:>22,.0f}{r['final_val_loss']:>12.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
