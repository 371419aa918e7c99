"""Measure a link's throughput with one TCP connection: ``sink HOST PORT`` takes one
connection, counts the bytes until the sender closes and prints them with the seconds from
the first byte to the last, as JSON; ``source HOST PORT SECONDS`` sends as fast as the link
takes for that long. Run on each side of a test bed link (tests/netns.py)."""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 64 * 1024


def sink(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            total, first, last = 0, None, None
            while data := conn.recv(CHUNK):
                last = time.monotonic()
                first = first or last
                total += len(data)
    print(json.dumps({"bytes": total, "seconds": (last - first) if first else 0.0}), flush=True)


def source(host: str, port: int, seconds: float) -> None:
    payload = b"\0" * CHUNK
    with socket.create_connection((host, port), timeout=60) as conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        sink(sys.argv[2], int(sys.argv[3]))
    else:
        source(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
