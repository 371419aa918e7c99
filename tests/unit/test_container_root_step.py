"""The worker container's root step writes no path the unprivileged user controls (issue
24): the identity file's folder must be root's and writable by root alone, and a link
planted where the temp file goes is never followed (geoloco.worker.container)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from geoloco.worker import container

IDENTITY = container.Identity(worker_id=1, session="s1", wan_profile="", straggler_profile="")


def plant(folder: Path) -> Path:
    """What a hostile worker user does: a link where the root step's temp file goes, to a
    file it must not reach (here a scratch file standing for /etc/shadow)."""
    victim = folder.parent / "victim"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    for name in (".identity.json.tmp", "identity.json.tmp"):
        (folder / name).symlink_to(victim)
    return victim


def test_the_symlink_trick_fails_in_a_folder_others_may_write(tmp_path: Path) -> None:
    folder = tmp_path / "run-geoloco"
    folder.mkdir()
    folder.chmod(0o777)  # as /run/geoloco was: the worker's user could change it
    victim = plant(folder)
    with pytest.raises(container.UnsafeFolder, match="writable"):
        IDENTITY.write(folder / "identity.json")
    assert victim.read_text() == "root's secret\n" and victim.stat().st_uid == os.geteuid()
    assert not (folder / "identity.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the folder to another user")
def test_the_symlink_trick_fails_in_a_folder_of_the_worker_user(tmp_path: Path) -> None:
    folder = tmp_path / "run-geoloco"
    folder.mkdir(mode=0o755)
    victim = plant(folder)
    os.chown(folder, 10001, 10001)  # the Dockerfile used to chown /run/geoloco to geoloco
    with pytest.raises(container.UnsafeFolder, match="belongs to uid 10001"):
        IDENTITY.write(folder / "identity.json")
    assert victim.read_text() == "root's secret\n" and victim.stat().st_uid == 0


def test_a_stale_link_in_roots_own_folder_is_replaced_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "run-geoloco"
    folder.mkdir(mode=0o755)
    victim = plant(folder)
    owner = os.geteuid() if os.geteuid() != 0 else 10001
    container.write_private_file(folder / "identity.json", json.dumps(IDENTITY.__dict__).encode(),
                                 uid=owner, gid=owner)
    written = folder / "identity.json"
    assert not written.is_symlink() and json.loads(written.read_text())["session"] == "s1"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and written.stat().st_uid == owner
    assert victim.read_text() == "root's secret\n" and victim.stat().st_uid == os.geteuid()
    assert folder.stat().st_uid == os.geteuid()  # the folder is not handed over


def test_the_root_step_reads_no_identity_through_a_link(tmp_path: Path) -> None:
    folder = tmp_path / "run-geoloco"
    folder.mkdir(mode=0o755)
    victim = plant(folder)
    (folder / "identity.json").symlink_to(victim)
    with pytest.raises(OSError):
        container._read_own(folder / "identity.json")
