"""The worker's session seam (geoloco.worker.session, .stream, .faults) against real gRPC
servers on loopback: what a push puts on the wire, a round result decoded and applied as
it streams in, a stream cut before its digest, and what each faulty session does (under
real worker and coordinator processes: tests/integration/test_faulty_sessions.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
import torch

from geoloco import transport
from geoloco.compression import Compressor, FrameError, Layout, decode_frame
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.replica import apply_round, param_digest
from geoloco.worker.faults import FLIP_BY, Fault, FaultySession, FlippingResult
from geoloco.worker.session import Push, Session
from geoloco.worker.stream import DigestCheck, Disconnected

TOKEN = "seam"


class ScriptedCoordinator(pb_grpc.CoordinatorServicer):
    """Answers Join, records pushes, and sends a fixed list of round updates on Rounds."""

    def __init__(self, updates: list[pb.RoundUpdate], hold_open: bool = False) -> None:
        self.updates = updates
        self.hold_open = hold_open  # keep the stream open after the updates until cancelled
        self.pushes: list[list[pb.PushChunk]] = []

    def Join(self, request, context):  # noqa: N802 - gRPC method names
        return pb.JoinReply(worker_id=1, session="secret", current_round=0,
                            protocol_version=transport.PROTOCOL_VERSION)

    def Push(self, request_iterator, context):  # noqa: N802
        self.pushes.append(list(request_iterator))
        return pb.PushReply(accepted=True, round=self.pushes[-1][0].header.round)

    def Rounds(self, request, context):  # noqa: N802
        yield from self.updates
        if self.hold_open:
            done = threading.Event()
            context.add_callback(done.set)
            done.wait(timeout=30)


@pytest.fixture
def serve() -> Iterator[Callable[[ScriptedCoordinator], str]]:
    """Starts a ScriptedCoordinator on loopback; returns its address."""
    servers = []

    def start(servicer: ScriptedCoordinator) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=transport.SERVER_OPTIONS)
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def small_layout() -> Layout:
    return Layout.from_named_tensors([("w", torch.zeros(64, 64)), ("b", torch.zeros(64))])


def sparse_frames(layout: Layout, senders: int) -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    frames = []
    for sender in range(senders):
        deltas = [torch.randn(s.shape, generator=gen) for s in layout.specs]
        frames.append(Compressor(layout).compress(deltas, round=0, sender=sender))
    return frames


def round_updates(frames: list[bytes], digest: str | None) -> list[pb.RoundUpdate]:
    """Round 0's header, each frame in two data chunks, then its digest (if given)."""
    header = pb.RoundHeader(round=0, aggregation="sum", alpha=-1.0, next_task=pb.WorkerTask(round=1),
                            frames=[pb.FrameInfo(sender=i, weight=0.5, nbytes=len(f)) for i, f in enumerate(frames)])
    updates = [pb.RoundUpdate(header=header)]
    for f in frames:
        half = len(f) // 2
        updates += [pb.RoundUpdate(data=f[:half]), pb.RoundUpdate(data=f[half:])]
    if digest is not None:
        updates.append(pb.RoundUpdate(digest=pb.RoundDigest(round=0, digest=digest)))
    return updates


def expected_after(layout: Layout, frames: list[bytes]) -> list[torch.Tensor]:
    params = [torch.zeros(s.shape) for s in layout.specs]
    apply_round(params, [decode_frame(f, layout) for f in frames], [0.5] * len(frames), "sum", -1.0)
    return params


def test_push_sends_the_header_fields_then_the_frame_in_chunks(serve) -> None:
    servicer = ScriptedCoordinator([])
    session = Session(serve(servicer), TOKEN, connect_timeout_s=10)
    session.join("cpu")
    frame = bytes(range(256)) * (transport.CHUNK_BYTES // 256 + 3)
    reply = session.push(Push(round=3, frame=frame, compute_s=1.5, train_loss=2.25, partitions=[1, 2],
                              encode_s=0.25, apply_s=0.125))
    assert reply.accepted
    (chunks,) = servicer.pushes
    header = chunks[0].header
    assert (header.worker_id, header.session, header.round, header.total_bytes) == (1, "secret", 3, len(frame))
    assert (header.compute_seconds, header.train_loss, list(header.partitions)) == (1.5, 2.25, [1, 2])
    assert (header.encode_seconds, header.apply_seconds) == (0.25, 0.125)
    assert len(chunks) == 3 and b"".join(c.data for c in chunks[1:]) == frame
    session.close()


def test_faulty_session_drops_the_push_of_its_round_only(serve) -> None:
    servicer = ScriptedCoordinator([])
    session = FaultySession(serve(servicer), TOKEN, 10, fault=Fault.DROP_PUSH, rounds=[3])
    session.join("cpu")
    dropped = session.push(Push(round=3, frame=b"frame", compute_s=0.0, train_loss=0.0))
    assert not dropped.accepted and "drop" in dropped.reason
    assert servicer.pushes == []  # nothing reached the coordinator
    assert session.push(Push(round=4, frame=b"frame", compute_s=0.0, train_loss=0.0)).accepted
    assert len(servicer.pushes) == 1 and session.fired == [3]
    session.close()


def test_round_result_is_applied_as_it_streams_in_and_matches_apply_round(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 2)
    expected = expected_after(layout, frames)
    session = Session(serve(ScriptedCoordinator(round_updates(frames, param_digest(expected)))), TOKEN, 10)
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    theta = [torch.zeros(s.shape) for s in layout.specs]
    assert result.apply_to(theta) >= 0.0
    assert all(torch.equal(t, e) for t, e in zip(theta, expected, strict=True))
    assert result.nbytes == sum(len(f) for f in frames)
    assert DigestCheck(result.header, theta, result.digest).outcome()
    with pytest.raises(Disconnected, match="closed the Rounds stream"):
        session.next_result(1)
    session.close()


def test_stream_that_ends_before_the_digest_leaves_theta_unconfirmed(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 1)
    session = Session(serve(ScriptedCoordinator(round_updates(frames, digest=None))), TOKEN, 10)
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    theta = [torch.zeros(s.shape) for s in layout.specs]
    result.apply_to(theta)  # every frame came
    check = DigestCheck(result.header, theta, result.digest)
    assert not check.release()
    with pytest.raises(Disconnected, match="cut off"):
        DigestCheck(result.header, theta, result.digest).outcome()
    session.close()


def test_a_frame_that_does_not_decode_fails_the_apply(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 2)
    broken = bytearray(frames[1])
    broken[len(broken) // 2] ^= 0xFF
    session = Session(serve(ScriptedCoordinator(round_updates([frames[0], bytes(broken)], "x"))), TOKEN, 10)
    session.join("cpu")
    session.follow(0, layout)
    with pytest.raises(FrameError, match="frame from worker 1"):
        session.next_result(0).apply_to([torch.zeros(s.shape) for s in layout.specs])
    session.close()


def test_cut_stream_ends_the_result_being_taken(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 1)
    header_only = round_updates(frames, digest=None)[:1]  # the frame never comes
    session = FaultySession(serve(ScriptedCoordinator(header_only, hold_open=True)), TOKEN, 10,
                            fault=Fault.CUT_STREAM, rounds=[0])
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    with pytest.raises(Disconnected, match="cut off"):
        result.apply_to([torch.zeros(s.shape) for s in layout.specs])
    with pytest.raises(Disconnected):
        session.poll_result(1)
    session.close()


def test_flipping_result_changes_one_parameter_before_applying(serve) -> None:
    layout = small_layout()
    frames = sparse_frames(layout, 1)
    session = FaultySession(serve(ScriptedCoordinator(round_updates(frames, "x"))), TOKEN, 10,
                            fault=Fault.FLIP_PARAMETER, rounds=[0])
    session.join("cpu")
    session.follow(0, layout)
    result = session.next_result(0)
    assert isinstance(result, FlippingResult)
    theta = [torch.zeros(s.shape) for s in layout.specs]
    result.apply_to(theta)
    expected = [torch.zeros(s.shape) for s in layout.specs]
    expected[0].view(-1)[0] += FLIP_BY
    apply_round(expected, [decode_frame(frames[0], layout)], [0.5], "sum", -1.0)
    assert all(torch.equal(t, e) for t, e in zip(theta, expected, strict=True))
    session.close()

