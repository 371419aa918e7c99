"""``geoloco export`` of a model of one's own with a tied head (the GRU of
examples/custom_model): a strict ``load_state_dict`` takes the export; the weights, of the
export and of the checkpoints, are readable like the run's other files (only secrets are
0600); an OUT that already holds something is refused in one line, exit 2, unless
``--overwrite``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import geoloco
from geoloco.cli import main
from geoloco.coordinator import checkpoint
from geoloco.tasks import ModelSpec
from geoloco.tasks.models import model_source

ROOT = Path(__file__).resolve().parents[2]
GRU = f"{ROOT / 'examples' / 'custom_model' / 'model.py'}:make_model"
UMASK = 0o022  # the common one: new files 0644


@pytest.fixture(scope="module")
def gru_run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread) -> Path:
    """A run directory of the GRU example with its first checkpoint, written by a real
    coordinator (which saves round 0 when it starts) under a 022 umask."""
    run_dir = tmp_path_factory.mktemp("gru") / "run"
    cfg = geoloco.load_config(overrides={
        "workers": 1, "rounds": 1, "run_dir": str(run_dir), "coordinator.listen": "127.0.0.1:0",
        "coordinator.token": "export-test", "task.model": GRU, "task.tokenizer": "bytes",
        "task.seq_len": 16, "task.batch_size": 4, "task.val_windows": 4, "task.corpus_bytes": 60_000})
    old = os.umask(UMASK)
    try:
        coordinator = geoloco.Coordinator(cfg)
        coordinator.start()
        coordinator.stop(grace=0.5)
    finally:
        os.umask(old)
    assert checkpoint.latest_path(run_dir) is not None
    return run_dir


def export(run_dir: Path, out: Path, *flags: str) -> int:
    old = os.umask(UMASK)
    try:
        return main(["export", str(run_dir), str(out), *flags])
    finally:
        os.umask(old)


def test_a_strict_load_state_dict_takes_the_export_of_a_tied_model(gru_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert export(gru_run, out) == 0
    described = json.loads((out / "config.json").read_text())
    model, _ = model_source(GRU).build(ModelSpec(described["vocab_size"], described["seq_len"], seed=1))
    model.load_state_dict(load_file(str(out / "model.safetensors")))  # strict
    assert described["tied_weights"] == {"head.weight": "embed.weight"}
    assert model.head.weight is model.embed.weight  # still tied after loading
    saved = checkpoint.load(checkpoint.latest_path(gru_run))
    for name, tensor in saved.params.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_exported_and_checkpointed_weights_are_readable_like_the_other_files(gru_run: Path,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert export(gru_run, out) == 0
    ckpt = checkpoint.latest_path(gru_run)
    modes = {str(p): p.stat().st_mode & 0o777 for p in (out / "model.safetensors", out / "config.json",
                                                        ckpt / "model.safetensors", ckpt / "config.json")}
    assert set(modes.values()) == {0o666 & ~UMASK}, modes


def test_an_out_that_is_a_file_is_refused_in_one_line_unless_overwrite(gru_run: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "model.safetensors"
    out.write_text("mine")
    assert export(gru_run, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("geoloco: export: ")
    assert "is a file" in err and "--overwrite" in err and "Traceback" not in err
    assert out.read_text() == "mine"
    assert export(gru_run, out, "--overwrite") == 0
    assert (out / "model.safetensors").is_file()


def test_an_out_folder_with_files_is_refused_unless_overwrite_which_keeps_the_others(
        gru_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "export"
    out.mkdir()
    assert export(gru_run, out) == 0  # an empty folder is a new one
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert export(gru_run, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds files" in err and "--overwrite" in err
    assert export(gru_run, out, "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
