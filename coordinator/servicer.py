"""The gRPC servicer of the round protocol (Join, FetchState, Push, Rounds): validates each
caller and each frame, and streams round results; the state lives in coordinator.server
(docs/protocol.md; wire: protos/geoloco.proto)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from geoloco import transport
from geoloco.compression import Frame, FrameError, decode_frame
from geoloco.coordinator.registry import RegistryError, WorkerRecord
from geoloco.coordinator.rounds import Arrival, RoundError
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc

if TYPE_CHECKING:
    from geoloco.coordinator.server import Coordinator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClosedRound:
    """A broadcast round result: the header (without the per-worker next task), the
    chosen frames back to back, and the digest of the parameters after the round, which
    the coordinator sets once it has applied the round (the broadcast does not wait)."""

    header: pb.RoundHeader
    data: bytes
    digest: Future[str] = field(default_factory=Future)

    @property
    def round(self) -> int:
        return self.header.round

    @property
    def finished(self) -> bool:
        return self.header.finished


class CoordinatorServicer(geoloco_pb2_grpc.CoordinatorServicer):
    """The four RPCs; each validates its caller and hands the work to ``Coordinator``."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            return self.core.join(request)
        except RegistryError as exc:
            log.warning("join refused: %s", exc)
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise  # unreachable: abort raises

    def FetchState(self, request: pb.FetchStateRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.StateChunk]:
        record = self._authenticate(request.worker_id, request.session, context)
        round, digest, data = self.core.state_snapshot(record)
        task = self.core.task_for(record.worker_id, round)
        log.info("worker %d fetches the state of round %d (%d bytes)", record.worker_id, round,
                 len(data))
        for i, chunk in enumerate(transport.chunks(data)):
            if i == 0:
                yield pb.StateChunk(round=round, digest=digest, total_bytes=len(data),
                                    data=chunk, task=task)
            else:
                yield pb.StateChunk(data=chunk)

    def Push(self, request_iterator: Iterator[pb.PushChunk],
             context: grpc.ServicerContext) -> pb.PushReply:
        header, reason = self._push_header(request_iterator)
        if reason is None:
            reason = self._receive(header, request_iterator, context)
        round = header.round if header is not None else self.core.open_round()
        if reason is not None:
            who = header.worker_id if header is not None else "?"
            log.warning("push from worker %s for round %d rejected: %s", who, round, reason)
            return pb.PushReply(accepted=False, reason=reason, round=round)
        return pb.PushReply(accepted=True, round=round)

    def _push_header(self, it: Iterator[pb.PushChunk]) -> tuple[pb.PushHeader | None, str | None]:
        try:
            first = next(it)
        except StopIteration:
            first = None
        if first is None or not first.HasField("header"):
            self.core.count_rejected()
            return None, "a push must start with a PushHeader message"
        return first.header, None

    def _receive(self, h: pb.PushHeader, it: Iterator[pb.PushChunk],
                 context: grpc.ServicerContext) -> str | None:
        """Authenticate, check round and size, read and decode the frame, then accept it.
        Returns the reason for a rejection, or None."""
        try:
            record = self.core.authenticate(h.worker_id, h.session)
            self.core.check_push(record, h.round)
        except (RegistryError, RoundError) as exc:
            return str(exc)
        try:
            data = self._read_frame(h, it)
            frame = self._decode(h, data)
        except FrameError as exc:
            self.core.count_rejected()
            return str(exc)
        try:
            self.core.accept(Arrival(h.worker_id, data, frame, h.compute_seconds, h.train_loss,
                                     tuple(h.partitions), h.encode_seconds, h.apply_seconds))
        except RoundError as exc:
            return str(exc)
        return None

    def _read_frame(self, h: pb.PushHeader, it: Iterator[pb.PushChunk]) -> bytes:
        if not 0 < h.total_bytes <= self.core.max_frame_bytes:
            raise FrameError(f"total_bytes {h.total_bytes} is outside 1..{self.core.max_frame_bytes} "
                             "(the largest frame this model's layout allows)")
        parts, got = [], 0
        try:
            for msg in it:
                if not msg.HasField("data"):
                    raise FrameError("a second PushHeader inside one push")
                got += len(msg.data)
                if got > h.total_bytes:
                    raise FrameError(f"frame longer than its total_bytes {h.total_bytes}")
                parts.append(msg.data)
        except grpc.RpcError as exc:
            raise FrameError(f"stream broke after {got} of {h.total_bytes} bytes (client cancelled "
                             f"or connection lost: {exc.code() if hasattr(exc, 'code') else exc})"
                             ) from None
        if got < h.total_bytes:
            raise FrameError(f"truncated frame: got {got} of {h.total_bytes} bytes")
        return b"".join(parts)

    def _decode(self, h: pb.PushHeader, data: bytes) -> Frame:
        frame = decode_frame(data, self.core.layout)
        if frame.round != h.round or frame.sender != h.worker_id:
            raise FrameError(f"frame says round {frame.round} from worker {frame.sender}, "
                             f"the header round {h.round} from worker {h.worker_id}")
        want = "sparse" if self.core.cfg.compression.method == "sparseloco" else "dense"
        if frame.kind != want:
            raise FrameError(f"a {frame.kind} frame, but this run ({self.core.cfg.compression.method}) "
                             f"takes {want} frames")
        return frame

    def Rounds(self, request: pb.RoundsRequest,
               context: grpc.ServicerContext) -> Iterator[pb.RoundUpdate]:
        record = self._authenticate(request.worker_id, request.session, context)
        worker = record.worker_id
        sub, backlog = self.core.subscribe(worker, request.from_round)
        last_sent = threading.Event()  # the finished run's last message is on its way

        def on_end() -> None:
            sub.put(None)
            # a worker that got the last message may hang up before gRPC asks this stream
            # for more, and then it never resumes: the end of the call says it instead
            if last_sent.is_set():
                self.core.mark_finish_delivered(worker)

        context.add_callback(on_end)
        log.info("worker %d follows rounds from %d (%d held results replayed)", worker,
                 request.from_round, len(backlog))
        try:
            yield from self._follow(worker, sub, backlog, context, last_sent)
        finally:
            self.core.unsubscribe(worker, sub)

    def _follow(self, worker: int, sub: queue.Queue, backlog: list[ClosedRound],
                context: grpc.ServicerContext, last_sent: threading.Event) -> Iterator[pb.RoundUpdate]:
        pending = deque(backlog)
        while context.is_active():
            if pending:
                closed = pending.popleft()
            else:
                try:
                    closed = sub.get(timeout=transport.KEEPALIVE_S)
                except queue.Empty:
                    yield pb.RoundUpdate(keepalive=pb.Keepalive(round=self.core.open_round()))
                    continue
            if closed is None:
                return
            yield from self._round_messages(worker, closed, context, last_sent)
            if closed.finished:
                _await_hang_up(context, self.core.cfg.coordinator.deadline_s)
                self.core.mark_finish_delivered(worker)
                return

    def _round_messages(self, worker: int, closed: ClosedRound, context: grpc.ServicerContext,
                        last_sent: threading.Event) -> Iterator[pb.RoundUpdate]:
        """Header, frame data cut at frame boundaries (a worker decodes each frame while the
        next one travels), then the digest, waited for only after the data is out; for the
        run's last round, last_sent is set as the digest goes."""
        header = pb.RoundHeader()
        header.CopyFrom(closed.header)
        header.next_task.CopyFrom(self.core.task_for(worker, closed.round + 1))
        yield pb.RoundUpdate(header=header)
        view, start = memoryview(closed.data), 0
        for info in closed.header.frames:
            for chunk in transport.chunks(view[start:start + info.nbytes]):
                yield pb.RoundUpdate(data=chunk)
            start += info.nbytes
        digest = _await_digest(closed, context)
        if digest is not None:
            if closed.finished:
                last_sent.set()
            yield pb.RoundUpdate(digest=pb.RoundDigest(round=closed.round, digest=digest))

    def _authenticate(self, worker_id: int, session: str,
                      context: grpc.ServicerContext) -> WorkerRecord:
        try:
            return self.core.authenticate(worker_id, session)
        except RegistryError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise  # unreachable: abort raises


def _await_digest(closed: ClosedRound, context: grpc.ServicerContext) -> str | None:
    """The round's digest once the coordinator has applied the round; None if the caller
    hung up first. A failed round loop (the future holds its exception) ends the stream."""
    while context.is_active():
        try:
            return closed.digest.result(timeout=transport.KEEPALIVE_S)
        except FutureTimeout:
            continue
    return None


def _await_hang_up(context: grpc.ServicerContext, limit_s: float) -> None:
    """Hold a finished stream open until the worker hangs up: it does so only after it
    has received and applied the last result, so the final bytes are not cut off."""
    deadline = time.monotonic() + limit_s
    while context.is_active() and time.monotonic() < deadline:
        time.sleep(0.05)
