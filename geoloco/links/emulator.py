"""An asyncio TCP relay that emulates a WAN link (rate, one-way delay, jitter) in both
directions between a worker and the coordinator; the unprivileged stand-in for tc netem/tbf.

Each direction is a token bucket (rate, burst ~5 ms of traffic) followed by a delay line:
a chunk leaves the bucket at ``depart`` and is delivered at
``max(previous delivery, depart + delay + jitter sample)``, so jitter never reorders bytes.
Packet loss cannot be emulated on a TCP relay (TCP would hide it behind retransmits the relay
never sees), so ``LinkProfile.loss`` is ignored here; in containers tc netem applies it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import threading
from collections.abc import Callable
from typing import Any

from geoloco.profiles import LinkProfile, LinkProfileError
from geoloco.transport import AddressError, parse_address

log = logging.getLogger(__name__)

BURST_S = 0.005  # token bucket depth: 5 ms of traffic at the set rate ...
MIN_BURST_BYTES = 4096  # ... but never below 4 KiB, so a small message is not split up
MAX_CHUNK = 16 * 1024  # read size when shaping: small enough for smooth pacing
UNSHAPED_CHUNK = 64 * 1024  # read size with no rate limit
QUEUE_CHUNKS = 1024  # chunks in flight per direction before reading pauses (backpressure)
CATCH_UP_S = 0.1  # link time a late wake-up of the relay may make up for (see TokenBucket)
READY_S = 0.0005  # a read that returns this fast found data waiting
JITTER_DISTS = ("uniform", "normal")

Address = tuple[str, int]


class TokenBucket:
    """Reservation-style token bucket: ``reserve(n, now)`` returns when ``n`` bytes may leave.
    Tokens refill at ``rate`` bytes/s up to ``burst``; a reservation may drive the level
    negative, which queues later senders behind it (FIFO, exact long-run rate).

    ``credit_s`` lifts the cap for one refill by that much time: the relay passes how late
    it woke while data was waiting, so a CPU stall of the relay does not cost link capacity
    (a real link keeps sending while the relay process is descheduled)."""

    def __init__(self, rate_bytes_s: float, burst: float) -> None:
        self.rate = rate_bytes_s
        self.burst = burst
        self.tokens = burst
        self.stamp: float | None = None

    def reserve(self, n: int, now: float, credit_s: float = 0.0) -> float:
        if self.stamp is not None:
            cap = self.burst + credit_s * self.rate
            refilled = min(cap, self.tokens + (now - self.stamp) * self.rate)
            self.tokens = max(self.tokens, refilled)
        self.stamp = now
        self.tokens -= n
        return now if self.tokens >= 0 else now - self.tokens / self.rate


class DelayLine:
    """One-way delay plus jitter, seeded: uniform in [-jitter, +jitter], or normal with
    sigma = jitter / 2 clipped to the same range."""

    def __init__(self, delay_s: float, jitter_s: float, dist: str, seed: int) -> None:
        if dist not in JITTER_DISTS:
            raise ValueError(f"jitter distribution {dist!r} is not one of {', '.join(JITTER_DISTS)}")
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.dist = dist
        self.rng = random.Random(seed)

    def sample(self) -> float:
        j = self.jitter_s
        if not j:
            return self.delay_s
        if self.dist == "uniform":
            return self.delay_s + self.rng.uniform(-j, j)
        return self.delay_s + max(-j, min(j, self.rng.gauss(0.0, j / 2)))


class Direction:
    """Shaping state of one direction of the link, shared by all its connections."""

    def __init__(self, profile: LinkProfile, dist: str, seed: int) -> None:
        self.dist, self.seed = dist, seed
        self.bytes = 0
        self.set_profile(profile)

    def set_profile(self, profile: LinkProfile) -> None:
        """Shape by ``profile`` from now on (connections open stay open; bytes already
        stamped keep their times)."""
        rate = profile.rate_bps / 8 if profile.rate_bps else None
        burst = max(MIN_BURST_BYTES, rate * BURST_S) if rate else 0.0
        self.bucket = TokenBucket(rate, burst) if rate else None
        self.delay = DelayLine(profile.delay_s, profile.jitter_s, self.dist, self.seed)
        self.chunk = min(MAX_CHUNK, int(burst)) if rate else UNSHAPED_CHUNK


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    wait = when - loop.time()
    if wait > 0:
        await asyncio.sleep(wait)


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: Direction
) -> None:
    """Move one direction of one connection until EOF has been passed on; the first error
    on either end (a reset, a write to a closed peer) is raised."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
    tasks = [
        asyncio.create_task(_shape(reader, queue, direction)),
        asyncio.create_task(_deliver(queue, writer, direction)),
    ]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()


async def _shape(
    reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]], direction: Direction
) -> None:
    """Read, wait for the token bucket, stamp each chunk with its in-order delivery time."""
    loop = asyncio.get_running_loop()
    last = late = 0.0
    while True:
        asked = loop.time()
        data = await reader.read(direction.chunk)
        if not data:
            break
        now = loop.time()
        waiting = now - asked < READY_S  # the bytes were already buffered: the link was busy
        depart = now
        if direction.bucket:
            depart = direction.bucket.reserve(len(data), now, min(late, CATCH_UP_S) if waiting else 0.0)
            await _sleep_until(loop, depart)
            late = max(0.0, loop.time() - depart)
        last = max(last, depart + direction.delay.sample())  # jitter never reorders
        await queue.put((last, data))
    await queue.put((last, b""))  # EOF, delivered after the bytes before it


async def _deliver(
    queue: asyncio.Queue[tuple[float, bytes]],
    writer: asyncio.StreamWriter,
    direction: Direction,
) -> None:
    """Write each chunk at its delivery time; pass EOF on as a half-close."""
    loop = asyncio.get_running_loop()
    while True:
        when, data = await queue.get()
        await _sleep_until(loop, when)
        if not data:
            if writer.can_write_eof():
                writer.write_eof()
            return
        direction.bytes += len(data)  # counted before the peer can read it (threads too)
        writer.write(data)
        await writer.drain()


class LinkEmulator:
    """Listens on ``listen`` and relays each connection to ``target`` through the profile's
    link, applied to both directions (up: client -> target, down: target -> client).
    ``stop()`` cuts every connection; ``start()`` again listens on the same port."""

    def __init__(
        self,
        listen: Address = ("127.0.0.1", 0),
        target: Address = ("127.0.0.1", 50051),
        profile: LinkProfile | None = None,
        seed: int = 0,
        jitter: str = "uniform",
    ) -> None:
        self.listen = listen
        self.target = target
        self.profile = profile or LinkProfile()
        self.up = Direction(self.profile, jitter, seed * 2)
        self.down = Direction(self.profile, jitter, seed * 2 + 1)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._port = listen[1]
        if self.profile.loss:
            log.warning("link emulator ignores loss %.3g%%: TCP hides it (tc netem applies it)",
                        self.profile.loss * 100)

    @property
    def port(self) -> int:
        """The listening port (the one picked by the OS when ``listen`` asked for port 0)."""
        return self._port

    @property
    def bytes_up(self) -> int:
        """Bytes delivered to the target since creation, across restarts."""
        return self.up.bytes

    @property
    def bytes_down(self) -> int:
        """Bytes delivered back to clients since creation, across restarts."""
        return self.down.bytes

    @property
    def connections(self) -> int:
        """Connections being relayed now."""
        return len(self._connections)

    def set_profile(self, profile: LinkProfile) -> None:
        """Change the link live: every connection is shaped by ``profile`` from now on."""
        self.profile = profile
        self.up.set_profile(profile)
        self.down.set_profile(profile)
        log.info("link now %s", profile)

    async def start(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._accept, self.listen[0], self._port, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]
        log.debug("link %s: %s:%d -> %s:%d", self.profile, self.listen[0], self._port, *self.target)

    async def stop(self) -> None:
        """Stop listening and abort every relayed connection (the link is cut)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        """Relay one connection in a task of our own, which ``stop()`` cancels."""
        task = asyncio.create_task(self._relay(c_reader, c_writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.warning("link: target %s:%d unreachable (%s); closing the client", *self.target, exc)
            c_writer.transport.abort()
            return
        pumps = [
            asyncio.create_task(_pump(c_reader, t_writer, self.up)),
            asyncio.create_task(_pump(t_reader, c_writer, self.down)),
        ]
        try:
            await _until_both_done_or_one_fails(pumps)
            for w in (c_writer, t_writer):
                w.close()
        finally:
            for p in pumps:
                p.cancel()
            for w in (c_writer, t_writer):
                if not w.is_closing():
                    w.transport.abort()  # cut: the peers see a reset, not a clean close


async def _until_both_done_or_one_fails(pumps: list[asyncio.Task[None]]) -> None:
    """Wait for both directions to pass EOF (a half-close is relayed as one); a reset or
    other error in either direction ends the connection at once."""
    done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception() is not None:
            log.debug("link: connection ended: %r", task.exception())


class RelayThread:
    """A LinkEmulator running on its own event loop in a daemon thread, for code that is not
    async. ``stop()``/``start()`` cut and restore the link; ``close()`` ends the thread."""

    def __init__(
        self,
        target: Address,
        profile: LinkProfile | None = None,
        listen: Address = ("127.0.0.1", 0),
        seed: int = 0,
        jitter: str = "uniform",
    ) -> None:
        self.emulator = LinkEmulator(listen, target, profile, seed, jitter)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.emulator.port

    def set_profile(self, profile: LinkProfile) -> None:
        """Change the link live (both directions), on the relay's own loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.emulator.set_profile, profile)

    @property
    def bytes_up(self) -> int:
        return self.emulator.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.emulator.bytes_down

    def start(self) -> RelayThread:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="link-emulator", daemon=True)
            self._thread.start()
        self._call(self.emulator.start)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._call(self.emulator.stop)

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._loop = self._thread = None

    def _call(self, coro_fn: Callable[[], Any]) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(timeout=10)

    def __enter__(self) -> RelayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address(text: str) -> Address:
    try:
        return parse_address(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _profile(text: str) -> LinkProfile:
    try:
        return LinkProfile.parse(text)
    except LinkProfileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m geoloco.links.emulator",
        description="Relay TCP from --listen to --target through an emulated WAN link "
        "(rate, one-way delay, jitter; both directions). Loss is ignored on a TCP relay.",
    )
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 7000), help="HOST:PORT to accept on")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to relay to")
    parser.add_argument("--profile", type=_profile, default=LinkProfile(),
                        help="RATE[/DELAY[/JITTER]], e.g. 20mbit/50ms/5ms, or 'unlimited'")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter samples")
    parser.add_argument("--jitter", choices=JITTER_DISTS, default="uniform", help="jitter distribution")
    return parser.parse_args(argv)


async def _run(args: argparse.Namespace) -> None:
    relay = LinkEmulator(args.listen, args.target, args.profile, args.seed, args.jitter)
    await relay.start()
    serving = asyncio.ensure_future(relay.serve_forever())
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, serving.cancel)
    print(f"link {args.profile}: {args.listen[0]}:{relay.port} -> {args.target[0]}:{args.target[1]}", flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    print(f"bytes up {relay.bytes_up}, down {relay.bytes_down}", flush=True)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_run(_parse_args(argv)))


if __name__ == "__main__":
    main()
