"""The chaos benchmark's short form (`python -m benchmarks.chaos --short`) asserts what its
full form promises, on real processes: a pgc-fr training of 4 workers through one worker
SIGKILL (restarted at once on its --state-dir), one coordinator SIGKILL at a random time
(resumed with --resume) and one cut link ends with every round applied once, every replica
on the coordinator's final digest, and each fault landed; and the same seed with a close that
waits for every frame ends on the same parameters, bit for bit, with and without the
coordinator kill. About 2 minutes on an idle 2-core machine (4 runs of 5 processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    work = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--short", "--work-dir", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(work.glob("*/logs/*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    context = proc.stdout[-2500:] + logs[-6000:]
    assert result["errors"] == {}, context
    assert result["rounds_done"] == result["rounds"], context
    assert result["rounds_applied_twice"] == 0, context
    assert result["replica_digest_mismatch_at_end"] == 0, context
    assert result["injected_faults"] == result["planned_faults"] == \
        {"worker_kills": 1, "coordinator_kills": 1, "link_cuts": 1}, context
    assert result["coordinator_only_injected"] == 1 and result["coordinator_only_rounds_applied_twice"] == 0, context
    assert result["coordinator_only_replica_mismatch"] == 0, context
    assert result["coordinator_only_digest_equal"] is True, context
    # 16 rounds are too few for the full form's 1 % (pgc-fr's own run-to-run spread is about
    # that): a bound that catches a replica gone astray or a round lost, not noise
    assert result["final_loss_ratio"] < 1.1, context
