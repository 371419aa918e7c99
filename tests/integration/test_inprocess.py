"""The in-process runner of the loss benchmarks (benchmarks/inprocess.py) against the real
thing: the same config through ``geoloco local`` (coordinator and worker processes, gRPC,
relays) and through ``simulate`` ends with the same parameters, bit for bit, uncoded and
under classic FR (whose group-mates' frames are the same: whichever arrives first is
chosen, the other one settles by CREDIT), the first on iid partitions, the second on
contiguous ones. The frame guard is set not to clip: it judges the frames that arrived
against the latest counted norm of each worker that did not, so which FR mate arrives first
decides whether an early round's frame is clipped (its norm grows ~3x a round under the
warmup), and simulate, which has no arrival order, has no guard. Cost: two local runs of 2 workers, about 25 s each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.inprocess import simulate
from geoloco.config import load_config
from geoloco.launch import run_local

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scheme, partitioning", [("none", "iid"), ("gc-fr", "contiguous")])
def test_simulate_ends_with_the_parameters_of_a_local_run(scheme: str, partitioning: str,
                                                          tmp_path: Path) -> None:
    cfg = load_config(overrides={
        "workers": 2, "rounds": 2, "inner.steps": 2, "task.seq_len": 16, "task.batch_size": 2,
        "task.val_windows": 2, "network.wan": "unlimited", "coordinator.checkpoint_every": 0,
        "run_dir": str(tmp_path / "run"), "coding.scheme": scheme,
        "coding.stragglers": 0 if scheme == "none" else 1, "task.partitioning": partitioning,
        "guard.clip_ratio": 1e6, "guard.reject_ratio": 1e12,  # simulate has no frame guard: see above
    })
    assert run_local(cfg).ok
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "run" / "workers").glob("worker-*.json"))]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    result = simulate(cfg)
    assert [r["digest"] for r in reports] == [result.digest] * 2
    assert result.final_val_loss == summary["final_val_loss"]
    assert result.modes == ["mean_kept", "mean_kept"]
