"""What a worker lets the coordinator's run config make it do (docs/security.md, "What the
coordinator can make a worker do"): run a ``module:function`` or ``.py`` model, and read the
data, tokenizer, ``hf:`` model and straggler-trace paths it names, only where the worker's
own config (``worker.allow_config_code``, ``worker.allowed_paths``) permits."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from geoloco.config import RunConfig
from geoloco.tasks.hf import PREFIX as HF_PREFIX

TOKENIZER_WORDS = ("auto", "bytes")
TRACE_PREFIX = "trace:"


class ConfigRefused(ValueError):
    """The coordinator's run config asks for what this worker does not allow."""


@dataclass(frozen=True)
class Admission:
    """``allow_code``: run code and read any path the run config names; else only the
    built-in models, and paths inside ``allowed_paths``."""

    allow_code: bool = True
    allowed_paths: Sequence[str] = field(default_factory=tuple)

    def check(self, cfg: RunConfig, straggler_profile: str = "") -> None:
        """ConfigRefused naming the field if ``cfg`` (not yet validated: validation reads
        files) or this worker's straggler profile asks for more than is allowed."""
        if self.allow_code:
            return
        model = cfg.task.model
        if not model.startswith(HF_PREFIX) and ":" in model:
            raise ConfigRefused(f"the coordinator's task.model {model!r} is code to run here; this worker "
                                "runs only built-in models unless worker.allow_config_code is set locally")
        for name, path in self._paths(cfg, straggler_profile):
            if not self._allowed(path):
                raise ConfigRefused(f"the coordinator's {name} {path!r} is outside this worker's "
                                    "worker.allowed_paths; allow it locally to read it")

    @staticmethod
    def _paths(cfg: RunConfig, straggler_profile: str) -> Iterable[tuple[str, str]]:
        task = cfg.task
        if task.model.startswith(HF_PREFIX):
            yield "task.model", task.model[len(HF_PREFIX):]
        if task.data is not None:
            yield "task.data", task.data
        if task.tokenizer not in TOKENIZER_WORDS and not task.tokenizer.startswith("train:"):
            yield "task.tokenizer", task.tokenizer
        profiles = [("stragglers.default", cfg.stragglers.default), ("the straggler profile", straggler_profile)]
        profiles += [(f"stragglers.per_worker[{i}]", p) for i, p in enumerate(cfg.stragglers.per_worker)]
        for name, profile in profiles:
            if profile.startswith(TRACE_PREFIX):
                yield name, profile[len(TRACE_PREFIX):]

    def _allowed(self, path: str) -> bool:
        real = os.path.realpath(path)
        for root in self.allowed_paths:
            top = os.path.realpath(root)
            if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
                return True
        return False
