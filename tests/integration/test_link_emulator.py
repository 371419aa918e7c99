"""The link emulator on loopback: bulk throughput never above the set rate (and not far
below it), added RTT never below twice the delay, order-preserving jitter that is never
faster than delay - jitter, both directions shaped, clean close propagation, cutting by
stop() and restoring by start(), the CLI. The figures are printed; the bounds are wide
below (a loaded machine is slower, never faster): tight figures are the benchmark's."""

from __future__ import annotations

import asyncio
import socket
import statistics
import subprocess
import sys
import time

import pytest

from geoloco.links.emulator import LinkEmulator, RelayThread
from geoloco.profiles import LinkProfile

LOCAL = "127.0.0.1"
BULK = 2_000_000
RATE_OVER = 1.10  # a shaped link is never faster than its rate (the first burst aside)
RATE_UNDER = 0.30  # nor much slower, even with the CPUs busy
SLOWER_S = 0.050  # what a loaded machine may add to a delay it emulates


async def _until_closed(relay: LinkEmulator, timeout: float = 10.0) -> None:
    """Until every relayed pair is closed (a close travels through both sides)."""
    deadline = time.monotonic() + timeout
    while relay.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _serve(handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, LOCAL, 0)
    return server, server.sockets[0].getsockname()[1]


async def _relay(port: int, profile: str, seed: int = 0) -> LinkEmulator:
    relay = LinkEmulator((LOCAL, 0), (LOCAL, port), LinkProfile.parse(profile), seed=seed)
    await relay.start()
    return relay


async def _ping_rtts(port: int, n: int, size: int = 64) -> list[float]:
    reader, writer = await asyncio.open_connection(LOCAL, port)
    rtts = []
    for _ in range(n):
        start = time.perf_counter()
        writer.write(b"p" * size)
        await reader.readexactly(size)
        rtts.append(time.perf_counter() - start)
    writer.close()
    return rtts


@pytest.mark.parametrize("profile, rate_bps, delay_s", [("8mbit", 8e6, 0.0), ("20mbit/10ms", 20e6, 0.01)])
def test_bulk_upload_rate_is_the_set_rate(profile, rate_bps, delay_s):
    async def run() -> float:
        done = asyncio.get_running_loop().create_future()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got = 0
            while data := await reader.read(65536):
                got += len(data)
                if got == BULK:
                    done.set_result(time.perf_counter())
            writer.close()

        server, port = await _serve(sink)
        relay = await _relay(port, profile)
        _, writer = await asyncio.open_connection(LOCAL, relay.port)
        start = time.perf_counter()
        writer.write(b"\x5a" * BULK)
        end = await asyncio.wait_for(done, 10)
        writer.close()
        assert relay.bytes_up == BULK and relay.bytes_down == 0
        await relay.stop()
        server.close()
        return BULK * 8 / (end - start - delay_s)

    measured = asyncio.run(run())
    print(f"{profile}: measured {measured / 1e6:.2f} Mbit/s")
    assert RATE_UNDER * rate_bps <= measured <= RATE_OVER * rate_bps


def test_download_direction_is_shaped_too():
    size = 1_000_000

    async def run() -> float:
        async def source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"\xa5" * size)
            await writer.drain()
            writer.close()

        server, port = await _serve(source)
        relay = await _relay(port, "10mbit/5ms")
        reader, writer = await asyncio.open_connection(LOCAL, relay.port)
        start = time.perf_counter()
        data = await asyncio.wait_for(reader.read(-1), 10)  # until the source closes
        elapsed = time.perf_counter() - start
        assert len(data) == size and relay.bytes_down == size
        writer.close()
        await relay.stop()
        server.close()
        return size * 8 / (elapsed - 0.005)

    measured = asyncio.run(run())
    print(f"download 10mbit: measured {measured / 1e6:.2f} Mbit/s")
    assert RATE_UNDER * 10e6 <= measured <= RATE_OVER * 10e6


@pytest.mark.parametrize("delay_ms", [20, 50])
def test_added_round_trip_time_is_twice_the_delay(delay_ms):
    async def run() -> tuple[float, float]:
        server, port = await _serve(_echo)
        direct = statistics.median(await _ping_rtts(port, 10))
        relay = await _relay(port, f"20mbit/{delay_ms}ms")
        shaped = statistics.median(await _ping_rtts(relay.port, 10))
        assert relay.bytes_up == relay.bytes_down == 640
        await relay.stop()
        server.close()
        return direct, shaped

    direct, shaped = asyncio.run(run())
    added = shaped - direct
    print(f"delay {delay_ms} ms: direct RTT {direct * 1e3:.2f} ms, added RTT {added * 1e3:.2f} ms")
    expected = 2 * delay_ms / 1e3
    assert expected - 0.002 <= added <= expected + 2 * SLOWER_S


def test_jitter_is_bounded_and_varies():
    async def run() -> list[float]:
        server, port = await _serve(_echo)
        relay = await _relay(port, "unlimited/20ms/10ms", seed=3)
        rtts = await _ping_rtts(relay.port, 31)
        await relay.stop()
        server.close()
        return rtts[1:]  # the first includes the relay's connect to the target

    rtts = asyncio.run(run())
    print(f"jitter RTTs: min {min(rtts) * 1e3:.1f} ms, median {statistics.median(rtts) * 1e3:.1f} ms, "
          f"max {max(rtts) * 1e3:.1f} ms")
    low, high = 2 * (0.020 - 0.010), 2 * (0.020 + 0.010)
    assert min(rtts) >= low - 0.001  # never faster than delay - jitter each way
    assert low <= statistics.median(rtts) <= high + 2 * SLOWER_S
    assert max(rtts) - min(rtts) > 0.010  # the samples really differ


def test_jitter_never_reorders_bytes():
    payload = b"".join(i.to_bytes(4, "big") for i in range(100_000))  # 400 kB of counters

    async def run() -> bytes:
        received = asyncio.get_running_loop().create_future()

        async def collect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.set_result(await reader.read(-1))
            writer.close()

        server, port = await _serve(collect)
        relay = await _relay(port, "40mbit/20ms/15ms", seed=1)
        _, writer = await asyncio.open_connection(LOCAL, relay.port)
        for i in range(0, len(payload), 3000):  # many small writes, many jitter samples
            writer.write(payload[i : i + 3000])
            await writer.drain()
        writer.write_eof()
        data = await asyncio.wait_for(received, 10)
        writer.close()
        await relay.stop()
        server.close()
        return data

    assert asyncio.run(run()) == payload


def test_many_concurrent_connections_share_the_link():
    async def one(port: int, i: int) -> bytes:
        reader, writer = await asyncio.open_connection(LOCAL, port)
        message = f"connection {i:03d} ".encode() * 100
        writer.write(message)
        echoed = await reader.readexactly(len(message))
        writer.close()
        return echoed == message

    async def run() -> None:
        server, port = await _serve(_echo)
        relay = await _relay(port, "50mbit/10ms/2ms")
        assert all(await asyncio.gather(*(one(relay.port, i) for i in range(40))))
        assert relay.bytes_up == relay.bytes_down == 40 * 1500
        await _until_closed(relay)
        assert relay.connections == 0  # every relayed pair closed after its client
        await relay.stop()
        server.close()

    asyncio.run(run())


def test_close_on_either_side_reaches_the_other():
    async def run() -> None:
        server_saw_eof = asyncio.get_running_loop().create_future()

        async def closer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            first = await reader.read(1)
            if first == b"c":  # the client will close: wait for its EOF
                server_saw_eof.set_result(await reader.read() == b"")
            writer.close()  # "s": the server closes first

        server, port = await _serve(closer)
        relay = await _relay(port, "20mbit/5ms")
        reader, writer = await asyncio.open_connection(LOCAL, relay.port)
        writer.write(b"c")
        await writer.drain()
        writer.close()
        assert await asyncio.wait_for(server_saw_eof, 2)

        reader, writer = await asyncio.open_connection(LOCAL, relay.port)
        writer.write(b"s")
        assert await asyncio.wait_for(reader.read(), 2) == b""  # the server's close arrived
        writer.close()
        await _until_closed(relay)
        assert relay.connections == 0
        await relay.stop()
        server.close()

    asyncio.run(run())


def test_stop_cuts_the_link_and_start_restores_it():
    async def run() -> None:
        server, port = await _serve(_echo)
        relay = await _relay(port, "20mbit/5ms")
        listen_port = relay.port
        reader, writer = await asyncio.open_connection(LOCAL, listen_port)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"hello"
        await relay.stop()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 2)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(LOCAL, listen_port)
        await relay.start()
        assert relay.port == listen_port
        assert await _ping_rtts(listen_port, 1)
        await relay.stop()
        server.close()

    asyncio.run(run())


def test_unreachable_target_closes_the_client():
    async def run() -> None:
        with socket.socket() as s:
            s.bind((LOCAL, 0))
            dead_port = s.getsockname()[1]  # bound but not listening: connections are refused
            relay = await _relay(dead_port, "20mbit")
            reader, writer = await asyncio.open_connection(LOCAL, relay.port)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(reader.readexactly(1), 2)
            writer.close()
            await relay.stop()

    asyncio.run(run())


def _sync_ping(port: int) -> bytes:
    with socket.create_connection((LOCAL, port), timeout=2) as sock:
        sock.sendall(b"ping")
        return sock.recv(4)


def test_relay_thread_for_blocking_code():
    async def echo_forever(ready: list, stop: asyncio.Event) -> None:
        server, port = await _serve(_echo)
        ready.append(port)
        await stop.wait()
        server.close()

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready: list[int] = []
    import threading

    thread = threading.Thread(target=loop.run_until_complete, args=(echo_forever(ready, stop),))
    thread.start()
    while not ready:
        time.sleep(0.01)
    try:
        with RelayThread(target=(LOCAL, ready[0]), profile=LinkProfile.parse("20mbit/10ms")) as relay:
            start = time.perf_counter()
            assert _sync_ping(relay.port) == b"ping"
            assert time.perf_counter() - start >= 0.018
            relay.stop()
            with pytest.raises(ConnectionRefusedError):
                _sync_ping(relay.port)
            relay.start()
            assert _sync_ping(relay.port) == b"ping"
            assert relay.bytes_up == relay.bytes_down == 8
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
        loop.close()


def test_command_line_entry_point():
    async def run() -> tuple[str, str]:
        server, port = await _serve(_echo)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "geoloco.links.emulator", "--listen", f"{LOCAL}:0",
            "--target", f"{LOCAL}:{port}", "--profile", "20mbit/10ms",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
        first = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        relay_port = int(first.split()[-3].rsplit(":", 1)[1])
        assert await _ping_rtts(relay_port, 2)
        proc.terminate()
        rest = (await asyncio.wait_for(proc.stdout.read(), 10)).decode()
        assert await proc.wait() == 0
        server.close()
        return first, rest

    first, rest = asyncio.run(run())
    assert first.startswith("link 20mbit/10ms/0ms: 127.0.0.1:")
    assert "bytes up 128, down 128" in rest


def test_cli_rejects_a_bad_profile():
    result = subprocess.run(
        [sys.executable, "-m", "geoloco.links.emulator", "--target", "127.0.0.1:1", "--profile", "fast"],
        capture_output=True, text=True, timeout=10,
    )
    assert result.returncode == 2
    assert "--profile" in result.stderr and "bad rate 'fast'" in result.stderr
