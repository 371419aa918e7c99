"""Shared fixtures of the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_processes import Processes


@pytest.fixture
def processes(tmp_path: Path):
    """The test's real processes (logs in tmp_path/test-logs), killed at its end."""
    procs = Processes(tmp_path / "test-logs")
    try:
        yield procs
    finally:
        procs.cleanup()
