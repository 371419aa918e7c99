"""A new user's first commands, against real `geoloco local` processes: plain `geoloco
local` twice makes two timestamped runs behind the runs/latest link and a bare `--resume`
finds the newest; a folder of the user's own look-alike files survives `--overwrite`, a
mistyped `--resume` and a task that cannot build are exit 2 with one message and write
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_processes import ROOT, SMALL, TOKEN, set_flags

pytestmark = pytest.mark.slow
FAST = {**SMALL, "task.seq_len": "16", "task.batch_size": "4", "inner.steps": "2",
        "inner.warmup_steps": "1", "coordinator.checkpoint_every": "0"}
LOCAL = ["local", "--workers", "2", "--rounds", "1", "--wan", "unlimited", "--progress", "lines",
         *set_flags(FAST)]


def geoloco(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GEOLOCO_TOKEN=TOKEN,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "geoloco.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plain_local_twice_makes_two_runs_and_a_bare_resume_finds_the_newest(tmp_path: Path) -> None:
    first, second = geoloco(tmp_path, *LOCAL), geoloco(tmp_path, *LOCAL)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    runs = tmp_path / "runs"
    made = sorted(p.name for p in runs.iterdir() if p.name != "latest")
    assert len(made) == 2 and (runs / "latest").is_symlink()
    assert os.readlink(runs / "latest") == made[-1]
    for name in made:
        assert (runs / name / "geoloco-run.json").is_file() and (runs / name / "summary.json").is_file()
    resumed = geoloco(tmp_path, *LOCAL, "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"all 1 rounds of the run in {(runs / made[-1]).resolve()} are done" in resumed.stdout


def test_a_users_folder_a_typo_and_a_broken_task_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "logs").mkdir(parents=True)
    (mine / "certs").mkdir()
    (mine / "config.json").write_text('{"app": "mine"}\n')
    (mine / "logs" / "app.log").write_text("my log\n")
    (mine / "certs" / "my-server.key").write_text("my key\n")
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    refused = geoloco(tmp_path, *LOCAL, "--run-dir", str(mine), "--overwrite", timeout=120)
    assert refused.returncode == 2 and "no geoloco-run.json" in refused.stderr, refused.stderr
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before

    typo = geoloco(tmp_path, *LOCAL, "--run-dir", str(tmp_path / "rnu"), "--resume", timeout=120)
    assert typo.returncode == 2 and "nothing to resume" in typo.stderr, typo.stderr
    broken = geoloco(tmp_path, *LOCAL, "--model", str(tmp_path / "model.py") + ":make", timeout=120)
    assert broken.returncode == 2, broken.stdout[-2000:] + broken.stderr[-2000:]
    assert broken.stderr.strip().count("\n") == 0 and "does not exist" in broken.stderr, broken.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no rnu/, no runs/
