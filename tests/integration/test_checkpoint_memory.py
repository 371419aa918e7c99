"""A coordinator writes its checkpoint without a second copy of what it holds: its
parameters and, under ``coordinator.broadcast = "aggregate"``, its error feedback (each a
model's size) go to the files as they are, between two rounds on the round loop's thread.
Measured in a fresh process: the peak resident set (VmHWM, reset just before) over the
resident set before RoundLoop.save_checkpoint, with a layout of 32M parameters (128 MB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from run_processes import ROOT

pytestmark = pytest.mark.slow
PARAMS = 32 << 20  # 128 MiB of fp32 parameters, and as much error feedback
MODEL_BYTES = 4 * PARAMS
# what a checkpoint may add: the sidecar's and safetensors' headers, the writes' buffers,
# the allocator's slack; a quarter of one copy of the parameters or of the error feedback
GROWTH_BOUND = MODEL_BYTES // 4

PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from torch import nn
    from geoloco.compression import Layout, TensorSpec
    from geoloco.config import load_config
    from geoloco.coordinator.gradient_coding import make_code
    from geoloco.coordinator.loop import RoundLoop
    from geoloco.coordinator.metrics import RunTotals
    from geoloco.coordinator.outer import make_outer
    from geoloco.coordinator.registry import WorkerRegistry
    from geoloco.coordinator.rounds import CodePolicy, RoundState
    from geoloco.coordinator.state import CoordinatorState
    from geoloco.coordinator import checkpoint

    run_dir, params_n = Path(sys.argv[1]), int(sys.argv[2])
    cfg = load_config(overrides={"workers": 2, "rounds": 4, "run_dir": str(run_dir),
                                 "coordinator.broadcast": "aggregate", "coordinator.token": "t"})
    layout = Layout([TensorSpec("w", (params_n // 1024, 1024), torch.float32),
                     TensorSpec("b", (1024,), torch.float32)])
    params = [torch.randn(s.shape) for s in layout.specs]
    state = CoordinatorState(layout, params, WorkerRegistry(2, "t"), RunTotals(), RoundState(0, 60.0))
    outer = make_outer(cfg, layout)
    outer.compressor.ensure_state()  # the aggregate's error feedback, as after a round
    for e in outer.compressor.error_live():
        e.normal_()
    loop = RoundLoop(cfg, state, CodePolicy(make_code("none", 2, 0, 0)), outer, None, nn.Module(), run_dir)

    def status(key):
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    before = status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts from here
    path = loop.save_checkpoint(1)
    grew = status("VmHWM:") - before
    saved = checkpoint.load(path)
    same = (all(torch.equal(saved.params[s.name], p) for s, p in zip(layout.specs, params))
            and all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(
                saved.outer_state["broadcast_error_feedback"]["error_feedback"], outer.compressor.error)))
    print(json.dumps({"growth": grew, "same": same}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_a_checkpoint_copies_neither_the_parameters_nor_the_error_feedback(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "run"), str(PARAMS)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["same"]  # the checkpoint holds them, bit for bit
    assert out["growth"] < GROWTH_BOUND, f"writing the checkpoint grew the process by {out['growth'] / 2**20:.0f} MiB"
