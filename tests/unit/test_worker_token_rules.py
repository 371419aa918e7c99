"""Per-worker tokens (coordinator.worker_tokens_file): worker i's token binds slot i, one
slot per token, the shared token then admits nobody; the tokens file is refused when others
can read it or when it is malformed; `geoloco certs` writes the tokens and the table."""

from __future__ import annotations

import pytest

from geoloco.certs import (
    WORKER_TOKENS_FILE,
    WorkerTokensError,
    load_worker_tokens,
    make_run_credentials,
    worker_token,
)
from geoloco.coordinator.registry import RegistryError, WorkerRegistry

TOKENS = {0: "a" * 20, 1: "b" * 20, 2: "c" * 20}


def registry() -> WorkerRegistry:
    return WorkerRegistry(3, "shared-token-of-the-run", TOKENS)


def test_a_workers_token_binds_its_slot_and_the_shared_token_admits_nobody() -> None:
    reg = registry()
    assert reg.join(TOKENS[2], "h", "cpu", None, "").worker_id == 2
    assert reg.join(TOKENS[0], "h", "cpu", None, "").worker_id == 0
    assert not reg.token_matches("shared-token-of-the-run")
    with pytest.raises(RegistryError) as refused:
        reg.join("shared-token-of-the-run", "h", "cpu", None, "")
    assert refused.value.code == "PERMISSION_DENIED"
    assert WorkerRegistry(3, "shared").token_matches("shared")  # without worker tokens: as before


def test_one_token_holds_one_slot_and_its_second_join_replaces_the_session() -> None:
    reg = registry()
    first = reg.join(TOKENS[1], "h", "cpu", None, "")
    old_session = first.session
    again = reg.join(TOKENS[1], "h", "cpu", None, "")
    assert again.worker_id == 1 and sorted(reg.records) == [1]  # not a second slot
    assert again.session != old_session
    with pytest.raises(RegistryError):
        reg.authenticate(1, old_session)
    assert reg.authenticate(1, again.session).worker_id == 1


def test_a_token_cannot_reclaim_or_be_bound_to_another_workers_slot() -> None:
    reg = registry()
    zero = reg.join(TOKENS[0], "h", "cpu", None, "")
    with pytest.raises(RegistryError, match="this token is worker 1's, but the reclaimed id is worker 0"):
        reg.join(TOKENS[1], "h", "cpu", 0, zero.session)
    with pytest.raises(RegistryError, match="certificate's name is worker 2"):
        reg.join(TOKENS[1], "h", "cpu", None, "", cert="c1", cert_slot=2)
    mtls = registry()
    mtls.join(TOKENS[0], "h", "cpu", None, "", cert="cert-0")
    with pytest.raises(RegistryError, match="joined with another certificate"):
        mtls.join(TOKENS[0], "h", "cpu", None, "", cert="another")


def test_a_dead_workers_slot_goes_to_the_next_holder_of_its_token() -> None:
    reg = registry()
    reg.join(TOKENS[0], "h", "cpu", None, "")
    reg.mark_dead(0)
    assert reg.join(TOKENS[0], "h2", "cpu", None, "").worker_id == 0
    assert reg.records[0].live and reg.records[0].hostname == "h2"


@pytest.mark.parametrize(("text", "mode", "message"), [
    ("0 " + "a" * 20 + "\n", 0o644, "readable by others"),
    ("0\n", 0o600, "expected '<worker id> <token>'"),
    ("x " + "a" * 20 + "\n", 0o600, "expected '<worker id> <token>'"),
    ("3 " + "a" * 20 + "\n", 0o600, "worker 3, but the run has 3 worker slots"),
    ("0 " + "a" * 20 + "\n0 " + "b" * 20 + "\n", 0o600, "worker 0 is given twice"),
    ("0 short\n", 0o600, "shorter than 16 characters"),
    ("0 " + "a" * 20 + "\n1 " + "a" * 20 + "\n", 0o600, "another worker's token"),
    ("# nothing\n\n", 0o600, "holds no token"),
])
def test_a_tokens_file_that_cannot_be_used_is_refused_with_the_reason(tmp_path, text, mode, message) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(mode)
    with pytest.raises(WorkerTokensError, match=message):
        load_worker_tokens(path, 3)


def test_geoloco_certs_writes_each_workers_token_and_the_coordinators_table(tmp_path) -> None:
    make_run_credentials(tmp_path, None, 2)
    table = tmp_path / WORKER_TOKENS_FILE
    assert (table.stat().st_mode & 0o777) == 0o600
    tokens = load_worker_tokens(table, 2)
    assert tokens == {i: (tmp_path / worker_token(i)).read_text().strip() for i in range(2)}
    assert all((tmp_path / worker_token(i)).stat().st_mode & 0o777 == 0o600 for i in range(2))
    make_run_credentials(tmp_path, None, 3)  # one more worker: the first two tokens are kept
    grown = load_worker_tokens(table, 3)
    assert {i: grown[i] for i in range(2)} == tokens and len(set(grown.values())) == 3
