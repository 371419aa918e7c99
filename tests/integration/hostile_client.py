"""A hostile client for the starvation test, run as its own process so that its threads do
not slow the test's own measurements: it holds idle Push streams open without (or with a
forged) session and sends wrong-token Joins at a steady rate, over mutual TLS with a
certificate of the run (a worker machine without the token), then prints one JSON line.

    python hostile_client.py HOST:PORT --ca CA --cert CERT --key KEY --streams 200 --joins 1000 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

JOIN_THREADS = 10


def idle(release: threading.Event):
    """A request stream that never sends a message, until released."""
    release.wait()
    return
    yield  # a generator


def hold_idle_pushes(stub, n: int, hold_s: float) -> dict:
    """Open ``n`` Push streams that send nothing for ``hold_s``: half without metadata, half
    with a forged session of worker 0. Returns how each ended and how soon."""
    release, started = threading.Event(), time.monotonic()
    ended: list[tuple[str, float]] = []
    lock = threading.Lock()

    def done(future) -> None:
        exc = future.exception()
        with lock:
            ended.append((exc.code().name if exc is not None else "OK", time.monotonic() - started))

    for i in range(n):
        metadata = (("x-geoloco-worker", "0"), ("x-geoloco-session", "f" * 32)) if i % 2 else None
        future = stub.Push.future(idle(release), metadata=metadata, timeout=hold_s + 30)
        future.add_done_callback(done)
    deadline = started + hold_s
    while time.monotonic() < deadline and len(ended) < n:
        time.sleep(0.05)
    release.set()
    time.sleep(0.5)
    with lock:
        codes = Counter(code for code, _ in ended)
        return {"codes": dict(codes), "ended": len(ended), "last_ended_s": max((s for _, s in ended), default=None)}


def wrong_joins(stub, n: int, seconds: float) -> dict:
    """``n`` Joins with a wrong token, spread evenly over ``seconds``."""
    codes: Counter = Counter()
    lock = threading.Lock()
    per_thread, gap = n // JOIN_THREADS, seconds * JOIN_THREADS / n

    def run() -> None:
        for _ in range(per_thread):
            start = time.monotonic()
            try:
                stub.Join(pb.JoinRequest(token="guess"), timeout=10)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes[code] += 1
            time.sleep(max(0.0, gap - (time.monotonic() - start)))

    threads = [threading.Thread(target=run) for _ in range(JOIN_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"codes": dict(codes)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--ca", type=Path, required=True)
    p.add_argument("--cert", type=Path, required=True)
    p.add_argument("--key", type=Path, required=True)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--joins", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    creds = grpc.ssl_channel_credentials(args.ca.read_bytes(), args.key.read_bytes(), args.cert.read_bytes())
    with grpc.secure_channel(args.address, creds) as push_channel, \
            grpc.secure_channel(args.address, creds) as join_channel:
        result: dict = {}
        pushes = threading.Thread(target=lambda: result.__setitem__("pushes", hold_idle_pushes(
            geoloco_pb2_grpc.CoordinatorStub(push_channel), args.streams, args.seconds)))
        pushes.start()
        result["joins"] = wrong_joins(geoloco_pb2_grpc.CoordinatorStub(join_channel), args.joins, args.seconds)
        pushes.join()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
