"""``hf:PATH`` models: a Hugging Face ``transformers`` causal LM built from a local config
(from scratch, no weights needed) or loaded from a local checkpoint folder, never from the
hub; and the optional Hugging Face packages imported offline.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from geoloco.tasks.protocol import Batch, ModelSpec, TaskError

PREFIX = "hf:"
HF_EXTRA = "pip install 'geoloco[hf]'"
# Read by huggingface_hub, transformers and datasets when they are first imported: the
# packages then never reach for the hub. Set (unless the user set them) only on the code
# paths that import those packages, so that importing geoloco changes no environment.
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def require(package: str, why: str) -> ModuleType:
    """Import one of the optional Hugging Face packages with the hub switched off; a missing
    package is a TaskError that says how to install it."""
    for name in OFFLINE_ENV:
        os.environ.setdefault(name, "1")
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise TaskError(f"{why} needs the {package} package ({exc}); {HF_EXTRA}") from None
    if package == "transformers":
        module.utils.logging.disable_progress_bar()
    return module


class HFModel:
    """``hf:PATH``: PATH is a config.json file, or a folder holding config.json and
    optionally weights (then they are loaded) and a tokenizer.json."""

    kind = "hf"

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = Path(name.removeprefix(PREFIX))
        self.folder = self.path if self.path.is_dir() else self.path.parent

    @property
    def weights(self) -> Path | None:
        """The weights file in the folder, if PATH is a folder that has one."""
        if not self.path.is_dir():
            return None
        return next((self.folder / f for f in WEIGHT_FILES if (self.folder / f).is_file()), None)

    def config(self):  # -> transformers.PretrainedConfig
        transformers = require("transformers", f"task.model {self.name!r}")
        if self.path.is_dir() and not (self.path / "config.json").is_file():
            raise TaskError(f"task.model {self.name!r}: {self.path} has no config.json")
        try:
            return transformers.AutoConfig.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise TaskError(f"task.model {self.name!r}: cannot read the config: {exc}") from None

    def build(self, spec: ModelSpec) -> tuple[nn.Module, object]:
        """The causal LM, from the folder's weights when it has them, else initialised from
        the run's seed; its context must hold ``spec.seq_len`` tokens."""
        transformers = require("transformers", f"task.model {self.name!r}")
        config = self.config()
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and spec.seq_len > context:
            raise TaskError(f"task.seq_len {spec.seq_len} is longer than the model's context: "
                            f"max_position_embeddings is {context} in {self.name.removeprefix(PREFIX)}")
        auto = transformers.AutoModelForCausalLM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            try:
                if self.weights is not None:
                    model = auto.from_pretrained(str(self.folder), local_files_only=True)
                else:
                    model = auto.from_config(config)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise TaskError(f"task.model {self.name!r}: transformers cannot build a causal LM "
                                f"from it: {exc}") from None
        return model, causal_lm_loss

    def config_json(self, model: nn.Module, spec: ModelSpec) -> str:
        """The model's own config.json (what from_pretrained reads)."""
        return model.config.to_json_string()


def causal_lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Next-token cross-entropy over a transformers model's logits (no KV cache is built)."""
    x, y = batch
    device = next(model.parameters()).device
    logits = model(input_ids=x.to(device), use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             y.to(device).reshape(-1))
