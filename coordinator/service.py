"""The gRPC servicer of the round protocol (Join, FetchState, Push, Rounds): validates each
caller and each frame and streams round results, over a narrow interface to the
coordinator's state (docs/protocol.md; wire: protos/geoloco.proto)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import Protocol

import grpc

from geoloco import transport
from geoloco.compression import Frame, FrameError, Layout, decode_frame
from geoloco.config import RunConfig
from geoloco.coordinator.gradient_coding import GradientCode
from geoloco.coordinator.limits import (
    JOIN_REQUEST_BYTES,
    JOIN_REQUEST_S,
    IdleTimeout,
    JoinLimiter,
    LimitExceeded,
    SourceGate,
    StreamSlots,
    Watchdog,
)
from geoloco.coordinator.registry import RegistryError, WorkerRecord, slot_of_name
from geoloco.coordinator.rounds import Arrival, ClosedRound, RoundError, worker_task
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc
from geoloco.tls import peer_fingerprint, peer_name

log = logging.getLogger(__name__)

FRAME_OVERHEAD_BYTES = 64 * 1024  # headroom over a dense fp32 frame for headers and tables
# frames validated at once: decode_frame already uses the codec's threads, and each check
# holds temporary buffers of the frame's size, so more at once only costs memory
VALIDATING_AT_ONCE = 2
EXTRA_CHUNKS = 64  # a frame may come in this many more chunks than CHUNK_BYTES pieces
JOIN_METHOD = "/geoloco.v1.Coordinator/Join"
CALLER_TEXT_CHARS = 64  # hostname, device and version as logged and kept: at most this long


class ServiceState(Protocol):
    """What the servicer may read and change of the coordinator's state (thread-safe)."""

    def token_matches(self, token: str) -> bool:
        """Whether ``token`` is the run's token (constant time)."""

    def join(self, token: str, hostname: str, device: str, reclaim_id: int | None,
             reclaim_session: str, cert: str | None, *,
             cert_slot: int | None = None) -> tuple[WorkerRecord, int]:
        """The worker's record and the current round; RegistryError if refused.
        ``cert_slot``: the slot the caller's certificate name binds."""

    def authenticate(self, worker_id: int, session: str, cert: str | None) -> WorkerRecord:
        """The worker's record; RegistryError if unknown, the session is wrong or comes
        over another certificate than the worker joined with."""

    def snapshot(self, record: WorkerRecord) -> tuple[int, str, bytes]:
        """(round, digest, dense fp32 frame) of the parameters at the current round's start."""

    def check_push(self, worker: int, round: int) -> None:
        """RoundError if ``worker`` may not push for ``round`` now."""

    def accept(self, arrival: Arrival) -> None:
        """Add a decoded frame to the current round; RoundError if it closed meanwhile."""

    def count_rejected(self, worker: int | None = None) -> None:
        """Count a push refused for its header or its frame."""

    def follow(self, worker: int, from_round: int) -> AbstractContextManager[
            tuple[queue.Queue[ClosedRound | None], list[ClosedRound]]]:
        """While open: a queue of later round results (None: end), and the held ones."""

    def mark_finish_delivered(self, worker: int) -> None:
        """``worker`` has the finished run's last result."""

    def open_round(self) -> int:
        """The current round's number."""


class CoordinatorServicer(geoloco_pb2_grpc.CoordinatorServicer):
    """The four RPCs; each validates its caller (from the request, or for Push from the
    call's metadata before the stream is read) and takes one of the caller's slots, then
    hands the work to the state (docs/security.md, "Hostile clients")."""

    def __init__(self, state: ServiceState, cfg: RunConfig, layout: Layout,
                 code: GradientCode) -> None:
        self.state = state
        self.cfg = cfg
        self.layout = layout
        self.code = code
        self.max_frame_bytes = layout.numel * 4 + FRAME_OVERHEAD_BYTES
        self.frame_kind = "sparse" if cfg.compression.method == "sparseloco" else "dense"
        self.validating = threading.BoundedSemaphore(VALIDATING_AT_ONCE)
        self.slots = StreamSlots()
        self.joins = JoinLimiter()
        self.unauthenticated = SourceGate()
        self.watchdog = Watchdog()

    def JoinCall(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> pb.JoinReply:
        """Join as the server runs it (a client stream of raw bytes, `add_to_server`), so
        that nothing is held before the request is checked: a place among the open
        unauthenticated calls of its source (else RESOURCE_EXHAUSTED at once), the request
        within JOIN_REQUEST_S (else the call is cancelled) and at most JOIN_REQUEST_BYTES."""
        try:
            place = self.unauthenticated.enter(_peer_host(context.peer()))
        except LimitExceeded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise  # unreachable: abort raises
        with place:
            return self.Join(self._join_request(requests, context), context)

    def _join_request(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> pb.JoinRequest:
        timeout = IdleTimeout(self.watchdog, context.cancel, first_s=JOIN_REQUEST_S)
        try:  # the request, then the end of the stream (a unary client sends both at once)
            data = next(requests, None)
            extra = next(requests, None) if data is not None else None
        except grpc.RpcError:
            data = extra = None
        finally:
            timeout.close()
        if extra is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Join carries one JoinRequest")
        if data is None:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if timeout.expired else
                          grpc.StatusCode.INVALID_ARGUMENT, "a Join must send its JoinRequest within "
                          f"{JOIN_REQUEST_S:g} s")
        if len(data) > JOIN_REQUEST_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a JoinRequest of {len(data)} bytes; "
                          f"at most {JOIN_REQUEST_BYTES} are allowed")
        try:
            return pb.JoinRequest.FromString(data)
        except Exception:  # protobuf's DecodeError, or a nested parse failure
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a JoinRequest")
            raise  # unreachable: abort raises

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        reclaim = request.reclaim_worker_id if request.HasField("reclaim_worker_id") else None
        caps, cert = request.capabilities, peer_fingerprint(context)
        if not self.state.token_matches(request.token):
            self._refuse_wrong_token(cert, context)
        mismatch = transport.protocol_mismatch("coordinator", "worker", request.protocol_version)
        if mismatch is not None:
            log.warning("join from %s refused: %s", context.peer(), mismatch)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        hostname, device = caller_text(caps.hostname), caller_text(caps.device)
        try:
            record, current = self.state.join(request.token, hostname, device, reclaim,
                                              request.reclaim_session, cert,
                                              cert_slot=slot_of_name(peer_name(context)))
        except RegistryError as exc:
            log.warning("join from %s refused: %s", context.peer(), exc)
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise  # unreachable: abort raises
        log.info("worker %d %s from %s at %s (%s), round %d", record.worker_id,
                 "reclaimed its id" if reclaim is not None else "joined",
                 hostname or "?", context.peer(), device or "?", current)
        return pb.JoinReply(
            worker_id=record.worker_id, session=record.session,
            run_config_json=self.cfg.to_json(), current_round=current,
            layout_digest=self.layout.digest, wan_profile=self._wan_text(record.worker_id),
            straggler_profile=self.cfg.stragglers.profile_for(record.worker_id),
            protocol_version=transport.PROTOCOL_VERSION,
        )

    def _refuse_wrong_token(self, cert: str | None, context: grpc.ServicerContext) -> None:
        """PERMISSION_DENIED, counted against the caller's address and certificate; once
        either has no failed Join left, RESOURCE_EXHAUSTED without a log line."""
        keys = (_peer_host(context.peer()),) + ((f"cert:{cert}",) if cert else ())
        try:
            self.joins.check(*keys)
        except LimitExceeded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        self.joins.failed(*keys)
        log.warning("join from %s refused: wrong token", context.peer())
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      "wrong token: the run's token (coordinator.token) does not match; "
                      "start the worker with the coordinator's token")

    def _wan_text(self, worker_id: int) -> str:
        per = self.cfg.network.per_worker
        return per[worker_id] if worker_id < len(per) else self.cfg.network.wan

    def task_for(self, worker: int, round: int) -> pb.WorkerTask:
        """What ``worker`` trains and sends in ``round`` (the gradient code decides)."""
        return worker_task(self.code, worker, round, self.cfg.rounds)

    def FetchState(self, request: pb.FetchStateRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.StateChunk]:
        record = self._authenticate(request.worker_id, request.session, context)
        with self._slot(record.worker_id, "FetchState", context), self.state.snapshot(record) as snap:
            round, digest, data = snap
            task = self.task_for(record.worker_id, round)
            log.info("worker %d fetches the state of round %d (%d bytes)", record.worker_id, round,
                     len(data))
            for i, chunk in enumerate(transport.chunks(data)):
                if i == 0:
                    yield pb.StateChunk(round=round, digest=digest, total_bytes=len(data),
                                        data=chunk, task=task,
                                        next_task=self.task_for(record.worker_id, round + 1))
                else:
                    yield pb.StateChunk(data=chunk)
            if round >= self.cfg.rounds:  # the run's final state: what its last result would give
                self.state.mark_finish_delivered(record.worker_id)

    def Push(self, request_iterator: Iterator[pb.PushChunk],
             context: grpc.ServicerContext) -> pb.PushReply:
        worker, session = _caller(context)
        self._authenticate(worker, session, context)
        with self._slot(worker, "Push", context):
            timeout = IdleTimeout(self.watchdog, context.cancel)
            try:
                header, reason = self._push_header(request_iterator, worker, session, timeout)
                if reason is None:
                    reason = self._receive(header, request_iterator, timeout)
            finally:
                timeout.close()
        round = header.round if header is not None else self.state.open_round()
        if reason is not None:
            log.warning("push from worker %d for round %d rejected: %s", worker, round, reason)
            return pb.PushReply(accepted=False, reason=reason, round=round)
        return pb.PushReply(accepted=True, round=round)

    def _push_header(self, it: Iterator[pb.PushChunk], worker: int, session: str,
                     timeout: IdleTimeout) -> tuple[pb.PushHeader | None, str | None]:
        try:
            first = next(it, None)
        except grpc.RpcError:
            first, reason = None, ("no PushHeader within the first-message deadline"
                                   if timeout.expired else "the stream broke before its PushHeader")
        else:  # a call the deadline cancelled may also read as a stream that ended
            reason = ("no PushHeader within the first-message deadline" if first is None and timeout.expired
                      else "a push must start with a PushHeader message")
        if first is not None and first.HasField("header"):
            h = first.header
            if h.worker_id == worker and h.session == session:
                timeout.fed()
                return h, None
            reason = (f"the PushHeader (worker {h.worker_id}) does not match the call's metadata "
                      f"(worker {worker} and its session)")
        self.state.count_rejected(worker)
        return None, reason

    def _receive(self, h: pb.PushHeader, it: Iterator[pb.PushChunk], timeout: IdleTimeout) -> str | None:
        """Check round and size, read and decode the frame, then accept it.
        Returns the reason for a rejection, or None."""
        try:
            self.state.check_push(h.worker_id, h.round)
        except RoundError as exc:
            return str(exc)
        try:
            data = self._read_frame(h, it, timeout)
            received = time.monotonic()  # the bytes are in; validating them is the coordinator's time
            with self.validating:
                decode_started = time.monotonic()
                frame = self._decode(h, data)
                norm, max_abs = frame.magnitudes()
                decode_seconds = time.monotonic() - decode_started
        except FrameError as exc:
            self.state.count_rejected(h.worker_id)
            return str(exc)
        try:
            self.state.accept(Arrival(h.worker_id, data, frame, h.compute_seconds, h.train_loss,
                                      tuple(h.partitions), h.encode_seconds, h.apply_seconds,
                                      decode_seconds=decode_seconds, received_at=received,
                                      norm=norm, max_abs=max_abs,
                                      digest_mismatches=h.digest_mismatches, resyncs=h.resyncs,
                                      density=h.density, upload_rate=h.upload_rate))
        except RoundError as exc:
            return str(exc)
        return None

    def _read_frame(self, h: pb.PushHeader, it: Iterator[pb.PushChunk], timeout: IdleTimeout) -> bytes:
        if not 0 < h.total_bytes <= self.max_frame_bytes:
            raise FrameError(f"total_bytes {h.total_bytes} is outside 1..{self.max_frame_bytes} "
                             "(the largest frame this model's layout allows)")
        max_chunks = -(-h.total_bytes // transport.CHUNK_BYTES) + EXTRA_CHUNKS
        parts, got = [], 0
        try:
            for msg in it:
                timeout.fed()
                if not msg.HasField("data"):
                    raise FrameError("a second PushHeader inside one push")
                if not msg.data:
                    raise FrameError("an empty data chunk")
                got += len(msg.data)
                if got > h.total_bytes:
                    raise FrameError(f"frame longer than its total_bytes {h.total_bytes}")
                parts.append(msg.data)
                if len(parts) > max_chunks:
                    raise FrameError(f"more than {max_chunks} chunks for a frame of {h.total_bytes} bytes")
        except grpc.RpcError as exc:
            why = "no data within the idle deadline" if timeout.expired else "client cancelled or connection lost"
            raise FrameError(f"stream broke after {got} of {h.total_bytes} bytes ({why}: "
                             f"{exc.code() if hasattr(exc, 'code') else exc})") from None
        if got < h.total_bytes and timeout.expired:  # cancelled: may read as a stream that ended
            raise FrameError(f"stream broke after {got} of {h.total_bytes} bytes (no data within the "
                             "idle deadline)")
        if got < h.total_bytes:
            raise FrameError(f"truncated frame: got {got} of {h.total_bytes} bytes")
        return b"".join(parts)

    def _decode(self, h: pb.PushHeader, data: bytes) -> Frame:
        frame = decode_frame(data, self.layout)
        if frame.round != h.round or frame.sender != h.worker_id:
            raise FrameError(f"frame says round {frame.round} from worker {frame.sender}, "
                             f"the header round {h.round} from worker {h.worker_id}")
        if frame.kind != self.frame_kind:
            raise FrameError(f"a {frame.kind} frame, but this run ({self.cfg.compression.method}) "
                             f"takes {self.frame_kind} frames")
        return frame

    def Rounds(self, request: pb.RoundsRequest,
               context: grpc.ServicerContext) -> Iterator[pb.RoundUpdate]:
        record = self._authenticate(request.worker_id, request.session, context)
        worker = record.worker_id
        if request.starting:
            with self._slot(worker, "Rounds", context), \
                    self.state.follow(worker, request.from_round, starting=True) as (sub, _):
                context.add_callback(lambda: sub.put(None))
                log.info("worker %d is starting (its stream keeps it live)", worker)
                yield from self._keep_alive(sub, context)
            return
        with self._slot(worker, "Rounds", context), \
                self.state.follow(worker, request.from_round) as (sub, backlog):
            last_sent = threading.Event()  # the finished run's last message is on its way

            def on_end() -> None:
                sub.put(None)
                # a worker that got the last message may hang up before gRPC asks this
                # stream for more, and then it never resumes: the end of the call says it
                if last_sent.is_set():
                    self.state.mark_finish_delivered(worker)

            context.add_callback(on_end)
            if request.from_round < self.state.open_round() and (
                    not backlog or backlog[0].round > request.from_round):
                context.abort(grpc.StatusCode.OUT_OF_RANGE,
                              f"the result of round {request.from_round} is no longer held; "
                              "fetch the state")
            log.info("worker %d follows rounds from %d (%d held results replayed)", worker,
                     request.from_round, len(backlog))
            yield from self._follow(worker, sub, backlog, context, last_sent)

    def _keep_alive(self, sub: queue.Queue, context: grpc.ServicerContext) -> Iterator[pb.RoundUpdate]:
        """A starting worker's stream: keepalives only, until the worker opens its real
        stream (which ends this one), hangs up or dies; the round results it misses are
        what FetchState and its real stream give it."""
        while context.is_active():
            try:
                if sub.get(timeout=transport.KEEPALIVE_S) is None:
                    return
            except queue.Empty:
                yield pb.RoundUpdate(keepalive=pb.Keepalive(round=self.state.open_round()))

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
                    yield pb.RoundUpdate(keepalive=pb.Keepalive(round=self.state.open_round()))
                    continue
            if closed is None:
                return
            yield from self._round_messages(worker, closed, context, last_sent)
            if closed.finished:
                _await_hang_up(context, self.cfg.coordinator.deadline_s)
                self.state.mark_finish_delivered(worker)
                return

    def _round_messages(self, worker: int, closed: ClosedRound, context: grpc.ServicerContext,
                        last_sent: threading.Event) -> Iterator[pb.RoundUpdate]:
        """Header, frame data cut at frame boundaries (a worker decodes each frame while the
        next one travels), then the digest, waited for only after the data is out; for the
        run's last round, last_sent is set as the digest goes."""
        header = pb.RoundHeader()
        header.CopyFrom(closed.header)
        header.next_task.CopyFrom(self.task_for(worker, closed.round + 1))
        header.task_after_next.CopyFrom(self.task_for(worker, closed.round + 2))
        if worker in closed.settlements:
            header.settlement.CopyFrom(closed.settlements[worker])
        yield pb.RoundUpdate(header=header)
        for part in closed.parts:
            for chunk in transport.chunks(part):
                yield pb.RoundUpdate(data=chunk)
        digest = _await_digest(closed, context)
        if digest is not None:
            if closed.finished:
                last_sent.set()
            yield pb.RoundUpdate(digest=pb.RoundDigest(round=closed.round, digest=digest))

    def _authenticate(self, worker_id: int, session: str,
                      context: grpc.ServicerContext) -> WorkerRecord:
        try:
            return self.state.authenticate(worker_id, session, peer_fingerprint(context))
        except RegistryError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise  # unreachable: abort raises

    def _slot(self, worker: int, rpc: str, context: grpc.ServicerContext) -> AbstractContextManager[None]:
        """One of ``worker``'s slots for ``rpc``, or RESOURCE_EXHAUSTED."""
        try:
            return self.slots.acquire(worker, rpc)
        except LimitExceeded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise  # unreachable: abort raises


def add_to_server(servicer: CoordinatorServicer, server: grpc.Server) -> None:
    """Serve ``servicer``'s four RPCs on ``server``, Join as a client stream of raw bytes
    (the same bytes on the wire as a unary call) so that its handler runs before the
    request is read: `CoordinatorServicer.JoinCall`."""
    geoloco_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    join = grpc.stream_unary_rpc_method_handler(
        servicer.JoinCall, response_serializer=pb.JoinReply.SerializeToString)
    service = JOIN_METHOD.split("/")[1]
    server.add_registered_method_handlers(service, {"Join": join})


def caller_text(text: str, limit: int = CALLER_TEXT_CHARS) -> str:
    """What a caller said about itself (hostname, device), cut to ``limit`` characters and
    with every character that is not printable escaped, so that it cannot forge a log line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text[:limit])


def parse_worker_id(text: str) -> int | None:
    """A worker id from caller text: ASCII decimal digits, at most 9 of them; else None."""
    return int(text) if text.isascii() and text.isdecimal() and len(text) <= 9 else None


def _caller(context: grpc.ServicerContext) -> tuple[int, str]:
    """(worker id, session) from the call's metadata; UNAUTHENTICATED without them."""
    metadata = dict(context.invocation_metadata() or ())
    worker = parse_worker_id(metadata.get(transport.WORKER_ID_KEY, ""))
    session = metadata.get(transport.SESSION_KEY, "")
    if worker is None or not session:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"a Push must carry {transport.WORKER_ID_KEY} "
                      f"(a worker id) and {transport.SESSION_KEY} metadata: join first")
    return worker, session


def _peer_host(peer: str) -> str:
    """``ipv4:10.0.0.5`` of ``ipv4:10.0.0.5:41234`` (what the Join limiter counts by)."""
    return peer.rpartition(":")[0] or peer


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
