"""A benchmark's JSON line names the code that ran: the checkout when its process started
(benchmarks/provenance.py), and where the checkout moved to while it ran, if it did."""

from __future__ import annotations

from benchmarks import provenance


def test_the_commit_is_the_one_at_the_start_and_a_move_is_named(monkeypatch) -> None:
    now = provenance.git_commit()
    found = provenance.provenance()["versions"]
    assert found["commit"] == provenance.COMMIT_AT_START
    assert ("commit_at_end" in found) == (now != provenance.COMMIT_AT_START)
    monkeypatch.setattr(provenance, "COMMIT_AT_START", "0" * 40)  # a run started on another commit
    moved = provenance.provenance()["versions"]
    assert moved["commit"] == "0" * 40 and moved["commit_at_end"] == now
