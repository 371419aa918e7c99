"""The one typed run configuration: dataclass sections, loaded from a TOML/JSON file plus
dotted overrides (``inner.steps=30``), validated once with errors naming field and range.
"""

from __future__ import annotations

import dataclasses
import json
import sys
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

MODEL_PRESETS = ("gpt-tiny", "gpt-small", "gpt-medium", "gpt-100m")
METHODS = ("sparseloco", "diloco")
SCHEMES = ("none", "ignore", "gc-fr", "gc-cr", "pgc-fr", "pgc-cr")
INDEX_CODINGS = ("rice", "fixed")
QUANTIZERS = ("two-level", "four-bin")
DENSE_DTYPES = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
AGGREGATIONS = ("mean", "mean_kept")


class ConfigError(ValueError):
    """A configuration value outside its allowed range; the message names the field."""


@dataclass
class TaskConfig:
    """Model and data. The default corpus is the running Python's standard library sources."""

    model: str = "gpt-tiny"  # one of MODEL_PRESETS (tiny ~1M parameters for tests and demos)
    data: str | None = None  # a text file or a folder of text files; None: stdlib sources
    seq_len: int = 64  # tokens (bytes) per training sequence
    batch_size: int = 16  # sequences per inner step
    val_batches: int = 8  # held-out batches averaged for the validation loss
    corpus_bytes: int = 4_000_000  # cap on the corpus read, so start-up stays fast


@dataclass
class InnerConfig:
    """The inner AdamW loop each worker runs between two outer steps (DiLoCo's H steps)."""

    steps: int = 20  # H: inner steps per round
    lr: float = 3e-3  # peak AdamW learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine decay over all rounds' inner steps
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass
class CompressionConfig:
    """What a worker sends: SparseLoCo's sparse 2-bit frames, or dense DiLoCo frames."""

    method: str = "sparseloco"  # sparseloco | diloco (dense baseline)
    density: float = 64 / 4096  # fraction of each chunk kept by top-k (1-3 % per the paper)
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

    lr: float | None = None
    momentum: float | None = None
    # mean_kept (SparseLoCo's rule): each coordinate is the mean over the frames that kept
    # it, wherever that is exact (uncoded, ignore, FR; cyclic codes take the weighted sum);
    # mean: the weighted sum of the frames divided by all n partitions, always
    aggregation: str = "mean_kept"


@dataclass
class CodingConfig:
    """Gradient coding against stragglers (Tandon et al. 2017; Su and Li 2026)."""

    scheme: str = "none"  # one of SCHEMES
    stragglers: int = 0  # s: how many slow or dead workers a round tolerates
    seed: int = 0


@dataclass
class NetworkConfig:
    """Emulated WAN links: a default profile and optional per-worker overrides (by id)."""

    wan: str = "20mbit/50ms"
    per_worker: list[str] = field(default_factory=list)

    def profile_for(self, worker_id: int) -> LinkProfile:
        text = self.per_worker[worker_id] if worker_id < len(self.per_worker) else self.wan
        return LinkProfile.parse(text)


@dataclass
class StragglerConfig:
    """Straggler emulation on workers: a default profile and per-worker overrides (by id),
    e.g. ``none``, ``fixed:4``, ``exp:0.1:0.5``, ``markov:0.1:0.3:4``, ``trace:FILE``."""

    default: str = "none"
    per_worker: list[str] = field(default_factory=list)

    def profile_for(self, worker_id: int) -> str:
        return self.per_worker[worker_id] if worker_id < len(self.per_worker) else self.default


@dataclass
class CoordinatorConfig:
    listen: str = "127.0.0.1:50051"
    token: str = "geoloco"  # shared secret workers present at Join
    deadline_s: float = 300.0  # a round closes at this deadline whatever has arrived
    join_timeout_s: float = 300.0  # how long round 0 waits for all workers to join
    checkpoint_every: int = 5  # rounds between checkpoints (0: only the final one)
    # rounds between validation losses, always measured after the broadcast; 0: only the
    # last round; None: every round for models under 20M parameters, else at checkpoints
    val_every: int | None = None


@dataclass
class WorkerConfig:
    coordinator: str = "127.0.0.1:50051"
    connect_timeout_s: float = 60.0  # give up (exit non-zero) after retrying this long
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class RunConfig:
    workers: int = 4
    rounds: int = 20
    seed: int = 0
    run_dir: str = "runs/latest"
    task: TaskConfig = field(default_factory=TaskConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    coding: CodingConfig = field(default_factory=CodingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return _build(cls, data, "")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML or JSON file (optional), apply dotted overrides, validate, resolve defaults."""
    data: dict[str, Any] = _read_file(Path(path)) if path else {}
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    return validate(RunConfig.from_dict(data))


def validate(cfg: RunConfig) -> RunConfig:
    """Check every field once; fill the method-dependent outer defaults. Returns ``cfg``."""
    _check_range("workers", cfg.workers, 1, 1024)
    _check_range("rounds", cfg.rounds, 1, 10**7)
    _check_task(cfg.task)
    _check_inner(cfg.inner)
    _check_compression(cfg.compression)
    _resolve_outer(cfg.outer, cfg.compression.method)
    _check_coding(cfg.coding, cfg.workers)
    _check_links(cfg.network, cfg.workers)
    _check_stragglers(cfg.stragglers, cfg.workers)
    _check_coordinator(cfg.coordinator)
    _check_choice("worker.device", cfg.worker.device, DEVICES)
    _check_range("worker.connect_timeout_s", cfg.worker.connect_timeout_s, 0.1, 1e6)
    _check_address("worker.coordinator", cfg.worker.coordinator)
    return cfg


def _check_task(task: TaskConfig) -> None:
    _check_choice("task.model", task.model, MODEL_PRESETS)
    if task.data is not None and not Path(task.data).exists():
        raise ConfigError(f"task.data: {task.data!r} does not exist (a text file or a folder of them)")
    _check_range("task.seq_len", task.seq_len, 8, 8192)
    _check_range("task.batch_size", task.batch_size, 1, 4096)
    _check_range("task.val_batches", task.val_batches, 1, 10_000)
    _check_range("task.corpus_bytes", task.corpus_bytes, 10_000, 10**11)


def _check_inner(inner: InnerConfig) -> None:
    _check_range("inner.steps", inner.steps, 1, 100_000)
    _check_range("inner.lr", inner.lr, 1e-8, 1.0)
    _check_range("inner.warmup_steps", inner.warmup_steps, 0, 10**7)
    _check_range("inner.min_lr_ratio", inner.min_lr_ratio, 0.0, 1.0)
    _check_range("inner.weight_decay", inner.weight_decay, 0.0, 1.0)
    _check_range("inner.beta1", inner.beta1, 0.0, 0.9999)
    _check_range("inner.beta2", inner.beta2, 0.0, 0.99999)
    _check_range("inner.grad_clip", inner.grad_clip, 0.0, 1e6)


def _check_compression(comp: CompressionConfig) -> None:
    _check_choice("compression.method", comp.method, METHODS)
    _check_range("compression.density", comp.density, 1 / 4096, 1.0)
    _check_range("compression.ef_beta", comp.ef_beta, 0.0, 1.0)
    _check_range("compression.tile", comp.tile, 4, MAX_TILE)
    _check_choice("compression.index_coding", comp.index_coding, INDEX_CODINGS)
    _check_choice("compression.quantizer", comp.quantizer, QUANTIZERS)
    _check_choice("compression.dense_dtype", comp.dense_dtype, DENSE_DTYPES)


def _resolve_outer(outer: OuterConfig, method: str) -> None:
    if outer.lr is None:
        outer.lr = 1.0 if method == "sparseloco" else 0.7
    if outer.momentum is None:
        outer.momentum = 0.0 if method == "sparseloco" else 0.9
    _check_range("outer.lr", outer.lr, 1e-6, 10.0)
    _check_range("outer.momentum", outer.momentum, 0.0, 0.999)
    _check_choice("outer.aggregation", outer.aggregation, AGGREGATIONS)


def _check_coding(coding: CodingConfig, workers: int) -> None:
    _check_choice("coding.scheme", coding.scheme, SCHEMES)
    _check_range("coding.stragglers", coding.stragglers, 0, workers - 1)
    if coding.scheme == "none" and coding.stragglers:
        raise ConfigError("coding.stragglers must be 0 with coding.scheme 'none' (wait for all)")
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
    if co.val_every is not None:
        _check_range("coordinator.val_every", co.val_every, 0, 10**7)
    if not co.token:
        raise ConfigError("coordinator.token must not be empty")


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


def _coerce(name: str, ftype: str, value: Any) -> Any:
    """Turn strings from flags or env into the declared type; leave typed values alone."""
    if not isinstance(value, str):
        if ftype == "float" and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if ftype.startswith("list") and not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return value
    try:
        if ftype == "int":
            return int(value)
        if ftype == "int | None":
            return None if value.lower() == "none" else int(value)
        if ftype in ("float", "float | None"):
            return None if value.lower() == "none" else float(value)
        if ftype == "bool":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if ftype.startswith("list"):
            return [item.strip() for item in value.split(",") if item.strip()]
        if ftype == "str | None":
            return None if value.lower() == "none" else value
    except ValueError:
        raise ConfigError(f"{name}: {value!r} is not a valid {ftype}") from None
    return value


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
}
