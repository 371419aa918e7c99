"""What ``geoloco local`` shows while a run goes: each start-up phase as it happens, one line
per closed round (round, losses, bytes, round time, elapsed, ETA; 80 columns) and, on a
terminal, a tqdm bar below them; plain lines alone where output is not a terminal."""

from __future__ import annotations

import shutil
import sys
import time
from typing import IO, Any, Protocol

from tqdm import tqdm

COLUMNS = 80
# tqdm's own elapsed time and rate would tell another story than the round lines (its clock
# starts at the first round, its rate counts the start-up): the bar shows the lines' clock
BAR_FORMAT = "{n_fmt}/{total_fmt} rounds |{bar}| {postfix}"


class RunProgress(Protocol):
    """Told of phases and rounds by the launcher, in order."""

    def phase(self, text: str) -> None:
        """A start-up step (or any event worth a line), as it happens."""

    def round(self, m: dict[str, Any]) -> None:
        """A closed round's metrics.jsonl line."""

    def close(self) -> None:
        """The run is over (the summary follows)."""


def make_progress(style: str, rounds: int, stream: IO[str] | None = None) -> RunProgress:
    """``bar``, ``lines``, or ``auto``: the bar when ``stream`` (stdout) is a terminal."""
    stream = stream or sys.stdout
    if style == "auto":
        style = "bar" if stream.isatty() else "lines"
    return BarProgress(rounds, stream) if style == "bar" else LineProgress(rounds, stream)


class LineProgress:
    """One plain line per phase and per round: for logs, CI and pipes."""

    def __init__(self, rounds: int, stream: IO[str]) -> None:
        self.rounds = rounds
        self.stream = stream
        self.started = time.monotonic()
        self.eta = RoundClock(rounds)

    def phase(self, text: str) -> None:
        self._write(f"{clock(time.monotonic() - self.started):>7}  {text}")

    def round(self, m: dict[str, Any]) -> None:
        self.eta.add(m)
        self._write(round_line(m, self.rounds, self.elapsed(), self.eta.left()))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def close(self) -> None:
        self.stream.flush()

    def _write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


class BarProgress(LineProgress):
    """The lines above a bar that tracks rounds with tqdm's elapsed time and ETA."""

    def __init__(self, rounds: int, stream: IO[str]) -> None:
        super().__init__(rounds, stream)
        self.bar: tqdm | None = None

    def round(self, m: dict[str, Any]) -> None:
        if self.bar is None:  # resumed runs start the bar at the first round they see
            width = min(COLUMNS, shutil.get_terminal_size((COLUMNS, 24)).columns)
            self.bar = tqdm(total=self.rounds, initial=m["round"], file=self.stream, ncols=width,
                            bar_format=BAR_FORMAT, dynamic_ncols=False, leave=True)
        super().round(m)
        # the same val, elapsed and ETA as the round line just above it
        self.bar.set_postfix_str(f"val {number(m.get('val_loss'), '.4f')}  {clock(self.elapsed())} "
                                 f"eta {clock(self.eta.left())}", refresh=False)
        self.bar.update(m["round"] + 1 - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        super().close()

    def _write(self, line: str) -> None:
        if self.bar is None:
            super()._write(line)
        else:
            self.bar.write(line, file=self.stream)


class RoundClock:
    """The ETA: rounds left times the mean round time seen so far."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.seconds: list[float] = []
        self.done = 0

    def add(self, m: dict[str, Any]) -> None:
        self.done = m["round"] + 1
        if m.get("round_seconds") is not None:
            self.seconds.append(m["round_seconds"])

    def left(self) -> float | None:
        if not self.seconds:
            return None
        return (self.rounds - self.done) * sum(self.seconds) / len(self.seconds)


def round_line(m: dict[str, Any], rounds: int, elapsed: float, eta: float | None) -> str:
    """``round 12/19  val 5.4321  train 5.4444  up 12.3 kB  3.2 s  1:23 eta 0:45``: round 12
    of rounds 0-19 (rounds are numbered from 0 everywhere, as in the logs, metrics.jsonl and
    the report; docs/protocol.md); at most 80 columns for runs up to 10^6 rounds and 99 hours."""
    last = rounds - 1
    width = len(str(last))
    return (f"round {m['round']:>{width}}/{last}  val {number(m.get('val_loss'), '.4f')}  "
            f"train {number(m.get('train_loss'), '.4f')}  up {size(m.get('upload_bytes_per_worker'))}  "
            f"{number(m.get('round_seconds'), '.1f')} s  {clock(elapsed)} eta {clock(eta)}")


def clock(seconds: float | None) -> str:
    """``1:23``, ``1:02:03``; ``-`` for unknown."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def size(value: float | None) -> str:
    """Bytes as ``812 B``, ``12.3 kB``, ``4.5 MB``, ``1.2 GB``."""
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def number(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``; ``-`` for None."""
    return "-" if value is None else format(value, spec)
