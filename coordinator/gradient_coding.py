"""Gradient codes against stragglers: which partitions each worker trains, which coded
combination it sends, and the decoding coefficients that rebuild the full update.

Classic gradient coding follows Tandon, Lei, Dimakis and Karampatziakis, "Gradient Coding:
Avoiding Stragglers in Distributed Learning" (ICML 2017): fractional repetition (FR) and the
cyclic repetition construction (CR, their Algorithm 2). The pipelined variants spread the
s + 1-fold redundancy over rounds instead of within one: each round a worker trains one of
its s + 1 partitions and sends the coded combination of its latest result for each (our
own construction; the closest published work on coding across rounds is Krishnan, Ebrahimi
and Khisti, "Sequential Gradient Coding for Straggler Mitigation", ICLR 2023). Decoding
runs in float64 with numpy.

Worker i holds partitions S_i and sends m_i = sum_j B[i, j] * delta_j. For an arrived set F
the decoder finds a with sum_{i in F} a_i * B[i] == 1 (all ones), so that
sum_{i in F} a_i * m_i == sum_j delta_j. See docs/gradient-coding.md.
"""

from __future__ import annotations

import argparse
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations
from typing import TypeVar

import numpy as np

from geoloco.config import SCHEMES

DECODE_TOLERANCE = 1e-9  # max |sum_i a_i B[i] - 1| accepted as exact decoding
CR_SEED_CANDIDATES = 16  # random H matrices tried for CR; the best worst-case |a| is kept
WORST_CASE_SET_LIMIT = 5000  # straggler sets checked exhaustively; above, a seeded sample
_BATCH_FLOATS = 500_000  # bound on one batched QR's input size (about 4 MB)

T = TypeVar("T")
Decoding = dict[int, float]


class GradientCode(ABC):
    """One code: the encoding matrix B, each worker's held partitions and training order.

    ``orders[i]`` lists worker i's partitions in its pipelined training order; a pipelined
    worker trains ``orders[i][t % (s + 1)]`` in round t > 0 and all of them in round 0.
    Subclasses supply ``decode`` and ``worst_case_coefficient``.
    """

    worst_case_coefficient: float = 1.0
    worst_case_exhaustive: bool = True

    def __init__(
        self, name: str, n: int, s: int, B: np.ndarray, orders: Sequence[Sequence[int]]
    ) -> None:
        self.name = name
        self.n = n
        self.s = s
        self.B = np.asarray(B, dtype=np.float64)
        self.pipelined = name.startswith("pgc-")
        self.stale_overlap = False  # pgc-cr: overlapping frames of versions of different ages
        self._orders = tuple(tuple(int(j) for j in order) for order in orders)
        self._held = tuple(tuple(sorted(order)) for order in self._orders)

    @property
    def min_arrivals(self) -> int:
        """The fewest arrivals that can be decodable (n - s; n when waiting for all)."""
        return self.n - self.s

    @property
    def staleness_bound(self) -> int:
        """Max rounds between a partition's training and its use in a combination."""
        return self.s if self.pipelined else 0

    def partitions(self, i: int) -> list[int]:
        """The sorted partitions worker i holds."""
        return list(self._held[self._check_worker(i)])

    def partition_at(self, i: int, t: int) -> list[int]:
        """The partitions worker i trains on in round t (all held ones, unless pipelined)."""
        self._check_worker(i)
        if t < 0:
            raise ValueError(f"round must be >= 0, got {t}")
        if not self.pipelined or t == 0:
            return self.partitions(i)
        order = self._orders[i]
        return [order[t % len(order)]]

    def coefficients(self, i: int) -> list[tuple[int, float]]:
        """(partition, B[i, partition]) for each partition worker i holds."""
        return [(j, float(self.B[i, j])) for j in self.partitions(i)]

    def combine(self, i: int, latest: Mapping[int, T]) -> list[tuple[T, float]]:
        """Pair worker i's latest pseudo-gradient per held partition with its coefficient.

        The worker sends ``m_i = sum(coef * delta for delta, coef in code.combine(i, latest))``.
        """
        missing = [j for j in self.partitions(i) if j not in latest]
        if missing:
            raise KeyError(
                f"worker {i} has no pseudo-gradient for partitions {missing}; "
                f"it holds {self.partitions(i)}"
            )
        return [(latest[j], coef) for j, coef in self.coefficients(i)]

    @abstractmethod
    def decode(self, arrived: Iterable[int]) -> Decoding | None:
        """{worker: a_i} with sum_i a_i * B[i] == 1, or None when ``arrived`` is not decodable."""

    def _arrived(self, arrived: Iterable[int]) -> list[int]:
        workers = sorted(set(int(i) for i in arrived))
        for i in workers:
            self._check_worker(i)
        return workers

    def _check_worker(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise ValueError(f"worker id must be in [0, {self.n - 1}], got {i}")
        return i

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, n={self.n}, s={self.s}, "
            f"worst_case_coefficient={self.worst_case_coefficient:.4g})"
        )


class WaitForAll(GradientCode):
    """``none``: B = I; a round closes only when all n workers have arrived, a_i = 1."""

    @property
    def min_arrivals(self) -> int:
        return self.n

    def decode(self, arrived: Iterable[int]) -> Decoding | None:
        workers = self._arrived(arrived)
        if len(workers) < self.n:
            return None
        return {i: 1.0 for i in workers}


class IgnoreStragglers(GradientCode):
    """``ignore``: B = I; any n - s arrivals close the round, each weighted n / |F|.

    An approximation, not a decoding: the missing partitions are replaced by the mean of
    the arrived ones, so sum_i a_i * B[i] is n / |F| on arrived partitions and 0 elsewhere.
    """

    def __init__(self, n: int, s: int) -> None:
        super().__init__("ignore", n, s, np.eye(n), [[i] for i in range(n)])
        self.worst_case_coefficient = n / (n - s)

    def decode(self, arrived: Iterable[int]) -> Decoding | None:
        workers = self._arrived(arrived)
        if len(workers) < self.n - self.s:
            return None
        return {i: self.n / len(workers) for i in workers}


class QuorumCode(GradientCode):
    """``quorum``: B = I and no code. All n arrived decode (a_i = 1); fewer close only by
    time, when ``coordinator.rounds.QuorumPolicy`` says so: n - s arrived and a grace
    window passed."""

    def __init__(self, n: int, s: int) -> None:
        super().__init__("quorum", n, s, np.eye(n), [[i] for i in range(n)])

    def decode(self, arrived: Iterable[int]) -> Decoding | None:
        workers = self._arrived(arrived)
        if len(workers) < self.n:
            return None
        return {i: 1.0 for i in workers}


class FractionalRepetition(GradientCode):
    """FR (Tandon et al. 2017, Sec. 3): groups of s + 1 workers share s + 1 partitions.

    B is block diagonal with all-ones blocks; decoding takes the lowest-id arrived worker of
    each group with a = 1, so it is exact even for compressed messages.
    """

    def __init__(self, name: str, n: int, s: int) -> None:
        if n % (s + 1):
            raise ValueError(
                f"scheme {name!r} needs (s + 1) to divide n; got n={n}, s={s} "
                f"(use a -cr scheme for any n)"
            )
        size = s + 1
        B = np.kron(np.eye(n // size), np.ones((size, size)))
        super().__init__(name, n, s, B, fractional_repetition_orders(n, s))

    def decode(self, arrived: Iterable[int]) -> Decoding | None:
        chosen: dict[int, int] = {}
        for i in self._arrived(arrived):
            chosen.setdefault(i // (self.s + 1), i)
        if len(chosen) < self.n // (self.s + 1):
            return None
        return {i: 1.0 for i in sorted(chosen.values())}


class CyclicRepetition(GradientCode):
    """CR (Tandon et al. 2017, Algorithm 2): S_i = {i, ..., i + s} mod n, for any n > s.

    Among ``CR_SEED_CANDIDATES`` random H (s x n, H @ 1 = 0) it keeps the B whose largest
    decoding coefficient over all straggler sets of size s is smallest. Decoding solves
    a @ B[F] = 1 by least squares in float64 and checks the residual.
    """

    def __init__(self, name: str, n: int, s: int, seed: int, aligned: bool | None = None) -> None:
        best_B, best_worst, exhaustive = np.empty(0), math.inf, True
        for k in range(CR_SEED_CANDIDATES):
            B = cyclic_repetition_matrix(n, s, np.random.default_rng([seed, k]))
            worst, exhaustive = worst_case_coefficient(B, s, seed, stop_above=best_worst)
            if worst < best_worst:
                best_B, best_worst = B, worst
        if not math.isfinite(best_worst):
            raise RuntimeError(f"no decodable cyclic code found for n={n}, s={s}, seed={seed}")
        if aligned is None:
            aligned = False
        if aligned and n % (s + 1):
            raise ValueError(f"aligned ages need (s + 1) to divide n; got n={n}, s={s}")
        self.aligned = aligned
        super().__init__(name, n, s, best_B, aligned_orders(n, s) if aligned else cyclic_orders(n, s))
        self.stale_overlap = self.pipelined
        self.worst_case_coefficient = best_worst
        self.worst_case_exhaustive = exhaustive

    def decode(self, arrived: Iterable[int]) -> Decoding | None:
        workers = self._arrived(arrived)
        if not workers or not self.B[workers].any(axis=0).all():
            return None  # some partition is held by no arrived worker
        rows = self.B[workers]
        a, *_ = np.linalg.lstsq(rows.T, np.ones(self.n), rcond=None)
        if np.max(np.abs(a @ rows - 1.0)) > DECODE_TOLERANCE:
            return None
        return {i: float(c) for i, c in zip(workers, a, strict=True)}


def fractional_repetition_orders(n: int, s: int) -> list[list[int]]:
    """Training orders for FR: the s + 1 workers of a group rotate over the group's
    partitions with distinct offsets, so each round every partition is trained once."""
    size = s + 1
    return [[(i // size) * size + (i % size + k) % size for k in range(size)] for i in range(n)]


def cyclic_orders(n: int, s: int) -> list[list[int]]:
    """Training orders for CR: worker i trains partition (i + t) mod n at offset t, so each
    round the n workers train n distinct partitions."""
    return [[(i + k) % n for k in range(s + 1)] for i in range(n)]


def aligned_orders(n: int, s: int) -> list[list[int]]:
    """Training orders for CR with aligned ages ((s + 1) | n): at offset t every worker
    trains its held partition p with p = t mod (s + 1), so all holders of a partition train
    it in the same rounds and a decode combines one version of each partition."""
    return [sorted(((i + k) % n for k in range(s + 1)), key=lambda p: p % (s + 1)) for i in range(n)]


def age_weights(code: GradientCode, arrived: Sequence[int], t: int) -> dict[tuple[int, int], float]:
    """{(partition, age): weight} of the decode of ``arrived`` in a steady round t of a
    pipelined code: sum_i a_i B[i, p] over the arrived holders of p whose latest version
    of it is ``age`` rounds old. The weights of a partition sum to 1; a single age of
    weight 1 means the decode uses one version of it."""
    decoded = code.decode(arrived)
    if decoded is None:
        raise ValueError(f"arrived set {sorted(arrived)} is not decodable")
    weights: dict[tuple[int, int], float] = {}
    size = code.s + 1
    for i, a in decoded.items():
        order = code._orders[i]
        for k, p in enumerate(order):
            age = (t - k) % size if code.pipelined else 0
            weights[(p, age)] = weights.get((p, age), 0.0) + a * float(code.B[i, p])
    return {key: w for key, w in weights.items() if abs(w) > 1e-12}


def age_weight_range(code: GradientCode) -> tuple[float, float]:
    """The smallest and largest per-(partition, age) weight over every straggler set of
    size s and every phase of the pipeline (exhaustive up to WORST_CASE_SET_LIMIT sets)."""
    sets, _ = _arrived_sets(code.n, code.s, 0)
    weights = [w for F in sets for t in range(code.s + 1) for w in age_weights(code, F.tolist(), t).values()]
    return min(weights), max(weights)


def cyclic_repetition_matrix(n: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """Tandon et al.'s Algorithm 2: a random H (s x n) with H @ 1 = 0; row i of B is the
    vector in H's null space supported on {i, ..., i + s} mod n with B[i, i] = 1."""
    H = rng.standard_normal((s, n))
    H[:, -1] = -H[:, :-1].sum(axis=1)
    B = np.zeros((n, n))
    for i in range(n):
        support = [(i + k) % n for k in range(s + 1)]
        B[i, i] = 1.0
        if s:
            B[i, support[1:]] = np.linalg.solve(H[:, support[1:]], -H[:, i])
    return B


def worst_case_coefficient(
    B: np.ndarray, s: int, seed: int = 0, stop_above: float = math.inf
) -> tuple[float, bool]:
    """Max |a_i| over the arrived sets of size n - s, and whether all of them were checked.

    Above ``WORST_CASE_SET_LIMIT`` sets a seeded random sample of that size is checked.
    Returns inf if some set is not exactly decodable, and stops early (returning a figure
    above ``stop_above``) once the running maximum exceeds ``stop_above``.
    """
    n = B.shape[0]
    sets, exhaustive = _arrived_sets(n, s, seed)
    per_batch = max(1, _BATCH_FLOATS // (n * n))
    worst = 0.0
    for start in range(0, len(sets), per_batch):
        worst = max(worst, _batch_worst(B, sets[start : start + per_batch]))
        if worst > stop_above:
            break
    return worst, exhaustive


def _arrived_sets(n: int, s: int, seed: int) -> tuple[np.ndarray, bool]:
    if math.comb(n, s) <= WORST_CASE_SET_LIMIT:
        return np.array(list(combinations(range(n), n - s)), dtype=np.intp), True
    rng = np.random.default_rng([seed, n, s])
    order = np.argsort(rng.random((WORST_CASE_SET_LIMIT, n)), axis=1)
    return np.sort(order[:, : n - s], axis=1), False


def _batch_worst(B: np.ndarray, sets: np.ndarray) -> float:
    """Solve a @ B[F] = 1 for a batch of arrived sets F by QR least squares."""
    M = np.transpose(B[sets], (0, 2, 1))  # (batch, n, n - s)
    Q, R = np.linalg.qr(M)
    rhs = Q.sum(axis=1)[..., None]  # Q^T @ 1
    try:
        a = np.linalg.solve(R, rhs)[..., 0]
    except np.linalg.LinAlgError:
        return math.inf
    residual = np.einsum("bnk,bk->bn", M, a) - 1.0
    if not np.all(np.isfinite(a)) or np.max(np.abs(residual)) > DECODE_TOLERANCE:
        return math.inf
    return float(np.max(np.abs(a)))


def make_code(scheme: str, n: int, s: int, seed: int = 0, aligned: bool | None = None) -> GradientCode:
    """The gradient code ``scheme`` (one of SCHEMES) for n workers tolerating s stragglers.
    ``aligned`` (CR only): the aligned training orders, which need (s + 1) | n; None or
    False: the cyclic orders."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown gradient-coding scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    n = _integer("n (workers)", n)
    s = _integer("s (stragglers)", s)
    if n < 1:
        raise ValueError(f"n (workers) must be >= 1, got {n}")
    if not 0 <= s < n:
        raise ValueError(f"s (stragglers) must be in [0, {n - 1}] for n={n}, got {s}")
    if scheme == "none":
        return WaitForAll("none", n, s, np.eye(n), [[i] for i in range(n)])
    if scheme == "ignore":
        return IgnoreStragglers(n, s)
    if scheme == "quorum":
        return QuorumCode(n, s)
    if scheme.endswith("-fr"):
        return FractionalRepetition(scheme, n, s)
    return CyclicRepetition(scheme, n, s, seed, aligned)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


REPORT_CASES = ((4, 1), (6, 2), (8, 1), (8, 2), (8, 3), (10, 2), (12, 3), (16, 3), (24, 4))
AGE_REPORT_MAX_N = 12  # per-age weights are reported up to this n (every set, every phase)


def report(cases: Sequence[tuple[int, int]] = REPORT_CASES, seed: int = 0) -> str:
    """A table of CR worst-case |a|: the kept B against the spread over candidate seeds."""
    lines = [
        f"CR worst-case |a| over straggler sets of size s ({CR_SEED_CANDIDATES} candidate H, seed {seed})",
        f"{'n':>4} {'s':>3} {'sets':>7} {'kept':>10} {'median':>10} {'worst':>10}  checked",
    ]
    for n, s in cases:
        figures = []
        for k in range(CR_SEED_CANDIDATES):
            B = cyclic_repetition_matrix(n, s, np.random.default_rng([seed, k]))
            figures.append(worst_case_coefficient(B, s, seed))
        worst = [w for w, _ in figures]
        checked = "all" if figures[0][1] else f"sample of {WORST_CASE_SET_LIMIT}"
        lines.append(
            f"{n:>4} {s:>3} {math.comb(n, s):>7} {min(worst):>10.3g} "
            f"{float(np.median(worst)):>10.3g} {max(worst):>10.3g}  {checked}"
        )
    lines += ["", "pgc-cr decode weights per (partition, age), over every straggler set and pipeline phase",
              f"{'n':>4} {'s':>3}  {'ages':<8} {'worst |a|':>10} {'min':>9} {'max':>9}"]
    for n, s in cases:
        if n > AGE_REPORT_MAX_N:
            continue
        for aligned in (False, True) if n % (s + 1) == 0 else (False,):
            code = make_code("pgc-cr", n, s, seed, aligned=aligned)
            low, high = age_weight_range(code)
            lines.append(f"{n:>4} {s:>3}  {'aligned' if aligned else 'cyclic':<8} "
                         f"{code.worst_case_coefficient:>10.3g} {low:>9.3g} {high:>9.3g}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print CR worst-case |a| figures")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.report:
        parser.error("nothing to do: pass --report")
    print(report(seed=args.seed))


if __name__ == "__main__":
    main()
