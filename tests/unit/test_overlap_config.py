"""The config of overlapped rounds and link-aware density: outer.overlap, compression.density
"auto" with density_min, density_max and target_push_s, validated with errors naming field
and allowed range, from flags, TOML and JSON alike."""

from __future__ import annotations

import pytest

from geoloco.config import ConfigError, RunConfig, load_config


def test_defaults_do_not_overlap_and_use_a_fixed_density() -> None:
    cfg = load_config()
    assert cfg.outer.overlap == "none"
    assert cfg.compression.density == 64 / 4096 and cfg.compression.target_push_s is None


def test_auto_density_from_flags_and_round_trip() -> None:
    cfg = load_config(overrides={"compression.density": "auto", "outer.overlap": "eager",
                                 "compression.density_min": "0.002", "compression.density_max": "0.05"})
    assert (cfg.compression.density, cfg.compression.density_min, cfg.compression.density_max) == \
        ("auto", 0.002, 0.05)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again.compression.density == "auto" and again.outer.overlap == "eager"
    assert load_config(overrides={"compression.density": "0.03"}).compression.density == 0.03


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"outer.overlap": "async"}, "outer.overlap: 'async' is not one of none, delayed, eager"),
        ({"compression.density": "auto"}, "compression.density 'auto' needs compression.target_push_s"),
        ({"compression.density": "auto", "compression.method": "diloco", "outer.overlap": "eager"},
         "compression.density 'auto' needs compression.method 'sparseloco'"),
        ({"compression.density": "lots"}, "compression.density: 'lots' is not a valid float | str"),
        ({"compression.density": 2.0}, "compression.density: 2.0 is outside the allowed range"),
        ({"compression.density_min": 0.1, "compression.density_max": 0.05},
         "compression.density_max: 0.05 is outside the allowed range 0.1..1"),
        ({"compression.density_min": 0.0}, "compression.density_min: 0.0 is outside the allowed range"),
        ({"compression.target_push_s": -1.0}, "compression.target_push_s: -1.0 is outside the allowed range"),
    ],
)
def test_errors_name_the_field_and_range(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_a_typed_density_must_be_a_number_or_auto() -> None:
    with pytest.raises(ConfigError, match="compression.density: expected a number or 'auto'"):
        RunConfig.from_dict({"compression": {"density": [0.1]}})
    with pytest.raises(ConfigError, match="neither a fraction"):
        load_config_dict({"compression": {"density": "dense"}})


def load_config_dict(data: dict) -> RunConfig:
    from geoloco.config import validate
    return validate(RunConfig.from_dict(data))


def test_fold_step_is_an_inner_step_under_overlap_in_a_one_process_worker() -> None:
    cfg = load_config(overrides={"outer.overlap": "delayed", "inner.steps": "8", "outer.fold_step": "3"})
    assert cfg.outer.fold_step == 3 and RunConfig.from_dict(cfg.to_dict()).outer.fold_step == 3
    assert load_config().outer.fold_step is None
    arrival = load_config(overrides={"outer.overlap": "eager", "outer.fold_step": "Arrival"})
    assert arrival.outer.fold_step == "arrival" and RunConfig.from_dict(arrival.to_dict()).outer.fold_step == "arrival"
    assert load_config(overrides={"outer.fold_step": "none"}).outer.fold_step is None
    for bad, message in [({"outer.fold_step": "8"}, "from 1 to 7"), ({"outer.fold_step": "0"}, "from 1 to 7"),
                         ({"outer.fold_step": "1.5"}, "not a valid int"),
                         ({"outer.fold_step": "soon"}, "not a valid int"),
                         ({"outer.overlap": "none", "outer.fold_step": "arrival"}, "needs outer.overlap"),
                         ({"outer.overlap": "none", "outer.fold_step": "2"}, "needs outer.overlap"),
                         ({"worker.nproc_per_node": "2", "outer.fold_step": "2"}, "several ranks")]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides={"outer.overlap": "eager", "inner.steps": "8", **bad})
    for typed, message in [("soon", "neither an inner step"), (True, "expected an integer, 'arrival' or none"),
                           (2.5, "expected an integer")]:
        with pytest.raises(ConfigError, match=message):
            load_config_dict({"outer": {"overlap": "eager", "fold_step": typed}, "inner": {"steps": 8}})
