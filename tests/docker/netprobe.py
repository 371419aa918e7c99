"""Link measurement tool copied into the test containers (standard library only): a TCP
sink/source/echo server and clients that measure goodput and round-trip time.

    python netprobe.py serve PORT                 # in the "coordinator" container
    python netprobe.py upload HOST PORT SECONDS   # prints {"rate_bps": ...} seen by the server
    python netprobe.py download HOST PORT SECONDS # prints {"rate_bps": ...} seen by the client
    python netprobe.py rtt HOST PORT COUNT        # prints {"rtt_s": [...]} of 64-byte echoes

Rates are measured at the receiver over the transfer after a warm-up (WARMUP_S), so the
socket buffers filled in the first moments do not count.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

WARMUP_S = 1.0
BLOCK = 64 * 1024


def _receive_rate(conn: socket.socket) -> float:
    """Read until EOF; bytes per second after the warm-up, in bit/s."""
    start = time.monotonic()
    mark_t, mark_n, total, last = None, 0, 0, start
    while True:
        data = conn.recv(BLOCK)
        if not data:
            break
        total += len(data)
        last = time.monotonic()
        if mark_t is None and last - start >= WARMUP_S:
            mark_t, mark_n = last, total
    if mark_t is None or last <= mark_t:
        raise RuntimeError(f"transfer too short to measure: {total} bytes in {last - start:.2f} s")
    return 8 * (total - mark_n) / (last - mark_t)


def _send_for(conn: socket.socket, seconds: float) -> None:
    block = b"\0" * BLOCK
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        conn.sendall(block)
    conn.shutdown(socket.SHUT_WR)


def _handle(conn: socket.socket) -> None:
    with conn:
        command = b""
        while not command.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                return
            command += chunk
        verb, *args = command.decode().split()
        if verb == "upload":
            conn.sendall(json.dumps({"rate_bps": _receive_rate(conn)}).encode() + b"\n")
        elif verb == "download":
            _send_for(conn, float(args[0]))
        elif verb == "echo":
            while data := conn.recv(BLOCK):
                conn.sendall(data)


def serve(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)
    print(f"netprobe listening on {port}", flush=True)
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _connect(host: str, port: int, verb: str) -> socket.socket:
    conn = socket.create_connection((host, port), timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(verb.encode() + b"\n")
    return conn


def upload(host: str, port: int, seconds: float) -> dict:
    with _connect(host, port, "upload") as conn:
        _send_for(conn, seconds)
        return json.loads(conn.makefile().readline())


def download(host: str, port: int, seconds: float) -> dict:
    with _connect(host, port, f"download {seconds}") as conn:
        return {"rate_bps": _receive_rate(conn)}


def rtt(host: str, port: int, count: int) -> dict:
    samples = []
    with _connect(host, port, "echo") as conn:
        for _ in range(count):
            start = time.monotonic()
            conn.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(conn.recv(64 - got))
            samples.append(time.monotonic() - start)
    return {"rtt_s": samples}


def main(argv: list[str]) -> None:
    verb, *args = argv
    if verb == "serve":
        serve(int(args[0]))
        return
    host, port, amount = args[0], int(args[1]), float(args[2])
    result = {"upload": upload, "download": download, "rtt": lambda h, p, n: rtt(h, p, int(n))}[verb](
        host, port, amount)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
