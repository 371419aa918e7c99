"""The run directory's rule (geoloco.run_dir), as `local`, `coordinator` and the Python API
apply it: a run is recognised only by GeoLoCo's marker; a marked run is refused without
resume or overwrite, and overwrite removes only what GeoLoCo wrote; a folder with look-alike
files that GeoLoCo did not write is refused whatever the flags, and nothing in it goes;
resume where there is no run is refused, resume-or-start starts; the default run dir is a
new folder per run behind the runs/latest link; an empty or blank --run-dir is exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import geoloco
from geoloco.cli import main
from geoloco.run_dir import (
    LOCAL_WRITES,
    MARKER_FILE,
    RunDirError,
    claim_run_dir,
    is_run,
    plan_run_dir,
    read_marker,
)

TOKEN = "run-dir-test"


def claim(run_dir: str | Path, **flags: bool) -> Path:
    return claim_run_dir(plan_run_dir(run_dir, **flags), LOCAL_WRITES)


def users_folder(path: Path) -> Path:
    """A folder of the user's own files whose names GeoLoCo also uses."""
    (path / "logs").mkdir(parents=True)
    (path / "certs").mkdir()
    (path / "config.json").write_text('{"app": "mine"}\n')
    (path / "logs" / "app.log").write_text("my app's log\n")
    (path / "certs" / "my-server.key").write_text("my key\n")
    return path


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def geoloco_run(path: Path) -> Path:
    """A run dir GeoLoCo claimed and wrote to, plus the user's files put in it since."""
    claim(path)
    (path / "checkpoints" / "round_00000001").mkdir(parents=True)
    (path / "checkpoints" / "round_00000001" / "state.pt").write_bytes(b"x")
    (path / "metrics.jsonl").write_text('{"round": 0}\n')
    (path / "config.json").write_text("{}\n")
    for name in ("logs", "certs", "workers"):
        (path / name).mkdir()
    (path / "logs" / "coordinator.log").write_text("coordinator\n")
    (path / "logs" / "worker-0.log").write_text("worker\n")
    (path / "certs" / "ca.pem").write_text("ca\n")
    (path / "certs" / "worker-1.key").write_text("key\n")
    (path / "workers" / "gate-0").touch()
    (path / "notes.txt").write_text("the operator's own file\n")
    (path / "logs" / "app.log").write_text("the operator's own log\n")
    return path


def test_a_new_or_empty_folder_is_claimed_and_marked(tmp_path: Path) -> None:
    run_dir = claim(tmp_path / "new" / "run")
    assert is_run(run_dir)
    marker = read_marker(run_dir)
    assert marker["kind"] == "geoloco run directory" and set(marker["writes"]) == set(LOCAL_WRITES)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)  # an empty folder is no sign
    assert is_run(claim(tmp_path / "empty"))


def test_a_folder_with_only_other_files_is_claimed_and_they_stay(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine\n")
    claim(tmp_path / "run")
    claim(tmp_path / "run", overwrite=True)
    assert files(tmp_path / "run") == [MARKER_FILE, "notes.txt"]


@pytest.mark.parametrize("flags", [{}, {"overwrite": True}, {"resume": True}, {"resume_or_start": True}])
def test_a_users_folder_of_look_alike_files_is_never_a_run_and_nothing_goes(tmp_path: Path, flags) -> None:
    folder = users_folder(tmp_path / "mine")
    before = files(folder)
    with pytest.raises(RunDirError, match=r"holds config.json, logs, certs but no geoloco-run.json.*not a "
                       r"GeoLoCo run's.*another run_dir"):
        claim(folder, **flags)
    assert files(folder) == before and (folder / "certs" / "my-server.key").read_text() == "my key\n"


def test_both_commands_refuse_a_users_folder_even_with_overwrite(tmp_path: Path, capsys) -> None:
    folder = users_folder(tmp_path / "mine")
    before = files(folder)
    for command in ("local", "coordinator"):
        assert main([command, "--run-dir", str(folder), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "not a GeoLoCo run's" in err and "another --run-dir" in err, err
        assert files(folder) == before


def test_a_marked_run_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    run_dir = geoloco_run(tmp_path / "run")
    before = files(run_dir)
    with pytest.raises(RunDirError, match=r"holds a GeoLoCo run.*resume=True.*overwrite=True"):
        claim(run_dir)
    assert files(run_dir) == before


def test_overwrite_removes_only_the_files_geoloco_wrote(tmp_path: Path) -> None:
    run_dir = geoloco_run(tmp_path / "run")
    created = read_marker(run_dir)["created"]
    claim(run_dir, overwrite=True)
    assert files(run_dir) == [MARKER_FILE, "logs", "logs/app.log", "notes.txt"]
    assert is_run(run_dir) and read_marker(run_dir)["created"] >= created


def test_resume_keeps_every_file_and_resume_with_overwrite_is_refused(tmp_path: Path) -> None:
    run_dir = geoloco_run(tmp_path / "run")
    before = files(run_dir)
    assert plan_run_dir(run_dir, resume=True).resume
    assert plan_run_dir(run_dir, resume_or_start=True).resume
    claim(run_dir, resume=True)
    assert files(run_dir) == before
    with pytest.raises(RunDirError, match="exclude each other"):
        plan_run_dir(run_dir, resume=True, overwrite=True)


def test_resume_where_there_is_no_run_is_refused_and_resume_or_start_starts(tmp_path: Path) -> None:
    typo = tmp_path / "rnu"
    with pytest.raises(RunDirError, match=r"nothing to resume in .*rnu.*does not exist.*resume_or_start=True"):
        plan_run_dir(typo, resume=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="nothing to resume.*holds no geoloco-run.json"):
        plan_run_dir(tmp_path / "empty", resume=True)
    assert not typo.exists()
    plan = plan_run_dir(typo, resume_or_start=True)
    assert not plan.resume and is_run(claim_run_dir(plan))


@pytest.mark.parametrize("command", ["local", "coordinator"])
def test_both_commands_refuse_resume_of_a_mistyped_folder(command: str, tmp_path: Path, capsys) -> None:
    assert main([command, "--run-dir", str(tmp_path / "rnu"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "--resume-or-start" in err and "resume=True" not in err, err
    assert not (tmp_path / "rnu").exists()


def test_the_default_run_dir_is_a_new_folder_each_run_behind_the_latest_link(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunDirError, match="nothing to resume: runs/latest does not exist"):
        plan_run_dir("runs/latest", resume=True)
    first, second = claim("runs/latest"), claim("runs/latest")  # within one second, too
    assert first != second and first.parent == second.parent == Path("runs")
    assert is_run(first) and is_run(second)
    latest = Path("runs/latest")
    assert latest.is_symlink() and os.readlink(latest) == second.name
    assert plan_run_dir("runs/latest", resume=True).path == second.resolve()
    assert plan_run_dir("runs/latest", resume_or_start=True).path == second.resolve()
    assert sorted(p.name for p in Path("runs").iterdir()) == sorted([first.name, second.name, "latest"])


def test_a_real_folder_at_runs_latest_is_left_and_a_new_run_goes_beside_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    users_folder(Path("runs/latest"))  # e.g. an older version's run
    run_dir = claim("runs/latest")
    assert run_dir.parent == Path("runs") and run_dir.name != "latest"
    assert not Path("runs/latest").is_symlink() and (Path("runs/latest") / "config.json").exists()


def test_a_file_is_no_run_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        claim(tmp_path / "file")


@pytest.mark.parametrize("command", ["local", "coordinator"])
@pytest.mark.parametrize("run_dir", ["", "   "])
def test_an_empty_run_dir_is_a_config_error(command: str, run_dir: str, capsys: pytest.CaptureFixture) -> None:
    assert main([command, "--run-dir", run_dir]) == 2
    assert "config error: run_dir" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["local", "coordinator"])
def test_both_commands_refuse_a_previous_run_before_starting(command: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    run_dir = geoloco_run(tmp_path / "run")
    before = files(run_dir)
    assert main([command, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "holds a GeoLoCo run" in err and "--resume" in err and "--overwrite" in err, err
    assert files(run_dir) == before


# ---------------------------------------------------------------- the Python API

def api_config(run_dir: Path, **overrides: object) -> geoloco.RunConfig:
    return geoloco.load_config(overrides={
        "workers": 1, "rounds": 1, "run_dir": str(run_dir), "coordinator.listen": "127.0.0.1:0",
        "coordinator.token": TOKEN, "task.seq_len": 16, "task.batch_size": 4,
        "task.val_windows": 4, "task.corpus_bytes": 20_000, **overrides})


def test_the_api_coordinator_refuses_a_run_naming_its_arguments_and_overwrite_replaces_it(
        tmp_path: Path) -> None:
    run_dir = geoloco_run(tmp_path / "run")
    before = files(run_dir)
    with pytest.raises(RunDirError, match=r"resume=True.*overwrite=True") as refused:
        geoloco.Coordinator(api_config(run_dir))
    assert "--" not in str(refused.value) and files(run_dir) == before
    coordinator = geoloco.Coordinator(api_config(run_dir), overwrite=True)
    assert coordinator.run_dir == run_dir and not (run_dir / "metrics.jsonl").exists()
    assert (run_dir / "notes.txt").exists() and (run_dir / "logs" / "app.log").exists()
    assert is_run(run_dir)
    with pytest.raises(RunDirError, match="not a GeoLoCo run's"):
        geoloco.Coordinator(api_config(users_folder(tmp_path / "mine")), overwrite=True)


def test_the_api_coordinator_refuses_resume_of_a_folder_without_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=r"nothing to resume.*resume_or_start=True"):
        geoloco.Coordinator(api_config(tmp_path / "rnu"), resume=True)
    assert not (tmp_path / "rnu").exists()


# ---------------------------------------------------------------- a task that does not build

@pytest.mark.parametrize("problem", ["missing model file", "empty data", "tiny data", "vocabulary"])
@pytest.mark.parametrize("command", ["local", "coordinator"])
def test_a_task_that_does_not_build_is_exit_2_one_line_and_writes_nothing(
        command: str, problem: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("GEOLOCO_TOKEN", TOKEN)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("tiny")
    (tmp_path / "small_vocab.py").write_text(
        "from torch import nn\n\ndef make(spec):\n    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))\n")
    flags = {"missing model file": ["--set", f"task.model={tmp_path / 'missing.py'}:make"],
             "empty data": ["--set", f"task.data={tmp_path / 'empty.txt'}"],
             "tiny data": ["--set", f"task.data={tmp_path / 'tiny.txt'}"],
             "vocabulary": ["--set", f"task.model={tmp_path / 'small_vocab.py'}:make"]}[problem]
    run_dir = tmp_path / "run"
    listen = ["--listen", "127.0.0.1:0"] if command == "coordinator" else []
    assert main([command, "--run-dir", str(run_dir), "--workers", "1", *listen, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("geoloco: config error: "), err
    assert any(word in err[0] for word in ("task.", "corpus", "tokenizer")), err
    assert not run_dir.exists()  # so the corrected command is not refused
