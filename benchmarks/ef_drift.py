"""Error-feedback drift under gradient coding: how much of the decoded update the applied
updates miss over 24 rounds, with each worker's frames settled by what the round header
says became of them ("after") and without ("before"); docs/gradient-coding.md, "Error
feedback that loses nothing".

Definition. Round t decodes the arrived set with coefficients a_i (``CodePolicy``, as the
coordinator does), applies U_t = sum_i a_i c_i (c_i: worker i's frame, decoded) and should
have applied T_t = sum_i a_i m_i (m_i: the uncompressed coded message). Then

    drift = |sum_t (U_t - T_t)| / |sum_t T_t|        (L2 norms over all coordinates)

It counts what is still waiting in the error feedback at the end (times the coefficients
it will be applied with), what its decay (beta) dropped, and what was lost or counted
twice. ``leak`` is the same run with beta = 1 after taking out what the error feedback
still owes at the end (sum over workers of nu_i e_i, nu_i the coefficient worker i's
frames were applied with; a classic FR group's workers hold one copy of the group's state
between them): zero when nothing is lost and nothing counted twice. It is defined where
every worker's coefficient stayed the same; under a cyclic code with a changing straggler
set it does not (a frame's coefficient depends on who straggles and is not known when
the frame is made), so no settlement is exact there and no leak is given.

Data: pseudo-gradients Delta_p of every partition, i.i.d. N(0, 1) per round, one 256 x 256
tensor; a worker that trains partition p in round t gets that round's Delta_p (the same
parameters and batches give every holder the same pseudo-gradient), and keeps it as its
latest until it trains p again (pipelined schemes). Messages go through the real
compressor (``FrameEncoder``: density 64/4096, beta 0.95) and are settled by
``FrameEncoder.settle`` with ``CodePolicy.settlement``. Stragglers arrive last: ``random``
draws s of them afresh each round, ``fixed`` keeps the same s; the others arrive in a
random order, and the round closes at the first decodable prefix.

    python -m benchmarks.ef_drift            # 13 codes x 2 straggler patterns, ~2-4 min on 2 cores
    python -m benchmarks.ef_drift --quick    # 3 codes, 6 rounds: a smoke test

Target: under every coded scheme, drift after <= 1.1 x the uncoded (``none``) drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.inprocess import close
from benchmarks.provenance import provenance
from geoloco.compression import Layout, decode_frame
from geoloco.config import CompressionConfig
from geoloco.coordinator.gradient_coding import GradientCode, make_code
from geoloco.coordinator.rounds import CodePolicy
from geoloco.worker.encoder import FrameEncoder

SHAPE = (256, 256)
ROUNDS = 24
TARGET = 1.10  # coded drift / uncoded drift
CASES = (("none", 4, 0), ("ignore", 4, 1), ("gc-fr", 4, 1), ("gc-cr", 4, 1), ("pgc-fr", 4, 1),
         ("pgc-cr", 4, 1, False), ("pgc-cr", 4, 1, True), ("ignore", 8, 3), ("gc-fr", 8, 3), ("gc-cr", 8, 3),
         ("pgc-fr", 8, 3), ("pgc-cr", 8, 3, False), ("pgc-cr", 8, 3, True))
QUICK_CASES = (("none", 4, 0), ("pgc-fr", 4, 1), ("pgc-cr", 4, 1, False))
PATTERNS = ("random", "fixed")


@dataclass(frozen=True)
class Case:
    scheme: str
    n: int
    s: int
    pattern: str
    aligned: bool | None = None  # pgc-cr: aligned ages or the cyclic orders

    @property
    def name(self) -> str:
        ages = "" if self.aligned is None else " aligned" if self.aligned else " cyclic"
        return f"{self.scheme}{ages} n={self.n} s={self.s}"


def owed(code: GradientCode, encoders: list[FrameEncoder], coefficients: list[set[float]]) -> torch.Tensor | None:
    """What the error feedback still owes, sum of nu_i e_i with nu_i the one coefficient
    worker i's frames were applied with (one copy per classic FR group, whose workers hold
    the same state); None when some worker's coefficient changed between rounds."""
    if any(len(c) > 1 for c in coefficients):
        return None
    total = torch.zeros(SHAPE).view(-1)
    copies = code.s + 1 if code.name == "gc-fr" else 1
    for enc, used in zip(encoders, coefficients, strict=True):
        total += (next(iter(used)) if used else 1.0) * enc.compressor.error[0] / copies
    return total


def run(case: Case, settle: bool, beta: float, rounds: int, seed: int = 0) -> tuple[float, float | None]:
    """(drift, leak) of one case; leak is |sum (T - U) - owed| / |sum T| (None: not defined)."""
    code = make_code(case.scheme, case.n, case.s, aligned=case.aligned)
    policy = CodePolicy(code)
    layout = Layout.from_named_tensors([("w", torch.zeros(SHAPE))])
    comp = CompressionConfig(ef_beta=beta)
    encoders = [FrameEncoder(layout, comp, undoable=True) for _ in range(case.n)]
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    fixed = [int(x) for x in rng.choice(case.n, size=case.s, replace=False)]
    latest: dict[tuple[int, int], torch.Tensor] = {}
    used: list[set[float]] = [set() for _ in range(case.n)]
    applied = torch.zeros(layout.numel, dtype=torch.float64)
    target = torch.zeros(layout.numel, dtype=torch.float64)
    for t in range(rounds):
        deltas = [torch.randn(SHAPE, generator=gen) for _ in range(case.n)]
        for i in range(case.n):
            for p in code.partition_at(i, t):
                latest[(i, p)] = deltas[p]
        messages = [sum(c * latest[(i, p)] for p, c in code.coefficients(i)) for i in range(case.n)]
        own = [enc.encode([m], t, i) for i, (enc, m) in enumerate(zip(encoders, messages, strict=True))]
        frames = [decode_frame(data, layout) for data in own]
        late = fixed if case.pattern == "fixed" else [int(x) for x in rng.choice(case.n, case.s, replace=False)]
        order = [int(x) for x in rng.permutation([i for i in range(case.n) if i not in late])] + late
        decision = close(policy, order)
        for i, a in decision.coefficients.items():
            used[i].add(round(a, 9))
            applied += a * frames[i].to_dense()[0].reshape(-1).double()
            target += a * messages[i].reshape(-1).double()
        chosen = [frames[i] for i in sorted(decision.coefficients)]
        for i, enc in enumerate(encoders):
            if settle:
                enc.settle(policy.settlement(decision, i), own[i], chosen)
    miss = target - applied
    drift = float(miss.norm() / target.norm())
    still = owed(code, encoders, used)
    leak = None if still is None else float((miss - still.double()).norm() / target.norm())
    return drift, leak


def measure(cases: list[Case], rounds: int) -> list[dict]:
    rows = []
    for case in cases:
        before, _ = run(case, settle=False, beta=0.95, rounds=rounds)
        after, _ = run(case, settle=True, beta=0.95, rounds=rounds)
        leak_before = run(case, settle=False, beta=1.0, rounds=rounds)[1]
        leak_after = run(case, settle=True, beta=1.0, rounds=rounds)[1]
        rows.append({"case": case.name, "pattern": case.pattern, "drift_before": before,
                     "drift_after": after, "leak_before": leak_before, "leak_after": leak_after})
        print(f"  {case.pattern:<7}{case.name:<23} before {before:.3f}  after {after:.3f}", flush=True)
    return rows


def table(rows: list[dict], uncoded: dict[str, float]) -> str:
    def fmt(x: float | None) -> str:
        return f"{x:>9.3f}" if x is not None else f"{'-':>9}"

    lines = [f"{'pattern':<8}{'scheme':<24}{'before':>9}{'after':>9}{'x none':>9}"
             f"{'leak b.':>9}{'leak a.':>9}  target"]
    for r in rows:
        ratio = r["drift_after"] / uncoded[r["pattern"]]
        met = "-" if r["case"].startswith("none") else ("met" if ratio <= TARGET else "NOT met")
        lines.append(f"{r['pattern']:<8}{r['case']:<24}{fmt(r['drift_before'])}{fmt(r['drift_after'])}"
                     f"{ratio:>9.3f}{fmt(r['leak_before'])}{fmt(r['leak_after'])}  {met}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 codes, 6 rounds: a smoke test")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    specs, rounds = (QUICK_CASES, 6) if args.quick else (CASES, ROUNDS)
    cases = [Case(*spec[:3], pattern, *spec[3:]) for pattern in PATTERNS for spec in specs]
    rows = measure(cases, rounds)
    uncoded = {r["pattern"]: r["drift_after"] for r in rows if r["case"].startswith("none")}
    print(f"drift = |sum_t (U_t - T_t)| / |sum_t T_t| over {rounds} rounds; leak: beta = 1, what the "
          f"error feedback still owes taken out (- : coefficients changed, nothing is exact); "
          f"target after <= {TARGET} x none")
    print(table(rows, uncoded))
    coded = [r for r in rows if not r["case"].startswith("none")]
    worst = max(r["drift_after"] / uncoded[r["pattern"]] for r in coded)
    print(json.dumps({**provenance(), "uncoded_drift": uncoded, "worst_coded_over_uncoded": round(worst, 3),
                      "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                               for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
