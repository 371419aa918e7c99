"""Link-aware density (compression.density = "auto"): each worker measures its own upload
rate from its pushes and picks the top-k density of its next SparseLoCo frame (Sarfi et al.
2025, arXiv 2508.15706) so that the push takes a target time, within configured bounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from geoloco.config import AUTO, CompressionConfig
from geoloco.worker.encoder import START_DENSITY

log = logging.getLogger(__name__)


def fit_density(density: float, nbytes: int, seconds: float, target_s: float, low: float,
                high: float, tile: int) -> float:
    """The density whose push should take ``target_s``, from one timed push of ``nbytes``
    at ``density`` that took ``seconds``: a push's time grows about in proportion to the
    kept values (plus a fixed part: latency, headers, tables, which this proportional step
    converges through), so scale the density by target / measured; then clamp to [low,
    high] and round to a whole k per tile x tile chunk (what the frame carries)."""
    if nbytes <= 0 or seconds <= 0 or target_s <= 0:
        return min(max(density, low), high)
    wanted = density * target_s / seconds
    chunk = tile * tile
    k_low, k_high = max(1, round(low * chunk)), max(1, round(high * chunk))
    k = min(max(round(wanted * chunk), k_low), k_high)
    return k / chunk


@dataclass
class DensityChooser:
    """One worker's density: fixed as configured, or ``auto`` from its last timed push. The
    target is ``compression.target_push_s``, or (under outer.overlap, unset) the compute
    seconds of the inner phase the push overlaps."""

    auto: bool
    density: float
    low: float
    high: float
    target_s: float | None
    tile: int
    rate: float = 0.0  # bytes/s of the last timed push (0: none yet)
    _last: tuple[float, int, float] | None = None  # (density, bytes, seconds) of that push

    @classmethod
    def from_config(cls, comp: CompressionConfig) -> DensityChooser:
        auto = comp.density == AUTO
        start = min(max(START_DENSITY, comp.density_min), comp.density_max) if auto else comp.density
        return cls(auto, float(start), comp.density_min, comp.density_max, comp.target_push_s, comp.tile)

    def observe(self, density: float, nbytes: int, seconds: float) -> None:
        """A push of ``nbytes`` made at ``density`` took ``seconds`` (Push call to reply)."""
        if seconds > 0 and nbytes > 0:
            self.rate = nbytes / seconds
            self._last = (density, nbytes, seconds)

    def choose(self, phase_s: float | None = None) -> float:
        """The density of the next frame; ``phase_s``: the compute seconds of the inner phase
        its push overlaps (the target when target_push_s is unset)."""
        target = self.target_s if self.target_s is not None else phase_s
        if not self.auto or self._last is None or not target:
            return self.density
        density, nbytes, seconds = self._last
        chosen = fit_density(density, nbytes, seconds, target, self.low, self.high, self.tile)
        if chosen != self.density:
            log.info("density %.5f -> %.5f (last push %d bytes in %.2fs, %.0f B/s; target %.2fs)",
                     self.density, chosen, nbytes, seconds, self.rate, target)
        self.density = chosen
        return chosen
