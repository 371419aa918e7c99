"""A worker's own state written beside the rounds (geoloco.worker.local_state): the snapshot
taken between rounds is what lands on disk, whatever training does while it is written; a
write that fails says so when its outcome is taken and leaves the file before it whole."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from geoloco.config import load_config
from geoloco.protos import geoloco_pb2 as pb
from geoloco.worker import local_state
from geoloco.worker.loop import Training

CPU = torch.device("cpu")
TASK = {"task.seq_len": 16, "task.batch_size": 4, "task.val_windows": 64, "task.corpus_bytes": 200_000}


def _training() -> Training:
    """A worker's real Training, built from the Join reply a coordinator would send."""
    cfg = load_config(overrides={"workers": 2, **TASK, "inner.steps": 2})
    reply = pb.JoinReply(worker_id=0, session="s", run_config_json=json.dumps(cfg.to_dict()))
    return Training.from_join(reply, CPU)


def _train(training: Training, round_: int) -> None:
    delta, _ = training.trainer.train_partition([p.detach().clone() for p in training.trainer.params], 0, round_)
    training.deltas.keep(0, delta)


def _moments(training: Training) -> list[torch.Tensor]:
    state = training.trainer.optimizer.state_dict()["state"]
    return [state[k][name].clone() for k in sorted(state) for name in ("exp_avg", "exp_avg_sq")]


def test_what_is_written_is_the_state_at_the_snapshot_not_after(tmp_path: Path) -> None:
    training = _training()
    _train(training, 0)
    at_snapshot = _moments(training)
    state = local_state.snapshot(training, 1)
    _train(training, 1)  # AdamW steps its moments in place while the snapshot waits to be written
    assert any(not torch.equal(a, b) for a, b in zip(at_snapshot, _moments(training), strict=True))
    writer = local_state.StateWriter()
    path = tmp_path / "worker-0.state.pt"
    writer.submit(path, state)
    assert writer.pending
    assert writer.outcome() > 0 and not writer.pending
    writer.close()
    restored = _training()
    assert local_state.load(path, restored) == (1, True)
    assert all(torch.equal(a, b) for a, b in zip(at_snapshot, _moments(restored), strict=True))
    assert oct(path.stat().st_mode & 0o777) == oct(local_state.PRIVATE_MODE)


def test_a_failed_write_says_so_at_its_outcome_and_keeps_the_file_before_it(tmp_path: Path) -> None:
    training = _training()
    path = tmp_path / "worker-0.state.pt"
    local_state.save(path, training, 0)
    before = path.read_bytes()
    writer = local_state.StateWriter()
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the state's folder should be")
    writer.submit(blocked / "worker-0.state.pt", local_state.snapshot(training, 1))
    with pytest.raises(RuntimeError, match="outcome was not taken"):
        writer.submit(path, local_state.snapshot(training, 1))
    with pytest.raises(OSError):
        writer.outcome()
    assert writer.outcome() is None  # taken once
    assert path.read_bytes() == before and not list(tmp_path.glob(".*"))
    writer.close()


def test_close_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    """What a stopping worker relies on: its last state is whole on disk once close returns."""
    training = _training()
    state = local_state.snapshot(training, 3)
    release = threading.Event()
    writer = local_state.StateWriter()
    writer._pool.submit(release.wait)  # the writer's thread is busy until released
    path = tmp_path / "worker-0.state.pt"
    writer.submit(path, state)
    assert writer.busy and not path.exists()
    closing = threading.Thread(target=writer.close)
    closing.start()
    release.set()
    closing.join(timeout=60)
    assert not closing.is_alive()
    assert local_state.load(path, _training())[0] == 3
