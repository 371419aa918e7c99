"""What a resumed coordinator does to the run dir's files: metrics lines of the rounds it
redoes (and a line cut off by a kill) are dropped, and what killed writes left beside the
checkpoints and the run dir's files is removed, the checkpoints themselves kept."""

from __future__ import annotations

import json
from pathlib import Path

from geoloco.coordinator import checkpoint
from geoloco.coordinator.metrics import METRICS_FILE, MetricsWriter


def test_the_rounds_a_resume_redoes_and_a_partial_line_are_dropped(tmp_path: Path) -> None:
    lines = [json.dumps({"round": r, "val_loss": 1.0}) for r in range(5)]
    (tmp_path / METRICS_FILE).write_text("\n".join(lines) + '\n{"round": 5, "val_lo')
    writer = MetricsWriter(tmp_path)
    assert writer.drop_rounds_from(3) == 3
    assert (tmp_path / METRICS_FILE).read_text() == "".join(line + "\n" for line in lines[:3])
    assert writer.drop_rounds_from(3) == 0
    assert not list(tmp_path.glob(".*"))


def test_stale_temporaries_go_and_checkpoints_stay(tmp_path: Path) -> None:
    folder = tmp_path / checkpoint.CHECKPOINT_DIR
    for name in ("round_00000004", "round_00000005.tmp123", "round_00000004.old77"):
        (folder / name).mkdir(parents=True)
    (folder / "round_00000000.pt").write_bytes(b"format 1")
    for name in (".metrics.jsonl.tmp99", ".summary.json.tmp1", "config.json", ".hidden"):
        (tmp_path / name).write_text("x")
    removed = {p.name for p in checkpoint.remove_stale(tmp_path)}
    assert removed == {"round_00000005.tmp123", "round_00000004.old77", ".metrics.jsonl.tmp99",
                       ".summary.json.tmp1"}
    assert sorted(p.name for p in folder.iterdir()) == ["round_00000000.pt", "round_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "checkpoints", "config.json"]
