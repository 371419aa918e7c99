"""The rules behind issue 24's defences, without a server: a certificate's name binds its
slot, the failed-Join buckets count addresses and certificates, the gate on unauthenticated
calls, caller text made safe to log, worker ids parsed safely (docs/security.md)."""

from __future__ import annotations

import pytest

from geoloco.coordinator.limits import JoinLimiter, LimitExceeded, SourceGate
from geoloco.coordinator.registry import RegistryError, WorkerRegistry, slot_of_name
from geoloco.coordinator.service import caller_text, parse_worker_id


def test_a_certificate_name_binds_its_slot_and_holds_no_other() -> None:
    assert [slot_of_name(n) for n in ("worker-3", "worker-03", "worker-x", "w-1", None, "worker-1\n")] \
        == [3, 3, None, None, None, None]
    registry = WorkerRegistry(3, "tok")
    two = registry.join("tok", "h", "cpu", None, "", cert="c2", cert_slot=2)
    assert two.worker_id == 2
    again = registry.join("tok", "h", "cpu", None, "", cert="c2", cert_slot=2)
    assert again.worker_id == 2 and sorted(registry.records) == [2]
    with pytest.raises(RegistryError, match="held by another certificate"):  # a second cert named worker-2
        registry.join("tok", "h", "cpu", None, "", cert="c2-copy", cert_slot=2)
    with pytest.raises(RegistryError, match="3 worker slots"):
        registry.join("tok", "h", "cpu", None, "", cert="c7", cert_slot=7)
    registry.mark_dead(2)  # gone: a re-issued certificate of the same name takes the slot back
    assert registry.join("tok", "h", "cpu", None, "", cert="c2-new", cert_slot=2).worker_id == 2


def test_failed_joins_count_every_key_and_one_empty_bucket_refuses() -> None:
    now = [0.0]
    limiter = JoinLimiter(burst=2, per_s=1.0, clock=lambda: now[0])
    limiter.failed("ipv4:10.0.0.1", "cert:a")
    limiter.failed("ipv4:10.0.0.1", "cert:b")
    limiter.check("ipv4:10.0.0.2", "cert:a")  # neither empty yet
    with pytest.raises(LimitExceeded):
        limiter.check("ipv4:10.0.0.2", "cert:b", "ipv4:10.0.0.1")  # the address is spent
    now[0] = 1.0
    limiter.check("ipv4:10.0.0.1")  # refilled


def test_the_gate_bounds_each_source_and_all_together() -> None:
    gate = SourceGate(per_source=2, total=3)
    a1, a2 = gate.enter("a"), gate.enter("a")
    with pytest.raises(LimitExceeded, match="from this address"):
        gate.enter("a")
    b1 = gate.enter("b")
    with pytest.raises(LimitExceeded, match="at once"):
        gate.enter("c")
    for place in (a1, a2, b1):
        with place:
            pass
    assert gate.held() == 0
    with gate.enter("c"):
        assert gate.held() == 1


def test_caller_text_is_cut_and_escaped() -> None:
    assert caller_text("host\nround 3: forged") == "host\\nround 3: forged"
    assert caller_text("a\x1b[2J\u202e") == "a\\x1b[2J\\u202e"
    assert len(caller_text("x" * 10_000)) == 64


def test_worker_ids_are_ascii_digits_of_bounded_length() -> None:
    assert [parse_worker_id(t) for t in ("0", "17", "123456789")] == [0, 17, 123456789]
    assert [parse_worker_id(t) for t in ("", "-1", "+1", "1e3", "\u00b2", "\u0661", "9" * 5000, "1234567890")] \
        == [None] * 8


def test_a_worker_admits_code_and_paths_only_as_its_own_config_allows(tmp_path) -> None:
    from geoloco.config import RunConfig
    from geoloco.worker.admission import Admission, ConfigRefused

    allowed = tmp_path / "data"
    allowed.mkdir()
    (allowed / "corpus.txt").write_text("x")
    (allowed / "escape").symlink_to("/etc")
    strict = Admission(allow_code=False, allowed_paths=(str(allowed),))

    def cfg(**task) -> RunConfig:
        c = RunConfig()
        for k, v in task.items():
            setattr(c.task, k, v)
        return c

    strict.check(cfg())  # a preset on the default corpus
    strict.check(cfg(data=str(allowed / "corpus.txt"), tokenizer="train:300"))
    for bad, field in [(cfg(model="os:system"), "code to run"), (cfg(model=f"{allowed}/m.py:make"), "code to run"),
                       (cfg(data="/etc/passwd"), "task.data"), (cfg(data=str(allowed / "escape" / "passwd")), "task.data"),
                       (cfg(tokenizer="/etc/tokenizer.json"), "task.tokenizer"), (cfg(model="hf:/srv/model"), "task.model")]:
        with pytest.raises(ConfigRefused, match=field):
            strict.check(bad)
    with pytest.raises(ConfigRefused, match="straggler profile"):
        strict.check(cfg(), straggler_profile="trace:/etc/shadow")
    Admission(allow_code=True).check(cfg(model="os:system", data="/etc/passwd"))  # allowed locally


def test_private_files_are_never_written_through_a_planted_link(tmp_path) -> None:
    from geoloco.certs import write_private
    from geoloco.run_dir import temp_path

    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    target = tmp_path / "token"
    temp_path(target).symlink_to(victim)  # where this process's write makes its temp file
    write_private(target, b"secret\n")
    assert victim.read_text() == "keep me\n"
    assert target.read_bytes() == b"secret\n" and not target.is_symlink()
    assert (target.stat().st_mode & 0o777) == 0o600
