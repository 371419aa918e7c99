"""The ``geoloco`` command: ``local`` (coordinator + workers on emulated WAN links),
``coordinator``, ``worker``, ``export``, ``warmup`` (compile the codec once), ``report``
(plots of runs) and ``config`` (the resolved config, or the reference of every field); a
config file plus flags, mapped onto geoloco.config.
"""

from __future__ import annotations

import os

# Process defaults of the geoloco command, set before anything below loads torch: torch's
# OpenMP threads otherwise spin for a while after every parallel op, holding the core that
# the codec's own threads need next (measured: decode + apply 1.5x slower right after a
# torch op). A value the user set wins. Child processes of `geoloco local` inherit it.
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
os.environ.setdefault(OMP_WAIT_POLICY, "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from geoloco import __version__  # noqa: E402
from geoloco.config import (  # noqa: E402
    PARALLEL_MODES,
    ConfigError,
    RunConfig,
    load_config,
    require_token,
    resolve_token,
)
from geoloco.stopping import EXIT_INTERRUPTED  # noqa: E402

EXIT_CONFIG_ERROR = 2
EXIT_EXPORT_FAILED = 1
EXIT_REPORT_FAILED = 1
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# flag attribute -> config field; only flags given on the command line override the file
LOCAL_FLAGS = {
    "workers": "workers", "rounds": "rounds", "run_dir": "run_dir", "wan": "network.wan",
    "method": "compression.method", "model": "task.model", "inner_steps": "inner.steps",
    "scheme": "coding.scheme", "stragglers": "coding.stragglers",
    "per_worker_wan": "network.per_worker", "straggler_profiles": "stragglers.per_worker",
    "seed": "seed", "deadline": "coordinator.deadline_s",
    "metrics_port": "monitoring.metrics_port", "progress": "monitoring.progress",
}
# `geoloco local` without --config: sized so 4 workers on 2 CPU cores finish in a few minutes
# (gpt-tiny, 20 rounds of H = 10 inner steps on 16 x 64-byte sequences).
LOCAL_DEMO_DEFAULTS = {"rounds": "20", "inner.steps": "10", "inner.warmup_steps": "10"}
TLS_FLAGS = {
    "token_file": "coordinator.token_file", "tls_ca": "tls.ca", "tls_cert": "tls.cert",
    "tls_key": "tls.key", "insecure": "tls.insecure",
}
COORDINATOR_FLAGS = {
    "listen": "coordinator.listen", "workers": "workers", "rounds": "rounds",
    "run_dir": "run_dir", "deadline": "coordinator.deadline_s", **TLS_FLAGS,
    "metrics_port": "monitoring.metrics_port", "metrics_host": "monitoring.metrics_host",
    "worker_tokens_file": "coordinator.worker_tokens_file",
}
WORKER_FLAGS = {
    "coordinator": "worker.coordinator", "device": "worker.device",
    "connect_timeout": "worker.connect_timeout_s", "tls_server_name": "tls.server_name",
    "precision": "worker.precision", **TLS_FLAGS,
    "metrics_port": "monitoring.worker_metrics_port", "metrics_host": "monitoring.metrics_host",
    "nproc_per_node": "worker.nproc_per_node", "parallel": "worker.parallel",
}
# fields that hold secrets: a command line is visible to every user of the machine (ps)
COMMAND_LINE_SECRETS = ("coordinator.token",)
MODEL_HELP = ("a preset (gpt-tiny | gpt-small | gpt-medium | gpt-100m), module:function or "
              "file.py:function (a factory of an nn.Module), or hf:PATH (a transformers config or "
              "checkpoint folder)")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (2 for configuration errors)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: the resume hint repeats it
    try:
        return args.run(args)
    except ConfigError as exc:
        from geoloco.run_dir import RunDirError, cli_wording

        message = cli_wording(str(exc)) if isinstance(exc, RunDirError) else str(exc)
        print(f"geoloco: config error: {message}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geoloco",
        description="Cross-region training: SparseLoCo compression and gradient coding over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"geoloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_local(sub)
    _add_coordinator(sub)
    _add_worker(sub)
    _add_certs(sub)
    _add_export(sub)
    _add_warmup(sub)
    _add_report(sub)
    _add_config(sub)
    return parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="run configuration (TOML or JSON)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field, e.g. --set inner.steps=30 (repeatable)")
    p.add_argument("--log-file", metavar="FILE", help="also write the log to FILE")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _run_dir_flags(p: argparse.ArgumentParser) -> None:
    """--resume, --overwrite, --resume-or-start: a run dir holding a run needs one of them
    (geoloco.run_dir: a run is a folder with GeoLoCo's geoloco-run.json)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir from its newest checkpoint (without "
                       "--run-dir: the newest run, runs/latest); refused where there is no run")
    group.add_argument("--overwrite", action="store_true",
                       help="replace the run in --run-dir: only the files GeoLoCo wrote there go")
    group.add_argument("--resume-or-start", action="store_true",
                       help="continue the run in --run-dir if there is one, else start one there "
                       "(for restarts by a scheduler, e.g. Kubernetes)")


def _metrics_flags(p: argparse.ArgumentParser, host: bool = True) -> None:
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; unset: off)")
    if host:
        p.add_argument("--metrics-host", metavar="HOST",
                       help="address the metrics bind to (default 127.0.0.1: plaintext HTTP, "
                       "keep it off public interfaces)")


def _security(p: argparse.ArgumentParser, side: str) -> None:
    """The token and TLS flags (docs/security.md); the token itself never is a flag."""
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding the run's token (default: $GEOLOCO_TOKEN, then the config file)"
                   + ("" if side == "coordinator" else "; with per-worker tokens, this worker's own"))
    if side == "coordinator":
        p.add_argument("--worker-tokens-file", metavar="FILE",
                       help="per-worker tokens instead of the shared one (lines '<id> <token>', mode "
                       "0600; `geoloco certs` writes worker-tokens): worker i's token binds slot i")
    p.add_argument("--tls-ca", metavar="PEM", help="the run's CA certificate: " + (
        "require worker certificates signed by it (mutual TLS)" if side == "coordinator"
        else "check the coordinator's certificate with it (default: the system's roots)"))
    p.add_argument("--tls-cert", metavar="PEM", help=f"this {side}'s certificate")
    p.add_argument("--tls-key", metavar="PEM", help="its private key")
    p.add_argument("--insecure", action="store_const", const="true", default=None,
                   help="allow plaintext to a non-loopback address (logged loudly at every start)")


def _add_local(sub: Any) -> None:
    p = sub.add_parser("local", allow_abbrev=False, help="coordinator + N workers on this machine behind emulated WAN links",
                       description="Start the coordinator and N worker processes on loopback, each "
                       "behind a link emulator, show progress and end with a summary table. Without "
                       "--config the run is demo-sized: "
                       + ", ".join(f"{k}={v}" for k, v in LOCAL_DEMO_DEFAULTS.items()) + ".")
    _common(p)
    p.add_argument("--workers", type=int, metavar="N", help="number of worker processes")
    p.add_argument("--rounds", type=int, metavar="R", help="outer rounds")
    p.add_argument("--wan", metavar="PROFILE", help="link profile of every worker, e.g. 20mbit/50ms")
    p.add_argument("--run-dir", metavar="DIR", help="where config, metrics, logs and checkpoints go "
                   "(the default runs/latest: a new runs/YYYYmmdd-HHMMSS each run, linked there)")
    _run_dir_flags(p)
    p.add_argument("--method", choices=("sparseloco", "diloco"), help="SparseLoCo or the dense DiLoCo baseline")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--inner-steps", type=int, metavar="H", help="inner AdamW steps per round")
    p.add_argument("--scheme", help="straggler policy: none | ignore | gc-fr | gc-cr | pgc-fr | pgc-cr")
    p.add_argument("--stragglers", type=int, metavar="S",
                   help="how many slow or dead workers a round tolerates (gradient coding's s)")
    p.add_argument("--per-worker-wan", metavar="P0,P1,...", help="per-worker link profiles, by worker id")
    p.add_argument("--straggler-profiles", metavar="P0,P1,...",
                   help="emulated slowness of each worker, by worker id, e.g. none,none,fixed:4")
    p.add_argument("--straggler", dest="straggler_profiles", metavar="P0,P1,...",
                   action=_DeprecatedAlias, help=argparse.SUPPRESS)  # the old name of --straggler-profiles
    p.add_argument("--seed", type=int, help="run seed (model init, data order)")
    p.add_argument("--deadline", type=float, metavar="SECONDS", help="round deadline")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="fail when no round closes for this long (default: deadline + 120 s)")
    p.add_argument("--progress", choices=("auto", "bar", "lines"),
                   help="a progress bar, or one plain line per round (auto: the bar on a terminal)")
    _metrics_flags(p, host=False)
    _show_defaults(p, LOCAL_FLAGS, LOCAL_DEMO_DEFAULTS)
    p.set_defaults(run=_run_local)


def _add_coordinator(sub: Any) -> None:
    p = sub.add_parser("coordinator", allow_abbrev=False, help="run the coordinator (gRPC server)",
                       description="Serve the round protocol to the workers and write the run directory.")
    _common(p)
    p.add_argument("--listen", metavar="HOST:PORT", help="address to serve on (port 0: pick a free one)")
    p.add_argument("--workers", type=int, metavar="N", help="workers expected before round 0 opens")
    p.add_argument("--rounds", type=int, metavar="R", help="outer rounds")
    p.add_argument("--run-dir", metavar="DIR", help="where config, metrics and checkpoints go")
    p.add_argument("--deadline", type=float, metavar="SECONDS", help="round deadline")
    p.add_argument("--crash-at", metavar="STAGE:ROUND", help=argparse.SUPPRESS)  # exactly-once tests
    _run_dir_flags(p)
    _metrics_flags(p)
    _security(p, "coordinator")
    _show_defaults(p, COORDINATOR_FLAGS)
    p.set_defaults(run=_run_coordinator)


def _add_worker(sub: Any) -> None:
    p = sub.add_parser("worker", allow_abbrev=False, help="run one worker against a coordinator",
                       description="Join a coordinator, train on the assigned partitions, push frames "
                       "and apply round results until the run finishes.")
    _common(p)
    p.add_argument("--coordinator", metavar="HOST:PORT", help="coordinator address")
    _security(p, "worker")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the coordinator's certificate carries (default: the host dialled)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="training device")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   help="inner-loop autocast (auto: bf16 on a GPU that has it)")
    p.add_argument("--connect-timeout", type=float, metavar="SECONDS",
                   help="give up (exit 1) when the coordinator stays unreachable this long")
    p.add_argument("--wan-emulate", metavar="PROFILE",
                   help="relay through an in-process link emulator with this profile (for hosts without netem)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, and the codec's (default 1)")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="run this worker as an island of N ranks on this host (one per GPU): one "
                   "worker id and gRPC session (rank 0's); task.batch_size is the island's batch")
    p.add_argument("--parallel", choices=PARALLEL_MODES,
                   help="how an island's ranks share the inner phase: ddp (each holds the whole model) "
                   "or fsdp (the model, its gradients and AdamW state sharded over the ranks)")
    p.add_argument("--report-dir", metavar="DIR", help="write worker-<id>.json (final digest, resyncs, bytes) here")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep this worker's own state (error feedback, inner AdamW state, data "
                   "positions) in DIR every worker.state_every rounds; a restart resumes it")
    p.add_argument("--identity-file", metavar="FILE",
                   help="reclaim the worker id and session in this JSON file (written by the "
                   "container entrypoint's join-and-apply step)")
    p.add_argument("--wait-for", metavar="FILE", help=argparse.SUPPRESS)  # launcher: join order
    _metrics_flags(p)
    _show_defaults(p, WORKER_FLAGS)
    p.set_defaults(run=_run_worker)


def _add_certs(sub: Any) -> None:
    p = sub.add_parser("certs", allow_abbrev=False, help="make a run's CA, coordinator and worker certificates and token",
                       description="Write into DIR what a run needs for TLS: the run's own CA, a "
                       "coordinator certificate for the names and addresses given with --san, one "
                       "client certificate per worker (worker-<i>.pem/.key), a random token file, "
                       "and per-worker tokens (worker-<i>.token, and worker-tokens for the "
                       "coordinator's --worker-tokens-file). "
                       "What DIR already holds is kept (the CA signs new worker certificates); keys "
                       "and the token are written readable by their owner only.")
    p.add_argument("dir", metavar="DIR", help="where the files go (created mode 0700)")
    p.add_argument("--san", action="append", default=[], metavar="NAME_OR_IP",
                   help="a DNS name or IP address workers dial the coordinator by (repeatable; "
                   "remakes the coordinator certificate; default localhost and 127.0.0.1)")
    p.add_argument("--workers", type=int, default=0, metavar="N", help="worker certificates 0..N-1")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.set_defaults(run=_run_certs)


def _add_export(sub: Any) -> None:
    p = sub.add_parser("export", allow_abbrev=False, help="write a run's newest checkpoint as a model folder others load",
                       description="A transformers save_pretrained folder for hf: models; for the "
                       "others model.safetensors (a plain state dict under every state-dict name, tied weights "
                       "too, for a strict load_state_dict) beside config.json. The "
                       "tokenizer.json goes along when the run had one.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (config.json, checkpoints/)")
    p.add_argument("out", metavar="OUT", help="folder to write (created; a file or a folder with files "
                   "in it is refused without --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a file at OUT, or the export's files in the folder OUT (others stay)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(run=_run_export)


def _add_warmup(sub: Any) -> None:
    p = sub.add_parser("warmup", help="compile the codec's kernels once, so no run pays for it",
                       description="Encode, decode and apply a small stand-in model once: numba "
                       "compiles the codec's kernels (about a minute on two cores) into its cache, "
                       "where every later process finds them. `make venv` runs it.")
    _common(p)
    p.set_defaults(run=_run_warmup)


def _add_report(sub: Any) -> None:
    p = sub.add_parser("report", help="plots and a Markdown summary of one or more runs",
                       description="Write PNGs (loss against wall time and against bytes sent, "
                       "the runs overlaid; per run a worker timeline, bytes per round, round time "
                       "against its limit) and report.md beside them.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where the report goes (default: RUN_DIR/report "
                   "of the first run)")
    p.add_argument("--label", action="append", default=[], metavar="NAME",
                   help="a run's name in the legends, in RUN_DIR order (default: the folder name)")
    p.set_defaults(run=_run_report)


def _add_config(sub: Any) -> None:
    p = sub.add_parser("config", allow_abbrev=False, help="print the resolved run config, or the reference of every field",
                       description="Print the run config that --config and --set give, validated, as "
                       "JSON (secrets left out); with --reference, every config field's type, default, "
                       "allowed values and meaning as Markdown (docs/config.md).")
    _common(p)
    p.add_argument("--reference", action="store_true", help="print the reference of every field")
    p.set_defaults(run=_run_config)


class _DeprecatedAlias(argparse.Action):
    """A flag's old spelling: stores like the new one and says which that is."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        new = "--" + self.dest.replace("_", "-")
        print(f"geoloco: warning: {option_string} is deprecated; use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _show_defaults(p: argparse.ArgumentParser, flags: dict[str, str],
                   demo: dict[str, str] | None = None) -> None:
    """Append each config flag's default (and its config field) to its help; ``demo``:
    the values used without --config where they differ."""
    defaults = dataclasses.asdict(RunConfig())
    for action in p._actions:
        key = flags.get(action.dest)
        if key is None or action.help in (None, argparse.SUPPRESS):
            continue
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        if "default" in action.help:  # the help says it already
            action.help += f" (config: {key})"
            continue
        shown = "unset" if value in (None, []) else str(value).lower() if isinstance(value, bool) else value
        if demo and key in demo and demo[key] != str(value):
            shown = f"{demo[key]} without --config, else {shown}"
        action.help += f" (default: {shown}; config: {key})".replace("%", "%%")


def resolve_config(args: argparse.Namespace, flags: dict[str, str],
                   defaults: dict[str, str] | None = None) -> RunConfig:
    """``defaults`` (only without --config) or the config file, then ``--set`` overrides,
    then the dedicated flags given."""
    overrides: dict[str, Any] = dict(defaults or {}) if not args.config else {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. inner.steps=30")
        if key.strip() in COMMAND_LINE_SECRETS:
            raise ConfigError(f"--set {key.strip()}: a secret on the command line is visible to every "
                              "user of the machine; use --token-file FILE or GEOLOCO_TOKEN")
        overrides[key.strip()] = value.strip()
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides[key] = str(value)
    cfg = load_config(args.config, overrides)
    resolve_token(cfg, os.environ)
    return cfg


def configure_logging(log_file: str | None, verbose: bool = False, rank: int | None = None) -> None:
    """Log to stderr and ``log_file``; an island's ``rank`` tags each line."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    fmt = LOG_FORMAT if rank is None else LOG_FORMAT.replace("%(name)s", f"[rank {rank}] %(name)s")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt,
                        handlers=handlers, force=True)


def _run_local(args: argparse.Namespace) -> int:
    cfg = resolve_config(args, LOCAL_FLAGS, LOCAL_DEMO_DEFAULTS)
    configure_logging(args.log_file, args.verbose)
    from geoloco.launch import run_local

    result = run_local(cfg, stall_timeout_s=args.stall_timeout, resume=args.resume,
                       overwrite=args.overwrite, resume_or_start=args.resume_or_start)
    if result.exit_code == EXIT_INTERRUPTED:
        print(resume_hint(args.argv, result.run_dir), flush=True)
    return result.exit_code


def resume_hint(argv: Sequence[str], run_dir: Path) -> str:
    """After a Ctrl-C: the same command on the same run dir with ``--resume``."""
    args = [a for a in argv if a not in ("--resume", "--overwrite", "--resume-or-start")]
    if not any(a == "--run-dir" or a.startswith("--run-dir=") for a in args):
        args += ["--run-dir", str(run_dir)]
    return f"stopped; the run goes on from its last checkpoint with:\n  geoloco {shlex.join([*args, '--resume'])}"


def _run_coordinator(args: argparse.Namespace) -> int:
    cfg = resolve_config(args, COORDINATOR_FLAGS)
    configure_logging(args.log_file, args.verbose)
    from geoloco.coordinator.app import run_coordinator

    crash_at = None
    if args.crash_at:  # the test seam: SIGKILL at "decision:R", "broadcast:R" or "checkpoint:R"
        stage, _, round_ = args.crash_at.partition(":")
        crash_at = (stage, int(round_))
    return run_coordinator(cfg, Path(cfg.run_dir), resume=args.resume, overwrite=args.overwrite,
                           crash_at=crash_at, resume_or_start=args.resume_or_start)


def _run_worker(args: argparse.Namespace) -> int:
    cfg = resolve_config(args, WORKER_FLAGS)
    if args.wan_emulate:
        _check_profile(args.wan_emulate)
    from geoloco.worker import island as islands

    island = islands.Island.from_env(cfg.worker.parallel)  # a rank that torchrun or launch started
    if island is None and cfg.worker.nproc_per_node > 1:
        configure_logging(args.log_file, args.verbose)
        return islands.launch(args.argv, cfg.worker.nproc_per_node)
    token = require_token(cfg) if island is None or island.leader else ""  # rank 0 joins
    configure_logging(args.log_file, args.verbose, island.rank if island else None)
    from geoloco.worker.admission import Admission
    from geoloco.worker.app import run_worker

    code = run_worker(
        cfg.worker.coordinator, token, device=cfg.worker.device,
        connect_timeout_s=cfg.worker.connect_timeout_s, report_dir=args.report_dir,
        wan_emulate=args.wan_emulate, threads=args.threads, wait_for=args.wait_for,
        identity_file=args.identity_file, tls=cfg.tls, precision=cfg.worker.precision,
        metrics=_worker_metrics(cfg), state_dir=args.state_dir, state_every=cfg.worker.state_every,
        admission=Admission(cfg.worker.allow_config_code, tuple(cfg.worker.allowed_paths)),
        island=island,
    )
    if island is not None and island.sharded:
        island.exit(code)
    return code


def _run_warmup(args: argparse.Namespace) -> int:
    cfg = resolve_config(args, {})
    configure_logging(args.log_file, args.verbose)
    import torch

    from geoloco.compression import Layout
    from geoloco.worker.encoder import FrameEncoder

    start = time.monotonic()
    FrameEncoder(Layout.from_named_tensors([("w", torch.zeros(1))]), cfg.compression).warm_up()
    print(f"codec kernels ready in {time.monotonic() - start:.1f}s")
    return 0


def _run_report(args: argparse.Namespace) -> int:
    configure_logging(None)
    from geoloco.report import ReportError, write_report

    try:
        out = write_report([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None,
                           args.label)
    except ReportError as exc:
        print(f"geoloco: report: {exc}", file=sys.stderr)
        return EXIT_REPORT_FAILED
    print(out)
    return 0


def _run_certs(args: argparse.Namespace) -> int:
    if not 0 <= args.workers <= 1024 or not 1 <= args.days <= 36500:
        raise ConfigError(f"--workers {args.workers} / --days {args.days}: expected 0..1024 workers "
                          "and 1..36500 days")
    from geoloco.certs import make_run_credentials

    for path in make_run_credentials(Path(args.dir), args.san, args.workers, args.days):
        print(f"wrote {path}")
    return 0


def _run_export(args: argparse.Namespace) -> int:
    configure_logging(None, args.verbose)
    from geoloco.coordinator.export import ExportError, ExportExists, export_run

    try:
        out = export_run(Path(args.run_dir), Path(args.out), overwrite=args.overwrite)
    except ExportError as exc:
        print(f"geoloco: export: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR if isinstance(exc, ExportExists) else EXIT_EXPORT_FAILED
    print(out)
    return 0


def _run_config(args: argparse.Namespace) -> int:
    if args.reference:
        from geoloco.config_reference import render

        print(render(), end="")
        return 0
    print(resolve_config(args, {}).to_json())
    return 0


def _worker_metrics(cfg: RunConfig) -> tuple[str, int] | None:
    port = cfg.monitoring.worker_metrics_port
    return None if port is None else (cfg.monitoring.metrics_host, port)


def _check_profile(text: str) -> None:
    from geoloco.profiles import LinkProfile, LinkProfileError

    try:
        LinkProfile.parse(text)
    except LinkProfileError as exc:
        raise ConfigError(f"--wan-emulate: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
