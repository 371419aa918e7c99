"""A worker's calls to the coordinator (docs/protocol.md, "A worker's life"; wire:
protos/geoloco.proto): Join or reclaim, FetchState, Push, and the Rounds stream. The round
loop does all its I/O through this class, and tests inject faults by subclassing it
(geoloco.worker.faults).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from geoloco import __version__, transport
from geoloco.compression import Layout
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc as pb_grpc
from geoloco.worker.stream import Disconnected, RoundResult, RoundsFollower

log = logging.getLogger(__name__)


@dataclass
class Push:
    """This worker's frame of one round and what its PushHeader reports beside it."""

    round: int
    frame: bytes
    compute_s: float  # the inner loop
    train_loss: float  # mean inner-loop loss
    partitions: list[int] = field(default_factory=list)  # trained fresh this round
    encode_s: float = 0.0
    apply_s: float = 0.0  # applying the previous round result, before this round's compute
    digest_mismatches: int = 0  # this process's counts so far, for the coordinator's summary
    resyncs: int = 0
    density: float = 0.0  # the frame's top-k density (0: a dense frame)
    upload_rate: float = 0.0  # bytes/s of the previous push (0: none measured yet)


@dataclass
class State:
    """The global parameters at the start of ``round`` (one dense fp32 frame) and the
    worker's task in that round, as FetchState served them."""

    round: int
    digest: str
    task: pb.WorkerTask
    data: bytes
    next_task: pb.WorkerTask | None = None  # the worker's task in round + 1


def read_identity(path: Path) -> tuple[int, str]:
    """The worker id and session that an earlier Join assigned (the container entrypoint
    joins as root to shape the link, then the worker reclaims that identity)."""
    try:
        data = json.loads(Path(path).read_text())
        return int(data["worker_id"]), str(data["session"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"identity file {str(path)!r} is unreadable or lacks worker_id/session: {exc}") from None


class Session:
    """One worker's connection to the coordinator: its id and session secret, the channel,
    and the Rounds stream it follows. A failed call raises Disconnected when rejoining may
    help (UNAVAILABLE and the like), RuntimeError when it cannot."""

    def __init__(self, address: str, token: str, connect_timeout_s: float = 60.0,
                 identity: tuple[int, str] | None = None,
                 security: transport.ChannelSecurity | None = None) -> None:
        self.address = address
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.security = security  # TLS of the channel (geoloco.tls); None: plaintext
        self.worker_id, self.secret = identity if identity is not None else (None, "")
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CoordinatorStub | None = None
        self._follower: RoundsFollower | None = None
        self.stopping = threading.Event()  # stop() was called: no call is retried

    def join(self, device: str) -> pb.JoinReply:
        """Join, or reclaim this session's id once it has one, retrying with exponential
        backoff until connect_timeout_s (transport.join_with_backoff). Stops the Rounds
        stream of the previous connection."""
        request = pb.JoinRequest(token=self.token, capabilities=pb.Capabilities(
            device=device, hostname=socket.gethostname(), version=__version__,
            threads=torch.get_num_threads()), protocol_version=transport.PROTOCOL_VERSION)
        reclaiming = self.worker_id is not None
        if reclaiming:
            request.reclaim_worker_id, request.reclaim_session = self.worker_id, self.secret

        def call(channel: grpc.Channel, deadline_s: float) -> pb.JoinReply:
            return pb_grpc.CoordinatorStub(channel).Join(request, timeout=deadline_s)

        self.close()
        reply, self._channel = transport.join_with_backoff(self.address, call, self.connect_timeout_s,
                                                           sleep=self._backoff, security=self.security)
        mismatch = transport.protocol_mismatch("worker", "coordinator", reply.protocol_version)
        if mismatch is not None:
            self.close()
            raise transport.JoinRefused(mismatch)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self.worker_id, self.secret = reply.worker_id, reply.session
        log.info("%s as worker %d at %s (open round %d, device %s, straggler profile %r)",
                 "rejoined" if reclaiming else "joined", reply.worker_id, self.address,
                 reply.current_round, device, reply.straggler_profile or "none")
        return reply

    def fetch_state(self) -> State:
        """The coordinator's parameters at the start of its open round, and this worker's task."""
        data, first = bytearray(), None
        request = pb.FetchStateRequest(worker_id=self.worker_id, session=self.secret)
        try:
            for chunk in self._connected().FetchState(request, metadata=self._metadata()):
                first = first or chunk
                data += chunk.data
        except grpc.RpcError as exc:
            raise _rpc_failure("FetchState", exc) from None
        if first is None or len(data) != first.total_bytes:
            raise Disconnected(f"FetchState ended after {len(data)} bytes")
        next_task = first.next_task if first.HasField("next_task") else None
        return State(first.round, first.digest, first.task, bytes(data), next_task)

    def push(self, push: Push) -> pb.PushReply:
        """Send one frame, header first, in chunks; the coordinator's verdict."""
        header = pb.PushHeader(worker_id=self.worker_id, session=self.secret, round=push.round,
                               total_bytes=len(push.frame), compute_seconds=push.compute_s,
                               train_loss=push.train_loss, partitions=push.partitions,
                               encode_seconds=push.encode_s, apply_seconds=push.apply_s,
                               digest_mismatches=push.digest_mismatches, resyncs=push.resyncs,
                               density=push.density, upload_rate=push.upload_rate)
        chunks = [pb.PushChunk(header=header)] + [pb.PushChunk(data=c) for c in transport.chunks(push.frame)]
        try:
            return self._connected().Push(iter(chunks), metadata=self._metadata())
        except grpc.RpcError as exc:
            raise _rpc_failure("Push", exc) from None

    def follow(self, from_round: int, layout: Layout) -> None:
        """(Re)open the Rounds stream from ``from_round``; its frames decode against ``layout``."""
        self._stop_following()
        request = pb.RoundsRequest(worker_id=self.worker_id, session=self.secret, from_round=from_round)
        self._follower = RoundsFollower(self._connected().Rounds(request, metadata=self._metadata()), layout)

    def keep_alive(self, from_round: int) -> None:
        """From a Join until ``follow``: a Rounds stream that carries keepalives only, so the
        coordinator knows this worker is alive while it builds its trainer or fetches the
        state, however long that takes (coordinator.liveness_s counts only while a worker
        has no stream)."""
        self._stop_following()
        request = pb.RoundsRequest(worker_id=self.worker_id, session=self.secret,
                                   from_round=from_round, starting=True)
        self._follower = RoundsFollower(self._connected().Rounds(request, metadata=self._metadata()))

    def poll_result(self, round_: int) -> RoundResult | None:
        """The result of round ``round_`` (or a later one) if its header is in, else None."""
        return self._followed().next_result(round_, wait=False)

    def next_result(self, round_: int) -> RoundResult:
        """The result of round ``round_`` (or a later one), waiting for its header."""
        return self._followed().next_result(round_, wait=True)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return transport.caller_metadata(self.worker_id, self.secret)

    def _backoff(self, seconds: float) -> None:
        """Join's wait before a retry; Disconnected at once after stop()."""
        if self.stopping.wait(seconds):
            raise Disconnected("stopped while waiting to join again")

    def stop(self) -> None:
        """Close, and end any Join retry at once (a worker that is stopping)."""
        self.stopping.set()
        self.close()

    def close(self) -> None:
        self._stop_following()
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    def _connected(self) -> pb_grpc.CoordinatorStub:
        if self._stub is None:
            raise Disconnected("not connected (closed, or not joined yet)")
        return self._stub

    def _followed(self) -> RoundsFollower:
        if self._follower is None:
            raise Disconnected("not following the Rounds stream")
        return self._follower

    def _stop_following(self) -> None:
        if self._follower is not None:
            self._follower.stop()
            self._follower = None


def _rpc_failure(call: str, exc: grpc.RpcError) -> Exception:
    """UNAVAILABLE (and friends) → Disconnected (rejoin); anything else is fatal."""
    if exc.code() in transport.RETRYABLE or exc.code() == grpc.StatusCode.CANCELLED:
        return Disconnected(f"{call} failed: {exc.code().name} {exc.details()}")
    return RuntimeError(f"{call} failed: {exc.code().name}: {exc.details()}")
