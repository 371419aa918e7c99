"""`geoloco worker --nproc-per-node N`'s launcher (geoloco.worker.island.launch) with real
processes: it returns rank 0's exit code, and when another rank dies first it stops the
island and returns that rank's code, naming the rank in its log."""

from __future__ import annotations

import logging
import time

import pytest

from geoloco.worker.island import launch

# each rank is `python -c PROGRAM`; RANK says which one it is
SLEEP_UNLESS = "import os, signal, sys, time\nrank = int(os.environ['RANK'])\n{body}\ntime.sleep(120)\n"


def run(body: str, ranks: int = 2) -> int:
    return launch([], ranks, grace_s=20, program=("-c", SLEEP_UNLESS.format(body=body)))


def test_every_rank_done_is_exit_0() -> None:
    assert run("sys.exit(0)") == 0


def test_rank_0s_own_code_is_the_islands() -> None:
    assert run("sys.exit(130 if rank == 0 else 0)", ranks=3) == 130


def test_a_rank_that_fails_stops_the_island_and_names_itself(caplog: pytest.LogCaptureFixture) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="geoloco"):
        assert run("if rank == 1: sys.exit(3)") == 3
    assert "island rank 1 exited with code 3; stopping the island" in caplog.text
    assert time.monotonic() - start < 60  # rank 0 did not sleep its 120 s: it was stopped


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="geoloco"):
        assert run("if rank == 2: os.kill(os.getpid(), signal.SIGKILL)", ranks=3) == 128 + 9
    assert "island rank 2 was killed by SIGKILL; stopping the island" in caplog.text
