"""Wire fuzzing of the coordinator's Push: mutated streams into a live coordinator process
over real gRPC. Does any of them crash it, get an invalid frame accepted, or leave it
unable to serve a real worker?

Each stream mutates one thing of a valid push: the call's metadata, the PushHeader (worker,
session, round, total_bytes), the chunk boundaries (random cuts, empty chunks, a second
header, data past the end, more chunks than the cap), or the frame itself
(benchmarks.fuzz_frames' mutations, half of them with the checksum and length repaired so
that the decoder's structural checks are reached). A stream whose header, chunks and frame
are all valid should be accepted; any other accepted stream is an invalid frame accepted.
A crash is the coordinator process dying, or a call ending in a status the servicer never
sends (UNKNOWN, INTERNAL: an exception in a handler). At the end every identity pushes a
valid frame, the round closes, and a client fetches the state, follows the round and must
reach the coordinator's digest: a real worker still served.

    python -m benchmarks.fuzz_rpc --count 100000 --seed 0      (--quick: 2,000 streams)

Prints a table and one JSON line; exits 1 when crashed > 0 or an invalid frame was accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from benchmarks.fuzz_frames import mutate, stamped
from benchmarks.provenance import provenance
from geoloco import transport
from geoloco.compression import Compressor, FrameError, Layout, decode_frame
from geoloco.config import load_config
from geoloco.coordinator.service import EXTRA_CHUNKS
from geoloco.protos import geoloco_pb2 as pb
from geoloco.protos import geoloco_pb2_grpc
from geoloco.replica import apply_round, param_digest
from geoloco.tasks import build_task

TOKEN = "fuzz-rpc"
IDENTITIES = 32  # worker slots the fuzzer holds; a round closes when half have pushed
THREADS = 6
RUN = {"task.model": "gpt-tiny", "task.seq_len": "16", "task.batch_size": "2", "task.val_windows": "2",
       "task.corpus_bytes": "100000", "coordinator.deadline_s": "1000000", "coordinator.val_every": "0",
       "coordinator.checkpoint_every": "0", "coordinator.join_timeout_s": "1", "rounds": "10000000"}
EXPECTED_CODES = {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


@dataclass
class Stream:
    """One push as sent, and whether everything in it is valid."""

    metadata: tuple
    chunks: list[pb.PushChunk]
    valid: bool
    kind: str


def frame_valid(data: bytes, layout: Layout, round_: int, worker: int) -> bool:
    try:
        f = decode_frame(data, layout)
    except FrameError:
        return False
    return f.kind == "sparse" and f.round == round_ and f.sender == worker


def cut(data: bytes, rng: random.Random, pieces: int) -> list[bytes]:
    points = sorted({rng.randrange(1, len(data)) for _ in range(pieces - 1)}) if len(data) > 1 else []
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def make_stream(rng: random.Random, base: bytes, frames: list[bytes], layout: Layout, round_: int,
                worker: int, session: str) -> Stream:
    """A valid push for (``round_``, ``worker``) with one thing mutated (or none)."""
    data = stamped(base, round_, worker)
    header = dict(worker_id=worker, session=session, round=round_, total_bytes=len(data))
    metadata = transport.caller_metadata(worker, session)
    pieces: list[bytes] | None = None
    extra: list[pb.PushChunk] = []
    kind = rng.choice(["none", "metadata", "header", "chunks", "frame", "frame", "frame"])
    if kind == "metadata":
        metadata = rng.choice([(), transport.caller_metadata(worker, "f" * 32), ((transport.WORKER_ID_KEY, "x"),),
                               transport.caller_metadata((worker + 1) % IDENTITIES, session)])
    elif kind == "header":
        field = rng.choice(["worker_id", "session", "round", "total_bytes"])
        header[field] = {"worker_id": rng.choice([worker + 1, -1, 2**31 - 1]),
                         "session": rng.choice(["", "0" * 32, session[:-1]]),
                         "round": rng.choice([round_ - 1, round_ + 1, -1, 2**62]),
                         "total_bytes": rng.choice([0, -5, len(data) - 1, len(data) + 1, 2**40])}[field]
    elif kind == "chunks":
        op = rng.randrange(5)
        pieces = cut(data, rng, rng.randint(1, 40))
        if op == 0:
            pieces.insert(rng.randrange(len(pieces) + 1), b"")
        elif op == 1:
            extra = [pb.PushChunk(header=pb.PushHeader(**header))]
        elif op == 2:
            pieces.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))))
        elif op == 3:
            pieces = pieces[:-1] or [data[:1]]
        else:
            limit = -(-len(data) // transport.CHUNK_BYTES) + EXTRA_CHUNKS
            pieces = cut(data, rng, min(len(data), limit + rng.randint(1, 8)))
    elif kind == "frame":
        data = mutate(rng, data, frames)
        if rng.random() < 0.5:
            header["total_bytes"] = len(data)
        if not data:
            data = b"\0"
    pieces = pieces if pieces is not None else cut(data, rng, rng.randint(1, 4))
    body = b"".join(pieces)
    valid = (kind in ("none", "frame", "chunks") and metadata == transport.caller_metadata(worker, session)
             and header == dict(worker_id=worker, session=session, round=round_, total_bytes=len(body))
             and not extra and all(pieces) and len(pieces) <= -(-len(body) // transport.CHUNK_BYTES) + EXTRA_CHUNKS
             and frame_valid(body, layout, round_, worker))
    chunks = [pb.PushChunk(header=pb.PushHeader(**header))] + [pb.PushChunk(data=p) for p in pieces]
    chunks[1:1] = extra if extra else []
    return Stream(metadata, chunks, valid, kind)


class Fuzzer:
    """A coordinator process, IDENTITIES joined slots, and the open round as its Rounds
    stream (followed by identity 0) tells it."""

    def __init__(self, run_dir: Path, seed: int) -> None:
        cfg = load_config(overrides={**RUN, "workers": str(IDENTITIES), "coordinator.token": TOKEN})
        model = build_task(cfg.task, cfg.workers, seed=cfg.seed).make_model()
        self.layout = Layout.from_named_tensors(model.named_parameters())
        gen = torch.Generator().manual_seed(seed)
        deltas = [torch.randn(s.shape, generator=gen) * 1e-3 for s in self.layout.specs]
        self.bases = [Compressor(self.layout, density=d).compress(deltas, round=0, sender=0)
                      for d in (cfg.compression.density, 4 * cfg.compression.density)]
        flags = [a for k, v in RUN.items() for a in ("--set", f"{k}={v}")]
        self.log = open(run_dir / "coordinator.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "geoloco.cli", "coordinator", "--listen", "127.0.0.1:0", "--run-dir",
             str(run_dir), "--workers", str(IDENTITIES), *flags], stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, GEOLOCO_TOKEN=TOKEN, OMP_NUM_THREADS="1"))
        try:
            self._connect(run_dir)
        except BaseException:  # the coordinator must not outlive a failed start
            self.proc.kill()
            self.proc.wait()
            self.log.close()
            raise

    def _connect(self, run_dir: Path) -> None:
        """Wait for the coordinator's port, join every identity, fetch the state and start
        following the rounds."""
        port_file = run_dir / "coordinator.port"
        while not (port_file.exists() and port_file.read_text().strip().isdigit()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited: see {run_dir / 'coordinator.log'}")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{int(port_file.read_text())}"
        self.channel = transport.open_channel(self.address)
        self.stub = geoloco_pb2_grpc.CoordinatorStub(self.channel)
        request = pb.JoinRequest(token=TOKEN, protocol_version=transport.PROTOCOL_VERSION)
        self.sessions = [self.stub.Join(request, timeout=60) for _ in range(IDENTITIES)]
        self.round = 0
        self.closed = threading.Condition()
        self.followed, self.mismatches = 0, 0
        first = self.sessions[0]
        state = list(self.stub.FetchState(pb.FetchStateRequest(worker_id=first.worker_id, session=first.session),
                                          timeout=60))
        self.params = [t.clone() for t in decode_frame(b"".join(c.data for c in state), self.layout).to_dense("cpu")]
        self.mismatches += param_digest(self.params) != state[0].digest
        self.follower = threading.Thread(target=self._follow, daemon=True)
        self.follower.start()

    def _follow(self) -> None:
        """A replica of the coordinator's parameters, as a worker keeps one: every round
        result applied, its digest compared."""
        first = self.sessions[0]
        header, data = None, b""
        for update in self.stub.Rounds(pb.RoundsRequest(worker_id=first.worker_id, session=first.session)):
            part = update.WhichOneof("part")
            if part == "header":
                header, data = update.header, b""
            elif part == "data":
                data += update.data
            elif part == "digest":
                decoded, at = [], 0
                for info in header.frames:
                    decoded.append(decode_frame(data[at:at + info.nbytes], self.layout))
                    at += info.nbytes
                apply_round(self.params, decoded, [f.weight for f in header.frames], header.aggregation,
                            header.alpha)
                with self.closed:
                    self.mismatches += param_digest(self.params) != update.digest.digest
                    self.followed += 1
                    self.round = header.round + 1
                    self.closed.notify_all()

    def push(self, stream: Stream) -> tuple[str, bool]:
        """(status name, accepted) of one push."""
        try:
            reply = self.stub.Push(iter(stream.chunks), metadata=stream.metadata, timeout=60)
            return "OK", reply.accepted
        except grpc.RpcError as exc:
            return exc.code().name, False

    def close_round(self, round_: int) -> None:
        """Every identity pushes a valid frame for ``round_``; wait for the round's result."""
        for s in self.sessions:
            data = stamped(self.bases[0], round_, s.worker_id)
            self.push(Stream(transport.caller_metadata(s.worker_id, s.session),
                             [pb.PushChunk(header=pb.PushHeader(worker_id=s.worker_id, session=s.session,
                                                                round=round_, total_bytes=len(data))),
                              pb.PushChunk(data=data)], True, "close"))
        with self.closed:
            if not self.closed.wait_for(lambda: self.round > round_, timeout=120):
                raise RuntimeError(f"round {round_} did not close; see {self.log.name}")

    def served(self) -> bool:
        """The replica that fetched the state at the start and applied every round since
        from the Rounds stream holds the coordinator's parameters after each of them, and
        one more round closes with every identity's valid push."""
        self.close_round(self.round)
        with self.closed:
            return self.followed >= 1 and self.mismatches == 0

    def stop(self) -> bool:
        """Stop the coordinator; True when it was still alive."""
        alive = self.proc.poll() is None
        self.channel.close()
        if alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return alive


def run(count: int, seed: int) -> dict:
    rng = random.Random(seed)
    counts: Counter = Counter()
    kinds: Counter = Counter()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz-rpc-") as tmp:
        fuzzer = Fuzzer(Path(tmp), seed)
        try:
            frames = [stamped(b, 0, 0) for b in fuzzer.bases]
            sent, rounds = 0, 0
            with ThreadPoolExecutor(THREADS) as pool:
                while sent < count:
                    round_, spent = fuzzer.round, set()
                    batch = []
                    while sent < count and len(spent) < IDENTITIES // 2 and len(batch) < 4 * IDENTITIES:
                        who = rng.choice([s for s in fuzzer.sessions if s.worker_id not in spent])
                        stream = make_stream(rng, rng.choice(fuzzer.bases), frames, fuzzer.layout, round_,
                                             who.worker_id, who.session)
                        batch.append((stream, who.worker_id, pool.submit(fuzzer.push, stream)))
                        sent += 1
                        if len(batch) % THREADS == 0:  # learn which identities are spent
                            for _, w, fut in batch[-THREADS:]:
                                if fut.result()[1]:
                                    spent.add(w)
                    for stream, _, fut in batch:
                        code, accepted = fut.result()
                        kinds[stream.kind] += 1
                        counts[code] += 1
                        counts["accepted"] += accepted
                        counts["accepted_valid" if stream.valid else "accepted_invalid"] += accepted
                        counts["refused_valid"] += stream.valid and not accepted
                    if fuzzer.proc.poll() is not None:
                        break
                    fuzzer.close_round(round_)
                    rounds += 1
            alive = fuzzer.proc.poll() is None
            served = alive and fuzzer.served()
        finally:
            fuzzer.stop()
    crashed = int(not alive) + sum(n for code, n in counts.items() if code in ("UNKNOWN", "INTERNAL"))
    return {"streams": sent, "crashed": crashed, "invalid_accepted": counts["accepted_invalid"],
            "valid_accepted": counts["accepted_valid"], "valid_refused": counts["refused_valid"],
            "refused": sent - counts["accepted"], "statuses": {k: v for k, v in counts.items() if k.isupper()},
            "mutations": dict(kinds), "rounds_closed": rounds, "worker_served": served,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=100_000, help="mutated Push streams to send")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2,000 streams: a smoke test")
    args = ap.parse_args(argv)
    r = run(2_000 if args.quick else args.count, args.seed)
    print(f"{'streams':>9} {'crashed':>8} {'invalid accepted':>17} {'valid accepted':>15} "
          f"{'refused':>9} {'rounds':>7} {'worker served':>14} {'seconds':>8}")
    print(f"{r['streams']:>9} {r['crashed']:>8} {r['invalid_accepted']:>17} {r['valid_accepted']:>15} "
          f"{r['refused']:>9} {r['rounds_closed']:>7} {r['worker_served']!s:>14} {r['seconds']:>8}")
    print(json.dumps({**r, **provenance(load_config(overrides=RUN).task)}))
    return 1 if r["crashed"] or r["invalid_accepted"] or not r["worker_served"] else 0


if __name__ == "__main__":
    sys.exit(main())
