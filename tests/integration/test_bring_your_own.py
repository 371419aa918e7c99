"""The examples, run as a user would: a tiny Llama (transformers) from a config with a
tokenizer trained on the corpus, and a custom nn.Module, each for 3 rounds with 3 worker
processes through ``geoloco.run_local``; the two-machine config on loopback for 2 rounds;
the Llama's export loaded with transformers gives the coordinator's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_processes import ROOT, Processes, final_coordinator_digest, wait_until, worker_reports

import geoloco
from geoloco.cli import main
from geoloco.compression import encode_dense
from geoloco.coordinator import checkpoint
from geoloco.replica import replica_layout
from geoloco.tasks import build_task

pytestmark = pytest.mark.slow
WORKERS, ROUNDS = 3, 3
EXAMPLES = ROOT / "examples"
# Fewer, shorter inner steps than the examples' own, so that three rounds take seconds.
FAST = {"inner.steps": 8, "inner.warmup_steps": 4, "task.val_windows": 16, "task.corpus_bytes": 300_000,
        "network.wan": "unlimited", "coordinator.join_timeout_s": 120}


def run_example(name: str, run_dir: Path) -> geoloco.RunResult:
    cfg = geoloco.load_config(EXAMPLES / name / "run.toml", {
        **FAST, "workers": WORKERS, "rounds": ROUNDS, "run_dir": str(run_dir)})
    result = geoloco.run_local(cfg, stall_timeout_s=120)
    assert result.ok, (result.error, [p.read_text()[-2000:] for p in result.logs_dir.glob("*.log")])
    return result


def check_run(result: geoloco.RunResult, rounds: int, workers: int) -> None:
    """Loss falls, every replica matched the coordinator's digest every round (no resync)
    and ends on it, and a worker-round uploads at most 1 % of dense fp32."""
    summary, lines = result.summary, result.metrics()
    assert summary["rounds"] == rounds and [m["round"] for m in lines] == list(range(rounds))
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.1, summary
    assert summary["digest_mismatches"] == 0
    final_round, digest = final_coordinator_digest(result.run_dir)
    reports = worker_reports(result.run_dir / "workers")
    assert final_round == rounds and len(reports) == workers
    assert all(r["digest"] == digest and r["resyncs"] == 0 and r["rounds_applied"] == rounds
               for r in reports.values()), reports
    for m in lines:
        assert sorted(m["arrived"]) == list(range(workers))
        assert max(m["upload_bytes"].values()) <= 0.01 * summary["dense_fp32_bytes"], m


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> geoloco.RunResult:
    return run_example("tiny_llama", tmp_path_factory.mktemp("llama") / "run")


def test_tiny_llama_with_a_trained_tokenizer_trains(llama_run: geoloco.RunResult) -> None:
    check_run(llama_run, ROUNDS, WORKERS)
    newest = llama_run.checkpoints[-1]
    assert {p.name for p in newest.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json",
                                                   checkpoint.STATE_FILE}
    cfg = geoloco.load_config(llama_run.run_dir / "config.json")
    assert cfg.task.tokenizer == "train:1024" and cfg.task.data_fingerprint


def test_the_llama_export_loads_in_transformers_with_the_coordinators_logits(
        llama_run: geoloco.RunResult, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    assert main(["export", str(llama_run.run_dir), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)

    cfg = geoloco.load_config(llama_run.run_dir / "config.json")
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    coordinator_model = task.make_model().to("cpu", torch.float32).eval()  # as the coordinator builds it
    ckpt = checkpoint.load_latest(llama_run.run_dir)
    coordinator_model.load_state_dict({**ckpt.params, **ckpt.fixed}, strict=False)
    assert [s.name for s in replica_layout(coordinator_model).specs] == list(ckpt.params)

    x, _ = task.batch(0, 0)
    with torch.no_grad():
        want = coordinator_model(input_ids=x).logits
        got = exported(input_ids=x).logits
    assert torch.equal(got, want)
    text = "def add(a, b):\n    return a + b\n"
    assert tokenizer(text)["input_ids"] == task.tokenizer.tokenizer.encode(text).ids
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_a_custom_module_function_model_trains(tmp_path: Path) -> None:
    result = run_example("custom_model", tmp_path / "run")
    check_run(result, ROUNDS, WORKERS)
    layout = replica_layout(build_task(geoloco.load_config(result.run_dir / "config.json").task, 1).make_model())
    assert "head.weight" not in [s.name for s in layout.specs]  # tied to the embedding: sent once
    dense = len(encode_dense(layout, [torch.zeros(s.shape) for s in layout.specs], round=0, sender=0))
    assert result.summary["dense_fp32_bytes"] == dense


def test_the_two_machine_config_on_loopback(tmp_path: Path) -> None:
    processes = Processes(tmp_path / "logs")
    config = str(EXAMPLES / "two_machines" / "run.toml")
    sets = [a for k, v in {**FAST, "rounds": 2}.items() for a in ("--set", f"{k}={v}")]
    run_dir = tmp_path / "run"
    try:
        processes.start("coordinator", ["coordinator", "--config", config, "--listen", "127.0.0.1:0",
                                        "--run-dir", str(run_dir), *sets])
        port_file = run_dir / "coordinator.port"
        wait_until(lambda: port_file.exists() and port_file.read_text().strip().isdigit(), 120,
                   "the coordinator's port")
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        for i in range(2):
            processes.start(f"worker-{i}", ["worker", "--config", config, "--coordinator", address,
                                            "--report-dir", str(run_dir / "workers"), *sets])
        assert processes.wait("coordinator", timeout=300) == 0, processes.log("coordinator")[-3000:]
        for i in range(2):
            assert processes.wait(f"worker-{i}", timeout=60) == 0, processes.log(f"worker-{i}")[-3000:]
    finally:
        processes.cleanup()
    final_round, digest = final_coordinator_digest(run_dir)
    reports = worker_reports(run_dir / "workers")
    assert final_round == 2 and {r["digest"] for r in reports.values()} == {digest}
    assert all(r["resyncs"] == 0 for r in reports.values())
