"""What the coordinator's Prometheus endpoint costs a round: the same short run with
monitoring off and on (scraped over HTTP every second, as Prometheus would), side by side,
plus the two costs alone: recording one round into the metrics, and one scrape.

    python -m benchmarks.metrics_cost [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import geoloco
from benchmarks.provenance import provenance
from geoloco.config import RunConfig, validate

TOKEN = "metrics-cost"
SCRAPE_EVERY_S = 1.0


def config(run_dir: Path, rounds: int, metrics: bool) -> RunConfig:
    return validate(RunConfig.from_dict({
        "workers": 2, "rounds": rounds, "run_dir": str(run_dir),
        "task": {"model": "gpt-tiny", "seq_len": 32, "batch_size": 8, "val_windows": 8, "corpus_bytes": 300_000},
        "inner": {"steps": 8, "warmup_steps": 4},
        "coordinator": {"listen": "127.0.0.1:0", "token": TOKEN, "checkpoint_every": 0},
        "monitoring": {"metrics_port": 0 if metrics else None},
    }))


class Scraper:
    """GETs /metrics every second on a thread; keeps each scrape's time."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.seconds: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(SCRAPE_EVERY_S):
            start = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as reply:
                reply.read()
            self.seconds.append(time.perf_counter() - start)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class TimedObserver:
    """The Prometheus metrics' round observer, timed."""

    def __init__(self, observer: object, seconds: list[float]) -> None:
        self.observer = observer
        self.seconds = seconds

    def write_round(self, m: object) -> None:
        start = time.perf_counter()
        self.observer.write_round(m)
        self.seconds.append(time.perf_counter() - start)


def one_run(rounds: int, metrics: bool, parent: Path | None) -> dict[str, float]:
    """A run's mean round time (rounds 1.., round 0 builds the models), and with metrics
    the scrapes' and the recording's cost."""
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        coordinator = geoloco.Coordinator(config(Path(tmp), rounds, metrics))
        coordinator.start()
        scraper = Scraper(coordinator.metrics_server.port) if metrics else None
        recorded: list[float] = []
        if metrics:
            observers = coordinator.loop.observers
            observers[observers.index(coordinator.prometheus)] = TimedObserver(coordinator.prometheus, recorded)
        workers = [geoloco.Worker(f"127.0.0.1:{coordinator.port}", TOKEN, device="cpu").start() for _ in range(2)]
        try:
            coordinator.wait(timeout=600)
            for w in workers:
                w.wait(timeout=60)
        finally:
            if scraper:
                scraper.close()
            for w in workers:
                w.stop(timeout=10)
            coordinator.stop(grace=0.5)
        lines = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    seconds = [m["round_seconds"] for m in lines[1:]]
    return {"round_s": statistics.mean(seconds),
            "scrape_ms": 1e3 * statistics.mean(scraper.seconds) if scraper and scraper.seconds else 0.0,
            "scrapes": len(scraper.seconds) if scraper else 0,
            "record_ms": 1e3 * statistics.mean(recorded) if recorded else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds, one pair of runs")
    parser.add_argument("--run-dir", type=Path, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    if args.run_dir:
        args.run_dir.mkdir(parents=True, exist_ok=True)
    rounds, repeats = (4, 1) if args.quick else (12, 3)
    off, on = [], []
    for _ in range(repeats):  # alternate, so load on the machine hits both alike
        off.append(one_run(rounds, False, args.run_dir))
        on.append(one_run(rounds, True, args.run_dir))
    off_s = statistics.mean(r["round_s"] for r in off)
    on_s = statistics.mean(r["round_s"] for r in on)
    scrape_ms = statistics.mean(r["scrape_ms"] for r in on)
    record_ms = statistics.mean(r["record_ms"] for r in on)
    print(f"{'metrics':<28}{'off':>10}{'on':>10}")
    print(f"{'mean round time (s)':<28}{off_s:>10.3f}{on_s:>10.3f}")
    print(f"{'one scrape (ms)':<28}{'-':>10}{scrape_ms:>10.2f}")
    print(f"{'recording a round (ms)':<28}{'-':>10}{record_ms:>10.3f}")
    print(f"on / off round time: {on_s / off_s:.3f} ({rounds} rounds x {repeats} runs each, "
          f"scraped every {SCRAPE_EVERY_S:g} s)")
    print(json.dumps({"benchmark": "metrics_cost", "rounds": rounds, "repeats": repeats,
                      "round_s_off": round(off_s, 4), "round_s_on": round(on_s, 4),
                      "ratio_on_off": round(on_s / off_s, 4), "scrape_ms": round(scrape_ms, 3),
                      "record_round_ms": round(record_ms, 4),
                      "scrapes": sum(r["scrapes"] for r in on),
                      **provenance(config(Path(tempfile.gettempdir()), rounds, False).task)}))


if __name__ == "__main__":
    main()
