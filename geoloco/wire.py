"""gRPC transport settings shared by coordinator and workers: chunk size, message limits,
keepalive, and helpers that cut a payload into chunks (protocol in docs/protocol.md)."""

from __future__ import annotations

from collections.abc import Iterator

CHUNK_BYTES = 1 << 20  # payload bytes per gRPC message (frames and state are chunked)
MAX_MESSAGE_BYTES = 4 << 20  # explicit limit on both sides: one chunk plus its header fits
KEEPALIVE_S = 5.0  # Rounds streams send a Keepalive this often when idle

_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
]

# Servers must accept the clients' keepalive pings, or they answer with GOAWAY.
SERVER_OPTIONS = _COMMON_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]

CHANNEL_OPTIONS = _COMMON_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Slices of at most ``size`` bytes, in order; nothing for empty data."""
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])
