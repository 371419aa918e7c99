"""The training-service benchmarks (wan, parity, metrics_cost, sweeps, quantizer, pgc_cr,
ef_drift, straggler_loss, overlap, heterogeneous, broadcast, simclock, island), the security ones (fuzz_rpc, scale) and the
codec's run end to end in their ``--quick`` form and end with one JSON line holding the figures
they promise and where they come from (the corpus fingerprint and the software versions). Plumbing only: the numbers of
a quick run are not measurements (docs/benchmarks.md has those). Cost: wan about a minute
(three real local runs), overlap and heterogeneous about a minute each under light load
(three real local runs each), island about 30 s (three), the in-process ones 10-25 s each (broadcast about a minute under
load: 8 runs and the frame sizes of a 3M-parameter layout)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

KEYS = {
    "wan": {"sparse_round_s", "dense_round_s", "dense_fp32_round_s", "sparse_compute_s", "sparse_limit_s",
            "coordinator_uplink_s", "speedup", "upload_ratio"},
    "parity": {"arms", "ratio_mean", "ratio_upper95", "rounds", "seeds", "diloco", "adamw", "dense_bf16_bytes"},
    "metrics_cost": {"round_s_off", "round_s_on", "ratio_on_off", "scrape_ms", "record_round_ms"},
    "sweeps": {"H"},
    "quantizer": {"loss_mean", "codec"},
    "pgc_cr": {"weights", "loss_mean"},
    "ef_drift": {"uncoded_drift", "worst_coded_over_uncoded", "rows"},
    "straggler_loss": {"rows", "worst_loss_gap", "seeds"},
    "overlap": {"comm50", "loss_vs_none", "loss_seeds", "loss_regime"},
    "heterogeneous": {"uniform", "fixed", "auto+overlap", "links"},
    "broadcast": {"rows", "ratio_mean_worst", "ratio_upper95_worst", "round_time", "rounds", "seeds"},
    "simclock": {"groups", "settings"},
    "island": {"island", "fsdp", "separate", "wan_bytes_ratio", "fsdp_round_s_ratio", "fsdp_loss_vs_ddp"},
}
PROVENANCE = {"corpus", "versions"}  # every benchmark's last JSON line (benchmarks/provenance.py)
RUN_DIR = {"wan", "overlap", "heterogeneous", "island"}  # the benchmarks that take --run-dir


@pytest.mark.parametrize("name", sorted(KEYS))
def test_quick_run_ends_with_json_line(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    extra = ["--run-dir", str(tmp_path / name)] if name in RUN_DIR else []
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    assert KEYS[name] | PROVENANCE <= set(result), f"missing {KEYS[name] | PROVENANCE - set(result)} in {last}"
    assert all(result[k] is not None for k in KEYS[name]), last
    assert result["versions"]["python"] == platform.python_version(), last


def test_parity_tune_writes_what_the_evaluation_reads(tmp_path: Path) -> None:
    """``--tune --quick`` writes a settings file; a second ``--tune`` of the same regime,
    without the run cache, takes every grid point from that file and trains nothing; the
    evaluation reads the file back and trains DiLoCo and AdamW with the settings it names;
    every run lands in the cache once."""
    tuned, cache = tmp_path / "tuned.json", tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    outputs, files = [], []
    for extra in (["--tune"], ["--tune", "--cache", "none"], []):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.parity", "--quick", "--tuned", str(tuned),
                               "--cache", str(cache), *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout)
        files.append(json.loads(tuned.read_text()))
    trained = [len(re.findall(r"seed \d+ +loss", out)) for out in outputs[:2]]
    assert trained[0] > 0 and trained[1] == 0 and "grid points from" in outputs[1], (trained, outputs[1])
    assert (files[1]["tuned"], files[1]["losses"]) == (files[0]["tuned"], files[0]["losses"])
    chosen = json.loads(tuned.read_text())["tuned"]
    assert set(chosen) == {"sparseloco", "diloco", "adamw"} and "outer.lr" in chosen["diloco"], chosen
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tuned_file"] == str(tuned)
    assert result["diloco"]["settings"]["outer.lr"] == chosen["diloco"]["outer.lr"], result
    assert result["adamw"]["settings"]["inner.lr"] == chosen["adamw"]["inner.lr"], result
    assert len(result["arms"]["sparseloco"]["ratios"]) == len(result["seeds"]), result
    stored = [json.loads(f.read_text()) for f in cache.glob("*.json")]
    evaluated = {(r["label"], r["seed"]) for r in stored if r["seed"] in result["seeds"]}
    assert evaluated == {(m, s) for m in ("sparseloco", "diloco", "adamw") for s in result["seeds"]}, stored


def test_overlap_fold_sweep_pairs_each_fold_step_against_none() -> None:
    """``overlap --fold-steps`` (loss only): none and eager at each step, paired by seed; a
    fold before the last step is a fold at the phase's end, which k = H names."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overlap", "--quick", "--fold-steps", "1,2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["fold_steps"]
    assert list(rows) == ["none", "eager@1", "eager@2"], rows
    assert [rows[a]["hidden_share"] for a in rows] == [0.0, 0.5, 1.0]
    assert rows["eager@1"]["final_loss"] != rows["eager@2"]["final_loss"], rows  # the step changed the run
    assert rows["none"]["vs_none"] is None and rows["eager@2"]["vs_none"]["mean"] is not None
    bad = subprocess.run([sys.executable, "-m", "benchmarks.overlap", "--quick", "--fold-steps", "3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "1..2" in bad.stderr, bad.stderr[-2000:]


SECURITY_KEYS = {
    "fuzz_rpc": {"streams", "crashed", "invalid_accepted", "worker_served"},
    "scale": {"params", "decode_apply_s", "rows", "targets"},
}


@pytest.mark.parametrize("name", sorted(SECURITY_KEYS))
def test_security_benchmarks_quick_run_ends_with_json_line(name: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert SECURITY_KEYS[name] | PROVENANCE <= set(result), result
    if name == "fuzz_rpc":
        assert result["crashed"] == 0 and result["invalid_accepted"] == 0 and result["worker_served"]
    if name == "scale":  # both round results by default; aggregate at the union's density: one frame, smaller
        assert set(result["targets"]) == {"frames", "aggregate"}
        rows = {(r["broadcast"], r["n"]): r for r in result["rows"]}
        assert {r["sent_as"][0] for r in result["rows"]} == {"frames", "aggregate"}
        assert rows["frames", 4]["download_bytes_per_worker"] > 3 * rows["frames", 2]["download_bytes_per_worker"] / 2
        for n in (2, 4):
            r = rows["aggregate", n]
            assert (r["broadcast_density"], r["broadcast_passes"]) == (n / 64, 1), r
            assert r["download_bytes_per_worker"] < rows["frames", n]["download_bytes_per_worker"], r
        assert all(r["coordinator_upload_bytes"] == r["n"] * r["download_bytes_per_worker"] for r in rows.values())
        assert all(r["checkpoint_rss_mb"] > 0 for r in rows.values())  # a checkpoint written after the rounds


CODEC_KEYS = {"bits_per_param", "ratio_vs_fp32", "ratio_vs_bf16", "encode_gbps", "decode_apply_gbps",
              "ef_pass_gbps", "encode_vs_ef_pass", "decode_apply_vs_ef_pass",
              "rel_error_vs_exact_topk", "entropy_bound_bits_per_index"}


def test_codec_benchmark_quick_prints_json_with_the_issue_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.codec", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == CODEC_KEYS | PROVENANCE | {"data_fingerprint"}
    assert all(isinstance(result[k], (int, float)) for k in CODEC_KEYS)


APPLY_KEYS = {"params", "torch_threads", "codec_threads", "rows", "apply_ratio", "apply_target", "tiny_op_us",
              "tiny_op_busy_us"}
APPLY_ROW_KEYS = {"n", "torch_mean_kept_ms", "fused_mean_kept_ms", "fused_sum_ms", "decode_apply_ms",
                  "worker_round_ms", "fused_vs_n_decode_apply", "sum_vs_n_decode_apply", "torch_vs_fused"}


def test_codec_benchmark_apply_quick_prints_json_with_its_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.codec", "--apply", "--quick", "--codec-threads", "2"],
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) >= APPLY_KEYS | PROVENANCE, result
    assert (result["torch_threads"], result["codec_threads"]) == (1, 2)
    assert [r["n"] for r in result["rows"]] == [2, 4] and all(set(r) >= APPLY_ROW_KEYS for r in result["rows"])
