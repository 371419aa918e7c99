"""``geoloco export RUN_DIR OUT``: a run's newest checkpoint as a model folder others load:
a transformers ``save_pretrained`` folder for ``hf:`` models, else a plain state dict
(``model.safetensors``) beside its config.json; the tokenizer goes along when the run had one.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from safetensors.torch import save_file

from geoloco.config import RunConfig
from geoloco.coordinator import checkpoint
from geoloco.run_dir import CONFIG_FILE
from geoloco.tasks.hf import PREFIX, require
from geoloco.tasks.tokenize import END_OF_TEXT

log = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "config.json"  # the model's, beside the weights of a checkpoint
TOKENIZER_FILE = "tokenizer.json"


class ExportError(ValueError):
    """The run directory has nothing to export, or the export could not be written."""


def export_run(run_dir: Path, out: Path) -> Path:
    """Export the newest readable checkpoint of ``run_dir`` into ``out``; returns ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    try:  # not validated: the paths it names need not exist on this machine
        cfg = RunConfig.from_dict(json.loads((run_dir / CONFIG_FILE).read_text()))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{run_dir} is not a run directory: cannot read {CONFIG_FILE} ({exc})") from None
    path = checkpoint.latest_path(run_dir)
    if path is None:
        raise ExportError(f"{run_dir} has no readable checkpoint in {run_dir / checkpoint.CHECKPOINT_DIR}")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.task.model.startswith(PREFIX) and path.is_dir():
        _export_transformers(path, out)
    else:
        _export_state_dict(path, out)
    log.info("exported %s (model %s) to %s", path, cfg.task.model, out)
    return out


def _export_transformers(path: Path, out: Path) -> None:
    """The checkpoint folder is already what from_pretrained reads (config.json beside
    model.safetensors): load it, and let transformers write its own folder."""
    transformers = require("transformers", "exporting an hf: model")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    model.save_pretrained(str(out))
    if (path / TOKENIZER_FILE).is_file():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / TOKENIZER_FILE))
        if END_OF_TEXT in tokenizer.get_vocab():
            tokenizer.eos_token = END_OF_TEXT
        tokenizer.save_pretrained(str(out))


def _export_state_dict(path: Path, out: Path) -> None:
    """model.safetensors with every tensor of the model under its state-dict name (a tied
    weight once), and the checkpoint's config.json and tokenizer.json."""
    ckpt = checkpoint.load(path)
    weights = {name: t.contiguous() for name, t in {**ckpt.params, **ckpt.fixed}.items()}
    save_file(weights, str(out / checkpoint.WEIGHTS_FILE), metadata={"format": "pt"})
    for name in (MODEL_CONFIG_FILE, TOKENIZER_FILE):
        if path.is_dir() and (path / name).is_file():
            shutil.copyfile(path / name, out / name)
