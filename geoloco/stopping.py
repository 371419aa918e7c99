"""How a geoloco process takes Ctrl-C and SIGTERM: the first asks it to stop cleanly (an
event its main loop polls, nothing raised inside the code that runs, so no traceback), a
second forces the stop at once (exit 130)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """While entered (on the main thread; elsewhere it does nothing): the first SIGINT or
    SIGTERM sets ``requested`` and calls ``on_stop``; a second calls ``on_force`` and ends
    the process with EXIT_INTERRUPTED. A signal the process was started with ignored stays
    ignored when ``keep_ignored`` (the children of `geoloco local` leave Ctrl-C to it)."""

    def __init__(self, on_stop: Callable[[], None] | None = None,
                 on_force: Callable[[], None] | None = None, keep_ignored: bool = True) -> None:
        self.keep_ignored = keep_ignored
        self.requested = threading.Event()
        self.name: str | None = None  # the signal that asked, e.g. "SIGINT"
        self.on_stop = on_stop
        self.on_force = on_force
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS
                              if not (self.keep_ignored and signal.getsignal(s) == signal.SIG_IGN)}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested.is_set():
            log.warning("%s again: stopping now", name)
            if self.on_force is not None:
                self.on_force()
            logging.shutdown()
            os._exit(EXIT_INTERRUPTED)
        self.name = name
        self.requested.set()
        log.warning("%s: stopping cleanly (a second Ctrl-C forces it)", name)
        if self.on_stop is not None:
            self.on_stop()
