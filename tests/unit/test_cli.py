"""The ``geoloco`` command line: --help on every subcommand, flags and ``--set`` mapped onto
the config, and configuration errors that exit 2 naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from geoloco.cli import (
    COORDINATOR_FLAGS,
    LOCAL_DEMO_DEFAULTS,
    LOCAL_FLAGS,
    build_parser,
    main,
    resolve_config,
)
from geoloco.config import InnerConfig

SUBCOMMANDS = {
    "local": ["--workers", "--rounds", "--wan", "--run-dir", "--method", "--per-worker-wan", "--straggler-profiles"],
    "coordinator": ["--listen", "--workers", "--rounds", "--run-dir", "--resume", "--token-file",
                    "--tls-cert", "--tls-key", "--tls-ca", "--insecure"],
    "worker": ["--coordinator", "--token-file", "--tls-ca", "--tls-cert", "--tls-key", "--device",
               "--wan-emulate", "--log-file"],
}


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_of_each_subcommand_lists_its_flags(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in SUBCOMMANDS[command] + ["--config", "--set"]:
        assert flag in out, f"{command} --help does not mention {flag}"
    assert "--token " not in out and "--token\n" not in out  # a secret is never a flag


@pytest.mark.slow
def test_console_script_top_level_help_names_the_subcommands() -> None:
    proc = subprocess.run([sys.executable, "-m", "geoloco.cli", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for command in SUBCOMMANDS:
        assert command in proc.stdout


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["coordinator", "--workers", "0"], "workers"),
        (["coordinator", "--listen", "nowhere"], "coordinator.listen"),
        (["local", "--wan", "fast"], "network.wan"),
        (["local", "--method", "sparseloco", "--set", "inner.steps=many"], "inner.steps"),
        (["local", "--set", "compression.density=2"], "compression.density"),
        (["worker", "--set", "nosuch.field=1"], "nosuch"),
        (["worker", "--device", "cpu", "--set", "worker.connect_timeout_s=-1"], "worker.connect_timeout_s"),
        (["worker", "--wan-emulate", "20mbit/fast"], "--wan-emulate"),
        (["coordinator", "--set", "rounds"], "--set"),
    ],
)
def test_config_errors_exit_2_and_name_the_field(argv: list[str], field: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("geoloco: config error: ")
    assert field in err


def test_config_file_errors_name_the_field(tmp_path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[inner]\nsteps = 5\n[coding]\nscheme = "magic"\n')
    assert main(["coordinator", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "coding.scheme" in err and "gc-fr" in err


def test_missing_config_file_is_a_config_error(tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert main(["local", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "absent.toml" in capsys.readouterr().err


def test_file_then_set_then_flags(tmp_path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rounds": 7, "inner": {"steps": 9}, "network": {"wan": "10mbit"}}))
    args = build_parser().parse_args(
        ["local", "--config", str(path), "--set", "inner.steps=11", "--set", "rounds=8",
         "--rounds", "3", "--per-worker-wan", "1mbit,2mbit", "--straggler-profiles", "none,fixed:2"]
    )
    cfg = resolve_config(args, LOCAL_FLAGS)
    assert cfg.rounds == 3  # the dedicated flag wins over --set and the file
    assert cfg.inner.steps == 11  # --set wins over the file
    assert cfg.network.wan == "10mbit"  # the file wins over the defaults
    assert cfg.network.per_worker == ["1mbit", "2mbit"]
    assert cfg.stragglers.per_worker == ["none", "fixed:2"]


def test_coordinator_flags_map_onto_the_config() -> None:
    args = build_parser().parse_args(
        ["coordinator", "--listen", "127.0.0.1:0", "--workers", "3", "--rounds", "2", "--run-dir", "x"]
    )
    cfg = resolve_config(args, COORDINATOR_FLAGS)
    assert (cfg.coordinator.listen, cfg.workers, cfg.rounds, cfg.run_dir) == ("127.0.0.1:0", 3, 2, "x")
    assert args.resume is False


def test_local_is_demo_sized_without_a_config_file(tmp_path) -> None:
    args = build_parser().parse_args(["local", "--workers", "4"])
    cfg = resolve_config(args, LOCAL_FLAGS, LOCAL_DEMO_DEFAULTS)
    assert cfg.inner.steps == int(LOCAL_DEMO_DEFAULTS["inner.steps"])
    path = tmp_path / "run.toml"
    path.write_text("[inner]\nwarmup_steps = 3\n")
    args = build_parser().parse_args(["local", "--config", str(path)])
    cfg = resolve_config(args, LOCAL_FLAGS, LOCAL_DEMO_DEFAULTS)
    assert cfg.inner.steps == InnerConfig().steps and cfg.inner.warmup_steps == 3  # a config file starts from the defaults


@pytest.mark.parametrize(("command", "flag", "default"), [
    ("local", "--wan", "(default: 20mbit/50ms; config: network.wan)"),
    ("local", "--inner-steps", "(default: 10 without --config, else 20; config: inner.steps)"),
    ("coordinator", "--listen", "(default: 127.0.0.1:50051; config: coordinator.listen)"),
    ("coordinator", "--deadline", "(default: 300.0; config: coordinator.deadline_s)"),
    ("worker", "--device", "(default: auto; config: worker.device)"),
    ("worker", "--insecure", "(default: false; config: tls.insecure)"),
])
def test_help_shows_each_config_flags_default(command: str, flag: str, default: str,
                                              capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space
    after = out[out.index(f" {flag} "):][:220]  # the flag's own help
    assert default in after, f"{flag}: {after}"


def test_straggler_profiles_and_its_deprecated_spelling(capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["local", "--straggler-profiles", "none,fixed:2"])
    assert resolve_config(args, LOCAL_FLAGS).stragglers.per_worker == ["none", "fixed:2"]
    assert not capsys.readouterr().err
    args = build_parser().parse_args(["local", "--straggler", "fixed:3"])
    assert resolve_config(args, LOCAL_FLAGS).stragglers.per_worker == ["fixed:3"]
    assert "--straggler is deprecated; use --straggler-profiles" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["local", "--help"])
    out = capsys.readouterr().out
    assert "--straggler-profiles" in out and "--straggler " not in out
