"""The worker's end of the Rounds stream (docs/protocol.md, steps 3 and 5): a reader thread
that hands over each round result as soon as its header is in and decodes every frame as
soon as its bytes are in, the result applied to θ frame by frame, and the digest check that
runs beside the next inner loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
from torch import Tensor

from geoloco.compression import Frame, FrameError, Layout, decode_frame
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import apply_round, param_digest

log = logging.getLogger(__name__)


class Disconnected(Exception):
    """The Rounds stream ended or broke, or a call failed with UNAVAILABLE: rejoin and resync."""


class Behind(Disconnected):
    """The coordinator no longer holds the round result this worker waits for: rejoin and
    fetch the state."""


@dataclass
class RoundResult:
    """One closed round as the coordinator broadcast it. It is handed over as soon as its
    header is in; its frames follow, each decoded as soon as its bytes are in, then the
    digest the coordinator sends once it has applied the round itself."""

    header: pb.RoundHeader
    frames: queue.Queue[Frame | Exception] = field(default_factory=queue.Queue)
    last_byte_at: Future[float] = field(default_factory=Future)  # monotonic time the frames were in
    digest: Future[str] = field(default_factory=Future)  # Disconnected if it never comes
    applied: list[Frame] = field(default_factory=list)  # the frames apply_to has applied, in order
    data: list[bytes] = field(default_factory=list)  # each frame's bytes, as they came (an island sends them on)

    @property
    def nbytes(self) -> int:
        """The frame bytes of this result (what it cost to receive)."""
        return sum(info.nbytes for info in self.header.frames)

    def apply_to(self, theta: list[Tensor]) -> float:
        """θ += the round's update, each frame as soon as it is decoded, with the call the
        coordinator makes (geoloco.replica.apply_round), so every replica ends bit-identical.
        Returns the seconds from the last frame byte (or from now, if later) to θ updated.
        FrameError: a frame did not decode; Disconnected: the stream broke first (θ is then
        partly updated)."""
        start, header = time.monotonic(), self.header
        apply_round(theta, self._decoded_frames(), [f.weight for f in header.frames],
                    header.aggregation or "sum", header.alpha)
        return time.monotonic() - max(start, self.last_byte_at.result())

    def all_frames(self) -> list[Frame]:
        """Every frame of the round once each is in and checked (``applied``, then ``data``
        holds them all). FrameError or Disconnected as apply_to."""
        return list(self._decoded_frames())

    def _decoded_frames(self) -> Iterator[Frame]:
        for _ in self.header.frames:
            item = self.frames.get()
            if isinstance(item, Exception):
                raise item
            self.applied.append(item)
            yield item


class RoundsFollower:
    """Reads one Rounds call on a background thread: queues a RoundResult as soon as its
    header is in, decodes its frames as their bytes come, fills in its digest, and queues
    a Disconnected once the stream ends or breaks. Without a ``layout`` it follows a
    starting worker's stream, which carries keepalives only."""

    def __init__(self, call: grpc.Call, layout: Layout | None = None) -> None:
        self.layout = layout
        self._call = call
        self._results: queue.Queue[RoundResult | Disconnected] = queue.Queue()
        self._pending: RoundResult | None = None  # its frames or digest still to come
        self._thread = threading.Thread(target=self._run, name="rounds-stream", daemon=True)
        self._thread.start()

    def next_result(self, round_: int, wait: bool) -> RoundResult | None:
        """The next result of round ``round_`` or later (older ones are skipped). With
        ``wait`` it blocks until one comes, else None when none is in yet; Disconnected
        when the stream ended first."""
        while True:
            try:
                item = self._results.get(block=wait)
            except queue.Empty:
                return None
            if isinstance(item, Disconnected):
                raise item
            if item.header.round >= round_:
                return item

    def stop(self) -> None:
        """Cancel the call and wait for the reader, which queues its Disconnected."""
        self._call.cancel()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        try:
            self._read(iter(self._call))
            reason = "the coordinator closed the Rounds stream"
        except grpc.RpcError as exc:
            reason = f"Rounds stream broke: {exc.code().name} {exc.details()}"
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                self._results.put(Behind(reason))
                return
        except ValueError as exc:
            reason = f"Rounds stream is malformed: {exc}"
        except Exception as exc:  # noqa: BLE001 - the main thread must not wait forever
            log.exception("the Rounds stream reader failed")
            reason = f"Rounds stream reader failed: {exc!r}"
        if self._pending is not None:  # whoever waits for its frames or digest learns it ended
            self._cut_off(self._pending, reason)
        self._results.put(Disconnected(reason))

    def _read(self, updates: Iterator[pb.RoundUpdate]) -> None:
        for update in updates:
            kind = update.WhichOneof("part")
            if kind == "header":
                if self.layout is None:
                    raise ValueError(f"round {update.header.round} result on a starting stream")
                if self._pending is not None:
                    raise ValueError(f"round {update.header.round} began before the digest of "
                                     f"round {self._pending.header.round}")
                self._pending = RoundResult(update.header)
                self._results.put(self._pending)
                self._collect(self._pending, updates)
            elif kind == "digest":
                self._take_digest(update.digest)
            elif kind != "keepalive":
                raise ValueError("frame data without a round header")

    def _collect(self, result: RoundResult, updates: Iterator[pb.RoundUpdate]) -> None:
        """Read the frames' bytes, decoding each frame as soon as it is complete (only the
        last decode waits for the link); a frame that does not decode is passed on as its
        FrameError, and the rest of the bytes are still read."""
        header, data, failed = result.header, bytearray(), False
        last = len(header.frames) - 1
        for i, info in enumerate(header.frames):
            while len(data) < info.nbytes:
                update = next(updates, None)
                if update is None or update.WhichOneof("part") != "data":
                    raise ValueError(f"round {header.round}: frame data ended early, before the "
                                     f"{info.nbytes} bytes of the frame from worker {info.sender}")
                data += update.data
            frame_bytes = bytes(data[: info.nbytes])
            del data[: info.nbytes]
            if i == last:
                if data:
                    raise ValueError(f"round {header.round}: {len(data)} frame bytes more than the header says")
                result.last_byte_at.set_result(time.monotonic())  # before the last frame is handed over
            if not failed:
                result.data.append(frame_bytes)
                try:
                    # checked as its bytes arrive, keeping its positions: applying the round's
                    # frames together then decodes none again (the worker's critical path)
                    result.frames.put(decode_frame(frame_bytes, self.layout, keep_positions=True))
                except ValueError as exc:  # FrameError: the codec names what is wrong
                    failed = True
                    result.frames.put(FrameError(f"frame from worker {info.sender}: {exc}"))
        if not header.frames:
            result.last_byte_at.set_result(time.monotonic())

    def _take_digest(self, msg: pb.RoundDigest) -> None:
        result = self._pending
        if result is None or msg.round != result.header.round:
            raise ValueError(f"digest for round {msg.round} without its round result")
        self._pending = None
        result.digest.set_result(msg.digest)

    @staticmethod
    def _cut_off(result: RoundResult, reason: str) -> None:
        gone = Disconnected(f"round {result.header.round} result cut off: {reason}")
        result.frames.put(gone)
        for future in (result.last_byte_at, result.digest):
            if not future.done():
                future.set_exception(gone)


class DigestCheck:
    """Compares ``param_digest(theta)`` with the coordinator's digest of a round on a
    background thread, so the hash runs beside the next inner loop instead of before it.
    ``theta`` must not change until ``outcome()`` or ``release()`` has returned."""

    def __init__(self, header: pb.RoundHeader, theta: list[Tensor] | None, expected: Future[str],
                 mine: str | None = None) -> None:
        """``mine``: θ's digest, already taken (``theta`` None)."""
        self.header = header
        self.expected = expected
        self.mine: str | None = mine
        self._thread = threading.Thread(target=self._hash, args=(theta,),
                                        name=f"digest-check-{header.round}", daemon=True)
        self._thread.start()

    def _hash(self, theta: list[Tensor] | None) -> None:
        if theta is not None:
            self.mine = param_digest(theta)

    def outcome(self) -> bool:
        """True when the digests match, False on a mismatch; raises Disconnected when the
        Rounds stream ended before the coordinator's digest came."""
        self._thread.join()
        return self.mine == self.expected.result()

    def release(self) -> bool:
        """Wait only for the hash (θ is free again): True if the coordinator's digest is
        already here and matches, False if it differs or is not known."""
        self._thread.join()
        if not self.expected.done() or self.expected.exception() is not None:
            return False
        return self.mine == self.expected.result()
