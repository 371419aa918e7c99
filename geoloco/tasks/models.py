"""What ``task.model`` names: a built-in GPT preset, a ``module:function`` (or
``path/to/file.py:function``) factory of any ``nn.Module``, or an ``hf:PATH`` transformers
model; each builds the model for a ModelSpec and says which loss trains it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoloco.tasks.gpt import build_model
from geoloco.tasks.hf import PREFIX, HFModel
from geoloco.tasks.protocol import Batch, LossFn, ModelSpec, TaskError

# the key of a model's config.json that lists its tied state-dict entries (alias -> original)
TIED_WEIGHTS = "tied_weights"


class ModelSource(Protocol):
    """Builds the model ``task.model`` names; ``config_json`` is saved beside its weights."""

    name: str
    kind: str  # "preset" | "factory" | "hf"

    def build(self, spec: ModelSpec) -> tuple[nn.Module, LossFn | None]: ...

    def config_json(self, model: nn.Module, spec: ModelSpec) -> str: ...


def model_source(name: str) -> ModelSource:
    """The source of ``task.model`` (its syntax was checked by geoloco.config)."""
    if name.startswith(PREFIX):
        return HFModel(name)
    if ":" in name:
        return FactoryModel(name)
    return PresetModel(name)


def next_token_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy of ``model(inputs)``: logits (batch, time, vocab), or an
    output with a ``logits`` attribute; the batch moves to the model's device."""
    x, y = batch
    device = next(model.parameters()).device
    out = model(x.to(device))
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1))


def describe(name: str, spec: ModelSpec, model: nn.Module, **extra: object) -> str:
    """The config.json of a model that has no config format of its own; ``tied_weights``
    names each state-dict entry that is another's tensor (a tied head), which the
    checkpoint stores once and ``geoloco export`` writes under both names."""
    return json.dumps({"geoloco_model": name, "vocab_size": spec.vocab_size, "seq_len": spec.seq_len,
                       TIED_WEIGHTS: tied_weights(model), **extra}, indent=2, sort_keys=True) + "\n"


def tied_weights(model: nn.Module) -> dict[str, str]:
    """State-dict name -> the earlier name of the same tensor, for each tied entry."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    tied = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in first:
            tied[name] = first[key]
        else:
            first.setdefault(key, name)
    return tied


class PresetModel:
    """One of the built-in GPT presets (geoloco.tasks.gpt)."""

    kind = "preset"

    def __init__(self, name: str) -> None:
        self.name = name

    def build(self, spec: ModelSpec) -> tuple[nn.Module, LossFn | None]:
        return build_model(self.name, spec.seq_len, spec.seed, spec.vocab_size), None

    def config_json(self, model: nn.Module, spec: ModelSpec) -> str:
        cfg = model.cfg
        return describe(self.name, spec, model, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model)


class FactoryModel:
    """``module:function`` or ``file.py:function``: ``function(spec)`` (or ``function()``)
    returns an ``nn.Module``, or ``(module, loss)`` where ``loss(model, batch)`` is a scalar.
    It is called with torch's RNG seeded from the run's seed, under a forked RNG."""

    kind = "factory"

    def __init__(self, name: str) -> None:
        self.name = name
        self.module_name, _, self.function_name = name.rpartition(":")

    def factory(self) -> Callable[..., object]:
        module = _import_module(self.module_name, self.name)
        function = getattr(module, self.function_name, None)
        if not callable(function):
            raise TaskError(f"task.model {self.name!r}: {self.module_name} has no function "
                            f"{self.function_name!r}")
        return function

    def build(self, spec: ModelSpec) -> tuple[nn.Module, LossFn | None]:
        function = self.factory()
        takes_spec = bool(inspect.signature(function).parameters)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            made = function(spec) if takes_spec else function()
        model, loss = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(model, nn.Module) or (loss is not None and not callable(loss)):
            raise TaskError(f"task.model {self.name!r} returned {type(made).__name__}; expected an "
                            "nn.Module or a tuple (nn.Module, loss(model, batch))")
        return model, loss

    def config_json(self, model: nn.Module, spec: ModelSpec) -> str:
        return describe(self.name, spec, model,
                        module_class=f"{type(model).__module__}.{type(model).__qualname__}")


def _import_module(module_name: str, name: str):
    """A module by dotted name, or a Python file by path (loaded once per process)."""
    if not module_name.endswith(".py"):
        try:
            return importlib.import_module(module_name)
        except ImportError as exc:
            raise TaskError(f"task.model {name!r}: cannot import {module_name!r} ({exc}); the module "
                            "must be importable on every machine (PYTHONPATH), or give a file path "
                            "such as models/mine.py:make_model") from None
    path = Path(module_name).resolve()
    if not path.is_file():
        raise TaskError(f"task.model {name!r}: file {module_name!r} does not exist")
    key = "geoloco_user_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules[key]
            raise
    return sys.modules[key]
