"""A worker as an island of ranks (geoloco.worker.island), with real processes on Gloo: an
island's pseudo-gradient is the one a single process computes from the same tokens; two
islands train and agree with the coordinator every round while only rank 0 of each talks to
it; a rank SIGKILLed mid-round takes its island down, naming the rank, and the island
restarts on its --state-dir, takes its slot back and agrees again."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_processes import (
    ROOT,
    SMALL,
    Processes,
    coordinator_port,
    final_coordinator_digest,
    metrics,
    set_flags,
    wait_until,
    worker_reports,
)

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
# An island's ranks average gradients of half batches where one process takes the mean of
# the whole batch: the same sums in another order, fp32 rounding apart (about 1e-7 of a
# value per operation). Over 8 AdamW steps that came to 1.4e-6 of Δ's norm; the bound leaves
# room for other CPUs' kernels, and stays far below what other tokens give (over 1e-2).
DELTA_RTOL = 1e-4


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(((x - y) ** 2).sum().item() for x, y in zip(a, b, strict=True))
    return math.sqrt(num / sum((x ** 2).sum().item() for x in a))


def island_delta(tmp_path: Path, ranks: int, batch_size: int = 8, parallel: str = "ddp") -> dict:
    out = tmp_path / f"delta-{ranks}-{batch_size}-{parallel}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, str(HERE / "island_delta.py"), "--ranks", str(ranks),
                           "--out", str(out), "--batch-size", str(batch_size), "--parallel", parallel],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_an_island_trains_the_pseudo_gradient_one_process_would(tmp_path: Path) -> None:
    one, two = island_delta(tmp_path, 1), island_delta(tmp_path, 2)
    assert relative_difference(one["delta"], two["delta"]) < DELTA_RTOL
    assert math.isclose(one["loss"], two["loss"], rel_tol=DELTA_RTOL)
    # the bound tells the same tokens from others: one rank's share alone is far off
    half = island_delta(tmp_path, 1, batch_size=4)
    assert relative_difference(one["delta"], half["delta"]) > 100 * DELTA_RTOL


def test_a_sharded_island_trains_the_same_pseudo_gradient_holding_half_each(tmp_path: Path) -> None:
    """fsdp: the same Δ as one process within the same bound (FSDP's reduce-scatter sums the
    halves' gradients as ddp's all-reduce does), while each rank holds only its shard of the
    parameters, of AdamW's moments, of θ, of Δ and of the error feedback: together the whole
    model once (twice for the moments), neither rank more than its torch.chunk share plus
    one row of each tensor (θ and the error feedback: 60 %); the frames the ranks compress
    together from that Δ, round after round through every settlement, are the ones a single
    compressor makes, byte for byte; and a round result that each rank applies to its
    pieces of θ leaves the θ one process gets, bit for bit (its digest)."""
    one, sharded = island_delta(tmp_path, 1), island_delta(tmp_path, 2, parallel="fsdp")
    assert relative_difference(one["delta"], sharded["delta"]) < DELTA_RTOL
    assert math.isclose(one["loss"], sharded["loss"], rel_tol=DELTA_RTOL)
    numel, held = one["numel"], sharded["held"]
    assert sum(held["params"]) == numel and sum(held["adamw"]) == 2 * numel, (held, numel)
    assert all(0 < n < 0.6 * numel for n in held["params"]), (held, numel)
    assert all(0 < n < 1.2 * numel for n in held["adamw"]), (held, numel)
    assert sum(held["error_feedback"]) == numel and all(0 < n < 0.6 * numel for n in held["error_feedback"]), held
    assert held["theta"] == held["error_feedback"], held  # θ and the Δs in the same pieces
    whole, island = sharded["frames"]  # four rounds, each settled another way (island_delta.settled_frames)
    assert len(set(whole)) == 4 and island == whole
    # a round result applied by each rank to its pieces of θ: the whole θ one process gets, bit for bit
    put_together, alone = sharded["digests"]
    assert put_together == alone, sharded["digests"]


def island_pids(launcher: int) -> dict[int, int]:
    """The ranks an island launcher started: {rank: pid}."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
        if ppid == launcher and rank is not None:
            ranks[rank] = int(proc.name)
    return ranks


def connections_to(port: int) -> dict[int, int]:
    """Loopback TCP connections to ``port`` on this host: {local port: pid of its owner}."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if int(remote.rsplit(":", 1)[1], 16) == port and state == "01":  # ESTABLISHED
                inodes[f"socket:[{inode}]"] = int(local.rsplit(":", 1)[1], 16)
    owners = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target in inodes:
                    owners[inodes[target]] = int(proc.name)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return owners


@pytest.mark.parametrize(("parallel", "overlap", "method"), [
    ("ddp", "none", "sparseloco"), ("fsdp", "none", "sparseloco"), ("fsdp", "eager", "sparseloco"),
    ("fsdp", "none", "diloco")])
def test_two_islands_agree_every_round_and_only_rank_0_talks(processes: Processes, tmp_path: Path,
                                                             parallel: str, overlap: str, method: str) -> None:
    """Two islands of 2 ranks agree with the coordinator every round and only rank 0 of each
    has a connection to it; under fsdp also with outer.overlap, where every rank makes its
    pieces of the running copy that the next phase trains from, and under DiLoCo, whose dense
    message is put together on rank 0 and whose dense round results each rank applies to
    its pieces."""
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", "6", "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "outer.overlap": overlap, "compression.method": method})])
    port = coordinator_port(run_dir)
    for i in range(2):
        processes.start(f"island-{i}", ["worker", "--coordinator", f"127.0.0.1:{port}", "--device", "cpu",
                                        "--nproc-per-node", "2", "--parallel", parallel,
                                        "--report-dir", str(reports)])
    wait_until(lambda: len(metrics(run_dir)) >= 2, 240, "two rounds")
    ranks = {name: island_pids(proc.pid) for name, proc in processes.procs.items() if name.startswith("island")}
    assert all(sorted(r) == [0, 1] for r in ranks.values()), ranks
    talking = set(connections_to(port).values())
    joins = re.findall(r"worker \d joined from \S+ at ipv[46]:\S+:(\d+) \(([^)]*)\)", processes.log("coordinator"))

    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for name in ranks:
        assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    leaders = {r[0] for r in ranks.values()}
    if overlap != "none":
        assert all("trains from the running copy" in processes.log(name) for name in ranks)
    assert talking and talking <= leaders, (talking, ranks)  # no rank 1 has a connection to it
    assert len(joins) == 2 and all(f"island of 2 ranks, {parallel}" in device for _, device in joins), joins
    validated = [m["val_loss"] for m in metrics(run_dir) if m.get("val_loss") is not None]
    assert validated[-1] < validated[0]
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert sorted(finished) == [0, 1]
    for report in finished.values():
        # every round's digest check passed: no mismatch, no state fetched again
        assert report["status"] == "finished" and report["digest"] == digest, report
        assert report["digest_mismatches"] == 0 and report["resyncs"] == 0, report
        assert report["island"]["ranks"] == 2 and report["island"]["rank0_pid"] in leaders
        if parallel == "fsdp":  # each rank held its half of the model, of AdamW's moments, of θ and of the error feedback
            held = report["island"]["held"]
            assert len(held["params"]) == 2 and all(0 < n < 0.6 * sum(held["params"]) for n in held["params"])
            assert sum(held["adamw"]) == 2 * sum(held["params"]), held
            for outer in (held["theta"], held.get("error_feedback", held["theta"])):  # DiLoCo: none
                assert sum(outer) == sum(held["params"]) and all(0 < n < 0.6 * sum(outer) for n in outer), held


ROUNDS = 12


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_killed_rank_takes_its_island_down_and_the_island_resumes(processes: Processes, tmp_path: Path,
                                                                    parallel: str) -> None:
    run_dir, reports, state_dir = tmp_path / "run", tmp_path / "reports", tmp_path / "state"
    processes.start("coordinator", ["coordinator", "--listen", "127.0.0.1:0", "--workers", "2",
                                    "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
                                    *set_flags({**SMALL, "coordinator.liveness_s": "5",
                                                "coordinator.checkpoint_every": "0"})])
    address = f"127.0.0.1:{coordinator_port(run_dir)}"

    def start_island(name: str) -> None:
        processes.start(name, ["worker", "--coordinator", address, "--device", "cpu", "--nproc-per-node",
                               "2", "--parallel", parallel, "--report-dir", str(reports),
                               "--state-dir", str(state_dir)])

    start_island("island")
    processes.start("plain", ["worker", "--coordinator", address, "--device", "cpu", "--report-dir", str(reports)])
    wait_until(lambda: len(metrics(run_dir)) >= 3, 240, "three rounds")
    island_id = next(i for i, r in worker_reports(reports).items() if "island" in r)
    rank1 = island_pids(processes.procs["island"].pid)[1]
    # the island's stream ends with it, so rounds no longer wait for it: hold them on "plain"
    # from before the kill (a CI run, the island's teardown slow on a loaded machine, closed
    # every round left on "plain" alone before the restart)
    with processes.paused("plain"):  # the open round waits for it: no round closes
        os.kill(rank1, 9)
        code = processes.wait("island", timeout=120)
        assert code == 128 + 9, processes.log("island")[-3000:]
        assert "island rank 1 was killed by SIGKILL; stopping the island" in processes.log("island")
        start_island("restarted")  # it reclaims its slot from its --state-dir, dead or not
        wait_until(lambda: processes.log("coordinator").count(f"worker {island_id} follows rounds") >= 2,
                   240, "the restarted island to follow the rounds")
    assert len(metrics(run_dir)) < ROUNDS

    assert processes.wait("coordinator", timeout=240) == 0, processes.log("coordinator")[-3000:]
    for name in ("plain", "restarted"):
        assert processes.wait(name, timeout=60) == 0, processes.log(name)[-3000:]
    restarted = processes.log("restarted")
    assert f"reclaiming worker {island_id}" in restarted and "restored the local state of round" in restarted
    assert "inner AdamW state, data positions" in restarted, [  # every rank's AdamW (shard) came back
        line for line in restarted.splitlines() if "state" in line]
    if parallel == "fsdp":  # rank 1's shards of the last two rounds beside rank 0's file, its error feedback in them
        shards = sorted(state_dir.glob(f"worker-{island_id}.rank-1.round-*.state.pt"))
        assert len(shards) == 2 and (state_dir / f"worker-{island_id}.state.pt").exists(), shards
        ef = torch.load(shards[-1], weights_only=True)["error_feedback"]["error_feedback"]
        assert 0 < sum(e.numel() for e in ef) < sum(e.numel() for e in torch.load(
            state_dir / f"worker-{island_id}.state.pt", weights_only=True)["error_feedback"]["error_feedback"]) * 1.2
    _, digest = final_coordinator_digest(run_dir)
    finished = worker_reports(reports)
    assert finished[island_id]["pid"] == processes.procs["restarted"].pid
    assert all(r["status"] == "finished" and r["digest"] == digest for r in finished.values())
