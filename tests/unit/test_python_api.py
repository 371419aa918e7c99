"""The Python API: a Coordinator and Workers started and stopped from a script in one
process, with a replaced inner step; a worker stopped mid-run; ``geoloco export`` of a
preset model as a plain state dict that rebuilds the coordinator's model exactly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import geoloco
from geoloco.cli import main
from geoloco.coordinator import checkpoint
from geoloco.replica import param_digest
from geoloco.tasks import build_model, build_task
from geoloco.worker.trainer import InnerTrainer

TOKEN = "api-test"
WAIT_S = 120.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(run_dir: Path, **overrides: object) -> geoloco.RunConfig:
    return geoloco.load_config(overrides={
        "workers": 2, "rounds": 2, "run_dir": str(run_dir), "coordinator.listen": "127.0.0.1:0",
        "coordinator.token": TOKEN, "coordinator.checkpoint_every": 1, "coordinator.join_timeout_s": 60,
        "task.seq_len": 16, "task.batch_size": 4, "task.val_windows": 4, "task.corpus_bytes": 60_000,
        "inner.steps": 2, "inner.warmup_steps": 1, **overrides})



def test_a_script_drives_a_coordinator_and_workers_with_its_own_inner_step(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run")
    calls: list[int] = []

    def halve_the_loss(trainer: InnerTrainer, batch) -> float:
        """The default step on half the loss: a stand-in for any custom step."""
        calls.append(batch[0].shape[0])
        with trainer.autocast():
            loss = trainer.task.loss(trainer.model, batch) * 0.5
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        trainer.optimizer.step()
        return loss.item()

    coordinator = geoloco.Coordinator(cfg)
    port = coordinator.start()
    workers = [geoloco.Worker(f"127.0.0.1:{port}", TOKEN, device="cpu", inner_step=halve_the_loss,
                              report_dir=tmp_path / "workers").start() for _ in range(2)]
    try:
        assert coordinator.wait(WAIT_S)
        assert all(w.wait(WAIT_S) for w in workers)
    finally:
        for w in workers:
            w.stop()
        coordinator.stop(grace=0.5)
    assert [w.exit_code for w in workers] == [0, 0] and not coordinator.failed
    assert len(calls) == 2 * 2 * 2  # workers x rounds x inner steps, each on a 4-sequence batch
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "workers").glob("worker-*.json"))]
    assert {r["digest"] for r in reports} == {coordinator.digest()}
    assert cfg.task.data_fingerprint == build_task(cfg.task, 2).fingerprint  # what workers check

    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    model = build_model("gpt-tiny", 16, seed=0)
    model.load_state_dict(exported)  # strict: a plain state dict of the preset
    assert param_digest([p for _, p in model.named_parameters()]) == coordinator.digest()
    described = json.loads((out / "config.json").read_text())
    assert described["geoloco_model"] == "gpt-tiny" and described["vocab_size"] == 256


def test_a_worker_stopped_mid_run_ends_and_says_so(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", workers=1, rounds=1000, **{"coordinator.checkpoint_every": 0})
    coordinator = geoloco.Coordinator(cfg)
    port = coordinator.start()
    worker = geoloco.Worker(f"127.0.0.1:{port}", TOKEN, device="cpu", report_dir=tmp_path / "w").start()
    try:
        deadline = time.monotonic() + WAIT_S
        while coordinator.open_round() < 2:
            assert not worker.wait(0.1), worker.error
            assert time.monotonic() < deadline, "no two rounds closed"
        worker.stop(timeout=WAIT_S)
        assert worker.wait(0) and worker.exit_code == 130 and worker.error is None
        report = json.loads((tmp_path / "w" / "worker-0.json").read_text())
        assert report["status"] == "stopped"
    finally:
        worker.stop()
        coordinator.stop(grace=0.5)


def test_export_of_a_run_dir_without_checkpoints_is_an_error(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "is not a run directory" in capsys.readouterr().err
    cfg = config(tmp_path)
    (tmp_path / "config.json").write_text(cfg.to_json())
    (tmp_path / checkpoint.CHECKPOINT_DIR).mkdir()
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "has no readable checkpoint" in capsys.readouterr().err


def test_the_api_takes_the_token_from_the_environment_as_the_cli_does(tmp_path: Path, monkeypatch) -> None:
    """No token in the config: GEOLOCO_TOKEN is the run's token for a Coordinator and a Worker
    (the README's snippet), and without it both refuse with a message naming it."""
    def tokenless(run_dir: Path) -> geoloco.RunConfig:
        cfg = config(run_dir)
        cfg.coordinator.token = None
        return cfg

    monkeypatch.delenv("GEOLOCO_TOKEN", raising=False)
    with pytest.raises(geoloco.ConfigError, match="GEOLOCO_TOKEN"):
        geoloco.Coordinator(tokenless(tmp_path / "none"))
    with pytest.raises(geoloco.ConfigError, match="GEOLOCO_TOKEN"):
        geoloco.Worker("127.0.0.1:1")
    assert not (tmp_path / "none").exists()  # refused before anything was written

    monkeypatch.setenv("GEOLOCO_TOKEN", "from-the-environment")
    coordinator = geoloco.Coordinator(tokenless(tmp_path / "run"))
    port = coordinator.start()
    workers = [geoloco.Worker(f"127.0.0.1:{port}", device="cpu").start() for _ in range(2)]
    try:
        assert coordinator.wait(WAIT_S) and all(w.wait(WAIT_S) for w in workers)
    finally:
        for w in workers:
            w.stop()
        coordinator.stop(grace=0.5)
    assert [w.exit_code for w in workers] == [0, 0] and not coordinator.failed
