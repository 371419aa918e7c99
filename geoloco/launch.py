"""``geoloco local`` and ``geoloco.run_local``: the coordinator and N worker processes on
loopback, each worker behind its own link emulator relay, with its start-up phases and
live progress from metrics.jsonl (geoloco.progress), a summary table and a RunResult.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from geoloco import certs
from geoloco.compression.kernel_cache import kernels_cached
from geoloco.config import RunConfig, load_config, validate
from geoloco.coordinator import checkpoint
from geoloco.links.emulator import RelayThread
from geoloco.progress import RunProgress, make_progress, number, size
from geoloco.run_dir import (
    CERTS_DIR,
    CONFIG_FILE,
    LOCAL_WRITES,
    LOGS_DIR,
    METRICS_FILE,
    METRICS_PORT_FILE,
    PORT_FILE,
    SUMMARY_FILE,
    WORKERS_DIR,
    claim_run_dir,
    plan_run_dir,
    worker_state_dir,
    write_atomic,
)
from geoloco.stopping import EXIT_INTERRUPTED, StopSignals
from geoloco.tasks import build_task

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # coordinator start-up (imports, task build) and each worker's join
WARMUP_TIMEOUT_S = 900.0  # compiling the codec kernels (about a minute on two idle cores)
POLL_S = 0.25
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
LOG_TAIL_LINES = 30
COORDINATOR_STOP_S = 120.0  # a stopping coordinator writes its checkpoint and summary first
EXIT_FAILED = 1


class LaunchError(RuntimeError):
    """A process of the local run died, or the run stalled; the message says which."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM asked the local run to stop."""


@dataclass
class Child:
    """One process of the run and the log file its output goes to."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        self.log_file.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclass
class RunResult:
    """What a local run left: its exit code (0: finished cleanly), why it failed, and the
    run directory's summary and files."""

    exit_code: int
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json ({} if never written)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def metrics_path(self) -> Path:
        """One JSON line per round (geoloco.coordinator.metrics)."""
        return self.run_dir / METRICS_FILE

    @property
    def summary_path(self) -> Path:
        return self.run_dir / SUMMARY_FILE

    @property
    def logs_dir(self) -> Path:
        """One log per process."""
        return self.run_dir / LOGS_DIR

    @property
    def checkpoints(self) -> list[Path]:
        """The checkpoint folders, oldest first (``geoloco export`` reads the newest)."""
        return checkpoint.list_checkpoints(self.run_dir)

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's rounds."""
        return _metrics_lines(self.run_dir)


def as_config(config: RunConfig | Mapping[str, Any] | str | Path) -> RunConfig:
    """A validated RunConfig from a RunConfig, a mapping of sections, or a TOML/JSON file."""
    if isinstance(config, RunConfig):
        return validate(config)
    if isinstance(config, Mapping):
        return validate(RunConfig.from_dict(dict(config)))
    return load_config(config)


def run_local(config: RunConfig | Mapping[str, Any] | str | Path,
              stall_timeout_s: float | None = None, progress: RunProgress | None = None,
              resume: bool = False, overwrite: bool = False,
              resume_or_start: bool = False) -> RunResult:
    """Run a whole training job locally: the coordinator and ``workers`` worker processes
    on loopback; returns the RunResult once every process has ended. ``progress`` shows
    it (default: monitoring.progress on stdout). A run dir holding a run needs ``resume``
    (continue it), ``overwrite`` (replace what GeoLoCo wrote there) or ``resume_or_start``;
    geoloco.run_dir's rule. The rule and the task (model, data) are checked before anything
    is written: a ConfigError (a RunDirError, a TaskError) leaves the run dir as it was."""
    cfg = as_config(config)
    plan = plan_run_dir(cfg.run_dir, resume, overwrite, resume_or_start)
    done = checkpoint.latest_round(plan.path) if plan.resume and plan.path else None
    if done is not None and done >= cfg.rounds:  # the coordinator would say so and exit at once
        print(f"all {cfg.rounds} rounds of the run in {plan.path} are done (its checkpoint: "
              f"rounds 0-{done - 1}): nothing to resume; raise `rounds` to train on", flush=True)
        summary = plan.path / SUMMARY_FILE
        return RunResult(0, plan.path, json.loads(summary.read_text()) if summary.exists() else {})
    check_task(cfg)
    cfg.run_dir = str(claim_run_dir(plan, LOCAL_WRITES))
    run = LocalRun(cfg, stall_timeout_s, progress, plan.resume)
    # The children ignore SIGINT (they inherit it ignored): a Ctrl-C on the terminal reaches
    # the whole process group, and only this launcher acts on it, with one SIGTERM each.
    with StopSignals(on_force=run.kill, keep_ignored=False) as signals:
        run.stop_requested = signals.requested
        try:
            run.start()
            run.watch()
            code, error = 0, None
        except LaunchError as exc:
            log.error("%s", exc)
            code, error = EXIT_FAILED, str(exc)
        except Interrupted:
            log.warning("%s: stopping the coordinator (it checkpoints) and the workers",
                        signals.name)
            code, error = EXIT_INTERRUPTED, "interrupted"
        finally:
            run.progress.close()
            run.stop()
    if code == EXIT_FAILED:
        return RunResult(code, run.run_dir, run.read_summary(), error)
    return RunResult(code, run.run_dir, run.report(), error)


def check_task(cfg: RunConfig) -> None:
    """Build the task and its model as the coordinator will, so that a missing model file,
    too little data or a vocabulary or seq_len that does not fit is one TaskError (exit 2)
    here, before the run dir is touched, and not a coordinator process that dies."""
    build_task(cfg.task, cfg.workers, seed=cfg.seed).make_model()


class LocalRun:
    """The processes and relays of one local run and the progress read from its run dir."""

    def __init__(self, cfg: RunConfig, stall_timeout_s: float | None = None,
                 progress: RunProgress | None = None, resume: bool = False) -> None:
        self.cfg = cfg
        self.resume = resume  # continue the run in run_dir: its checkpoints, metrics, certificates
        self.progress = progress or make_progress(cfg.monitoring.progress, cfg.rounds)
        self.run_dir = Path(cfg.run_dir)
        self.stall_timeout_s = stall_timeout_s or cfg.coordinator.deadline_s + 120.0
        self.coordinator: Child | None = None
        self.workers: list[Child] = []
        self.warmup: Child | None = None
        self.relays: list[RelayThread] = []
        self.exits = contextlib.ExitStack()
        self.metrics_offset = 0
        self.last_shown = -1  # the last round whose line progress showed
        self.started = time.monotonic()
        self.certs = self.run_dir / CERTS_DIR
        self.stop_requested = threading.Event()  # set by run_local's signal handler

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        self._prepare_dir()
        self.progress.phase(f"run dir {self.run_dir}")
        self.progress.phase("starting the coordinator (task and model)")
        self._start_warmup()
        port = self._start_coordinator()
        self.progress.phase(f"coordinator up on 127.0.0.1:{port}{self._metrics_note()}")
        for i in range(self.cfg.workers):
            relay = self.exits.enter_context(
                RelayThread(target=("127.0.0.1", port), profile=self.cfg.network.profile_for(i), seed=self.cfg.seed + i)
            )
            self.relays.append(relay)
            self.workers.append(self._spawn(f"worker-{i}", self._worker_args(i, relay.port)))
        self._finish_warmup()
        for i in range(self.cfg.workers):
            self._admit(i)
        self.progress.phase(f"{self.cfg.workers} workers joined, {self._links()}")
        # numbered from 0, as everywhere; a resumed run goes on after the last round it showed
        self.progress.phase(f"round {self.last_shown + 1} running: the workers "
                            f"{'restore their state' if self.resume else 'build the model'} and train")

    def _start_warmup(self) -> None:
        """Compile the codec's kernels in one process of their own when numba's cache lacks
        them (a fresh install), instead of in every worker at once."""
        if self.cfg.compression.method == "sparseloco" and not kernels_cached():
            self.progress.phase("compiling codec kernels, first run only (about a minute)")
            self.warmup = self._spawn("warmup", ["warmup"])

    def _finish_warmup(self) -> None:
        if self.warmup is None:
            return
        started = time.monotonic()
        self._wait(lambda: self.warmup.proc.poll() is not None, "the codec kernels to compile",
                   WARMUP_TIMEOUT_S)
        if self.warmup.proc.returncode != 0:
            raise LaunchError(f"compiling the codec kernels failed; last lines of {self.warmup.log_path}:\n"
                              f"{self.warmup.tail()}")
        self.progress.phase(f"codec kernels compiled ({time.monotonic() - started:.0f} s more); "
                            "later runs load them")

    def _metrics_note(self) -> str:
        path = self.run_dir / METRICS_PORT_FILE
        if self.cfg.monitoring.metrics_port is None or not path.exists():
            return ""
        return f", metrics on http://{self.cfg.monitoring.metrics_host}:{path.read_text().strip()}/metrics"

    def _links(self) -> str:
        links = [str(self.cfg.network.profile_for(i)) for i in range(self.cfg.workers)]
        return f"each on a {links[0]} link" if len(set(links)) == 1 else "links " + ", ".join(links)

    def _prepare_dir(self) -> None:
        """Create the run dir's folders and the run's credentials (mutual TLS on every
        connection, as in a deployment); a resumed run keeps its certificates (the
        coordinator knows the workers by them; a new or overwritten run has none), and only
        the previous processes' join reports and port files go."""
        for name in (PORT_FILE, METRICS_PORT_FILE):
            (self.run_dir / name).unlink(missing_ok=True)
        for stale in (self.run_dir / WORKERS_DIR).glob("*"):
            if stale.is_file():
                stale.unlink()
        if self.resume:  # the rounds done before are not shown again
            self.last_shown = max((m["round"] for m in _metrics_lines(self.run_dir)), default=-1)
        for sub in (LOGS_DIR, WORKERS_DIR):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        certs.make_run_credentials(self.certs, None, self.cfg.workers)
        config = self.cfg.to_dict()  # without the token
        config["coordinator"]["listen"] = "127.0.0.1:0"
        write_atomic(self.run_dir / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")

    def _start_coordinator(self) -> int:
        args = ["coordinator", "--config", str(self.run_dir / CONFIG_FILE),
                "--listen", "127.0.0.1:0", "--run-dir", str(self.run_dir),
                # run_local claimed the run dir: the coordinator continues what is there, a
                # checkpoint when resuming, round 0 in a new or overwritten run
                "--resume",
                "--token-file", str(self.certs / certs.TOKEN_FILE),
                "--tls-ca", str(self.certs / certs.CA_CERT),
                "--tls-cert", str(self.certs / certs.COORDINATOR_CERT),
                "--tls-key", str(self.certs / certs.COORDINATOR_KEY)]
        self.coordinator = self._spawn("coordinator", args)
        port_file = self.run_dir / PORT_FILE
        self._wait(lambda: port_file.exists() and port_file.read_text().strip().isdigit(),
                   "the coordinator to write its port")
        return int(port_file.read_text().strip())

    def _worker_args(self, i: int, relay_port: int) -> list[str]:
        return ["worker", "--coordinator", f"127.0.0.1:{relay_port}",
                "--token-file", str(self.certs / certs.TOKEN_FILE),
                "--tls-ca", str(self.certs / certs.CA_CERT),
                "--tls-cert", str(self.certs / certs.worker_cert(i)),
                "--tls-key", str(self.certs / certs.worker_key(i)),
                "--device", self.cfg.worker.device, "--precision", self.cfg.worker.precision,
                "--connect-timeout", str(self.cfg.worker.connect_timeout_s),
                "--report-dir", str(self.run_dir / WORKERS_DIR),
                "--state-dir", str(worker_state_dir(self.run_dir, i)), *self._state_every_args(),
                "--wait-for", str(self.run_dir / WORKERS_DIR / f"gate-{i}"), *self._worker_metrics_args(i),
                *self._island_args(),
                # its own coordinator: the run config's model and paths are this user's own
                "--set", "worker.allow_config_code=true"]

    def _island_args(self) -> list[str]:
        """worker.nproc_per_node > 1: every worker an island of that many ranks."""
        ranks = self.cfg.worker.nproc_per_node
        return [] if ranks == 1 else ["--nproc-per-node", str(ranks), "--parallel", self.cfg.worker.parallel]

    def _state_every_args(self) -> list[str]:
        """worker.state_every of the run config, for the workers' own saves."""
        every = self.cfg.worker.state_every
        return [] if every is None else ["--set", f"worker.state_every={every}"]

    def _worker_metrics_args(self, i: int) -> list[str]:
        """Worker i's /metrics: monitoring.worker_metrics_port + i, or a free port for 0."""
        mon = self.cfg.monitoring
        if mon.worker_metrics_port is None:
            return []
        port = mon.worker_metrics_port + i if mon.worker_metrics_port else 0
        return ["--metrics-port", str(port), "--metrics-host", mon.metrics_host]

    def _admit(self, i: int) -> None:
        """Open worker i's gate and wait for its join, so worker ids follow process order and
        each worker's relay carries its own per-worker link profile."""
        (self.run_dir / WORKERS_DIR / f"gate-{i}").touch()
        report = self.run_dir / WORKERS_DIR / f"worker-{i}.json"
        self._wait(report.exists, f"worker process {i} to join")
        pid = json.loads(report.read_text())["pid"]
        if pid != self.workers[i].proc.pid:
            raise LaunchError(f"worker process {i} (pid {self.workers[i].proc.pid}) got another id than {i}")

    def _spawn(self, name: str, args: list[str]) -> Child:
        path = self.run_dir / LOGS_DIR / f"{name}.log"
        out = open(path, "ab" if self.resume else "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):  # one thread per process by default
            env.setdefault(var, "1")
        with _sigint_ignored():  # the child inherits it: only SIGTERM from stop() stops it
            proc = subprocess.Popen([sys.executable, "-m", "geoloco.cli", *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=env)
        return Child(name, proc, path, out)

    def _wait(self, ready: Any, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            self._check_interrupt()
            self._check_children()
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout_s:g}s waiting for {what}")
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ watch

    def watch(self) -> None:
        """Print progress until the coordinator exits 0 and every worker has exited 0."""
        last_progress = time.monotonic()
        while self.coordinator.proc.poll() is None:
            self._check_interrupt()
            if self._print_new_rounds():
                last_progress = time.monotonic()
            self._check_children()
            if time.monotonic() - last_progress > self.stall_timeout_s:
                raise LaunchError(f"run stalled: no round closed for {self.stall_timeout_s:g}s; "
                                  f"coordinator log tail:\n{self.coordinator.tail()}")
            time.sleep(POLL_S)
        self._print_new_rounds()
        self._check_children()
        self._wait(lambda: all(w.proc.poll() is not None for w in self.workers), "the workers to exit")
        self._check_children()

    def _check_interrupt(self) -> None:
        if self.stop_requested.is_set():
            raise Interrupted("stop requested")

    def _check_children(self) -> None:
        for child in [self.coordinator, self.warmup, *self.workers]:
            code = child.proc.poll() if child else None
            if code not in (None, 0):
                raise LaunchError(f"{child.name} exited with code {code}; last lines of {child.log_path}:\n"
                                  f"{child.tail()}")

    def _print_new_rounds(self) -> bool:
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return False
        if path.stat().st_size < self.metrics_offset:  # a resumed coordinator dropped redone rounds
            self.metrics_offset = 0
        with open(path) as f:
            f.seek(self.metrics_offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.metrics_offset += len(complete.encode())
        rounds = [json.loads(line) for line in complete.splitlines() if line.strip()]
        for m in rounds:
            if m["round"] > self.last_shown:
                self.progress.round(m)
                self.last_shown = m["round"]
        return bool(rounds)

    # ------------------------------------------------------------------ stop and report

    def stop(self) -> None:
        """Stop whatever still runs (one SIGTERM each; SIGKILL after STOP_GRACE_S, the
        coordinator's checkpoint gets COORDINATOR_STOP_S), close relays and logs."""
        children = self.children()
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        for child in children:
            grace = COORDINATOR_STOP_S if child is self.coordinator else STOP_GRACE_S
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, started + grace - time.monotonic()))
            if child.proc.poll() is None:
                log.warning("%s did not stop within %.0f s: killing it", child.name, grace)
                child.proc.kill()
                child.proc.wait()
            child.log_file.close()
        self.exits.close()

    def kill(self) -> None:
        """SIGKILL every child at once (a second Ctrl-C): nothing is left running."""
        for child in self.children():
            if child.proc.poll() is None:
                child.proc.kill()
        for child in self.children():
            child.proc.wait()

    def children(self) -> list[Child]:
        return [c for c in [self.coordinator, self.warmup, *self.workers] if c is not None]

    def read_summary(self) -> dict[str, Any]:
        path = self.run_dir / SUMMARY_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def report(self) -> dict[str, Any]:
        """Add the workers' digest checks and the relays' bytes to summary.json; print it,
        and return it."""
        summary_path = self.run_dir / SUMMARY_FILE
        summary = self.read_summary()
        workers = self.worker_reports()
        summary["digest_mismatches"] = sum(w.get("digest_mismatches", 0) for w in workers)
        summary["worker_resyncs"] = sum(w.get("resyncs", 0) for w in workers)
        summary["worker_final_digests"] = {str(w["worker_id"]): w.get("digest") for w in workers}
        summary["relay_bytes"] = {str(i): {"up": r.bytes_up, "down": r.bytes_down} for i, r in enumerate(self.relays)}
        summary.setdefault("wall_seconds", time.monotonic() - self.started)
        write_atomic(summary_path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
        print(summary_table(summary, workers, self.run_dir), flush=True)
        return summary

    def worker_reports(self) -> list[dict[str, Any]]:
        paths = sorted((self.run_dir / WORKERS_DIR).glob("worker-*.json"))
        return [json.loads(p.read_text()) for p in paths]


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def summary_table(summary: dict[str, Any], workers: list[dict[str, Any]], run_dir: Path) -> str:
    up, dense = summary.get("upload_bytes_per_worker_round"), summary.get("dense_fp32_bytes")
    rows = [
        ("rounds", str(summary.get("rounds"))),
        ("val loss", f"{number(summary.get('initial_val_loss'), '.4f')} -> {number(summary.get('final_val_loss'), '.4f')}"),
        ("upload / worker / round", f"{size(up)} (dense fp32 {size(dense)}, "
                                    f"ratio {number(up / dense if up and dense else None, '.4f')})"),
        ("download / worker / round", size(summary.get("download_bytes_per_worker_round"))),
        ("digest mismatches", str(summary.get("digest_mismatches"))),
        ("wall seconds", number(summary.get("wall_seconds"), ".1f")),
    ]
    lines = [f"summary of {run_dir}"] + [f"  {k:<27}{v}" for k, v in rows]
    lines.append(f"  {'worker':<8}{'relay up':>12}{'relay down':>12}{'resyncs':>9}  final digest")
    relays = summary.get("relay_bytes", {})
    for w in workers:
        r = relays.get(str(w["worker_id"]), {})
        lines.append(f"  {w['worker_id']:<8}{size(r.get('up')):>12}{size(r.get('down')):>12}"
                     f"{w.get('resyncs', 0):>9}  {(w.get('digest') or '-')[:16]}")
    return "\n".join(lines)
