"""The run directory's rule (geoloco.run_dir), as `local` and `coordinator` apply it: a
previous run is refused without --resume or --overwrite, --overwrite removes only what the
command writes, an empty or blank --run-dir is a config error (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from geoloco.cli import main
from geoloco.config import ConfigError
from geoloco.run_dir import claim_run_dir, previous_run


def previous(run_dir: Path) -> Path:
    (run_dir / "checkpoints" / "round_00000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"round": 0}\n')
    (run_dir / "notes.txt").write_text("the operator's own file\n")
    return run_dir


def test_a_fresh_or_empty_folder_is_claimed_and_created(tmp_path: Path) -> None:
    assert claim_run_dir(tmp_path / "new" / "run", False, False).is_dir()
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert previous_run(tmp_path / "empty") == []
    claim_run_dir(tmp_path / "empty", False, False)


def test_a_previous_run_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    run_dir = previous(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"previous run \(metrics.jsonl, checkpoints\).*--resume.*--overwrite"):
        claim_run_dir(run_dir, False, False)
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "checkpoints" / "round_00000001").is_dir()


def test_resume_keeps_and_overwrite_removes_only_the_runs_files(tmp_path: Path) -> None:
    run_dir = previous(tmp_path / "run")
    claim_run_dir(run_dir, True, False)
    assert previous_run(run_dir) == ["metrics.jsonl", "checkpoints"]
    claim_run_dir(run_dir, False, True)
    assert previous_run(run_dir) == []
    assert (run_dir / "notes.txt").exists()
    with pytest.raises(ConfigError, match="exclude each other"):
        claim_run_dir(run_dir, True, True)


def test_a_file_is_no_run_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        claim_run_dir(tmp_path / "file", False, False)


@pytest.mark.parametrize("command", ["local", "coordinator"])
@pytest.mark.parametrize("run_dir", ["", "   "])
def test_an_empty_run_dir_is_a_config_error(command: str, run_dir: str, capsys: pytest.CaptureFixture) -> None:
    assert main([command, "--run-dir", run_dir]) == 2
    assert "config error: run_dir" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["local", "coordinator"])
def test_both_commands_refuse_a_previous_run_before_starting(command: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    run_dir = previous(tmp_path / "run")
    assert main([command, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "holds a previous run" in err and "--resume" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl", "notes.txt"]
