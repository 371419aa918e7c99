"""benchmarks/parity.py's tuning goes on from its tuned file only where the file was tuned
in the same regime: the run's size, seeds, model, batch, split, overrides and token stream.
A file from before the model, batch, split and validation fields were recorded counts as
tuned at their defaults."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.parity import REGIME_DEFAULTS, earlier_losses

LOSSES = {"diloco": {"inner.lr=0.003,outer.lr=0.5": [1.77, 1.78]}, "adamw": {"inner.lr=0.006": [1.45, 1.45]}}
REGIME = {"rounds": 60, "seeds": [100, 101], "workers": 8, "inner_steps": 15, "warmup_steps": 135,
          "user_overrides": {"sparseloco": [], "diloco": [], "adamw": []}, "data_fingerprint": "f386390fd2238fea",
          **REGIME_DEFAULTS}


def tuned_file(tmp_path: Path, **fields) -> str:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"tuned": {}, "losses": LOSSES, **fields}))
    return str(path)


def test_the_same_regime_keeps_the_losses(tmp_path: Path) -> None:
    assert earlier_losses(tuned_file(tmp_path, **REGIME), REGIME) == LOSSES


def test_a_file_without_the_newer_fields_counts_as_tuned_at_their_defaults(tmp_path: Path) -> None:
    older = {k: v for k, v in REGIME.items() if k not in REGIME_DEFAULTS}
    assert earlier_losses(tuned_file(tmp_path, **older), REGIME) == LOSSES
    assert earlier_losses(tuned_file(tmp_path, **older), {**REGIME, "partitioning": "contiguous"}) == {}


def test_any_other_regime_or_no_file_keeps_nothing(tmp_path: Path) -> None:
    path = tuned_file(tmp_path, **REGIME)
    for key, other in [("rounds", 20), ("seeds", [100]), ("warmup_steps", 90), ("batch", [4, 32]),
                       ("data_fingerprint", "0000000000000000"),
                       ("user_overrides", {"sparseloco": ["inner.lr=1e-3"], "diloco": [], "adamw": []})]:
        assert earlier_losses(path, {**REGIME, key: other}) == {}, key
    assert earlier_losses(str(tmp_path / "missing.json"), REGIME) == {}
