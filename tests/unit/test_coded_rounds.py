"""Gradient coding inside a round, without a server: the close policy decodes as soon as
it can, the deadline fallback covers what arrived, the coded messages aggregate to the mean
pseudo-gradient, and ``mean_kept`` is refused for coded schemes."""

from __future__ import annotations

import pytest
import torch

from geoloco.cli import main
from geoloco.compression import Layout, decode_frame, encode_dense
from geoloco.config import SCHEMES, ConfigError, OuterConfig, load_config
from geoloco.coordinator.app import Coordinator
from geoloco.coordinator.gradient_coding import make_code
from geoloco.coordinator.metrics import RoundMetrics, RunTotals
from geoloco.coordinator.outer import SparseLoCoOuter, apply_update, check_aggregation
from geoloco.coordinator.rounds import Arrival, CodePolicy, deadline_decoding

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


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "ignore"])
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


@pytest.mark.parametrize("scheme", ["ignore", "gc-fr", "pgc-cr"])
def test_mean_kept_is_refused_for_coded_schemes(scheme: str, tmp_path) -> None:
    cfg = load_config(overrides={"workers": "4", "coding.scheme": scheme, "coding.stragglers": "1",
                                 "outer.aggregation": "mean_kept"})
    with pytest.raises(ConfigError, match="outer.aggregation 'mean_kept'"):
        check_aggregation(cfg)
    with pytest.raises(ConfigError, match=scheme):
        Coordinator(cfg, tmp_path / "run")
    check_aggregation(load_config(overrides={"workers": "4", "outer.aggregation": "mean_kept"}))


def test_coordinator_command_exits_2_on_mean_kept_with_a_code(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("GEOLOCO_TOKEN", "a-token")
    code = main(["coordinator", "--run-dir", str(tmp_path), "--set", "coding.scheme=pgc-fr",
                 "--set", "coding.stragglers=1", "--set", "outer.aggregation=mean_kept"])
    assert code == 2
    assert "mean_kept" in capsys.readouterr().err


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
    code = main(["local", "--workers", "2", "--run-dir", str(tmp_path), "--straggler", "none,fixed:0.5"])
    assert code == 2
    err = capsys.readouterr().err
    assert "stragglers.per_worker[1]" in err and "fixed:0.5" in err
    assert not (tmp_path / "logs").exists()  # nothing was started
