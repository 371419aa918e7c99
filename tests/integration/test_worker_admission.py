"""Workers decide what runs on them (issue 24): a real coordinator whose run config names a
``.py:function`` model, and real ``geoloco worker`` processes. Run by hand (the default) a
worker refuses it before importing anything; with ``worker.allow_config_code`` set locally
it runs it. The model's file marks every process that imports it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_processes import ROOT, TOKEN, Processes

from geoloco.config import load_config
from geoloco.coordinator.app import Coordinator

pytestmark = pytest.mark.slow
MARKS = "GEOLOCO_TEST_IMPORT_MARKS"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[Coordinator, Path]]:
    marks = tmp_path / "imported-by"
    marks.mkdir()
    model = tmp_path / "their_model.py"
    model.write_text((ROOT / "examples" / "custom_model" / "model.py").read_text()
                     + f"\nimport os as _os\nPath_ = __import__('pathlib').Path\n"
                     f"Path_(_os.environ[{MARKS!r}], str(_os.getpid())).touch()\n")
    os.environ[MARKS] = str(marks)
    cfg = load_config(overrides={
        "workers": 1, "rounds": 1, "task.model": f"{model}:make_model", "task.seq_len": 16,
        "task.batch_size": 4, "task.val_windows": 8, "task.corpus_bytes": 100_000, "inner.steps": 2,
        "coordinator.listen": "127.0.0.1:0", "coordinator.token": TOKEN, "coordinator.join_timeout_s": 600.0,
        "coordinator.checkpoint_every": 0,
        "coordinator.liveness_s": 2.0})  # the refused worker's slot is free again soon
    coordinator = Coordinator(cfg, tmp_path / "run")
    coordinator.start()
    yield coordinator, marks
    coordinator.stop(grace=0.5)
    os.environ.pop(MARKS, None)


def importers(marks: Path) -> set[int]:
    return {int(p.name) for p in marks.iterdir()} - {os.getpid()}  # not the coordinator (this process)


def test_a_worker_refuses_a_coordinators_module_function_unless_allowed(coordinator, tmp_path) -> None:
    coord, marks = coordinator
    processes = Processes(tmp_path / "logs")
    address = f"127.0.0.1:{coord.port}"
    try:
        refused = processes.start("by-hand", ["worker", "--coordinator", address, "--device", "cpu"])
        assert processes.wait("by-hand", timeout=300) != 0
        assert "is code to run here" in processes.log("by-hand")
        assert importers(marks) == set()  # nothing of it was imported
        allowed = processes.start("allowed", ["worker", "--coordinator", address, "--device", "cpu",
                                              "--set", "worker.allow_config_code=true"])
        assert processes.wait("allowed", timeout=300) == 0, processes.log("allowed")[-3000:]
        assert importers(marks) == {allowed.pid} and refused.pid not in importers(marks)
    finally:
        processes.cleanup()
    shutil.rmtree(marks, ignore_errors=True)
