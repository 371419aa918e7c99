"""The mutation fuzzer and the codec benchmark run and report what they promise."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` puts tests/unit, not the repository, on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import fuzz_frames  # noqa: E402

BENCH_KEYS = {"bits_per_param", "ratio_vs_fp32", "ratio_vs_bf16", "encode_gbps", "decode_apply_gbps",
              "ef_pass_gbps", "encode_vs_ef_pass", "decode_apply_vs_ef_pass",
              "rel_error_vs_exact_topk", "entropy_bound_bits_per_index"}


def test_mutated_frames_never_crash_the_decoder():
    r = fuzz_frames.run(count=3000, seed=1)
    assert r["crashed"] == 0
    assert r["rejected"] > r["accepted"] > 0  # both outcomes are exercised


def test_fuzz_script_exit_status_and_json(capsys):
    assert fuzz_frames.main(["--count", "200", "--seed", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert set(json.loads(last)) >= {"rejected", "accepted", "crashed"}


def test_codec_benchmark_quick_prints_json_with_the_issue_keys():
    out = subprocess.run([sys.executable, "-m", "benchmarks.codec", "--quick"], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == BENCH_KEYS
    assert all(isinstance(v, (int, float)) for v in result.values())
