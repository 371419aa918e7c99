"""One way to write a file (geoloco.run_dir.write_atomic): a reader sees the old file or
the whole new one, a secret is 0600 from its first byte, a failed write leaves nothing; and
no module of the project writes, renames or fsyncs a file any other way."""

from __future__ import annotations

import ast
import errno
import os
import stat
from pathlib import Path

import pytest

from geoloco import run_dir
from geoloco.run_dir import STALE_TEMP, remove_stale_temps, temp_path, write_atomic

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("geoloco", "compression", "coordinator", "worker")
# calls that write, move or sync a file: only write_atomic (and a checkpoint folder's own
# rename, a folder being no file) may make them
WRITES = {"replace", "rename", "fsync", "write_text", "write_bytes"}
ALLOWED = {("geoloco/run_dir.py", name) for name in WRITES} | {
    ("coordinator/checkpoint.py", "replace"), ("coordinator/checkpoint.py", "rename"),
    # the container's root step writes inside a folder opened once (dir_fd) and fchowns the
    # open file: write_private_file, its own stricter path
    ("worker/container.py", "replace"), ("worker/container.py", "fsync")}


def test_text_and_bytes_land_whole_with_their_mode(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    write_atomic(target, "old\n")
    write_atomic(target, b"new bytes", mode=0o600)
    assert target.read_bytes() == b"new bytes"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    write_atomic(target, memoryview(b"view"), durable=False)
    assert target.read_bytes() == b"view" and not list(tmp_path.glob(".*"))


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "registry.json"
    write_atomic(target, "kept")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_dir.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "lost")
    assert target.read_text() == "kept" and not list(tmp_path.glob(".*"))


def test_what_a_killed_write_leaves_is_recognised_and_removed(tmp_path: Path) -> None:
    left = temp_path(tmp_path / "metrics.jsonl")
    left.write_bytes(b"half")
    (tmp_path / ".old.tmp12").write_bytes(b"")  # the earlier scheme, .NAME.tmpPID
    (tmp_path / ".hidden").write_bytes(b"")
    assert STALE_TEMP.match(left.name)
    assert sorted(p.name for p in remove_stale_temps(tmp_path)) == sorted([left.name, ".old.tmp12"])
    assert [p.name for p in tmp_path.iterdir()] == [".hidden"]


def writes_outside_write_atomic() -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    name = node.func.attr
                    if name in WRITES and (rel, name) not in ALLOWED and _is_file_call(node):
                        found.append(f"{rel}:{node.lineno} .{name}()")
    return found


def _is_file_call(node: ast.Call) -> bool:
    """``str.replace(a, b)`` has two arguments and a string or text receiver; os.replace
    and Path.replace are the file ones (``x.replace(path)``, ``os.replace(a, b)``)."""
    if node.func.attr != "replace":
        return True
    owner = node.func.value
    if isinstance(owner, ast.Name) and owner.id == "dataclasses":  # dataclasses.replace(record)
        return False
    return (isinstance(owner, ast.Name) and owner.id == "os") or len(node.args) == 1


def test_every_writer_goes_through_write_atomic() -> None:
    assert writes_outside_write_atomic() == []


def test_a_streamed_write_lands_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "worker-0.state.pt"
    with run_dir.open_atomic(target, mode=0o600) as f:
        f.write(b"first ")
        f.write(b"state")
    assert target.read_bytes() == b"first state"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with pytest.raises(RuntimeError, match="serializer failed"), run_dir.open_atomic(target) as f:
        f.write(b"half of the next")
        raise RuntimeError("serializer failed")
    assert target.read_bytes() == b"first state" and not list(tmp_path.glob(".*"))
