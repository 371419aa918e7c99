"""The gRPC transport both sides share: message limits and keepalive, chunking of payloads,
``HOST:PORT`` parsing, and the one Join-with-backoff client (round protocol:
docs/protocol.md; wire: protos/geoloco.proto)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # payload bytes per gRPC message (frames and state are chunked)
MAX_MESSAGE_BYTES = 4 << 20  # explicit limit on both sides: one chunk plus its header fits
KEEPALIVE_S = 5.0  # Rounds streams send a Keepalive this often when idle
# The wire version both sides state at Join (protos/geoloco.proto); a message without one is
# version 1. 2: the task of the round after next (overlapped rounds) and a frame's density.
PROTOCOL_VERSION = 2

BACKOFF_START_S = 0.5  # first retry delay of Join; doubles up to BACKOFF_MAX_S
BACKOFF_MAX_S = 10.0
# One Join attempt's deadline at first; a dead address fails much faster. An attempt that
# runs out doubles the next one's (a slow link's round trips: TLS and HTTP/2 take several),
# within what is left of the caller's timeout.
JOIN_CALL_TIMEOUT_S = 10.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Join retries these too: every slot is taken (a new worker waits for one to be marked dead),
# or the coordinator holds this caller to its share of Joins for a while
JOIN_RETRYABLE = (*RETRYABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
]

# Servers must accept the clients' keepalive pings, or they answer with GOAWAY. SO_REUSEPORT
# is gRPC's default on Linux: a second coordinator would bind a busy port and share the Joins.
# A server receives nothing larger than one chunk and its header (what gRPC may buffer for a
# caller not yet authenticated).
SERVER_RECEIVE_BYTES = CHUNK_BYTES + (64 << 10)
SERVER_OPTIONS = [o for o in _COMMON_OPTIONS if o[0] != "grpc.max_receive_message_length"] + [
    ("grpc.max_receive_message_length", SERVER_RECEIVE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]

CHANNEL_OPTIONS = _COMMON_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]

Reply = TypeVar("Reply")

# Call metadata that names the caller of a Push before its stream is read.
WORKER_ID_KEY = "x-geoloco-worker"
SESSION_KEY = "x-geoloco-session"


@dataclass(frozen=True)
class ChannelSecurity:
    """TLS for a channel: gRPC's credentials, and the name the server's certificate must
    carry when it is not the host dialled (a relay in between: geoloco.links)."""

    credentials: grpc.ChannelCredentials
    server_name: str | None = None


class AddressError(ValueError):
    """A ``HOST:PORT`` string that cannot be used; the message says which part is wrong."""


class JoinRefused(RuntimeError):
    """The coordinator answered Join with an error (wrong token, no free slot, run over);
    ``code``: the gRPC status name, when the coordinator sent one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def protocol_mismatch(me: str, peer: str, peer_version: int) -> str | None:
    """The refusal when ``peer`` speaks another wire version than this process (``me``),
    naming both; None when they agree. ``peer_version`` 0 (the field absent) is version 1."""
    theirs = peer_version or 1
    if theirs == PROTOCOL_VERSION:
        return None
    return (f"protocol version mismatch: this {me} speaks geoloco wire protocol {PROTOCOL_VERSION}, "
            f"the {peer} {theirs}; run the same geoloco version on both sides")


class CoordinatorUnreachable(RuntimeError):
    """Join kept failing with a retryable error for longer than the timeout."""


def parse_address(text: str) -> tuple[str, int]:
    """``(host, port)`` from ``HOST:PORT`` (``[::1]:50051`` for IPv6); port 0..65535."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AddressError(f"{text!r} is not HOST:PORT with PORT in 0..65535")
    return host, int(port)


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Slices of at most ``size`` bytes, in order; nothing for empty data."""
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])


def open_channel(address: str, security: ChannelSecurity | None = None) -> grpc.Channel:
    """A channel to ``address`` with the shared options: TLS with ``security``, else
    plaintext (geoloco.tls decides which is allowed)."""
    if security is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    return grpc.secure_channel(address, security.credentials, options=options)


def caller_metadata(worker_id: int, session: str) -> tuple[tuple[str, str], ...]:
    """The metadata a worker's calls carry (the coordinator checks it before reading)."""
    return ((WORKER_ID_KEY, str(worker_id)), (SESSION_KEY, session))


def join_with_backoff(address: str, join: Callable[[grpc.Channel, float], Reply], timeout_s: float,
                      sleep: Callable[[float], None] = time.sleep,
                      security: ChannelSecurity | None = None,
                      call_timeout_s: float = JOIN_CALL_TIMEOUT_S) -> tuple[Reply, grpc.Channel]:
    """Call ``join(channel, deadline_s)`` on a fresh channel to ``address`` until it answers,
    retrying UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED (no free slot yet) with
    exponential backoff (BACKOFF_START_S doubling to BACKOFF_MAX_S, one log line per
    attempt) for up to ``timeout_s``. The first attempt's deadline is ``call_timeout_s``;
    each attempt that runs out of time doubles the next one's, up to what is left of
    ``timeout_s``, so a link with seconds of round trip still joins. Returns the reply and
    the open channel that got it. Any other error raises JoinRefused; running out of time
    raises CoordinatorUnreachable, or JoinRefused when the last answer was RESOURCE_EXHAUSTED."""
    start, delay, attempt, deadline_s = time.monotonic(), BACKOFF_START_S, 0, call_timeout_s
    while True:
        attempt += 1
        channel = open_channel(address, security)
        try:
            return join(channel, deadline_s), channel
        except grpc.RpcError as exc:
            channel.close()
            refused = JoinRefused(f"coordinator at {address} refused Join: "
                                  f"{exc.code().name}: {exc.details()}", exc.code().name)
            if exc.code() not in JOIN_RETRYABLE:
                raise refused from None
            elapsed = time.monotonic() - start
            left = timeout_s - elapsed
            if left <= 0 and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise refused from None
            timed_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if left <= 0:
                hint = (f"the last attempt got no answer in {deadline_s:.1f}s: on a link with "
                        "seconds of round trip, raise worker.connect_timeout_s; otherwise check"
                        if timed_out else "check")
                raise CoordinatorUnreachable(
                    f"coordinator at {address} unreachable after {attempt} attempts in "
                    f"{elapsed:.1f}s (timeout {timeout_s:g}s); {hint} the address and that the "
                    "coordinator is running") from None
            wait = min(delay, left)
            if timed_out:
                deadline_s = max(call_timeout_s, min(2 * deadline_s, left - wait))
            log.warning("join attempt %d to %s failed (%s: %s); retrying in %.1fs%s", attempt, address,
                        exc.code().name, exc.details(), wait,
                        f" with {deadline_s:.0f}s to answer" if timed_out else "")
            sleep(wait)
            delay = min(delay * 2, BACKOFF_MAX_S)
