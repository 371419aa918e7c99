"""What geoloco local's terminal shows is one story (issue 27, item 9): the bar's elapsed
time and ETA are the round line's, the relays say nothing at INFO between the phase lines,
and a Ctrl-C ends with the command that goes on."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

from geoloco.cli import resume_hint
from geoloco.links.emulator import RelayThread
from geoloco.progress import BarProgress


def test_the_bar_shows_the_round_lines_elapsed_time_and_eta() -> None:
    out = io.StringIO()
    progress = BarProgress(10, out)
    progress.started -= 90  # the run began 1:30 ago (start-up included)
    for r in range(3):
        progress.round({"round": r, "val_loss": 5.0 - r, "train_loss": 5.0, "round_seconds": 10.0})
    progress.close()
    text = out.getvalue()
    line = [x for x in text.replace("\r", "\n").splitlines() if x.startswith("round 2/9")][-1]
    elapsed, eta = re.search(r"(\d+:\d\d) eta (\d+:\d\d)$", line).groups()
    assert eta == "1:10"  # 7 rounds left x 10 s, the mean round
    bar = [x for x in text.replace("\r", "\n").splitlines() if x.startswith("3/10 rounds")][-1]
    assert f"{elapsed} eta {eta}" in bar, (line, bar)
    assert "<" not in bar  # not tqdm's own elapsed<remaining


def test_a_relay_says_nothing_at_info_when_it_starts(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="geoloco.links"), \
            RelayThread(target=("127.0.0.1", 9), profile=None) as relay:
        assert relay.port > 0
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text


def test_the_resume_hint_repeats_the_command_on_the_same_run_dir() -> None:
    hint = resume_hint(["local", "--workers", "3", "--overwrite"], Path("runs/20261202-101500"))
    assert hint.endswith("geoloco local --workers 3 --run-dir runs/20261202-101500 --resume")
    given = resume_hint(["local", "--run-dir", "my run", "--resume"], Path("my run"))
    assert given.endswith("geoloco local --run-dir 'my run' --resume")
