"""Config values of the wrong type, the run token (a file or GEOLOCO_TOKEN, never a flag,
never written out), `geoloco certs` and the registry's session hashes."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from geoloco import certs
from geoloco.cli import main
from geoloco.config import ConfigError, RunConfig, load_config, resolve_token
from geoloco.coordinator.registry import RegistryError, WorkerRegistry, session_hash


@pytest.mark.parametrize(("toml", "message"), [
    ("[inner]\nsteps = 3.5\n", "inner.steps: expected an integer, got 3.5 (float)"),
    ("[coordinator]\ntoken = 12345\n", "coordinator.token: expected a string or none, got 12345 (int)"),
    ("workers = true\n", "workers: expected an integer, got True (bool)"),
    ("[compression]\nzstd = \"yes\"\n", "compression.zstd: expected true or false, got 'yes' (str)"),
    ("[network]\nper_worker = [\"10mbit\", 5]\n", "network.per_worker: expected a list of strings"),
    ("[inner]\nlr = \"fast\"\n", "inner.lr: expected a number, got 'fast' (str)"),
    ("[guard]\nclip_ratio = 0.5\n", "guard.clip_ratio: 0.5 is outside the allowed range 1..1e+06"),
    ("[tls]\ncert = \"c.pem\"\n", "tls.cert and tls.key go together"),
])
def test_a_value_of_the_wrong_type_names_field_type_and_value(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


@pytest.mark.slow
def test_the_command_exits_2_without_a_traceback_on_a_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[inner]\nsteps = 3.5\n")
    proc = subprocess.run([sys.executable, "-m", "geoloco.cli", "local", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "inner.steps: expected an integer, got 3.5 (float)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_flag_text_is_still_parsed_into_the_field_type() -> None:
    cfg = load_config(overrides={"inner.steps": "7", "guard.clip_ratio": "3", "tls.insecure": "true"})
    assert (cfg.inner.steps, cfg.guard.clip_ratio, cfg.tls.insecure) == (7, 3.0, True)


def test_the_token_is_never_written_out() -> None:
    cfg = load_config(overrides={"coordinator.token": "s3cret-token"})
    assert cfg.coordinator.token == "s3cret-token"
    assert "s3cret-token" not in cfg.to_json() and "token" not in cfg.to_dict()["coordinator"]
    assert RunConfig.from_dict(json.loads(cfg.to_json())).coordinator.token is None


def test_token_from_a_file_wins_over_the_environment_and_the_file_config(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    cfg = load_config(overrides={"coordinator.token": "from-config"})
    assert resolve_token(cfg, {"GEOLOCO_TOKEN": "from-env"}) == "from-env"
    cfg.coordinator.token_file = str(token_file)
    assert resolve_token(cfg, {"GEOLOCO_TOKEN": "from-env"}) == "from-file"
    cfg.coordinator.token_file = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match="coordinator.token_file: cannot read"):
        resolve_token(cfg, {})


def test_no_token_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.delenv("GEOLOCO_TOKEN", raising=False)
    assert main(["worker", "--set", "coordinator.token=visible-in-ps"]) == 2
    assert "--set coordinator.token: a secret on the command line" in capsys.readouterr().err
    assert main(["coordinator", "--run-dir", str(tmp_path)]) == 2
    assert "no run token: give --token-file FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["worker", "--token", "visible-in-ps"])


def test_a_non_loopback_coordinator_without_tls_refuses_to_start(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("GEOLOCO_TOKEN", "t")
    assert main(["coordinator", "--listen", "0.0.0.0:0", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a loopback address and no TLS is configured" in err and "--insecure" in err


def test_certs_command_makes_a_ca_certificates_and_a_token_with_private_modes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "certs"
    assert main(["certs", str(out), "--san", "coordinator.example.org", "--san", "10.1.2.3",
                 "--workers", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for name in ("ca.key", "coordinator.key", "worker-0.key", "worker-1.key", "token", "worker-0.token",
                 "worker-1.token", "worker-tokens"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((out / "coordinator.pem").read_bytes())
    client = x509.load_pem_x509_certificate((out / "worker-1.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    client.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["coordinator.example.org"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    token = (out / "token").read_text()
    # a second call keeps the CA and the token, and adds only what is missing
    written = certs.make_run_credentials(out, None, 3)
    assert written == [out / "worker-2.pem", out / "worker-2.key", out / "worker-2.token", out / "worker-tokens"]
    assert (out / "token").read_text() == token
    x509.load_pem_x509_certificate((out / "worker-2.pem").read_bytes()).verify_directly_issued_by(ca)


def test_the_registry_keeps_only_session_hashes_bound_to_the_joining_certificate() -> None:
    registry = WorkerRegistry(2, "tok")
    record = registry.join("tok", "host", "cpu", None, "", cert="cert-a")
    session = record.session
    stored = registry.to_dict()[record.worker_id]
    assert session not in json.dumps(stored) and stored["session_sha256"] == session_hash(session)
    assert registry.authenticate(record.worker_id, session, "cert-a") is record
    with pytest.raises(RegistryError, match="over another certificate"):
        registry.authenticate(record.worker_id, session, "cert-b")
    with pytest.raises(RegistryError, match="over another certificate"):
        registry.authenticate(record.worker_id, session, None)
    restored = WorkerRegistry(2, "tok")
    restored.load_dict(registry.to_dict())
    assert restored.join("tok", "host", "cpu", record.worker_id, session, "cert-a").worker_id == record.worker_id
    with pytest.raises(RegistryError, match="bad session"):
        restored.authenticate(record.worker_id, "0" * 32, "cert-a")


def test_a_join_with_the_certificate_of_a_slot_nobody_holds_takes_that_slot() -> None:
    registry = WorkerRegistry(2, "tok")
    first = [registry.join("tok", "host", "cpu", None, "", cert=c) for c in ("cert-a", "cert-b")]
    restored = WorkerRegistry(2, "tok")  # a resumed coordinator: nobody holds a slot yet
    restored.load_dict(registry.to_dict())
    again = restored.join("tok", "host", "cpu", None, "", cert="cert-b")
    assert again.worker_id == first[1].worker_id and again.session != first[1].session
    assert restored.authenticate(again.worker_id, again.session, "cert-b") is again
    held = restored.join("tok", "host", "cpu", None, "", cert="cert-b")  # one slot per certificate:
    assert held is again and held.worker_id == first[1].worker_id  # the same one, a new session
    with pytest.raises(RegistryError, match="slots are taken"):  # another certificate
        restored.join("tok", "host", "cpu", None, "", cert="cert-c")
