"""WAN link profiles such as ``20mbit/50ms/5ms/0.1%``: rate, one-way delay, jitter, loss.

One parser shared by the link emulator (local runs), the ``tc`` shaping in containers and
the config validation, so a profile means the same thing everywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)%$")

PROFILE_FORMS = (
    "RATE[/DELAY[/JITTER[/LOSS]]], e.g. '20mbit', '20mbit/50ms', '20mbit/50ms/5ms', "
    "'20mbit/50ms/5ms/0.1%' (rate units bit|kbit|mbit|gbit, times us|ms|s), "
    "or 'unlimited' for no shaping"
)


class LinkProfileError(ValueError):
    """A link profile string that cannot be parsed; the message shows the allowed forms."""


@dataclass(frozen=True)
class LinkProfile:
    """One direction-symmetric link: rate in bit/s (``None``: unlimited), one-way delay and
    jitter in seconds, packet loss as a fraction in [0, 1)."""

    rate_bps: float | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkProfile:
        text = text.strip().lower()
        if text in ("unlimited", "none", ""):
            return cls()
        parts = text.split("/")
        if len(parts) > 4:
            raise LinkProfileError(f"link profile {text!r} has {len(parts)} parts; allowed: {PROFILE_FORMS}")
        rate = _parse_rate(parts[0], text)
        delay = _parse_time(parts[1], text) if len(parts) > 1 else 0.0
        jitter = _parse_time(parts[2], text) if len(parts) > 2 else 0.0
        loss = _parse_loss(parts[3], text) if len(parts) > 3 else 0.0
        if jitter > delay:
            raise LinkProfileError(f"link profile {text!r}: jitter {jitter * 1e3:g}ms exceeds delay {delay * 1e3:g}ms")
        return cls(rate_bps=rate, delay_s=delay, jitter_s=jitter, loss=loss)

    @property
    def rtt_s(self) -> float:
        """Round-trip time the profile adds (delay applied in both directions)."""
        return 2.0 * self.delay_s

    def __str__(self) -> str:
        if self.rate_bps is None and not (self.delay_s or self.jitter_s or self.loss):
            return "unlimited"
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e6:g}mbit"
        text = f"{rate}/{self.delay_s * 1e3:g}ms/{self.jitter_s * 1e3:g}ms"
        return f"{text}/{self.loss * 100:g}%" if self.loss else text


def _parse_rate(part: str, text: str) -> float | None:
    if part == "unlimited":
        return None
    match = _RATE.match(part)
    if not match or float(match.group(1)) <= 0:
        raise LinkProfileError(f"link profile {text!r}: bad rate {part!r}; allowed: {PROFILE_FORMS}")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def _parse_time(part: str, text: str) -> float:
    match = _TIME.match(part)
    if not match:
        raise LinkProfileError(f"link profile {text!r}: bad time {part!r}; allowed: {PROFILE_FORMS}")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def _parse_loss(part: str, text: str) -> float:
    match = _LOSS.match(part)
    if not match or float(match.group(1)) >= 100:
        raise LinkProfileError(f"link profile {text!r}: bad loss {part!r}; allowed 0%..<100%")
    return float(match.group(1)) / 100.0
