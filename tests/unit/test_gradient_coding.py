"""Gradient codes: exact decoding over every straggler set, the pipelined schedule, and the
encoder/decoder round trip (Tandon et al. 2017; docs/gradient-coding.md)."""

from __future__ import annotations

from functools import cache
from itertools import combinations

import numpy as np
import pytest

from geoloco.config import SCHEMES
from geoloco.coordinator.gradient_coding import (
    CR_SEED_CANDIDATES,
    DECODE_TOLERANCE,
    GradientCode,
    cyclic_repetition_matrix,
    make_code,
    worst_case_coefficient,
)

CODED = ("gc-fr", "gc-cr", "pgc-fr", "pgc-cr")


def _cases(schemes: tuple[str, ...], max_n: int = 12, max_s: int = 3) -> list[tuple[str, int, int]]:
    cases = []
    for scheme in schemes:
        for n in range(1, max_n + 1):
            for s in range(min(max_s, n - 1) + 1):
                if scheme.endswith("-fr") and n % (s + 1):
                    continue
                cases.append((scheme, n, s))
    return cases


@cache
def _code(scheme: str, n: int, s: int, seed: int = 0) -> GradientCode:
    return make_code(scheme, n, s, seed=seed)


def _decoded_sum(code: GradientCode, decoding: dict[int, float]) -> np.ndarray:
    workers = sorted(decoding)
    a = np.array([decoding[i] for i in workers])
    return a @ code.B[workers]


@pytest.mark.parametrize("scheme", CODED)
def test_every_straggler_set_up_to_s_decodes_exactly(scheme: str) -> None:
    for _, n, s in _cases((scheme,)):
        code = _code(scheme, n, s)
        for size in range(n - s, n + 1):
            for arrived in combinations(range(n), size):
                decoding = code.decode(arrived)
                assert decoding is not None, (scheme, n, s, arrived)
                assert set(decoding) <= set(arrived)
                np.testing.assert_allclose(
                    _decoded_sum(code, decoding), 1.0, rtol=0, atol=DECODE_TOLERANCE
                )


@pytest.mark.parametrize("scheme", ("gc-fr", "pgc-fr"))
def test_fr_decodes_iff_every_group_arrived_with_unit_coefficients(scheme: str) -> None:
    for _, n, s in _cases((scheme,)):
        code = _code(scheme, n, s)
        groups = {frozenset(range(g, g + s + 1)) for g in range(0, n, s + 1)}
        for arrived in combinations(range(n), max(n - s - 1, 0)):
            decoding = code.decode(arrived)
            covered = all(group & set(arrived) for group in groups)
            assert (decoding is not None) == covered, (n, s, arrived)
            if decoding is not None:
                assert set(decoding.values()) == {1.0}
                assert sorted(decoding) == sorted(min(g & set(arrived)) for g in groups)


@pytest.mark.parametrize("scheme", ("gc-cr", "pgc-cr"))
def test_cr_with_more_than_s_stragglers_is_not_decodable(scheme: str) -> None:
    for _, n, s in _cases((scheme,)):
        code = _code(scheme, n, s)
        for arrived in combinations(range(n), n - s - 1):
            assert code.decode(arrived) is None, (n, s, arrived)


def test_whole_fr_group_missing_is_not_decodable() -> None:
    code = make_code("gc-fr", 6, 2)
    assert code.decode([3, 4, 5]) is None
    assert code.decode([0, 4]) == {0: 1.0, 4: 1.0}
    assert code.decode([5, 2, 1]) == {1: 1.0, 5: 1.0}


def test_fr_needs_s_plus_one_to_divide_n() -> None:
    with pytest.raises(ValueError, match=r"n=5, s=1"):
        make_code("gc-fr", 5, 1)
    with pytest.raises(ValueError, match=r"n=8, s=2"):
        make_code("pgc-fr", 8, 2)
    assert make_code("gc-cr", 5, 1).decode([0, 1, 3, 4]) is not None


@pytest.mark.parametrize(
    ("scheme", "n", "s", "message"),
    [
        ("gc-xx", 4, 1, "allowed: none, ignore"),
        ("gc-cr", 0, 0, r"n \(workers\) must be >= 1, got 0"),
        ("gc-cr", 4, 4, r"\[0, 3\].*got 4"),
        ("gc-cr", 4, -1, r"\[0, 3\].*got -1"),
        ("gc-cr", 4.0, 1, "must be an integer"),
        ("gc-cr", 4, True, "must be an integer"),
    ],
)
def test_invalid_arguments_name_value_and_range(scheme, n, s, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_code(scheme, n, s)


def test_decode_rejects_unknown_worker() -> None:
    with pytest.raises(ValueError, match=r"\[0, 3\], got 4"):
        make_code("gc-cr", 4, 1).decode([0, 1, 4])


def test_wait_for_all_and_ignore_baselines() -> None:
    none = make_code("none", 4, 0)
    assert np.array_equal(none.B, np.eye(4)) and none.min_arrivals == 4
    assert none.decode([0, 1, 2]) is None
    assert none.decode([3, 2, 1, 0]) == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    ignore = make_code("ignore", 4, 1)
    assert ignore.min_arrivals == 3 and ignore.worst_case_coefficient == pytest.approx(4 / 3)
    assert ignore.decode([0, 1]) is None
    assert ignore.decode([0, 2, 3]) == pytest.approx({0: 4 / 3, 2: 4 / 3, 3: 4 / 3})
    assert ignore.decode(range(4)) == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}


@pytest.mark.parametrize(("scheme", "n", "s"), _cases(SCHEMES, max_n=8))
def test_flags_and_held_partitions_match_B(scheme: str, n: int, s: int) -> None:
    code = _code(scheme, n, s)
    assert (code.name, code.n, code.s) == (scheme, n, s)
    assert code.B.shape == (n, n) and code.B.dtype == np.float64
    assert code.pipelined == scheme.startswith("pgc-")
    assert code.staleness_bound == (s if code.pipelined else 0)
    assert code.min_arrivals == (n if scheme == "none" else n - s)
    for i in range(n):
        assert code.partitions(i) == sorted(np.flatnonzero(code.B[i]).tolist())
        if scheme.endswith("-cr"):
            assert code.partitions(i) == sorted({(i + k) % n for k in range(s + 1)})
        elif scheme.endswith("-fr"):
            base = i - i % (s + 1)
            assert code.partitions(i) == list(range(base, base + s + 1))
        else:
            assert code.partitions(i) == [i]


@pytest.mark.parametrize(("scheme", "n", "s"), _cases(("gc-fr", "gc-cr")))
def test_classic_trains_all_held_partitions_every_round(scheme: str, n: int, s: int) -> None:
    code = _code(scheme, n, s)
    for i in range(n):
        for t in range(3 * (s + 1)):
            assert code.partition_at(i, t) == code.partitions(i)


@pytest.mark.parametrize(("scheme", "n", "s"), _cases(("pgc-fr", "pgc-cr")))
def test_pipelined_covers_held_partitions_in_every_s_plus_one_rounds(
    scheme: str, n: int, s: int
) -> None:
    code = _code(scheme, n, s)
    for i in range(n):
        assert code.partition_at(i, 0) == code.partitions(i)  # warm-up round
        for t0 in range(1, 3 * (s + 1)):
            window = [code.partition_at(i, t) for t in range(t0, t0 + s + 1)]
            assert all(len(p) == 1 for p in window)
            assert sorted(p[0] for p in window) == code.partitions(i), (i, t0)


@pytest.mark.parametrize(("scheme", "n", "s"), _cases(("pgc-fr", "pgc-cr")))
def test_pipelined_trains_every_partition_fresh_each_round(scheme: str, n: int, s: int) -> None:
    code = _code(scheme, n, s)
    for t in range(1, 3 * (s + 1)):
        trained = sorted(code.partition_at(i, t)[0] for i in range(n))
        assert trained == list(range(n)), t
        for i in range(n):  # FR: within the group; CR: within the worker's window
            assert code.partition_at(i, t)[0] in code.partitions(i)


@pytest.mark.parametrize(("scheme", "n", "s"), _cases(("pgc-fr", "pgc-cr"), max_n=8))
def test_pipelined_buffers_are_at_most_s_rounds_stale(scheme: str, n: int, s: int) -> None:
    code = _code(scheme, n, s)
    for i in range(n):
        trained_at: dict[int, int] = {}
        for t in range(4 * (s + 1)):
            trained_at.update({j: t for j in code.partition_at(i, t)})
            assert max(t - r for r in trained_at.values()) <= code.staleness_bound


@pytest.mark.parametrize(("scheme", "n", "s"), [("gc-fr", 6, 1), ("gc-cr", 7, 2), ("pgc-cr", 5, 3)])
def test_coded_messages_decode_to_the_sum_of_pseudo_gradients(scheme: str, n: int, s: int) -> None:
    code = make_code(scheme, n, s, seed=1)
    rng = np.random.default_rng(0)
    deltas = {j: rng.standard_normal(10) for j in range(n)}
    messages = {
        i: sum(coef * delta for delta, coef in code.combine(i, deltas)) for i in range(n)
    }
    for arrived in combinations(range(n), n - s):
        decoding = code.decode(arrived)
        rebuilt = sum(a * messages[i] for i, a in decoding.items())
        np.testing.assert_allclose(rebuilt, sum(deltas.values()), rtol=0, atol=1e-6)


def test_combine_names_missing_partitions() -> None:
    code = make_code("pgc-cr", 5, 2)
    assert [j for j, _ in code.coefficients(4)] == [0, 1, 4]
    with pytest.raises(KeyError, match=r"partitions \[1\]; it holds \[0, 1, 4\]"):
        code.combine(4, {0: 0.0, 4: 0.0})


@pytest.mark.parametrize(("n", "s"), [(4, 1), (7, 2), (9, 3), (12, 3)])
def test_cr_worst_case_coefficient_is_reported_and_attained(n: int, s: int) -> None:
    code = _code("gc-cr", n, s)
    observed = max(
        abs(a) for arrived in combinations(range(n), n - s) for a in code.decode(arrived).values()
    )
    assert np.isfinite(code.worst_case_coefficient) and code.worst_case_exhaustive
    assert observed == pytest.approx(code.worst_case_coefficient, rel=1e-6)
    candidates = [
        worst_case_coefficient(cyclic_repetition_matrix(n, s, np.random.default_rng([0, k])), s)[0]
        for k in range(CR_SEED_CANDIDATES)
    ]
    assert code.worst_case_coefficient == pytest.approx(min(candidates))


def test_cr_is_deterministic_given_seed() -> None:
    assert np.array_equal(make_code("gc-cr", 7, 2, seed=3).B, make_code("pgc-cr", 7, 2, seed=3).B)
    assert not np.array_equal(make_code("gc-cr", 7, 2, seed=3).B, make_code("gc-cr", 7, 2).B)


def test_partition_at_rejects_negative_round() -> None:
    with pytest.raises(ValueError, match="round must be >= 0, got -1"):
        make_code("pgc-fr", 4, 1).partition_at(0, -1)


@pytest.mark.parametrize("n, s", [(4, 1), (6, 2), (8, 1), (8, 3)])
def test_aligned_ages_train_each_partition_at_every_holder_in_the_same_rounds(n: int, s: int) -> None:
    code = make_code("pgc-cr", n, s, aligned=True)
    for t in range(1, 3 * (s + 1)):
        trained = {i: code.partition_at(i, t)[0] for i in range(n)}
        for p in range(n):
            holders = [i for i in range(n) if p in code.partitions(i)]
            assert len({trained[i] == p for i in holders}) == 1, (t, p)  # all of them or none
    with pytest.raises(ValueError, match=r"\(s \+ 1\) to divide n"):
        make_code("pgc-cr", 8, 2, aligned=True)


@pytest.mark.parametrize("aligned", [False, True])
def test_per_age_weights_sum_to_one_and_extrapolate_only_when_ages_mix(aligned) -> None:
    from geoloco.coordinator.gradient_coding import age_weight_range, age_weights

    code = make_code("pgc-cr", 4, 1, aligned=aligned)
    # aligned: one version of each partition, of weight 1. Mixed ages: the largest weight is
    # the code's largest coefficient (a_0 = 2.4455 of the decode of {0, 1, 3} here, times
    # B[0, 0] = 1) on one version of partition 0, and the other version gets 1 minus it
    high = 1.0 if aligned else code.worst_case_coefficient
    low = 1.0 - high if not aligned else 1.0
    for arrived in ([0, 1, 2], [1, 2, 3], [0, 2, 3]):
        for t in (4, 5):
            weights = age_weights(code, arrived, t)
            for p in range(4):
                assert sum(w for (q, _), w in weights.items() if q == p) == pytest.approx(1.0)
            if aligned:
                assert len(weights) == 4  # one version of each partition
    assert age_weight_range(code) == pytest.approx((low, high), abs=1e-4)
