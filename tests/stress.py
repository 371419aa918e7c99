"""The flake hunt (`make test-stress`): the integration suite run several times in a row
while busy-loop processes keep every core loaded; prints failures and time per run, then
one JSON line. The hogs are killed on any exit (the end, an error, Ctrl-C, SIGTERM).

    python tests/stress.py [--runs 3] [--hogs 2] [--paths tests/integration] [-- PYTEST ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOG = "while True: pass"
# pytest's last line: "== 3 failed, 120 passed, 2 skipped in 812.31s (0:13:32) =="
COUNTS = re.compile(r"(\d+) (failed|passed|skipped|errors?|xfailed|xpassed)")


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        if hog.poll() is None:
            os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()


def run_suite(paths: list[str], args: list[str], log: Path) -> dict:
    """One run of the tests in ``paths``; its counts, failed test ids and wall time. An
    interrupted run gets SIGINT first, so that its fixtures end the processes they started."""
    started = time.monotonic()
    with open(log, "w") as out:
        pytest = subprocess.Popen([sys.executable, "-m", "pytest", *paths, "-q", "-rfE",
                                   "-p", "no:cacheprovider", *args], cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = pytest.wait()
        finally:
            if pytest.poll() is None:
                os.killpg(pytest.pid, signal.SIGINT)
                try:
                    pytest.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(pytest.pid, signal.SIGKILL)
                    pytest.wait()
    text = log.read_text(errors="replace")
    last = text.strip().splitlines()[-1] if text.strip() else ""
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
              for n, kind in COUNTS.findall(last)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    return {"exit": code, "seconds": round(time.monotonic() - started, 1),
            "failed": counts.get("failed", 0) + counts.get("error", 0),
            "passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
            "failed_tests": failed, "log": str(log)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy-loop processes")
    p.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "stress")
    p.add_argument("--paths", nargs="+", default=["tests/integration"], help="what pytest runs")
    args = p.parse_args(own)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally below
    hogs = start_hogs(args.hogs)
    runs = []
    try:
        for i in range(args.runs):
            runs.append(run_suite(args.paths, extra, args.log_dir / f"run-{i + 1}.log"))
            r = runs[-1]
            print(f"run {i + 1}/{args.runs}: {r['failed']} failed, {r['passed']} passed, "
                  f"{r['skipped']} skipped in {r['seconds']:.0f} s {' '.join(r['failed_tests'])}",
                  flush=True)
    finally:
        stop_hogs(hogs)
    print(f"{'run':>4} {'failed':>7} {'passed':>7} {'skipped':>8} {'seconds':>8}")
    for i, r in enumerate(runs, 1):
        print(f"{i:>4} {r['failed']:>7} {r['passed']:>7} {r['skipped']:>8} {r['seconds']:>8.0f}")
    print(json.dumps({"hogs": args.hogs, "runs": len(runs),
                      "failures_per_run": [r["failed"] for r in runs],
                      "seconds_per_run": [r["seconds"] for r in runs],
                      "failed_tests": sorted({t for r in runs for t in r["failed_tests"]})}))
    return 0 if runs and all(r["failed"] == 0 and r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
