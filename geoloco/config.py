"""The one typed run configuration: dataclass sections, loaded from a TOML/JSON file plus
dotted overrides (``inner.steps=30``), validated once with errors naming field and range.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoloco.compression import MAX_TILE
from geoloco.profiles import (
    LinkProfile,
    LinkProfileError,
    StragglerProfileError,
    load_trace,
    parse_straggler_profile,
)
from geoloco.transport import AddressError, parse_address

MODEL_PRESETS = ("gpt-nano", "gpt-tiny", "gpt-small", "gpt-medium", "gpt-100m")
METHODS = ("sparseloco", "diloco")
SCHEMES = ("none", "ignore", "quorum", "gc-fr", "gc-cr", "pgc-fr", "pgc-cr")
LATE_WORK = ("keep", "drop")  # coding.late: what a quorum round does with the frames it closed without
INDEX_CODINGS = ("rice", "fixed")
QUANTIZERS = ("two-level", "four-bin")
DENSE_DTYPES = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
PARALLEL_MODES = ("ddp", "fsdp")  # worker.parallel (an island's ranks)
MODEL_KINDS = ("a preset", "module:function", "path/to/file.py:function", "hf:PATH")
TOKENIZER_TRAIN_VOCAB = (300, 1_000_000)  # train:N: the 256 bytes and a special token fit
DEFAULT_RUN_DIR = "runs/latest"  # a link to the newest run (geoloco.run_dir)
AGGREGATIONS = ("mean", "mean_kept")
OVERLAPS = ("none", "delayed", "eager")  # outer.overlap (docs/decisions.md, "Overlapped rounds")
FOLD_ARRIVAL = "arrival"  # outer.fold_step: fold the late result in as soon as it is in
STANDINS = ("mean", "share")  # outer.standin: what eager's stand-in scales the own pseudo-gradient by
AUTO = "auto"  # compression.density chosen by each worker from its measured upload rate
BROADCASTS = ("frames", "aggregate", AUTO)  # coordinator.broadcast
MAX_BROADCAST_PASSES = 4  # coordinator.broadcast_passes
PARTITIONINGS = ("iid", "contiguous")
STDLIB_CORPUS = "stdlib"  # task.data naming the running Python's standard-library sources
PROGRESS_STYLES = ("auto", "bar", "lines")
TOKEN_ENV = "GEOLOCO_TOKEN"  # the run token from the environment (never from a command line)
# fields that were renamed: the old name's error says what replaced it
RENAMED_FIELDS = {"task.val_batches": "task.val_windows (held-out windows, not batches)"}
SECRET_FIELDS = (("coordinator", "token"),)  # left out of every config written or sent


class ConfigError(ValueError):
    """A configuration value outside its allowed range; the message names the field."""


@dataclass
class TaskConfig:
    """Model and data. The default corpus is the pinned one shipped with geoloco (about 4 MB
    of CPython 3.11 standard-library sources, geoloco.tasks.corpus): the same bytes on every
    machine. The token stream is cut into non-overlapping windows of seq_len + 1 tokens; a
    fixed-seed validation set of val_windows windows spread over the whole corpus is held
    out, and the rest are split between the partitions (docs/decisions.md, "The data split")."""

    # a preset (gpt-tiny: ~1M parameters, for tests and demos); module:function or
    # path/to/file.py:function (a factory of an nn.Module); hf:PATH (a transformers causal LM
    # from a local config.json or checkpoint folder)
    model: str = "gpt-tiny"
    # a text file or a folder of text files, or JSONL/JSON/Parquet records (a file or a folder
    # of them); "stdlib": the running Python's standard-library sources (differ between
    # Pythons); None: the pinned corpus (the same bytes everywhere)
    data: str | None = None
    text_field: str = "text"  # the column of JSONL/Parquet records that holds the text
    # bytes | PATH (a tokenizer.json, or a folder holding one) | train:VOCAB (BPE trained on
    # the corpus) | auto: the hf: model folder's tokenizer.json if it has one, else bytes
    tokenizer: str = "auto"
    seq_len: int = 64  # tokens per training sequence
    batch_size: int = 16  # sequences per inner step
    # held-out windows the validation loss is the mean over: drawn over the whole corpus with
    # a fixed seed (the same for every run seed and method), in no partition
    val_windows: int = 1024
    # iid: the other windows shuffled with the run seed and dealt to the partitions (every
    # worker sees the whole corpus's mix); contiguous: one region of the stream per partition
    # (data that stays in its region)
    partitioning: str = "iid"
    corpus_bytes: int = 4_000_000  # cap on the text read, so start-up stays fast
    # the tokenized corpus's fingerprint (geoloco.tasks.LMTask.fingerprint); None: the
    # coordinator fills in its own, and a worker whose data differs refuses to start
    data_fingerprint: str | None = None


@dataclass
class InnerConfig:
    """The inner AdamW loop each worker runs between two outer steps (DiLoCo's H steps)."""

    steps: int = 20  # H: inner steps per round
    lr: float = 3e-3  # peak AdamW learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine decay over all rounds' inner steps
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # the gradients' global L2 norm is clipped to this before each step


@dataclass
class CompressionConfig:
    """What a worker sends: SparseLoCo's sparse 2-bit frames, or dense DiLoCo frames."""

    method: str = "sparseloco"  # sparseloco | diloco (dense baseline)
    # fraction of each chunk kept by top-k (1-3 % per the paper); "auto": each worker picks
    # it within [density_min, density_max] from its measured upload rate so that its push
    # takes target_push_s (under outer.overlap, unset: one inner phase's compute time)
    density: float | str = 64 / 4096
    # density "auto"'s range, 4x apart by default: a frame's norm grows with k (x1.6 from 32 to 128 of 4096), and the
    # frame bounds clip a frame above guard.clip_ratio (2) x the round's lower median norm
    density_min: float = 32 / 4096
    density_max: float = 128 / 4096  # the upper end of density "auto"'s range
    # density "auto": the seconds a worker's push should take (None: one inner phase's
    # compute time under outer.overlap)
    target_push_s: float | None = None
    ef_beta: float = 0.95  # error-feedback decay
    tile: int = 64  # 2-D tensors are chunked into tile x tile blocks
    index_coding: str = "rice"  # rice (entropy coded) | fixed (12-bit)
    # two-level: sign x {lo, hi} per chunk (medians of the halves, bfloat16); four-bin: the
    # SparseLoCo reference's 4 bins over mean-centred values, scale 6 sigma / 4, bin means
    # as values, one table per tensor (docs/codec.md; the choice: docs/decisions.md)
    quantizer: str = "two-level"
    zstd: bool = False  # zstd over frame sections
    dense_dtype: str = "fp32"  # diloco: fp32 | bf16 pseudo-gradients


@dataclass
class OuterConfig:
    """Outer optimizer; None picks the method's default (SparseLoCo: SGD lr 1, no momentum;
    DiLoCo: Nesterov SGD lr 0.7, momentum 0.9)."""

    lr: float | None = None  # the outer SGD learning rate (None: the method's default)
    momentum: float | None = None  # Nesterov momentum of the outer SGD (None: the method's default)
    # mean_kept (SparseLoCo's rule): each coordinate is the mean over the frames that kept
    # it, exact for uncoded, ignore, quorum and FR, the same estimate for gc-cr (pgc-cr,
    # whose overlapping frames carry versions of different ages, takes the weighted sum);
    # mean: the weighted sum of the frames divided by all n partitions, always
    aggregation: str = "mean_kept"
    # none: wait for round t's result before round t+1's inner steps; delayed: push and go
    # on at once from the last global parameters known, fold round t's result in at the
    # end of round t+1's inner phase (one-round-delayed outer update); eager: the same, but
    # the next inner phase starts from them plus the worker's own pseudo-gradient as a
    # stand-in for round t's update (Kale, Douillard and Donchev 2025, arXiv 2502.12996)
    overlap: str = "none"
    # eager's stand-in: mean: the worker's own pseudo-gradient stands in for the round's
    # mean, times the outer step's response (-lr; Nesterov: -lr (1 + momentum)); share: its
    # 1/n share of that mean, as in Kale et al. (measured: docs/decisions.md, "Overlapped rounds")
    standin: str = "mean"
    # under overlap, when the late result of round t is folded in: None: at the end of
    # round t+1's inner phase; k: before its inner step k, waiting for the result there if it
    # is not in yet, the steps taken so far moved onto the global track (the rest of the
    # phase trains from it; for a transfer that takes about k of the H steps' time);
    # "arrival": before the first inner step that finds the whole result in, never waiting
    # (at the phase's end if it is not in by then)
    fold_step: int | str | None = None


@dataclass
class CodingConfig:
    """Gradient coding against stragglers (Tandon et al. 2017; docs/gradient-coding.md)."""

    # none: wait for every worker; ignore: close on the first n - s, the missing partitions
    # estimated; quorum: close once coding.quorum arrived and a grace window passed, the
    # mean of what arrived; gc-fr/gc-cr: gradient codes (fractional repetition, cyclic)
    # that decode the exact sum from any n - s; pgc-*: the same, pipelined over rounds
    scheme: str = "none"
    stragglers: int = 0  # s: how many slow or dead workers a round tolerates
    seed: int = 0  # seeds the random code matrices of the -cr schemes
    # quorum: the fewest arrived frames a round closes on before its deadline; None:
    # workers - stragglers
    quorum: int | None = None
    # quorum: seconds a round waits for more frames once the quorum is in; None: adaptive,
    # coding.grace_spread times the median arrival spread of the recent rounds
    grace_s: float | None = None
    # quorum, adaptive grace: the multiple of the recent rounds' median arrival spread (the
    # seconds from a round's first frame to its last one in time); 0: close at the quorum
    grace_spread: float = 0.0
    # quorum: a frame that missed its round is dropped ("drop"), or stays in its worker's
    # error feedback and is sent later ("keep"; docs/decisions.md, "A quorum baseline")
    late: str = "drop"

    def tolerance(self, workers: int) -> int:
        """s, the workers a round may close without: coding.stragglers, or with scheme
        quorum and coding.quorum set, workers - quorum."""
        if self.scheme == "quorum" and self.quorum is not None:
            return workers - self.quorum
        return self.stragglers


@dataclass
class NetworkConfig:
    """Emulated WAN links: a default profile and optional per-worker overrides (by id)."""

    wan: str = "20mbit/50ms"  # every worker's link profile (rate/delay/jitter/loss)
    per_worker: list[str] = field(default_factory=list)  # link profiles by worker id, overriding wan

    def profile_for(self, worker_id: int) -> LinkProfile:
        text = self.per_worker[worker_id] if worker_id < len(self.per_worker) else self.wan
        return LinkProfile.parse(text)


@dataclass
class StragglerConfig:
    """Straggler emulation on workers: a default profile and per-worker overrides (by id),
    e.g. ``none``, ``fixed:4``, ``exp:0.1:0.5``, ``markov:0.1:0.3:4``, ``trace:FILE``."""

    default: str = "none"  # every worker's straggler profile (none: no emulated slowness)
    per_worker: list[str] = field(default_factory=list)  # profiles by worker id, overriding default

    def profile_for(self, worker_id: int) -> str:
        return self.per_worker[worker_id] if worker_id < len(self.per_worker) else self.default


@dataclass
class CoordinatorConfig:
    """The coordinator's server: where it listens, who it admits, how long rounds wait, and
    how often it checkpoints and validates."""

    listen: str = "127.0.0.1:50051"  # HOST:PORT the gRPC server binds (port 0: a free one)
    # the run's shared secret that workers present at Join: from token_file, $GEOLOCO_TOKEN
    # or this field (config file only; never on a command line, never written out)
    token: str | None = None
    token_file: str | None = None  # a file holding the token (`geoloco certs` writes one)
    # per-worker tokens instead of the shared one: a file (0600) of lines "<worker id>
    # <token>" (`geoloco certs` writes worker-tokens and each worker-<i>.token); set, a Join
    # must present worker i's token, which binds slot i, and the shared token admits nobody
    worker_tokens_file: str | None = None
    deadline_s: float = 300.0  # a round closes at this deadline whatever has arrived
    join_timeout_s: float = 300.0  # how long round 0 waits for all workers to join
    checkpoint_every: int = 5  # rounds between checkpoints (0: only the final one)
    # a worker without a Rounds stream this long is dead (a starting worker holds one from
    # its Join, so a slow start-up is not), and a new worker with the token may take its
    # slot (id, partitions); it is back if it follows again. Rounds stop waiting for a
    # worker as soon as its Rounds stream ends, until it follows them again
    liveness_s: float = 60.0
    # rounds between validation losses, always measured after the broadcast; 0: only the
    # last round; None: for models under 20M parameters as often as keeps an evaluation
    # under 10 % of a round (every round where it is cheap), else at checkpoints
    val_every: int | None = None
    # what a round result carries (compression.method sparseloco; docs/decisions.md, "One
    # frame down"): "frames", the workers' frames as they are (a worker downloads n frames);
    # "aggregate", their aggregate compressed into one frame with the coordinator's own error
    # feedback (one frame whatever n); "auto", whichever of the two is smaller, each round
    broadcast: str = "frames"
    # the aggregate's top-k density; None: the union of the frames a round aggregates (how
    # many times the workers' compression.density: n, or n / (s + 1) under an FR code), at
    # most a quarter a frame, sent in as many frames as that takes (broadcast_passes), at
    # most 4 (docs/decisions.md, "One frame down": what held the loss at n = 8, 16 and 32)
    broadcast_density: float | None = None
    # frames the aggregate is sent as: the first compresses it, each further one what the
    # frames before it left out, its two-bit quantization error included (the same error
    # feedback, no new input, in place), so a coordinate may be sent with more levels than one
    # frame's. None: 1 where broadcast_density is set, else the frames the union takes at a
    # quarter each
    broadcast_passes: int | None = None


@dataclass
class WorkerConfig:
    """A worker process's own settings: these are read from its local config and flags,
    not from the run config the coordinator sends."""

    coordinator: str = "127.0.0.1:50051"  # HOST:PORT of the coordinator to join
    connect_timeout_s: float = 60.0  # give up (exit non-zero) after retrying this long
    device: str = "auto"  # auto | cpu | cuda
    # the inner loop's autocast: bf16 | fp32 | auto (bf16 on a GPU that has it, else fp32);
    # master weights, error feedback and pseudo-gradients stay fp32 whatever it is
    precision: str = "auto"
    # with `geoloco worker --state-dir DIR`: save the worker's own state (error feedback,
    # inner AdamW, data positions) there every this many rounds; 0: never; None: every
    # round while a save costs under 5 % of a round (measured), else as often as keeps it so
    state_every: int | None = None
    # what the coordinator's run config may make this worker do (docs/security.md): False
    # (`geoloco worker`'s default) refuses a module:function or .py model and any data,
    # tokenizer, hf: model or trace path outside allowed_paths; geoloco local and the
    # examples turn it on
    allow_config_code: bool = False
    allowed_paths: list[str] = field(default_factory=list)  # folders (or files) it may read
    # an island: this many processes (ranks) on this host train as one worker, one slot and
    # one gRPC session (rank 0's); task.batch_size is the island's batch, each rank takes an
    # equal share of it (docs/deploy.md, "A region's GPUs as one worker")
    nproc_per_node: int = 1
    # how an island's ranks share the inner phase: ddp (each holds the whole model; the
    # gradients are averaged before every inner step) or fsdp (FSDP2: the parameters, their
    # gradients and the AdamW state are sharded over the ranks)
    parallel: str = "ddp"


@dataclass
class MonitoringConfig:
    """Watching a run (docs/monitoring.md): Prometheus metrics over plain HTTP, TensorBoard
    scalars, and how ``geoloco local`` shows its progress."""

    # the coordinator's /metrics (geoloco coordinator, geoloco local); None: off, 0: a free
    # port, written to run_dir/metrics.port
    metrics_port: int | None = None
    # a worker's own /metrics (geoloco worker; geoloco local gives worker i this port + i,
    # or free ports for 0); None: off
    worker_metrics_port: int | None = None
    # the address both bind: loopback by default, since /metrics is plaintext HTTP without
    # authentication; 0.0.0.0 only where the network around it is private (a container's)
    metrics_host: str = "127.0.0.1"
    tensorboard: bool = False  # TensorBoard scalars of every round in run_dir/tensorboard
    # geoloco local: bar | lines (one plain line per round) | auto: the bar on a terminal,
    # lines otherwise (CI, logs)
    progress: str = "auto"


@dataclass
class TlsConfig:
    """Transport security of this process's connections (docs/security.md). The
    coordinator serves TLS with ``cert`` and ``key``; with ``ca`` it also requires every
    client to present a certificate signed by that CA (mutual TLS). A worker checks the
    coordinator's certificate against ``ca`` (the system's roots when unset) and presents
    ``cert`` and ``key`` when given. Paths are read when the process starts."""

    ca: str | None = None  # PEM: the run's CA certificate
    cert: str | None = None  # PEM: this process's certificate (chain)
    key: str | None = None  # PEM: its private key
    # worker: the name the coordinator's certificate must carry (default: the host of
    # worker.coordinator)
    server_name: str | None = None
    insecure: bool = False  # allow plaintext on a non-loopback address (warned at every start)


@dataclass
class GuardConfig:
    """Bounds on every frame before it counts (docs/security.md): a frame whose L2 norm
    exceeds ``clip_ratio`` x the reference norm is scaled down to it, one above
    ``reject_ratio`` x the reference is dropped. The reference is the lower median of the
    round's arrived frames' norms and, for each worker without a frame this round, its
    latest counted frame's norm of the last ``reference_rounds`` rounds, so it stays an
    honest frame's while fewer than half lie, and a round that closed on few frames still
    has the others'. With fewer than ``min_reference_workers`` norms in that pool frames
    are only clipped, never dropped by the ratio (at n = 2 one worker cannot be told from
    the other)."""

    clip_ratio: float = 2.0  # a frame above this x the reference norm is scaled down to it
    reject_ratio: float = 100.0  # a frame above this x the reference norm is dropped
    reference_rounds: int = 8  # how many rounds back an absent worker's last norm still counts
    min_reference_workers: int = 3  # fewer norms in the pool: frames are only clipped


@dataclass
class RunConfig:
    """A run: its size and seed, where it writes, and one section per part of the system."""

    workers: int = 4  # worker processes (each holds a slot and its partitions)
    rounds: int = 20  # outer rounds to train
    seed: int = 0  # the run seed: model initialisation and data order
    # where config.json, metrics, logs and checkpoints go; the default is a link: each new
    # run makes runs/YYYYmmdd-HHMMSS and points runs/latest at it, a resume continues its target
    run_dir: str = DEFAULT_RUN_DIR
    task: TaskConfig = field(default_factory=TaskConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    coding: CodingConfig = field(default_factory=CodingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every field but the secrets (SECRET_FIELDS): what config.json and Join send."""
        data = dataclasses.asdict(self)
        for section, name in SECRET_FIELDS:
            data[section].pop(name, None)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return _build(cls, data, "")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML or JSON file (optional), apply dotted overrides, validate, resolve defaults."""
    data: dict[str, Any] = _read_file(Path(path)) if path else {}
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, _Text(value) if isinstance(value, str) else value)
    return validate(RunConfig.from_dict(data))


def resolve_token(cfg: RunConfig, environ: Mapping[str, str]) -> str | None:
    """The run token, into ``cfg.coordinator.token``: from ``coordinator.token_file`` if
    set, else from $GEOLOCO_TOKEN, else the config file's ``coordinator.token``."""
    co = cfg.coordinator
    if co.token_file:
        try:
            co.token = Path(co.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"coordinator.token_file: cannot read {co.token_file!r} ({exc.strerror})") from None
        if not co.token:
            raise ConfigError(f"coordinator.token_file: {co.token_file!r} is empty")
    elif environ.get(TOKEN_ENV):
        co.token = environ[TOKEN_ENV].strip()
    return co.token


def require_token(cfg: RunConfig) -> str:
    """The run token; ConfigError saying where to put it when there is none."""
    if not cfg.coordinator.token:
        raise ConfigError(f"no run token: give --token-file FILE (`geoloco certs` writes one) or set "
                          f"{TOKEN_ENV}; a token is never taken from the command line")
    return cfg.coordinator.token


def validate(cfg: RunConfig) -> RunConfig:
    """Check every field once; fill the method-dependent outer defaults. Returns ``cfg``."""
    _check_range("workers", cfg.workers, 1, 1024)
    _check_range("rounds", cfg.rounds, 1, 10**7)
    _check_run_dir(cfg.run_dir)
    _check_task(cfg.task)
    _check_inner(cfg.inner)
    _check_compression(cfg.compression, cfg.outer.overlap)
    _resolve_outer(cfg.outer, cfg.compression.method)
    _check_coding(cfg.coding, cfg.workers)
    _check_links(cfg.network, cfg.workers)
    _check_stragglers(cfg.stragglers, cfg.workers)
    _check_coordinator(cfg.coordinator)
    if cfg.coordinator.broadcast == "aggregate" and cfg.compression.method != "sparseloco":
        raise ConfigError(f"coordinator.broadcast 'aggregate' needs compression.method 'sparseloco' "
                          f"(a {cfg.compression.method} round result is already one dense frame)")
    _check_choice("worker.device", cfg.worker.device, DEVICES)
    _check_choice("worker.precision", cfg.worker.precision, PRECISIONS)
    _check_range("worker.connect_timeout_s", cfg.worker.connect_timeout_s, 0.1, 1e6)
    _check_range("worker.nproc_per_node", cfg.worker.nproc_per_node, 1, 1024)
    _check_choice("worker.parallel", cfg.worker.parallel, PARALLEL_MODES)
    if cfg.worker.state_every is not None:
        _check_range("worker.state_every", cfg.worker.state_every, 0, 10**7)
    _check_address("worker.coordinator", cfg.worker.coordinator)
    _check_monitoring(cfg.monitoring)
    _check_tls(cfg.tls)
    _check_range("guard.clip_ratio", cfg.guard.clip_ratio, 1.0, 1e6)
    _check_range("guard.reject_ratio", cfg.guard.reject_ratio, cfg.guard.clip_ratio, 1e12)
    _check_range("guard.reference_rounds", cfg.guard.reference_rounds, 0, 10**6)
    _check_range("guard.min_reference_workers", cfg.guard.min_reference_workers, 1, 10**6)
    _check_fold_step(cfg)
    return cfg


def _check_fold_step(cfg: RunConfig) -> None:
    """outer.fold_step: a whole inner step inside the phase, under overlap, in a worker of
    one process."""
    step = cfg.outer.fold_step
    if step is None:
        return
    if step != FOLD_ARRIVAL and (isinstance(step, bool) or not isinstance(step, int) or not 1 <= step < cfg.inner.steps):
        raise ConfigError(f"outer.fold_step: {step!r} is neither an inner step from 1 to {cfg.inner.steps - 1} nor "
                          f"{FOLD_ARRIVAL!r} (inner.steps is {cfg.inner.steps}; unset: fold at the end of the phase)")
    if cfg.outer.overlap == "none":
        raise ConfigError("outer.fold_step needs outer.overlap 'delayed' or 'eager' (without overlap every "
                          "result is in before the next phase starts)")
    if cfg.worker.nproc_per_node > 1:
        raise ConfigError("outer.fold_step is not supported in a worker of several ranks "
                          "(worker.nproc_per_node > 1): unset it, and the island folds at the end of the phase")


def _check_run_dir(run_dir: Any) -> None:
    """A path that names a folder: not empty or blank (that would be the current folder)
    and without NUL bytes; whether it may be used is geoloco.run_dir's rule."""
    if not isinstance(run_dir, str) or not run_dir.strip() or "\0" in run_dir:
        raise ConfigError(f"run_dir: {run_dir!r} is not a folder path; give a non-empty path "
                          "such as runs/exp1")


def _check_task(task: TaskConfig) -> None:
    _check_model(task.model)
    if task.data not in (None, STDLIB_CORPUS) and not Path(task.data).exists():
        raise ConfigError(f"task.data: {task.data!r} does not exist (a text file, a JSONL or "
                          f"Parquet file, or a folder of them; or {STDLIB_CORPUS!r}: this Python's "
                          "sources; or unset: the pinned corpus)")
    if not isinstance(task.text_field, str) or not task.text_field:
        raise ConfigError(f"task.text_field: {task.text_field!r} is not a column name")
    _check_tokenizer(task.tokenizer)
    if task.data_fingerprint is not None and not isinstance(task.data_fingerprint, str):
        raise ConfigError(f"task.data_fingerprint: {task.data_fingerprint!r} is not a fingerprint")
    _check_range("task.seq_len", task.seq_len, 8, 8192)
    _check_range("task.batch_size", task.batch_size, 1, 4096)
    _check_range("task.val_windows", task.val_windows, 1, 10**6)
    _check_choice("task.partitioning", task.partitioning, PARTITIONINGS)
    _check_range("task.corpus_bytes", task.corpus_bytes, 10_000, 10**11)


def _check_model(model: Any) -> None:
    """A preset, ``module:function``, ``file.py:function`` or ``hf:PATH`` (PATH exists)."""
    if not isinstance(model, str) or not model:
        raise ConfigError(f"task.model: {model!r} is not one of {', '.join(MODEL_KINDS)}")
    if model.startswith("hf:"):
        if not Path(model[3:]).exists():
            raise ConfigError(f"task.model: {model[3:]!r} does not exist (hf:PATH wants a local "
                              "config.json, or a folder with config.json and optionally weights)")
        return
    module, sep, function = model.rpartition(":")
    if not sep:
        _check_choice("task.model", model, MODEL_PRESETS)
    elif not function.isidentifier() or not module:
        raise ConfigError(f"task.model: {model!r} is not module:function (e.g. mypkg.models:make_model "
                          "or models/mine.py:make_model)")


def _check_tokenizer(spec: Any) -> None:
    """``auto``, ``bytes``, ``train:VOCAB`` or a path that exists."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"task.tokenizer: {spec!r} is not auto, bytes, train:VOCAB or a path")
    if spec in ("auto", "bytes"):
        return
    if spec.startswith("train:"):
        low, high = TOKENIZER_TRAIN_VOCAB
        vocab = spec[len("train:"):]
        if not vocab.isdigit() or not low <= int(vocab) <= high:
            raise ConfigError(f"task.tokenizer: {spec!r}: train:VOCAB wants a vocabulary size in "
                              f"the allowed range {low}..{high}")
        return
    if not Path(spec).exists():
        raise ConfigError(f"task.tokenizer: {spec!r} does not exist (a tokenizer.json or a folder "
                          "holding one; or auto, bytes, train:VOCAB)")


def _check_inner(inner: InnerConfig) -> None:
    _check_range("inner.steps", inner.steps, 1, 100_000)
    _check_range("inner.lr", inner.lr, 1e-8, 1.0)
    _check_range("inner.warmup_steps", inner.warmup_steps, 0, 10**7)
    _check_range("inner.min_lr_ratio", inner.min_lr_ratio, 0.0, 1.0)
    _check_range("inner.weight_decay", inner.weight_decay, 0.0, 1.0)
    _check_range("inner.beta1", inner.beta1, 0.0, 0.9999)
    _check_range("inner.beta2", inner.beta2, 0.0, 0.99999)
    _check_range("inner.grad_clip", inner.grad_clip, 0.0, 1e6)


def _check_compression(comp: CompressionConfig, overlap: str) -> None:
    _check_choice("compression.method", comp.method, METHODS)
    _check_density(comp, overlap)
    _check_range("compression.ef_beta", comp.ef_beta, 0.0, 1.0)
    _check_range("compression.tile", comp.tile, 4, MAX_TILE)
    _check_choice("compression.index_coding", comp.index_coding, INDEX_CODINGS)
    _check_choice("compression.quantizer", comp.quantizer, QUANTIZERS)
    _check_choice("compression.dense_dtype", comp.dense_dtype, DENSE_DTYPES)


def _check_density(comp: CompressionConfig, overlap: str) -> None:
    """A fixed density in 1/4096..1, or "auto" with 1/4096 <= density_min <= density_max
    <= 1 and a target time: target_push_s, or one inner phase under outer.overlap."""
    _check_range("compression.density_min", comp.density_min, 1 / 4096, 1.0)
    _check_range("compression.density_max", comp.density_max, comp.density_min, 1.0)
    if comp.target_push_s is not None:
        _check_range("compression.target_push_s", comp.target_push_s, 0.001, 1e6)
    if comp.density != AUTO:
        if isinstance(comp.density, str):
            raise ConfigError(f"compression.density: {comp.density!r} is neither a fraction in the "
                              f"allowed range {1 / 4096:g}..1 nor {AUTO!r}")
        _check_range("compression.density", comp.density, 1 / 4096, 1.0)
        return
    if comp.method != "sparseloco":
        raise ConfigError(f"compression.density {AUTO!r} needs compression.method 'sparseloco' "
                          f"(dense frames have no density); got {comp.method!r}")
    if comp.target_push_s is None and overlap == "none":
        raise ConfigError(f"compression.density {AUTO!r} needs compression.target_push_s (seconds a "
                          "push may take), or outer.overlap 'delayed' or 'eager' (then a push fits "
                          "one inner phase)")


def _resolve_outer(outer: OuterConfig, method: str) -> None:
    if outer.lr is None:
        outer.lr = 1.0 if method == "sparseloco" else 0.7
    if outer.momentum is None:
        outer.momentum = 0.0 if method == "sparseloco" else 0.9
    _check_range("outer.lr", outer.lr, 1e-6, 10.0)
    _check_range("outer.momentum", outer.momentum, 0.0, 0.999)
    _check_choice("outer.aggregation", outer.aggregation, AGGREGATIONS)
    _check_choice("outer.overlap", outer.overlap, OVERLAPS)
    _check_choice("outer.standin", outer.standin, STANDINS)


def _check_coding(coding: CodingConfig, workers: int) -> None:
    _check_choice("coding.scheme", coding.scheme, SCHEMES)
    _check_range("coding.stragglers", coding.stragglers, 0, workers - 1)
    if coding.scheme == "none" and coding.stragglers:
        raise ConfigError("coding.stragglers must be 0 with coding.scheme 'none' (wait for all)")
    if coding.quorum is not None:
        if isinstance(coding.quorum, bool) or not isinstance(coding.quorum, int):
            raise ConfigError(f"coding.quorum: {coding.quorum!r} is not a whole number of workers")
        _check_range("coding.quorum", coding.quorum, 1, workers)
        if coding.scheme != "quorum":
            raise ConfigError(f"coding.quorum is for coding.scheme 'quorum', not {coding.scheme!r}")
        if coding.stragglers and coding.quorum != workers - coding.stragglers:
            raise ConfigError(f"coding.quorum {coding.quorum} and coding.stragglers {coding.stragglers} "
                              f"disagree for {workers} workers: set one of them (quorum = workers - stragglers)")
    if coding.grace_s is not None:
        _check_range("coding.grace_s", coding.grace_s, 0.0, 1e6)
    _check_range("coding.grace_spread", coding.grace_spread, 0.0, 1e3)
    _check_choice("coding.late", coding.late, LATE_WORK)
    if coding.scheme.endswith("-fr") and workers % (coding.stragglers + 1):
        raise ConfigError(
            f"coding.scheme {coding.scheme!r} needs (stragglers + 1) to divide workers; "
            f"got workers={workers}, stragglers={coding.stragglers} (use a -cr scheme for any n)"
        )


def _check_links(net: NetworkConfig, workers: int) -> None:
    for name, text in [("network.wan", net.wan)] + [
        (f"network.per_worker[{i}]", t) for i, t in enumerate(net.per_worker)
    ]:
        try:
            LinkProfile.parse(text)
        except LinkProfileError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if len(net.per_worker) > workers:
        raise ConfigError(f"network.per_worker lists {len(net.per_worker)} profiles for {workers} workers")


def _check_stragglers(st: StragglerConfig, workers: int) -> None:
    """Every worker's profile parses, and a trace file has a row for every worker it is
    the profile of."""
    if len(st.per_worker) > workers:
        raise ConfigError(f"stragglers.per_worker lists {len(st.per_worker)} profiles for {workers} workers")
    for i in range(workers):
        name = f"stragglers.per_worker[{i}]" if i < len(st.per_worker) else "stragglers.default"
        try:
            profile = parse_straggler_profile(st.profile_for(i))
            if profile.kind == "trace" and len(load_trace(profile.path)) <= i:
                raise StragglerProfileError(f"straggler trace {profile.path!r} has no row for worker {i}")
        except StragglerProfileError as exc:
            raise ConfigError(f"{name}: {exc}") from None


def _check_coordinator(co: CoordinatorConfig) -> None:
    _check_address("coordinator.listen", co.listen)
    _check_range("coordinator.deadline_s", co.deadline_s, 0.1, 1e6)
    _check_range("coordinator.join_timeout_s", co.join_timeout_s, 0.1, 1e6)
    _check_range("coordinator.checkpoint_every", co.checkpoint_every, 0, 10**7)
    _check_range("coordinator.liveness_s", co.liveness_s, 0.5, 1e6)
    if co.val_every is not None:
        _check_range("coordinator.val_every", co.val_every, 0, 10**7)
    _check_choice("coordinator.broadcast", co.broadcast, BROADCASTS)
    if co.broadcast_density is not None:
        _check_range("coordinator.broadcast_density", co.broadcast_density, 1 / 4096, 1.0)
    if co.broadcast_passes is not None:
        _check_range("coordinator.broadcast_passes", co.broadcast_passes, 1, MAX_BROADCAST_PASSES)
    if co.token is not None and not co.token.strip():
        raise ConfigError("coordinator.token must not be empty")
    if co.worker_tokens_file is not None and (not isinstance(co.worker_tokens_file, str) or not co.worker_tokens_file):
        raise ConfigError(f"coordinator.worker_tokens_file: {co.worker_tokens_file!r} is not a file path")


def _check_monitoring(mon: MonitoringConfig) -> None:
    for name in ("metrics_port", "worker_metrics_port"):
        port = getattr(mon, name)
        if port is not None:
            _check_range(f"monitoring.{name}", port, 0, 65535)
    if not isinstance(mon.metrics_host, str) or not mon.metrics_host:
        raise ConfigError(f"monitoring.metrics_host: {mon.metrics_host!r} is not a host name or address")
    _check_address("monitoring.metrics_host", f"{mon.metrics_host}:0")
    _check_choice("monitoring.progress", mon.progress, PROGRESS_STYLES)
    if not isinstance(mon.tensorboard, bool):
        raise ConfigError(f"monitoring.tensorboard: {mon.tensorboard!r} is not true or false")


def _check_tls(tls: TlsConfig) -> None:
    if bool(tls.cert) != bool(tls.key):
        raise ConfigError("tls.cert and tls.key go together: give both (the certificate and its "
                          "private key) or neither")


def _check_address(name: str, value: str) -> None:
    try:
        parse_address(value)
    except AddressError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _check_range(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(f"{name}: {value!r} is outside the allowed range {low:g}..{high:g}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return _toml_loads(text)
    except ValueError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix or 'TOML'}: {exc}") from None


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[leaf] = value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table of fields, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        renamed = RENAMED_FIELDS.get(f"{prefix}{unknown[0]}")
        if renamed is not None:
            raise ConfigError(f"{prefix}{unknown[0]} was renamed: give {renamed} instead")
        raise ConfigError(
            f"unknown field {prefix}{unknown[0]}; fields of {prefix.rstrip('.') or 'the config'}: "
            f"{', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        ftype = fields[name].type
        nested = _SECTIONS.get(ftype) if isinstance(ftype, str) else None
        kwargs[name] = _build(nested, value, f"{prefix}{name}.") if nested else _coerce(
            f"{prefix}{name}", ftype, value
        )
    return cls(**kwargs)


class _Text(str):
    """A value given as text (a flag or an override): parsed into the field's type."""


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "list[str]": "a list of strings"}


def _coerce(name: str, ftype: str, value: Any) -> Any:
    """Parse text from flags and overrides into the declared type; a typed value (TOML,
    JSON) must already have it: ConfigError naming field, expected type and value."""
    if not isinstance(value, _Text):
        return _typed(name, ftype, value)
    try:
        if ftype == "int":
            return int(value)
        if ftype == "int | None":
            return None if value.lower() == "none" else int(value)
        if ftype in ("float", "float | None"):
            return None if value.lower() == "none" else float(value)
        if ftype == "float | str":
            return AUTO if value.lower() == AUTO else float(value)
        if ftype == "int | str | None":  # outer.fold_step: an inner step, "arrival" or none
            return None if value.lower() == "none" else FOLD_ARRIVAL if value.lower() == FOLD_ARRIVAL else int(value)
        if ftype == "bool":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if ftype.startswith("list"):
            return [item.strip() for item in value.split(",") if item.strip()]
        if ftype == "str | None":
            return None if value.lower() == "none" else value
    except ValueError:
        raise ConfigError(f"{name}: {str(value)!r} is not a valid {ftype}") from None
    return str(value)


def _typed(name: str, ftype: str, value: Any) -> Any:
    if ftype == "float | str":  # compression.density: a fraction or "auto"
        if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value if isinstance(value, str) else float(value)
        raise ConfigError(f"{name}: expected a number or {AUTO!r}, got {value!r} ({type(value).__name__})")
    if ftype == "int | str | None":
        if value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ConfigError(f"{name}: expected an integer, {FOLD_ARRIVAL!r} or none, got {value!r} "
                          f"({type(value).__name__})")
    base, optional = ftype.removesuffix(" | None"), ftype.endswith(" | None")
    if value is None and optional:
        return None
    if base == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, float),
          "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str),
          "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}[base]
    if not ok(value):
        expected = _EXPECTED[base] + (" or none" if optional else "")
        raise ConfigError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")
    return list(value) if base == "list[str]" else value


_SECTIONS: dict[str, type] = {
    "TaskConfig": TaskConfig,
    "InnerConfig": InnerConfig,
    "CompressionConfig": CompressionConfig,
    "OuterConfig": OuterConfig,
    "CodingConfig": CodingConfig,
    "NetworkConfig": NetworkConfig,
    "StragglerConfig": StragglerConfig,
    "CoordinatorConfig": CoordinatorConfig,
    "WorkerConfig": WorkerConfig,
    "MonitoringConfig": MonitoringConfig,
    "TlsConfig": TlsConfig,
    "GuardConfig": GuardConfig,
}
