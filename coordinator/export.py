"""``geoloco export RUN_DIR OUT``: a run's newest checkpoint as a model folder others load:
a transformers ``save_pretrained`` folder for ``hf:`` models, else a plain state dict
(``model.safetensors``, every state-dict name, tied ones too, so a strict ``load_state_dict``
takes it) beside its config.json; the tokenizer goes along when the run had one. The files
are readable like the run's checkpoints (docs/security.md: only secrets are 0600).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from geoloco.config import RunConfig
from geoloco.coordinator import checkpoint
from geoloco.run_dir import CONFIG_FILE
from geoloco.tasks.hf import PREFIX, require
from geoloco.tasks.models import TIED_WEIGHTS
from geoloco.tasks.tokenize import END_OF_TEXT

log = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "config.json"  # the model's, beside the weights of a checkpoint
TOKENIZER_FILE = "tokenizer.json"


class ExportError(ValueError):
    """The run directory has nothing to export, or the export could not be written."""


class ExportExists(ExportError):
    """``out`` already holds something and ``overwrite`` was not given: nothing was written."""


def export_run(run_dir: Path, out: Path, overwrite: bool = False) -> Path:
    """Export the newest readable checkpoint of ``run_dir`` into ``out``, a new or empty
    folder; ``overwrite``: a file at ``out`` is replaced, and so are the files of the same
    names in a folder (others are kept). Returns ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    _check_out(out, overwrite)
    try:  # not validated: the paths it names need not exist on this machine
        cfg = RunConfig.from_dict(json.loads((run_dir / CONFIG_FILE).read_text()))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{run_dir} is not a run directory: cannot read {CONFIG_FILE} ({exc})") from None
    path = checkpoint.latest_path(run_dir)
    if path is None:
        raise ExportError(f"{run_dir} has no readable checkpoint in {run_dir / checkpoint.CHECKPOINT_DIR}")
    if overwrite and (out.is_file() or out.is_symlink()):
        out.unlink()
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
    for weights in out.glob("model*.safetensors"):  # written 0600 by safetensors, as checkpoints were
        weights.chmod(checkpoint.readable_mode())
    if (path / TOKENIZER_FILE).is_file():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / TOKENIZER_FILE))
        if END_OF_TEXT in tokenizer.get_vocab():
            tokenizer.eos_token = END_OF_TEXT
        tokenizer.save_pretrained(str(out))


def _export_state_dict(path: Path, out: Path) -> None:
    """model.safetensors with every tensor of the model under each of its state-dict names
    (a tied weight, stored once in the checkpoint, as a copy under the other name), and the
    checkpoint's config.json and tokenizer.json."""
    ckpt = checkpoint.load(path)
    weights = {name: t.contiguous() for name, t in {**ckpt.params, **ckpt.fixed}.items()}
    for alias, name in _tied_weights(path).items():
        if name in weights and alias not in weights:
            weights[alias] = weights[name].clone()  # safetensors stores no shared tensors
    checkpoint.save_weights(weights, out / checkpoint.WEIGHTS_FILE, {"format": "pt"})
    for name in (MODEL_CONFIG_FILE, TOKENIZER_FILE):
        if path.is_dir() and (path / name).is_file():
            shutil.copyfile(path / name, out / name)


def _tied_weights(path: Path) -> dict[str, str]:
    """The checkpoint's tied state-dict entries (alias -> stored name), from its config.json;
    none for a checkpoint written before they were recorded."""
    try:
        described = json.loads((path / MODEL_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return {}
    tied = described.get(TIED_WEIGHTS) if isinstance(described, dict) else None
    return tied if isinstance(tied, dict) else {}


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse (ExportExists) an ``out`` that is a file or a folder with files in it, unless
    ``overwrite``."""
    if overwrite or not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ExportExists(f"{out} is a file, not a folder; give a new OUT, or --overwrite to replace it")
    held = sorted(p.name for p in out.iterdir())
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ExportExists(f"{out} already holds files ({shown}); give a new or empty OUT, or "
                           "--overwrite to replace the export's files in it")
