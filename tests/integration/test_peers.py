"""benchmarks/peers.py end to end on the network-namespace test bed, tiny: torchft's DiLoCo
and GeoLoCo's dense DiLoCo at the same settings train the same model (the same final
validation loss) and put the same bytes on the wire, and the JSON line carries the figures
the comparison is read from. Skipped without root or `ip netns` (GEOLOCO_REQUIRE_NETNS=1:
a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from netns import require_testbed
from run_processes import ROOT

pytestmark = pytest.mark.slow


def test_torchft_and_geoloco_dense_diloco_agree_on_the_test_bed(tmp_path: Path) -> None:
    require_testbed()
    pytest.importorskip("torchft")
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--replicas", "2", "--rounds", "3",
                           "--warmup-rounds", "1", "--inner-steps", "2", "--seq-len", "16", "--seeds", "1",
                           "--systems", "torchft,diloco,sparseloco", "--run-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # one algorithm, one model: fp32 sums in another order (ring against star) at most
    assert result["diloco_vs_torchft"] == pytest.approx([1.0], abs=1e-4)
    dense = result["diloco"]["wire_bytes_per_replica_round"]
    assert result["torchft"]["wire_bytes_per_replica_round"] == pytest.approx(dense, rel=0.1)
    assert result["bytes_ratio_vs_torchft"] < 0.05  # sparse frames against the dense all-reduce
    for key in ("speedup_vs_torchft", "loss_ratio_vs_torchft", "dense_transfer_over_compute"):
        assert result[key] > 0
