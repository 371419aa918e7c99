"""Tasks: what a round needs from the user (``protocol``: a model factory, resumable
per-partition batches, a loss, an evaluation) and the language-model task that provides
it for GPT presets, any ``nn.Module`` factory and transformers models (README, "Bring your
own model").
"""

from geoloco.tasks.corpus import corpus_fingerprint, pinned_bytes, pinned_documents
from geoloco.tasks.data import load_corpus, load_documents, stdlib_root
from geoloco.tasks.gpt import GPT, PRESETS, VOCAB_SIZE, GPTConfig, build_model, count_parameters
from geoloco.tasks.lm import LMTask, PartitionBatches, build_task
from geoloco.tasks.protocol import Batch, BatchIterator, LossFn, ModelSpec, Task, TaskError

__all__ = [
    "GPT",
    "PRESETS",
    "VOCAB_SIZE",
    "Batch",
    "BatchIterator",
    "GPTConfig",
    "LMTask",
    "LossFn",
    "ModelSpec",
    "PartitionBatches",
    "Task",
    "TaskError",
    "build_model",
    "build_task",
    "corpus_fingerprint",
    "count_parameters",
    "load_corpus",
    "load_documents",
    "pinned_bytes",
    "pinned_documents",
    "stdlib_root",
]
