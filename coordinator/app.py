"""The coordinator process: builds the model, the state and the round loop, serves the
round protocol with the gRPC health service, and turns Ctrl-C or SIGTERM into a final
checkpoint and an exit code (docs/protocol.md)."""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from torch import Tensor, nn

from geoloco import transport
from geoloco.certs import WorkerTokensError, load_worker_tokens
from geoloco.compression import (
    Layout,
    cap_malloc_arenas,
    map_large_allocations,
    on_huge_pages,
    set_codec_threads,
)
from geoloco.config import ConfigError, RunConfig, require_token, resolve_token
from geoloco.coordinator import checkpoint, roundlog
from geoloco.coordinator.gradient_coding import GradientCode, make_code
from geoloco.coordinator.limits import RPCS, STREAMS_PER_WORKER, UNAUTHENTICATED_AT_ONCE
from geoloco.coordinator.loop import RoundLoop
from geoloco.coordinator.metrics import MetricsWriter, RunTotals
from geoloco.coordinator.outer import (
    OuterOptimizer,
    aggregation_note,
    broadcast_density,
    broadcast_passes,
    make_outer,
)
from geoloco.coordinator.prometheus import CoordinatorMetrics
from geoloco.coordinator.registry import WorkerRegistry
from geoloco.coordinator.rounds import RoundState, close_policy
from geoloco.coordinator.scalars import TensorBoardScalars
from geoloco.coordinator.service import CoordinatorServicer, add_to_server
from geoloco.coordinator.state import CoordinatorState
from geoloco.metrics_server import MetricsServer
from geoloco.protos import geoloco_pb2 as pb
from geoloco.replica import param_digest, replica_layout, replica_tensors
from geoloco.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    COORDINATOR_WRITES,
    METRICS_FILE,
    METRICS_PORT_FILE,
    PORT_FILE,
    REGISTRY_FILE,
    claim_run_dir,
    cli_wording,
    plan_run_dir,
    write_atomic,
)
from geoloco.stopping import EXIT_INTERRUPTED, StopSignals
from geoloco.tasks import build_task
from geoloco.tls import server_credentials

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name  # geoloco.v1.Coordinator
STOP_GRACE_S = 2.0  # in-flight calls get this long when the server stops
LOOP_JOIN_S = 30.0  # how long stop() waits for the round loop to end
SPARE_THREADS = 16  # beyond every worker's slots and the Joins: health checks, calls refused at once
STOP_POLL_S = 0.2  # how often the main thread looks for a stop request
EXIT_OK, EXIT_FAILED = 0, 1


class ResumeError(RuntimeError):
    """--resume found a run in the run dir but no checkpoint of it that can be read."""


class Coordinator:
    """One run of the coordinator: its state, its round loop on a thread, its server.
    ``start()`` serves (returns the port), ``wait()`` for the run to end, ``stop()``;
    ``run_dir`` defaults to ``cfg.run_dir``; the run token is ``cfg.coordinator.token``, else
    read as ``geoloco coordinator`` reads it (``coordinator.token_file``, else
    $GEOLOCO_TOKEN). It logs through ``logging`` (``geoloco.*`` loggers). A run dir holding a run needs ``resume=True``
    (continue it), ``overwrite=True`` (replace what GeoLoCo wrote there) or
    ``resume_or_start=True``; a folder with files GeoLoCo did not write is refused
    (geoloco.run_dir; RunDirError, a ConfigError, before anything is written)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None = None, resume: bool = False,
                 crash_at: tuple[str, int] | None = None, overwrite: bool = False,
                 resume_or_start: bool = False) -> None:
        # geoloco.run_dir's rule, as for the CLI: checked before anything is built, claimed
        # (the marker written, an overwrite's files removed) once the task and model build
        plan = plan_run_dir(run_dir if run_dir is not None else cfg.run_dir, resume, overwrite,
                            resume_or_start)
        resume = plan.resume
        if not cfg.coordinator.token:  # as the CLI: coordinator.token_file, else $GEOLOCO_TOKEN
            resolve_token(cfg, os.environ)
        worker_tokens = _worker_tokens(cfg)
        # per-worker tokens replace the shared one, which is then not needed
        token = (cfg.coordinator.token or "") if worker_tokens else require_token(cfg)
        self.credentials = server_credentials(cfg.tls, cfg.coordinator.listen)
        self.cfg = cfg
        task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
        check_data(cfg, task.fingerprint)
        model = task.make_model().to("cpu", torch.float32)
        self.run_dir = claim_run_dir(plan, COORDINATOR_WRITES)
        cfg.run_dir = str(self.run_dir)  # the folder it is (the default names a new one per run)
        self.layout, params = _params_on_huge_pages(model)
        self.code = make_code(cfg.coding.scheme, cfg.workers, cfg.coding.tolerance(cfg.workers), cfg.coding.seed)
        outer = make_outer(cfg, self.layout)
        if cfg.coordinator.broadcast != "frames" and cfg.compression.method == "sparseloco":
            log.info("coordinator.broadcast %s: the aggregate at density %.4g in %d frame(s) a round%s",
                     cfg.coordinator.broadcast, broadcast_density(cfg), broadcast_passes(cfg),
                     "" if cfg.coordinator.broadcast_density is not None else
                     " (the union of the round's frames; coordinator.broadcast_density sets it)")
        registry = WorkerRegistry(cfg.workers, token, worker_tokens)
        for stale in checkpoint.remove_stale(self.run_dir):
            log.info("removed %s, left by a write that was cut off", stale)
        start_round, totals, guard_norms = 0, RunTotals(), {}
        if resume:
            start_round, totals, guard_norms = _restore(self.run_dir, self.layout, params, outer, registry)
        totals.extra.update(coding_summary(self.code))
        note = aggregation_note(cfg, self.code)
        if note is not None:
            log.info(note)
        totals.extra["aggregation"] = cfg.outer.aggregation if note is None else "sum (weighted)"
        self.state = CoordinatorState(self.layout, params, registry, totals,
                                      RoundState(start_round, cfg.coordinator.deadline_s),
                                      self.run_dir / REGISTRY_FILE, cfg.coordinator.liveness_s,
                                      roundlog.FrameSpool(self.run_dir))
        self.loop = RoundLoop(cfg, self.state, close_policy(self.code, cfg.coding), outer, task, model,
                              self.run_dir, task.model_files(model))
        self.loop.bounds.recent.update(guard_norms)
        self.loop.crash_at = crash_at  # the exactly-once tests' seam
        self.prometheus = (CoordinatorMetrics(self.state, cfg, self.code.worst_case_coefficient)
                           if cfg.monitoring.metrics_port is not None else None)
        self.tensorboard = TensorBoardScalars(self.run_dir) if cfg.monitoring.tensorboard else None
        self.loop.observers += [o for o in (self.prometheus, self.tensorboard) if o is not None]
        self.metrics_server: MetricsServer | None = None
        self.port: int | None = None
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind, serve and start the round loop; returns the bound port."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir / CONFIG_FILE, self.cfg.to_json() + "\n")
        if not checkpoint.list_checkpoints(self.run_dir):  # from here on a kill can resume
            self.loop.try_checkpoint(self.state.open_round())
        self.loop.replay()  # a resumed run's logged rounds, before any Join sees the round
        servicer = CoordinatorServicer(self.state, self.cfg, self.layout, self.code)
        self._server, self.port = serve(self.cfg, servicer, self._health, self.credentials)
        listen = self.cfg.coordinator.listen
        self._serve_metrics()
        write_atomic(self.run_dir / PORT_FILE, f"{self.port}\n", durable=False)
        log.info("coordinator listening on %s (port %d), %d workers, %d rounds, model %s "
                 "(%d parameters)", listen, self.port, self.cfg.workers, self.cfg.rounds,
                 self.cfg.task.model, self.layout.numel)
        log.info("gradient coding %s (n=%d, s=%d): worst-case decoding coefficient %.4g",
                 self.code.name, self.code.n, self.code.s, self.code.worst_case_coefficient)
        self._thread = threading.Thread(target=self.loop.run, name="round-loop", daemon=True)
        self._thread.start()
        return self.port

    def _serve_metrics(self) -> None:
        """/metrics for Prometheus when monitoring.metrics_port is set; its port goes to
        run_dir/metrics.port."""
        if self.prometheus is None:
            return
        mon = self.cfg.monitoring
        self.metrics_server = MetricsServer(self.prometheus.registry, mon.metrics_host, mon.metrics_port)
        write_atomic(self.run_dir / METRICS_PORT_FILE, f"{self.metrics_server.port}\n", durable=False)
        log.info("metrics on http://%s:%d/metrics", mon.metrics_host, self.metrics_server.port)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the run is over (all rounds done, or stopped)."""
        return self.loop.done.wait(timeout)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop the round loop and the server (in-flight calls get ``grace`` seconds)."""
        self.state.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=LOOP_JOIN_S)
        if self.state.spool is not None:
            self.state.spool.close()
        if self._server is not None:
            self._health.enter_graceful_shutdown()
            self._server.stop(grace).wait()
            self._server = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.tensorboard is not None:
            self.tensorboard.close()

    def save_checkpoint(self, next_round: int) -> Path:
        """Write the parameters at the start of ``next_round`` with everything else."""
        return self.loop.save_checkpoint(next_round)

    @property
    def failed(self) -> bool:
        """The round loop ended with an error."""
        return self.loop.failed

    def open_round(self) -> int:
        return self.state.open_round()

    def digest(self) -> str:
        return self.state.digest()

    @property
    def params(self) -> list[Tensor]:
        return self.state.params

    @property
    def registry(self) -> WorkerRegistry:
        return self.state.registry

    @property
    def totals(self) -> RunTotals:
        return self.state.totals


def serve(cfg: RunConfig, servicer: CoordinatorServicer, health_servicer: health.HealthServicer,
          credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, int]:
    """The started gRPC server of ``servicer`` and the health service on
    ``coordinator.listen`` (TLS with ``credentials``), and its port. The pool has a thread
    for every worker's slots of every RPC, every open unauthenticated Join, and spares, so no
    caller starves health checks."""
    threads = cfg.workers * len(RPCS) * STREAMS_PER_WORKER + UNAUTHENTICATED_AT_ONCE + SPARE_THREADS
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
                         options=transport.SERVER_OPTIONS)
    add_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    listen = cfg.coordinator.listen
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on coordinator.listen {listen!r} ({exc}); is another "
                      "coordinator running there? pick a free port, or port 0") from None
    server.start()
    return server, port


def _params_on_huge_pages(model: nn.Module) -> tuple[Layout, list[Tensor]]:
    """The model's layout and the tensors the replicas share (geoloco.replica.replica_tensors),
    moved into one buffer on huge pages (applying sparse rounds touches cache lines at random)."""
    named = replica_tensors(model)
    for (_, t), data in zip(named, on_huge_pages([t.data for _, t in named]), strict=True):
        t.data = data
    return replica_layout(model), [t.data for _, t in named]


def _worker_tokens(cfg: RunConfig) -> dict[int, str] | None:
    """coordinator.worker_tokens_file's tokens, or None when it is not set; ConfigError
    saying what is wrong with the file."""
    if not cfg.coordinator.worker_tokens_file:
        return None
    try:
        return load_worker_tokens(cfg.coordinator.worker_tokens_file, cfg.workers)
    except WorkerTokensError as exc:
        raise ConfigError(str(exc)) from None


def _restore(run_dir: Path, layout: Layout, params: list[Tensor], outer: OuterOptimizer,
             registry: WorkerRegistry) -> tuple[int, RunTotals, dict[int, tuple[int, float]]]:
    """Load the newest readable checkpoint into ``params``, ``outer`` and ``registry`` (the
    registry file, newer, wins); drop the metrics of the rounds it redoes. Returns the round
    to open, the run totals and the frame bounds' memory (FrameBounds.recent); round 0,
    fresh totals and no memory in a run dir that has no run yet.
    ResumeError when the run dir holds a run but no checkpoint of it can be read."""
    ckpt = checkpoint.load_latest(run_dir)
    if ckpt is None:
        left = [p.name for p in (run_dir / CHECKPOINT_DIR, run_dir / METRICS_FILE,
                                 run_dir / REGISTRY_FILE) if p.exists()]
        if left:
            raise ResumeError(f"resume=True: no readable checkpoint in {run_dir / CHECKPOINT_DIR}, "
                              f"but the run dir holds a run ({', '.join(left)}); nothing was "
                              "started. Restore a checkpoint, or start over with overwrite=True")
        log.info("resume: %s holds no checkpoint yet; starting at round 0", run_dir)
        return 0, RunTotals(), {}
    if ckpt.layout_digest != layout.digest:
        raise ValueError(
            f"checkpoint in {run_dir} was written for another model layout; "
            "resume with the same task.model and seq_len, or use a new run_dir"
        )
    with torch.no_grad():
        for spec, p in zip(layout.specs, params, strict=True):
            p.copy_(ckpt.params[spec.name])
    outer.load_state_dict(ckpt.outer_state)
    registry.load_dict(ckpt.workers)
    if (run_dir / REGISTRY_FILE).exists():
        registry.load_dict(json.loads((run_dir / REGISTRY_FILE).read_text()))
    dropped = MetricsWriter(run_dir).drop_rounds_from(ckpt.round)
    log.info("resumed from the checkpoint %s (digest %s)%s", checkpoint.starts(ckpt.round),
             param_digest(params),
             f"; {dropped} metrics lines of the rounds redone dropped" if dropped else "")
    return ckpt.round, RunTotals(**ckpt.totals), ckpt.guard_norms


def check_data(cfg: RunConfig, fingerprint: str) -> None:
    """Record the data's fingerprint in the run config the workers receive (they refuse to
    train on other data); a fingerprint set in the config must be this data's."""
    expected = cfg.task.data_fingerprint
    if expected is not None and expected != fingerprint:
        raise ConfigError(f"task.data_fingerprint is {expected!r} but the data read here has "
                          f"fingerprint {fingerprint!r}; give the data it was taken from, or drop it")
    cfg.task.data_fingerprint = fingerprint


def coding_summary(code: GradientCode) -> dict[str, object]:
    """The gradient code's figures for summary.json."""
    return {"coding_scheme": code.name, "coding_stragglers": code.s,
            "worst_case_coefficient": code.worst_case_coefficient}


def run_coordinator(cfg: RunConfig, run_dir: Path, resume: bool = False,
                    overwrite: bool = False, crash_at: tuple[str, int] | None = None,
                    resume_or_start: bool = False) -> int:
    """Serve until every round is done, or until Ctrl-C or SIGTERM: then stop the round
    loop (a round being applied is finished first), write the checkpoint of the open round
    and summary.json, exit 130; a second signal exits at once. Returns the exit code. A run
    dir holding a previous run needs ``resume``, ``overwrite`` or ``resume_or_start``
    (geoloco.run_dir; RunDirError otherwise)."""
    plan = plan_run_dir(run_dir, resume, overwrite, resume_or_start)
    coordinator_threads()
    if plan.resume and plan.path is not None and run_is_done(cfg, plan.path):
        return EXIT_OK
    with StopSignals() as signals:
        try:
            coordinator = Coordinator(cfg, Path(run_dir), resume=resume, crash_at=crash_at,
                                      overwrite=overwrite, resume_or_start=resume_or_start)
        except ResumeError as exc:
            log.error("%s", cli_wording(str(exc)))
            return EXIT_FAILED
        if signals.requested.is_set():
            return EXIT_INTERRUPTED
        try:
            coordinator.start()
        except OSError as exc:
            log.error("%s", exc)
            coordinator.stop()
            return EXIT_FAILED
        while not coordinator.wait(timeout=STOP_POLL_S):
            if signals.requested.is_set():
                return _stop_and_checkpoint(coordinator, signals.name)
    coordinator.stop()
    return EXIT_FAILED if coordinator.failed else EXIT_OK


def coordinator_threads() -> None:
    """The coordinator process's thread policy (docs/decisions.md, "Thread policy"): the
    codec's kernels keep the threads torch would have had (OMP_NUM_THREADS, else the
    cores), and torch's own ops run on one, so that no torch parallel region waits for a
    core held by the codec's threads, the gRPC threads or another process; and the
    gRPC threads that take frames share two malloc arenas rather than one each, and
    buffers of half a megabyte and more are mapped apart and returned at free
    (compression.memory.cap_malloc_arenas, map_large_allocations)."""
    set_codec_threads(torch.get_num_threads())
    torch.set_num_threads(1)
    cap_malloc_arenas()
    map_large_allocations()


def run_is_done(cfg: RunConfig, run_dir: Path) -> bool:
    """Whether the newest checkpoint in ``run_dir`` is that of the end of all ``cfg.rounds``
    rounds: a resume then has nothing to do, and says so (nothing is written)."""
    done = checkpoint.latest_round(run_dir)
    if done is None or done < cfg.rounds:
        return False
    log.info("--resume: all %d rounds of the run in %s are done (its checkpoint: rounds 0-%d); "
             "nothing to do. Raise `rounds` to train on", cfg.rounds, run_dir, done - 1)
    return True


def _stop_and_checkpoint(coordinator: Coordinator, reason: str | None) -> int:
    log.warning("%s: checkpointing the model before round %d (a resume runs it) and stopping", reason,
                coordinator.open_round())
    coordinator.stop()
    coordinator.loop.save_final()
    return EXIT_INTERRUPTED
