"""Config loading, overrides and validation errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geoloco.config import ConfigError, RunConfig, load_config
from geoloco.profiles import LinkProfile, LinkProfileError


def test_defaults_are_valid_and_resolve_outer_by_method() -> None:
    sparse = load_config()
    dense = load_config(overrides={"compression.method": "diloco"})
    assert (sparse.outer.lr, sparse.outer.momentum) == (1.0, 0.0)
    assert (dense.outer.lr, dense.outer.momentum) == (0.7, 0.9)


def test_toml_file_plus_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('workers = 6\n[inner]\nsteps = 7\n[network]\nper_worker = ["10mbit/80ms"]\n')
    cfg = load_config(path, {"inner.steps": "9", "coding.scheme": "pgc-fr", "coding.stragglers": "1"})
    assert (cfg.workers, cfg.inner.steps, cfg.coding.scheme) == (6, 9, "pgc-fr")
    assert cfg.network.profile_for(0) == LinkProfile.parse("10mbit/80ms")
    assert cfg.network.profile_for(5) == LinkProfile.parse("20mbit/50ms")


def test_json_round_trip(tmp_path: Path) -> None:
    cfg = load_config(overrides={"stragglers.per_worker": "fixed:4,none"})
    path = tmp_path / "c.json"
    path.write_text(cfg.to_json())
    assert load_config(path) == cfg
    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"workers": 0}, "workers: 0 is outside the allowed range 1..1024"),
        ({"workers": "four"}, "workers: 'four' is not a valid int"),
        ({"inner.lr": 5}, "inner.lr"),
        ({"inner.stepz": 3}, "unknown field inner.stepz"),
        ({"compression.method": "dense"}, "compression.method: 'dense' is not one of sparseloco, diloco"),
        ({"coding.scheme": "gc-fr", "coding.stragglers": 2}, "needs (stragglers + 1) to divide workers"),
        ({"coding.stragglers": 1}, "coding.stragglers must be 0 with coding.scheme 'none'"),
        ({"network.wan": "fast"}, "network.wan: link profile 'fast': bad rate"),
        ({"coordinator.listen": "localhost"}, "coordinator.listen: 'localhost' is not HOST:PORT"),
        ({"task.data": "/nonexistent/corpus"}, "task.data"),
        ({"compression.zstd": "maybe"}, "compression.zstd: 'maybe' is not a valid bool"),
        ({"coordinator.val_every": -1}, "coordinator.val_every: -1 is outside the allowed range 0..1e+07"),
        ({"coordinator.val_every": "often"}, "coordinator.val_every: 'often' is not a valid int | None"),
        ({"compression.tile": 512}, "compression.tile: 512 is outside the allowed range 4..256"),
    ],
)
def test_errors_name_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_val_every_defaults_to_none_and_takes_flags() -> None:
    assert load_config().coordinator.val_every is None
    assert load_config(overrides={"coordinator.val_every": "0"}).coordinator.val_every == 0
    assert load_config(overrides={"coordinator.val_every": "none"}).coordinator.val_every is None
    assert load_config(overrides={"coordinator.val_every": 3}).coordinator.val_every == 3


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = [")
    with pytest.raises(ConfigError, match="not valid"):
        load_config(bad)


@pytest.mark.parametrize(
    ("text", "rate", "delay", "jitter", "loss"),
    [
        ("20mbit", 20e6, 0.0, 0.0, 0.0),
        ("20mbit/50ms", 20e6, 0.05, 0.0, 0.0),
        ("100kbit/1s/250ms/0.5%", 1e5, 1.0, 0.25, 0.005),
        ("unlimited/10ms", None, 0.01, 0.0, 0.0),
    ],
)
def test_link_profiles(text: str, rate: float | None, delay: float, jitter: float, loss: float) -> None:
    profile = LinkProfile.parse(text)
    assert (profile.rate_bps, profile.delay_s, profile.jitter_s, profile.loss) == (rate, delay, jitter, loss)
    assert LinkProfile.parse(str(profile)) == profile


@pytest.mark.parametrize("text", ["20", "20mb/50ms", "20mbit/50", "20mbit/5ms/10ms", "1mbit/1ms/0ms/100%", "a/b/c/d/e"])
def test_bad_link_profiles(text: str) -> None:
    with pytest.raises(LinkProfileError):
        LinkProfile.parse(text)


def test_tile_limit_is_the_frame_format_limit() -> None:
    from geoloco.compression import MAX_TILE as FRAME_MAX_TILE
    from geoloco.config import MAX_TILE

    assert MAX_TILE == FRAME_MAX_TILE
    load_config(overrides={"compression.tile": MAX_TILE})
