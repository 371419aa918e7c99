"""A client that holds partly sent Joins open, run as its own process: each of ``--calls``
connections opens one Join over plaintext HTTP/2 (RFC 9113, a frame writer of its own, since
no gRPC client can send part of a message), announces a request of ``--declared`` bytes,
sends as much of it as the server's flow-control windows let it up to ``--send`` bytes, then
stalls. Once every call is stalled or ended it prints one JSON line, holds the calls until
its stdin closes, waits up to ``--wait`` s for the server to end them all, and prints a
second line (how many it ended, and when the last one).

    python stalled_joins.py 127.0.0.1:PORT --calls 100 --declared 4000000 --send 3900000
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_HEADERS, ACK = 0x4, 0x1
INITIAL_WINDOW = 65_535
MAX_FRAME = 16_384
STALL_S = 2.0  # no window for this long: the call is stalled
STREAM = 1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    out = b"\x00"
    for text in (name.encode(), value.encode()):
        assert len(text) < 127
        out += bytes([len(text)]) + text
    return out


class StalledJoin:
    """One connection, one Join sent in part; a reader thread answers SETTINGS and PING and
    counts the windows the server grants."""

    def __init__(self, address: str, source: str, declared: int, send: int) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), source_address=(source, 0))
        self.declared, self.send = declared, send
        self.cond = threading.Condition()
        self.wlock = threading.Lock()  # the sender and the reader's replies write whole frames
        self.conn_window = self.stream_window = INITIAL_WINDOW
        self.sent = 0
        self.ended: str | None = None
        self.ended_at: float | None = None
        self.started = time.monotonic()
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))  # before any reply of the reader
        threading.Thread(target=self._read, daemon=True).start()

    def run(self) -> None:
        headers = b"".join(literal(k, v) for k, v in [
            (":method", "POST"), (":scheme", "http"), (":path", "/geoloco.v1.Coordinator/Join"),
            (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])
        self._write(frame(HEADERS, END_HEADERS, STREAM, headers))
        body = b"\x00" + struct.pack(">I", self.declared) + b"\x0a" * self.send
        while self.sent < len(body):
            with self.cond:
                if not self.cond.wait_for(lambda: self.ended or min(self.conn_window, self.stream_window) > 0,
                                          timeout=STALL_S) or self.ended:
                    return
                n = min(self.conn_window, self.stream_window, MAX_FRAME, len(body) - self.sent)
                self.conn_window -= n
                self.stream_window -= n
            try:
                self._write(frame(DATA, 0, STREAM, body[self.sent:self.sent + n]))
            except OSError:
                self._end("send failed")
                return
            self.sent += n

    def _write(self, data: bytes) -> None:
        with self.wlock:
            self.sock.sendall(data)

    def _end(self, why: str) -> None:
        with self.cond:
            if self.ended is None:
                self.ended, self.ended_at = why, time.monotonic() - self.started
            self.cond.notify_all()

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = self.sock.recv(n - len(data))
            if not part:
                raise OSError("closed")
            data += part
        return data

    def _read(self) -> None:
        try:
            while True:
                head = self._recv(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags, stream = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                self._on_frame(kind, flags, stream, self._recv(length))
        except OSError as exc:
            self._end(f"connection closed ({exc})")

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for i in range(0, len(payload), 6):
                key, value = struct.unpack(">HI", payload[i:i + 6])
                if key == 4:
                    with self.cond:
                        self.stream_window += value - INITIAL_WINDOW
                        self.cond.notify_all()
            self._write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            with self.cond:
                if stream == 0:
                    self.conn_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
                else:
                    self.stream_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
                self.cond.notify_all()
        elif kind in (HEADERS, RST_STREAM, GOAWAY) and stream in (0, STREAM):
            self._end({HEADERS: "answered", RST_STREAM: "reset", GOAWAY: "goaway"}[kind])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--declared", type=int, default=4_000_000)
    ap.add_argument("--send", type=int, default=3_900_000)
    ap.add_argument("--sources", type=int, default=1, help="spread over 127.0.0.2 ... 127.0.0.N+1")
    ap.add_argument("--wait", type=float, default=30.0, help="after stdin closes: wait this long "
                    "for the server to end every call")
    args = ap.parse_args()
    calls = [StalledJoin(args.address, f"127.0.0.{2 + i % args.sources}", args.declared, args.send)
             for i in range(args.calls)]
    threads = [threading.Thread(target=c.run) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"calls": len(calls), "sent_bytes": sum(c.sent for c in calls),
                      "ended": sum(c.ended is not None for c in calls), "why": sorted({str(c.ended) for c in calls})}), flush=True)
    sys.stdin.read()
    deadline = time.monotonic() + args.wait
    for c in calls:
        with c.cond:
            c.cond.wait_for(lambda c=c: c.ended is not None, timeout=max(0.0, deadline - time.monotonic()))
    print(json.dumps({"ended": sum(c.ended is not None for c in calls),
                      "last_ended_s": max((c.ended_at or 0.0) for c in calls)}), flush=True)


if __name__ == "__main__":
    main()
