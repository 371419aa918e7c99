"""The config reference: docs/config.md is what ``geoloco config --reference`` prints, and
it has a row with a type, default, allowed values and meaning for every config field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from geoloco import config
from geoloco.cli import main
from geoloco.config_reference import FORMATS, field_docs, render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def every_field(cls: type = config.RunConfig, prefix: str = "") -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        section = config._SECTIONS.get(f.type)
        names += every_field(section, f"{f.name}.") if section else [prefix + f.name]
    return names


def test_the_committed_page_is_the_generated_reference(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == render()
    assert PAGE.read_text() == printed, "docs/config.md is stale: geoloco config --reference > docs/config.md"


def test_every_field_has_a_row_with_type_default_allowed_and_meaning() -> None:
    docs = {d.name: d for d in field_docs()}
    assert list(docs) == every_field()
    page = PAGE.read_text()
    for name, doc in docs.items():
        assert f"| `{name}` |" in page, f"{name} is missing from docs/config.md"
        assert doc.type and doc.default and doc.allowed, name
        assert doc.meaning, f"{name} has no comment in geoloco/config.py saying what it means"


def test_allowed_values_come_from_the_validation() -> None:
    docs = {d.name: d for d in field_docs()}
    assert docs["inner.steps"].allowed == "1..100_000"
    assert docs["coding.scheme"].allowed == " | ".join(f"`{s}`" for s in config.SCHEMES)
    assert docs["coding.stragglers"].allowed == "0..workers - 1"  # a bound naming another field
    assert docs["compression.density_max"].allowed == "compression.density_min..1.0"
    assert docs["guard.reject_ratio"].allowed == "guard.clip_ratio..1e12"
    assert docs["compression.tile"].allowed == f"4..{config.MAX_TILE}"  # a constant by its value
    assert docs["coordinator.val_every"].allowed == "unset | 0..10**7"
    assert docs["inner.lr"].default == "`0.003`" and docs["outer.lr"].default == "unset"


def test_every_format_names_a_field() -> None:
    assert set(FORMATS) <= set(every_field())


def test_config_prints_the_resolved_config_without_secrets(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--set", "inner.steps=3", "--set", "rounds=7"]) == 0
    out = capsys.readouterr().out
    assert '"steps": 3' in out and '"rounds": 7' in out and '"token"' not in out
    assert main(["config", "--set", "inner.steps=0"]) == 2
    assert "inner.steps" in capsys.readouterr().err
