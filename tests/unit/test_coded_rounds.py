"""Gradient coding inside a round, without a server: the close policy decodes as soon as
it can, the deadline fallback covers what arrived, the coded messages aggregate to the mean
pseudo-gradient, ``mean_kept`` is used wherever it is exact (one frame per FR group) and the
weighted sum elsewhere, and each worker is told how to settle its frame's error feedback."""

from __future__ import annotations

import pytest
import torch

from geoloco.cli import main
from geoloco.compression import Layout, decode_frame, encode_dense
from geoloco.config import SCHEMES, OuterConfig, load_config
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.metrics import RoundMetrics, RunTotals
from geoloco.coordinator.outer import SparseLoCoOuter, aggregation_note, apply_update, mean_weights
from geoloco.coordinator.rounds import Arrival, CodePolicy, deadline_decoding
from geoloco.protos import geoloco_pb2 as pb

N, S = 4, 1


def test_pgc_fr_closes_once_every_group_has_an_arrival() -> None:
    policy = CodePolicy(make_code("pgc-fr", N, S))
    assert policy.decide([0, 1], deadline_passed=False) is None  # group {2, 3} missing
    decision = policy.decide([1, 3], deadline_passed=False)
    assert decision is not None and decision.reason == "decodable"
    assert decision.coefficients == {1: 1.0, 3: 1.0} and decision.covered == N


@pytest.mark.parametrize("scheme", ["gc-cr", "pgc-cr"])
def test_cr_closes_on_any_n_minus_s_arrivals(scheme: str) -> None:
    policy = CodePolicy(make_code(scheme, N, S))
    assert policy.decide([0, 1], False) is None
    for straggler in range(N):
        arrived = [i for i in range(N) if i != straggler]
        assert policy.decide(arrived, False).reason == "decodable"


def test_deadline_fallback_averages_the_covered_partitions() -> None:
    fr = make_code("gc-fr", N, S)
    coefficients, covered = deadline_decoding(fr.B, [0])  # worker 0 sends Δ0 + Δ1
    assert covered == 2 and coefficients == pytest.approx({0: 1.0})
    assert deadline_decoding(make_code("none", N, 0).B, [2, 0]) == ({0: 1.0, 2: 1.0}, 2)
    assert deadline_decoding(fr.B, []) == ({}, 0)
    decision = CodePolicy(fr).decide([3], deadline_passed=True)
    assert decision.reason == "deadline" and decision.covered == 2


def test_deadline_takes_one_frame_per_fr_group() -> None:
    """Two group-mates send the same combination: the fallback takes the lower id with
    a = 1 (least squares over both would split it 0.5 / 0.5)."""
    coefficients, covered = deadline_decoding(make_code("gc-fr", N, S).B, [0, 1])
    assert coefficients == pytest.approx({0: 1.0}) and covered == 2


def layout() -> Layout:
    return Layout.from_named_tensors([("w", torch.zeros(6, 5)), ("b", torch.zeros(7))])


def coded_arrivals(scheme: str, lay: Layout) -> tuple[list[Arrival], list[list[torch.Tensor]]]:
    """Each worker's dense frame of m_i = Σ_j B_ij Δ_j for seeded pseudo-gradients Δ_j."""
    code = make_code(scheme, N, 0 if scheme == "none" else S)
    gen = torch.Generator().manual_seed(1)
    deltas = [[torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in lay.specs]
              for _ in range(N)]
    arrivals = []
    for i in range(N):
        message = [sum(c * deltas[j][k] for j, c in code.coefficients(i)).float()
                   for k in range(len(lay.specs))]
        data = encode_dense(lay, message, round=0, sender=i)
        arrivals.append(Arrival(i, data, decode_frame(data, lay)))
    return arrivals, deltas


# ignore and quorum take the mean of what arrived, not a decoding (test_quorum_rules.py)
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in ("ignore", "quorum")])
def test_decoded_update_is_minus_lr_times_the_mean_pseudo_gradient(scheme: str) -> None:
    lay = layout()
    arrivals, deltas = coded_arrivals(scheme, lay)
    policy = CodePolicy(make_code(scheme, N, 0 if scheme == "none" else S))
    arrived = list(range(N)) if scheme == "none" else [0, 2, 3]
    decision = policy.decide(arrived, deadline_passed=False)
    chosen = [(arrivals[i], a) for i, a in sorted(decision.coefficients.items())]
    outer = SparseLoCoOuter(lay, OuterConfig(lr=0.5))
    params = [torch.zeros(s.shape) for s in lay.specs]
    apply_update(params, outer.step(0, chosen, decision))
    for k, p in enumerate(params):
        mean = sum(d[k] for d in deltas) / N
        torch.testing.assert_close(p, (-0.5 * mean).float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme, arrived, mode, weights", [
    ("none", [0, 1, 2, 3], "mean_kept", [1.0] * 4),
    ("ignore", [0, 2, 3], "mean_kept", [1.0] * 3),  # the mean over the arrived keepers
    ("gc-fr", [1, 2, 3], "mean_kept", [0.5, 0.5]),  # one frame per group, each of 2 partitions
    ("pgc-fr", [0, 3], "mean_kept", [0.5, 0.5]),
    ("gc-cr", [0, 1, 2], "mean_kept", "a |F| / n"),  # overlapping weighted rows: the same estimate
    ("pgc-cr", [0, 1, 3], "sum", "a / n"),  # overlapping frames of several ages: the weighted sum
])
def test_mean_kept_except_for_pgc_cr_and_the_weighted_sum_there(scheme, arrived, mode, weights) -> None:
    decision = CodePolicy(make_code(scheme, N, 0 if scheme == "none" else S)).decide(arrived, False)
    got, got_mode = mean_weights(decision, "mean_kept")
    assert got_mode == mode
    a = [c for _, c in sorted(decision.coefficients.items())]
    if weights == "a |F| / n":  # a coordinate every frame kept: sum_i a_i m_i / n, the exact mean
        assert got == pytest.approx([c * len(a) / N for c in a]) and len(set(a)) > 1
    elif weights == "a / n":
        assert got == pytest.approx([c / N for c in a])
    else:
        assert got == pytest.approx(weights)
    assert mean_weights(decision, "mean")[1] == "sum"


def test_a_deadline_with_nothing_arrived_is_an_empty_weighted_sum() -> None:
    decision = CodePolicy(make_code("gc-cr", N, S)).decide([], True)
    assert decision is not None and not decision.coefficients
    assert mean_weights(decision, "mean_kept") == ([], "sum")


def test_only_pgc_cr_says_it_takes_the_weighted_sum() -> None:
    def note(scheme: str) -> str | None:
        cfg = load_config(overrides={"workers": "4", "coding.scheme": scheme, "coding.stragglers": "1"})
        return aggregation_note(cfg, make_code(scheme, 4, 1))
    assert "weighted sum" in note("pgc-cr")
    assert note("gc-cr") is None and note("pgc-fr") is None
    assert make_code("pgc-cr", 4, 1, aligned=True).stale_overlap  # aligned ages: measured worse too


@pytest.mark.parametrize("scheme, arrived, deadline, want", [
    ("none", [0, 1, 2, 3], False, {i: "KEEP" for i in range(4)}),
    ("none", [0, 2], True, {0: "KEEP", 1: "ADD_BACK", 2: "KEEP", 3: "ADD_BACK"}),
    ("ignore", [0, 1, 2], False, {0: "KEEP", 1: "KEEP", 2: "KEEP", 3: "RESTORE"}),
    ("gc-fr", [1, 2, 3], False, {0: ("CREDIT", 1), 1: "KEEP", 2: "KEEP", 3: ("CREDIT", 2)}),
    ("pgc-fr", [1, 2, 3], False, {0: "RESTORE", 1: "KEEP", 2: "KEEP", 3: "RESTORE"}),
    ("gc-fr", [0, 1], True, {0: "KEEP", 1: ("CREDIT", 0), 2: "ADD_BACK", 3: "ADD_BACK"}),
    ("gc-cr", [0, 1, 2], False, {0: "KEEP", 1: "KEEP", 2: "KEEP", 3: "RESTORE"}),
])
def test_each_worker_is_told_what_became_of_its_frame(scheme, arrived, deadline, want) -> None:
    policy = CodePolicy(make_code(scheme, N, 0 if scheme == "none" else S))
    decision = policy.decide(arrived, deadline)
    for worker, expected in want.items():
        kind, sender = expected if isinstance(expected, tuple) else (expected, 0)
        got = policy.settlement(decision, worker)
        assert (pb.Settlement.Kind.Name(got.kind), got.sender) == (kind, sender), worker


def test_partitions_per_worker_round_counts_the_arrived_frames() -> None:
    totals = RunTotals()
    for r, trained in enumerate([{0: 2, 1: 2}, {0: 1, 1: 1, 2: 1}]):
        m = RoundMetrics(r, None, None, sorted(trained), sorted(trained), "decodable", {}, 0, 1.0,
                         None, None, 0, 0, partitions_trained=trained)
        totals.add(m, 4)
    assert '"partitions_per_worker_round": 2.0' in RoundMetrics(
        0, None, None, [], [], "x", {}, 0, 1.0, None, None, 0, 0, {0: 2}).to_json()
    assert totals.summary(1)["partitions_per_worker_round"] == pytest.approx(7 / 5)


def test_local_refuses_a_malformed_straggler_profile_before_starting(tmp_path, capsys) -> None:
    code = main(["local", "--workers", "2", "--run-dir", str(tmp_path), "--straggler-profiles", "none,fixed:0.5"])
    assert code == 2
    err = capsys.readouterr().err
    assert "stragglers.per_worker[1]" in err and "fixed:0.5" in err
    assert not (tmp_path / "logs").exists()  # nothing was started
