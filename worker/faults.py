"""Fault injection at the worker's session seam: a real Session that drops or delays a
push, cuts the Rounds stream, or flips a parameter of θ as a round result is applied, at
chosen rounds (after torchft's EventInjector and hivemind's FaultyAverager). The tests of
the worker's fault handling run real workers over it against a real coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from geoloco.protos import geoloco_pb2 as pb
from geoloco.transport import ChannelSecurity
from geoloco.worker.session import Push, Session
from geoloco.worker.stream import RoundResult

log = logging.getLogger(__name__)

FLIP_BY = 1e-3  # added to θ's first element: a bad memory bit or a non-deterministic kernel


class Fault(Enum):
    DROP_PUSH = "drop the push"  # answered as rejected, nothing sent
    LATE_PUSH = "push only after the round closed"  # and never look at the stream before pushing
    CUT_STREAM = "cut the Rounds stream"  # as the round's result is taken
    FLIP_PARAMETER = "flip a parameter"  # of θ, just before the round's result is applied


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
