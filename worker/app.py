"""Entry point of one worker process (``geoloco worker``): an optional link emulator relay
in front of the coordinator address, then the round loop until the run finishes (exit 0),
fails (1) or is interrupted (130); and WorkerThread, a worker that a script starts and stops.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from geoloco.compression import FrameError, decode_frame, set_codec_threads
from geoloco.config import TOKEN_ENV, ConfigError, RunConfig, TlsConfig, validate
from geoloco.metrics_server import MetricsServer
from geoloco.profiles import LinkProfile
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import replica_layout
from geoloco.stopping import EXIT_INTERRUPTED, StopSignals
from geoloco.tasks import build_task
from geoloco.tls import channel_security
from geoloco.transport import ChannelSecurity, CoordinatorUnreachable, JoinRefused, parse_address
from geoloco.worker import local_state
from geoloco.worker.admission import Admission
from geoloco.worker.encoder import island_state, settle_shard
from geoloco.worker.island import Island, IslandError, optimizer_tensors
from geoloco.worker.island_state import IslandState
from geoloco.worker.local_state import LocalStateError
from geoloco.worker.loop import Worker, restore_shards
from geoloco.worker.prometheus import worker_registry
from geoloco.worker.session import Session, read_identity
from geoloco.worker.trainer import InnerStep, InnerTrainer, TrainingStopped

log = logging.getLogger(__name__)

EXIT_FAILED = 1  # the run could not be joined or followed to its end


def run_worker(
    coordinator: str,
    token: str,
    device: str = "auto",
    connect_timeout_s: float = 60.0,
    report_dir: str | Path | None = None,
    wan_emulate: str | None = None,
    threads: int = 1,
    wait_for: str | Path | None = None,
    identity_file: str | Path | None = None,
    tls: TlsConfig | None = None,
    precision: str = "auto",
    metrics: tuple[str, int] | None = None,
    state_dir: str | Path | None = None,
    state_every: int | None = None,
    admission: Admission | None = None,
    island: Island | None = None,
) -> int:
    """Run one worker against ``coordinator`` (HOST:PORT); returns the process exit code.
    ``wan_emulate`` puts a link emulator relay with that profile in front of the address;
    ``wait_for`` delays the Join until that file exists (the local launcher orders joins);
    ``identity_file`` makes the first Join reclaim the id and session written there;
    ``metrics`` (HOST, PORT) serves the worker's Prometheus metrics there; ``state_dir``
    keeps the worker's own state every ``state_every`` rounds (geoloco.worker.local_state);
    ``admission``: what the coordinator's run config may make it do (geoloco.worker.admission;
    None: anything);
    ``tls``: the channel's security (geoloco.tls.channel_security: TLS unless plaintext is
    allowed there); ``island``: this process is a rank of an island of ranks
    (geoloco.worker.island): rank 0 runs the worker, the others train as it says."""
    torch.set_num_threads(threads)  # the inner loop's (docs/decisions.md, "Thread policy")
    set_codec_threads(threads)
    if island is not None:
        device = island.start(device).type
        if not island.leader:
            try:
                return follow(island, precision)
            finally:
                island.close()
    code = EXIT_FAILED
    try:
        code = _play(coordinator, token, device, connect_timeout_s, report_dir, wan_emulate,
                     wait_for, identity_file, tls, precision, metrics, state_dir, state_every,
                     admission, island)
        return code
    finally:
        if island is not None:
            _end_island(island, code)


def _end_island(island: Island, code: int) -> None:
    """Rank 0 is done: tell the other ranks to exit (a rank that died cannot hear it)."""
    try:
        island.send("exit", code)
    except Exception as exc:  # noqa: BLE001 - the launcher ends what is left
        log.warning("could not tell the island's other ranks to exit (%s)", exc)
    island.close()


def _play(coordinator: str, token: str, device: str, connect_timeout_s: float,
          report_dir: str | Path | None, wan_emulate: str | None, wait_for: str | Path | None,
          identity_file: str | Path | None, tls: TlsConfig | None, precision: str,
          metrics: tuple[str, int] | None, state_dir: str | Path | None, state_every: int | None,
          admission: Admission | None, island: Island | None) -> int:
    """run_worker's worker (rank 0 of an island)."""
    security = channel_security(tls or TlsConfig(), coordinator)
    with StopSignals() as signals:  # Ctrl-C or SIGTERM: stop where it is, report "stopped"
        if wait_for is not None and not _wait_for_file(Path(wait_for), signals.requested):
            return EXIT_INTERRUPTED
        try:
            identity = read_identity(Path(identity_file)) if identity_file else None
            with _link(coordinator, wan_emulate) as address:
                session = Session(address, token, connect_timeout_s, identity,
                                  _through_relay(security, coordinator, address))
                worker = Worker(session, device, Path(report_dir) if report_dir else None,
                                precision=precision,
                                state_dir=Path(state_dir) if state_dir else None,
                                state_every=state_every, admission=admission, island=island)
                signals.on_stop = worker.stop
                if signals.requested.is_set():
                    return EXIT_INTERRUPTED
                with _metrics(worker, metrics):
                    return worker.run()
        except (CoordinatorUnreachable, JoinRefused, RuntimeError, FloatingPointError, ValueError,
                OSError) as exc:
            if signals.requested.is_set():
                log.warning("worker stopped (%s)", exc)
                return EXIT_INTERRUPTED
            log.error("worker failed: %s", exc)
            return EXIT_FAILED


def follow(island: Island, precision: str) -> int:
    """Ranks 1..N-1: train as rank 0 says until it says exit. Returns the exit code (0).
    Under fsdp this rank also holds its pieces of the island's outer state (``state``:
    geoloco.worker.island_state) and takes part in each of rank 0's collectives on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to act on
    trainer: InnerTrainer | None = None
    state: IslandState | None = None
    layout = None
    while True:
        kind, *args = island.receive()
        if kind == "exit":
            log.info("rank %d: rank 0 ended the island (its exit code %s)", island.rank, args[0])
            return 0
        if kind == "config":
            cfg = validate(RunConfig.from_dict(json.loads(args[0])))
            task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
            trainer = InnerTrainer(task, cfg.inner, cfg.rounds, island.device, precision, island=island)
            layout = replica_layout(trainer.model)
            if island.sharded:
                state = trainer.island_state = island_state(island, layout, cfg.compression,
                                                            undoable=cfg.coding.scheme != "none")
        elif trainer is None:
            raise IslandError(f"rank {island.rank}: command {kind!r} before the run config")
        elif kind == "train":
            partition, round_, running = args
            try:
                trainer.train_partition(None, partition, round_, running=running)
            except (TrainingStopped, FloatingPointError) as exc:  # rank 0 fails or stops the same way
                log.info("rank %d: %s", island.rank, exc)
        elif kind == "optimizer":
            trainer.optimizer.load_state_dict(args[0])
        elif state is None:
            raise IslandError(f"rank {island.rank}: command {kind!r} outside an fsdp island")
        elif not follow_state(island, trainer, state, layout, kind, args):
            raise IslandError(f"rank {island.rank}: unknown command {kind!r}")


def follow_state(island: Island, trainer: InnerTrainer, state: IslandState, layout, kind: str,
                 args: list) -> bool:
    """One of rank 0's commands on an fsdp island's outer state; False for an unknown one."""
    if kind == "message":  # the task's message of this rank's pieces; a dense one whole on rank 0
        task_bytes, whole = args
        state.make_message(pb.WorkerTask.FromString(task_bytes))
        if whole:
            state.whole_message()
    elif kind == "compress":  # SparseLoCo: this rank's pieces into its share of the error feedback
        state.shard.set_density(args[0])
        state.compress()
    elif kind == "settle":
        settle_shard(state.shard, args[0])
    elif kind == "running":
        state.make_running(*args)
    elif kind == "apply":  # the frames rank 0 checked, applied to this rank's pieces of θ
        data, weights, mode, alpha = args
        try:
            frames = [decode_frame(d, layout) for d in data]
        except FrameError as exc:
            raise IslandError(f"rank {island.rank}: a frame rank 0 applied does not decode here: {exc}") from None
        state.apply(frames, weights, mode, alpha)
    elif kind == "load":
        state.load(None)
    elif kind == "digest":
        state.digest()
    elif kind == "save":  # this rank's shards, before rank 0 writes its state
        path, round_, layout_digest = args
        try:
            local_state.save_shard(Path(path), island.rank, trainer, round_, layout_digest, state)
            written = True
        except OSError as exc:
            log.error("rank %d: shards of round %d not written (%s)", island.rank, round_, exc.strerror or exc)
            written = False
        island.agree(written)
    elif kind == "restore":
        path, round_, layout_digest = args
        try:
            local_state.load_shard(Path(path), island.rank, trainer, round_, layout_digest, state)
            loaded = True
        except LocalStateError as exc:
            log.warning("rank %d: %s", island.rank, exc)
            loaded = False
        restore_shards(island, trainer, loaded, state)
    elif kind == "shards":
        island.shard_sizes(trainer.params)
        island.shard_sizes(optimizer_tensors(trainer.optimizer))
        island.counts(state.held)
        if state.shard is not None:
            island.counts(state.shard.held)
    else:
        return False
    return True


class WorkerThread:
    """A worker of this process, on a thread of its own: ``start()``, then ``wait()`` for the
    run to finish or ``stop()`` it; ``exit_code`` as ``geoloco worker`` would exit (and
    ``error``, the exception that failed it). ``inner_step`` replaces the inner training step
    (geoloco.worker.trainer.InnerStep). ``tls``: as ``geoloco worker``'s (TLS unless the
    coordinator is on loopback or ``tls.insecure``). ``token``: the run's token, else
    $GEOLOCO_TOKEN."""

    def __init__(self, coordinator: str, token: str | None = None, device: str = "auto",
                 precision: str = "auto", connect_timeout_s: float = 60.0,
                 report_dir: str | Path | None = None, inner_step: InnerStep | None = None,
                 tls: TlsConfig | None = None) -> None:
        token = token or os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise ConfigError(f"no run token: pass token= or set {TOKEN_ENV}")
        self.session = Session(coordinator, token, connect_timeout_s,
                               security=channel_security(tls or TlsConfig(), coordinator))
        self.worker = Worker(self.session, device, Path(report_dir) if report_dir else None,
                             precision=precision, inner_step=inner_step)
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> WorkerThread:
        self._thread = threading.Thread(target=self._run, name="geoloco-worker", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.exit_code = self.worker.run()
        except Exception as exc:  # noqa: BLE001 - kept for the caller, as the process would exit 1
            log.error("worker failed: %s", exc)
            self.error, self.exit_code = exc, EXIT_FAILED
            self.worker.close()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the worker has ended (finished, failed or stopped)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is not None and not self._thread.is_alive()

    def stop(self, timeout: float | None = 60.0) -> None:
        """End the worker where it is (its report says ``stopped``) and wait for it."""
        self.worker.stop()
        self.wait(timeout)

    @property
    def worker_id(self) -> int | None:
        return self.session.worker_id


@contextlib.contextmanager
def _link(address: str, profile: str | None) -> Iterator[str]:
    """The address to dial: ``address`` itself, or a local relay emulating ``profile``."""
    if not profile:
        yield address
        return
    from geoloco.links.emulator import RelayThread

    link = LinkProfile.parse(profile)
    with RelayThread(target=parse_address(address), profile=link, seed=0) as relay:
        log.info("emulating link %s to %s through 127.0.0.1:%d", link, address, relay.port)
        yield f"127.0.0.1:{relay.port}"


@contextlib.contextmanager
def _metrics(worker: Worker, address: tuple[str, int] | None) -> Iterator[None]:
    if address is None:
        yield
        return
    server = MetricsServer(worker_registry(worker), *address)
    log.info("metrics on http://%s:%d/metrics", server.host, server.port)
    try:
        yield
    finally:
        server.close()


def _through_relay(security: ChannelSecurity | None, coordinator: str,
                   address: str) -> ChannelSecurity | None:
    """Through a local relay the coordinator's certificate must still carry its own name."""
    if security is None or security.server_name or address == coordinator:
        return security
    return ChannelSecurity(security.credentials, parse_address(coordinator)[0])


def _wait_for_file(path: Path, stop: threading.Event, poll_s: float = 0.05) -> bool:
    """Wait until ``path`` exists (True) or ``stop`` is set (False)."""
    while not path.exists():
        if stop.wait(poll_s):
            return False
    return True
