"""The round log's frames written as they arrive (``roundlog.FrameSpool``): each accepted
frame becomes ``round_N.<sha256>.frame`` before any close; the close's record names the
frames by hash and reads back bit for bit; a frame the spool never took (an aggregate made
at the close, one handed over while the log was paused) is written by the close itself; a
frame no record names goes with its round's prune; a missing or altered frame file makes
its round unreadable (redone), not the log's end silently; a round log written before
frames had files of their own still replays."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from pathlib import Path

import pytest

from geoloco.coordinator import roundlog
from geoloco.protos import geoloco_pb2 as pb
from geoloco.run_dir import ROUNDLOG_DIR


def frame_bytes(sender: int, round_: int, size: int = 5000) -> bytes:
    return bytes((sender * 31 + round_ * 7 + i) % 251 for i in range(size))


def entry(round_: int, parts: list[bytes], sources: tuple = ()) -> roundlog.LoggedRound:
    header = pb.RoundHeader(round=round_, aggregation="mean_kept", alpha=1.0,
                            frames=[pb.FrameInfo(sender=i, weight=1.0, nbytes=len(p)) for i, p in enumerate(parts)])
    settlements = {0: pb.Settlement(kind=pb.Settlement.CREDIT, sender=0)}
    return roundlog.LoggedRound(header, tuple(parts), settlements, {"round": round_}, sources, "")


def frame_file(run_dir: Path, round_: int, data: bytes) -> Path:
    return run_dir / ROUNDLOG_DIR / f"round_{round_:08d}.{hashlib.sha256(data).hexdigest()}.frame"


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def spool(tmp_path: Path):
    spool = roundlog.FrameSpool(tmp_path)
    yield spool
    spool.close()


def test_frames_are_durable_on_arrival_and_the_record_names_them(tmp_path: Path, spool) -> None:
    frames = [frame_bytes(w, 3) for w in range(4)]
    for data in frames:
        spool.put(3, data)
    # written with no close at all: the writer thread takes them as they come
    wait_for(lambda: all(frame_file(tmp_path, 3, d).exists() for d in frames), "the frames on disk")
    chosen = [frames[2], frames[0]]
    roundlog.append(tmp_path, entry(3, chosen), spool)
    record = json.loads((tmp_path / ROUNDLOG_DIR / "round_00000003.json").read_text())
    assert record["frames_sha256"] == [hashlib.sha256(d).hexdigest() for d in chosen]
    assert not (tmp_path / ROUNDLOG_DIR / "round_00000003.frames").exists()
    [back] = roundlog.read(tmp_path, 3)
    assert back.parts == tuple(chosen) and back.settlements[0].kind == pb.Settlement.CREDIT


def test_frames_the_spool_never_took_are_written_by_the_close(tmp_path: Path, spool) -> None:
    worker = frame_bytes(1, 0)
    spool.put(0, worker)
    aggregate = frame_bytes(9, 0)  # made at the close: never put
    spool.paused = True
    paused = frame_bytes(2, 0)
    spool.put(0, paused)  # dropped while the log is off
    spool.paused = False
    roundlog.append(tmp_path, entry(0, [aggregate], ((1, 1.0, worker), (2, 1.0, paused))), spool)
    [back] = roundlog.read(tmp_path, 0)
    assert back.parts == (aggregate,)
    assert [(s, w, d) for s, w, d in back.sources] == [(1, 1.0, worker), (2, 1.0, paused)]


def test_unnamed_frames_go_with_their_round_and_later_rounds_stay(tmp_path: Path, spool) -> None:
    late, kept, next_round = frame_bytes(3, 4), frame_bytes(0, 4), frame_bytes(0, 5)
    for round_, data in ((4, late), (4, kept), (5, next_round)):
        spool.put(round_, data)
    roundlog.append(tmp_path, entry(4, [kept]), spool)
    spool.settled(4)
    roundlog.append(tmp_path, entry(5, [next_round]), spool)
    assert frame_file(tmp_path, 4, late).exists()  # accepted, never named by a decision
    roundlog.prune(tmp_path, 5)
    assert sorted(p.name for p in (tmp_path / ROUNDLOG_DIR).iterdir()) == sorted(
        ["round_00000005.json", frame_file(tmp_path, 5, next_round).name])
    assert [e.round for e in roundlog.read(tmp_path, 5)] == [5]


@pytest.mark.parametrize("damage", ["missing", "altered"])
def test_a_damaged_frame_file_makes_its_round_unreadable(tmp_path: Path, spool, damage: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    first, second = frame_bytes(0, 0), frame_bytes(0, 1)
    roundlog.append(tmp_path, entry(0, [first]), spool)
    roundlog.append(tmp_path, entry(1, [second]), spool)
    path = frame_file(tmp_path, 1, second)
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(second[:-1] + bytes([second[-1] ^ 1]))
    with caplog.at_level(logging.WARNING, logger="geoloco.coordinator.roundlog"):
        assert [e.round for e in roundlog.read(tmp_path, 0)] == [0]  # round 1 is redone
    assert "round log entry of round 1 is unreadable" in caplog.text


def test_a_failed_frame_write_fails_the_close_with_its_os_error(tmp_path: Path) -> None:
    (tmp_path / ROUNDLOG_DIR).write_text("a file where the folder should be")
    spool = roundlog.FrameSpool(tmp_path)
    try:
        data = frame_bytes(0, 0)
        spool.put(0, data)
        with pytest.raises(OSError):
            roundlog.append(tmp_path, entry(0, [data]), spool)
    finally:
        spool.close()


def test_a_round_log_written_with_joined_frames_still_replays(tmp_path: Path) -> None:
    parts = [frame_bytes(0, 2), frame_bytes(1, 2)]
    source = frame_bytes(5, 2)
    old = entry(2, parts)
    folder = tmp_path / ROUNDLOG_DIR
    folder.mkdir()
    (folder / "round_00000002.frames").write_bytes(b"".join([*parts, source]))
    record = {"round": 2, "header": base64.b64encode(old.header.SerializeToString()).decode(),
              "frames_sha256": [hashlib.sha256(p).hexdigest() for p in parts],
              "settlements": {}, "metrics": {"round": 2},
              "sources": [{"sender": 5, "weight": 0.5, "nbytes": len(source),
                           "sha256": hashlib.sha256(source).hexdigest()}], "source_mode": "mean_kept"}
    (folder / "round_00000002.json").write_text(json.dumps(record))
    [back] = roundlog.read(tmp_path, 2)
    assert back.parts == tuple(parts) and back.sources == ((5, 0.5, source),)
