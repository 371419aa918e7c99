"""The mutation fuzzer runs in process and reports what it promises (the codec benchmark,
a subprocess, is in tests/integration/test_benchmarks_smoke.py)."""

import json

import pytest

from benchmarks import fuzz_frames


@pytest.mark.slow
def test_mutated_frames_never_crash_the_decoder():
    r = fuzz_frames.run(count=3000, seed=1)
    assert r["crashed"] == 0
    assert r["rejected"] > r["accepted"] > 0  # both outcomes are exercised


def test_fuzz_script_exit_status_and_json(capsys):
    assert fuzz_frames.main(["--count", "200", "--seed", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert set(json.loads(last)) >= {"rejected", "accepted", "crashed"}

