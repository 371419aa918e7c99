"""Fault injection at the worker's session seam: a real Session that drops, delays or
poisons a push, cuts the Rounds stream, or flips a parameter of θ as a round result is
applied, at chosen rounds (after torchft's EventInjector and hivemind's FaultyAverager). The tests of
the worker's fault handling run real workers over it against a real coordinator.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np
import torch
from torch import Tensor

from geoloco.compression.format import HEADER_BYTES
from geoloco.protos import geoloco_pb2 as pb
from geoloco.transport import ChannelSecurity
from geoloco.worker.session import Push, Session
from geoloco.worker.stream import RoundResult

log = logging.getLogger(__name__)

FLIP_BY = 1e-3  # added to θ's first element: a bad memory bit or a non-deterministic kernel
SCALE_BY = 1e6  # SCALE_FRAME multiplies every quantizer level by this
SHRINK_BY = 1e-6  # SHRINK_FRAME multiplies every quantizer level by this: a tiny frame
MAX_LEVEL = 3.4e38  # MAX_LEVELS sets every quantizer level to this (about bfloat16's largest)
_SECTION = struct.Struct("<BQQ")  # a frame section's codec, raw and stored length (docs/codec.md)


class Fault(Enum):
    DROP_PUSH = "drop the push"  # answered as rejected, nothing sent
    LATE_PUSH = "push only after the round closed"  # and never look at the stream before pushing
    CUT_STREAM = "cut the Rounds stream"  # as the round's result is taken
    FLIP_PARAMETER = "flip a parameter"  # of θ, just before the round's result is applied
    SCALE_FRAME = "scale the pushed frame by 1e6"  # its levels, with the checksum repaired
    MAX_LEVELS = "set the pushed frame's levels to 3.4e38"  # ditto: a poisoned update
    SHRINK_FRAME = "scale the pushed frame by 1e-6"  # ditto: to shrink the reference norm


def with_levels(frame: bytes, levels: Callable[[np.ndarray], np.ndarray]) -> bytes:
    """A sparse frame (without zstd) whose quantizer table is ``levels(table)`` (fp32 in,
    fp32 out, stored back as bfloat16), with its checksum made valid again: what a worker
    holding the token could send on purpose."""
    data = bytearray(frame)
    codec, raw_len, stored_len = _SECTION.unpack_from(data, HEADER_BYTES)
    if codec != 0 or raw_len != stored_len:
        raise ValueError("with_levels needs a frame without zstd")
    start = HEADER_BYTES + _SECTION.size
    bits = np.frombuffer(bytes(data[start:start + raw_len]), dtype=np.uint16).astype(np.uint32) << 16
    changed = levels(bits.view(np.float32)).astype(np.float32)
    data[start:start + raw_len] = (changed.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])))
    return bytes(data)


POISONS = {
    Fault.SCALE_FRAME: lambda table: table * SCALE_BY,
    Fault.MAX_LEVELS: lambda table: np.full_like(table, MAX_LEVEL),
    Fault.SHRINK_FRAME: lambda table: table * SHRINK_BY,
}


@dataclass
class FlippingResult(RoundResult):
    """A round result that changes θ's first element before it applies itself."""

    def apply_to(self, theta: list[Tensor]) -> float:
        with torch.no_grad():
            theta[0].view(-1)[0] += FLIP_BY
        return super().apply_to(theta)


class FaultySession(Session):
    """A Session that injects ``fault`` once in each round of ``rounds`` (every round if
    None); ``fired`` lists the rounds it fired in."""

    def __init__(self, address: str, token: str, connect_timeout_s: float = 60.0, *, fault: Fault,
                 rounds: Iterable[int] | None = None, identity: tuple[int, str] | None = None,
                 security: ChannelSecurity | None = None) -> None:
        super().__init__(address, token, connect_timeout_s, identity, security)
        self.fault = fault
        self.rounds = None if rounds is None else set(rounds)
        self.fired: list[int] = []
        self._held: RoundResult | None = None  # a result taken while a late push waited

    def push(self, push: Push) -> pb.PushReply:
        if self.fault in POISONS and self._fires(self.fault, push.round):
            push = replace(push, frame=with_levels(push.frame, POISONS[self.fault]))
        if self._fires(Fault.DROP_PUSH, push.round):
            return pb.PushReply(accepted=False, reason=f"dropped by {Fault.DROP_PUSH}", round=push.round)
        if self._fires(Fault.LATE_PUSH, push.round):
            self._held = super().next_result(push.round)  # the round has closed
        return super().push(push)

    def poll_result(self, round_: int) -> RoundResult | None:
        if self._injects(Fault.LATE_PUSH, round_):
            return None  # a late pusher does not look before it has pushed
        return self._deliver(super().poll_result(round_))

    def next_result(self, round_: int) -> RoundResult:
        held, self._held = self._held, None
        if held is not None and held.header.round >= round_:
            return self._deliver(held)
        return self._deliver(super().next_result(round_))

    def _deliver(self, result: RoundResult | None) -> RoundResult | None:
        if result is None:
            return None
        if self._fires(Fault.CUT_STREAM, result.header.round):
            self._stop_following()  # the reader ends the result and queues Disconnected
        if self._fires(Fault.FLIP_PARAMETER, result.header.round):
            return FlippingResult(result.header, result.frames, result.last_byte_at, result.digest)
        return result

    def _injects(self, fault: Fault, round_: int) -> bool:
        return self.fault is fault and (self.rounds is None or round_ in self.rounds)

    def _fires(self, fault: Fault, round_: int) -> bool:
        if not self._injects(fault, round_) or round_ in self.fired:
            return False
        self.fired.append(round_)
        log.warning("fault injected in round %d: %s", round_, fault.value)
        return True
