"""The two profile grammars of a run's config: WAN link profiles such as
``20mbit/50ms/5ms/0.1%`` (rate, one-way delay, jitter, loss) and straggler profiles such as
``fixed:4`` or ``trace:FILE`` (the straggler models of the gradient-coding literature, e.g. Tandon et al. 2017).

One parser for each, shared by the config validation, the link emulator, the ``tc``
shaping in containers and the worker's straggler emulation, so a profile means the same
thing everywhere.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)%$")

LINK_PROFILE_FORMS = (
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
            raise LinkProfileError(f"link profile {text!r} has {len(parts)} parts; allowed: {LINK_PROFILE_FORMS}")
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
        raise LinkProfileError(f"link profile {text!r}: bad rate {part!r}; allowed: {LINK_PROFILE_FORMS}")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def _parse_time(part: str, text: str) -> float:
    match = _TIME.match(part)
    if not match:
        raise LinkProfileError(f"link profile {text!r}: bad time {part!r}; allowed: {LINK_PROFILE_FORMS}")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def _parse_loss(part: str, text: str) -> float:
    match = _LOSS.match(part)
    if not match or float(match.group(1)) >= 100:
        raise LinkProfileError(f"link profile {text!r}: bad loss {part!r}; allowed 0%..<100%")
    return float(match.group(1)) / 100.0


# ---------------------------------------------------------------------------- stragglers

STRAGGLER_PROFILE_FORMS = (
    "none",
    "fixed:FACTOR",
    "exp:T0:MEAN",
    "markov:P_SLOW:P_FAST:FACTOR",
    "blocks:FACTOR:ROUNDS",
    "trace:PATH",
)
_KIND_ALIASES = {"shifted-exponential": "exp"}
_ARITY = {"none": 0, "fixed": 1, "exp": 2, "markov": 3, "blocks": 2, "trace": 1}



class StragglerProfileError(ValueError):
    """A straggler profile string or trace file that cannot be used; the message says why."""


@dataclass(frozen=True)
class StragglerProfile:
    """A parsed profile: ``kind`` is none, fixed, exp, markov, blocks or trace."""

    kind: str
    params: tuple[float, ...] = ()
    path: str = ""


def parse_straggler_profile(profile: str) -> StragglerProfile:
    """Parse a profile string (see STRAGGLER_PROFILE_FORMS); raise StragglerProfileError if malformed."""
    kind, _, rest = profile.strip().partition(":")
    kind = _KIND_ALIASES.get(kind.lower(), kind.lower())
    fields = rest.split(":") if rest else []
    if kind not in _ARITY:
        raise _form_error(profile, f"unknown kind {kind!r}")
    if kind == "trace":
        if not rest:
            raise _form_error(profile, "trace needs a file path")
        return StragglerProfile("trace", (), rest)
    if len(fields) != _ARITY[kind]:
        raise _form_error(profile, f"{kind} takes {_ARITY[kind]} value(s), got {len(fields)}")
    params = tuple(_number(profile, f) for f in fields)
    _check_ranges(profile, kind, params)
    return StragglerProfile(kind, params)


def load_trace(path: str | Path) -> list[list[float]]:
    """An n x rounds table of extra delays (seconds): CSV rows, or a JSON list of lists."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise StragglerProfileError(f"cannot read straggler trace {str(path)!r}: {exc}") from exc
    if path.suffix.lower() == ".json":
        rows = _json_rows(path, text)
    else:
        rows = [row for row in csv.reader(text.splitlines()) if row and any(c.strip() for c in row)]
    table = [[_trace_value(path, r, c, v) for c, v in enumerate(row)] for r, row in enumerate(rows)]
    if not table or any(not row for row in table):
        raise StragglerProfileError(f"straggler trace {str(path)!r} has an empty row or no rows")
    return table


def load_trace_row(path: str | Path, worker_id: int) -> list[float]:
    """Worker ``worker_id``'s row of the trace at ``path``."""
    table = load_trace(path)
    if worker_id >= len(table):
        raise StragglerProfileError(
            f"straggler trace {str(path)!r} has rows for workers 0..{len(table) - 1}, "
            f"not worker {worker_id}"
        )
    return table[worker_id]


def _json_rows(path: Path, text: str) -> list[list[object]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StragglerProfileError(f"straggler trace {str(path)!r} is not JSON: {exc}") from exc
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise StragglerProfileError(
            f"straggler trace {str(path)!r} must be a JSON list of lists (workers x rounds)"
        )
    return rows


def _trace_value(path: Path, row: int, col: int, value: object) -> float:
    try:
        delay = float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        delay = math.nan
    if not math.isfinite(delay) or delay < 0:
        raise StragglerProfileError(
            f"straggler trace {str(path)!r} row {row} round {col}: {value!r} is not a "
            f"finite delay >= 0 seconds"
        )
    return delay


def _check_ranges(profile: str, kind: str, params: tuple[float, ...]) -> None:
    if kind in ("fixed", "blocks") and params[0] < 1:
        raise _form_error(profile, f"FACTOR must be >= 1, got {params[0]}")
    if kind == "blocks" and (params[1] < 1 or params[1] != int(params[1])):
        raise _form_error(profile, f"ROUNDS must be a whole number >= 1, got {params[1]}")
    if kind == "exp" and min(params) < 0:
        raise _form_error(profile, f"T0 and MEAN must be >= 0, got {params}")
    if kind == "markov":
        p_slow, p_fast, factor = params
        if not (0 <= p_slow <= 1 and 0 <= p_fast <= 1):
            raise _form_error(profile, f"P_SLOW and P_FAST must be in [0, 1], got {p_slow}, {p_fast}")
        if factor < 1:
            raise _form_error(profile, f"FACTOR must be >= 1, got {factor}")


def _number(profile: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _form_error(profile, f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise _form_error(profile, f"{text!r} is not a finite number")
    return value


def _form_error(profile: str, why: str) -> StragglerProfileError:
    return StragglerProfileError(
        f"bad straggler profile {profile!r}: {why}; allowed forms: {', '.join(STRAGGLER_PROFILE_FORMS)}"
    )
