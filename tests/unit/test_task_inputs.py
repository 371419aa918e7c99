"""Bring your own model and data: JSONL and Parquet corpora through datasets, tokenizer.json
files and tokenizers trained on the corpus, module:function and hf: models built offline,
the resumable batch iterator, and a clear error for each bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geoloco.config import ConfigError, TaskConfig, load_config
from geoloco.tasks import PartitionBatches, TaskError, build_task, load_documents
from geoloco.tasks.tokenize import END_OF_TEXT, train_bpe

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "examples" / "tiny_llama"
SMALL = {"seq_len": 16, "batch_size": 4, "val_windows": 4, "corpus_bytes": 60_000}
LINE = "def add(a, b):\n    return a + b  # the sum of two numbers\n"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    """A JSONL file and a Parquet file of the same 400 records (about 50 kB of text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("records")
    texts = [f"# record {i}\n" + LINE * (1 + i % 3) for i in range(400)]
    with open(folder / "corpus.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    pq.write_table(pa.table({"body": texts, "id": list(range(400))}), folder / "corpus.parquet")
    return folder


def task_cfg(**fields: object) -> TaskConfig:
    return TaskConfig(**{**SMALL, **fields})


def test_jsonl_and_parquet_records_are_the_documents(records: Path) -> None:
    jsonl = load_documents(str(records / "corpus.jsonl"), "text", 10**6)
    parquet = load_documents(str(records / "corpus.parquet"), "body", 10**6)
    assert len(jsonl) == 400 and jsonl == parquet and jsonl[0].startswith("# record 0\n")
    capped = load_documents(str(records / "corpus.jsonl"), "text", 1000)
    assert sum(len(d.encode()) for d in capped) == 1000
    task = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer="bytes"), 2)
    assert bytes(task.data[:20].tolist()).decode() == jsonl[0][:20]


def test_a_folder_of_records_is_read_in_sorted_order(records: Path, tmp_path: Path) -> None:
    for name in ("b.jsonl", "a.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": name * 3}) + "\n")
    (tmp_path / "notes.txt").write_text("plain text beside records is not read")
    assert load_documents(str(tmp_path), "text", 10**6) == ("a.jsonl" * 3, "b.jsonl" * 3)


def test_a_trained_tokenizer_is_deterministic_and_cached(records: Path) -> None:
    docs = load_documents(str(records / "corpus.jsonl"), "text", 10**6)
    first = train_bpe(docs, 400)
    assert train_bpe(docs, 400) is first  # cached within the process
    train_bpe.cache_clear()
    again = train_bpe(docs, 400)
    assert again is not first and again.to_str() == first.to_str()
    assert first.get_vocab_size() <= 400 and first.token_to_id(END_OF_TEXT) is not None
    task = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer="train:400"), 2)
    assert task.vocab_size == first.get_vocab_size() and task.unit == "tokens"
    assert task.n_tokens < sum(len(d) for d in docs) / 2  # BPE merges what repeats
    ids = task.data.tolist()
    assert ids.count(first.token_to_id(END_OF_TEXT)) == 400  # one separator per document
    model = task.make_model()
    assert model.wte.num_embeddings == task.vocab_size  # presets size their embedding to it


def test_a_tokenizer_json_file_is_read(records: Path, tmp_path: Path) -> None:
    docs = load_documents(str(records / "corpus.jsonl"), "text", 10**6)
    path = tmp_path / "tokenizer.json"
    path.write_text(train_bpe(docs, 400).to_str())
    from_file = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer=str(path)), 2)
    from_folder = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer=str(tmp_path)), 2)
    trained = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer="train:400"), 2)
    assert from_file.fingerprint == from_folder.fingerprint == trained.fingerprint


def test_partitions_cover_the_training_windows_without_overlap(records: Path) -> None:
    task = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer="train:400"), 3)
    dealt = torch.cat([*task.partition_windows, task.val_offsets // task.window]).sort().values
    assert torch.equal(dealt, torch.arange(task.n_windows))  # every window once
    again = build_task(task_cfg(data=str(records / "corpus.jsonl"), tokenizer="train:400"), 3, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again.partition_windows, task.partition_windows, strict=True))
    assert torch.equal(again.batch(1, 5)[0], task.batch(1, 5)[0])


def test_the_batch_iterator_resumes_from_its_saved_position() -> None:
    task = build_task(task_cfg(), 2, seed=3)
    batches = task.batches(1)
    assert isinstance(batches, PartitionBatches) and batches.step == 0
    for _ in range(5):
        next(batches)
    saved = batches.state_dict()
    assert saved == {"partition": 1, "step": 5, "data": task.split_fingerprint}
    resumed = build_task(task_cfg(), 2, seed=3).batches(1)
    resumed.load_state_dict(saved)
    for a, b in zip([next(batches) for _ in range(3)], [next(resumed) for _ in range(3)], strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(next(task.batches(1, step=8))[0], next(batches)[0])
    with pytest.raises(ValueError, match="partition 0 loaded into partition 1"):
        resumed.load_state_dict({**saved, "partition": 0})
    with pytest.raises(ValueError, match="saved for data"):
        resumed.load_state_dict({**saved, "data": "0" * 16})
    with pytest.raises(ValueError, match="step -1"):
        resumed.load_state_dict({**saved, "step": -1})


FACTORY = '''
import torch
from torch import nn

class Bag(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)
    def forward(self, x):
        return self.head(self.embed(x))

def make(spec):
    return Bag(spec.vocab_size)

def with_loss(spec):
    return Bag(spec.vocab_size), lambda model, batch: model(batch[0]).float().square().mean()

def small(spec):
    return Bag(spec.vocab_size - 1)

def not_a_model():
    return "a string"
'''


def test_module_function_factories(tmp_path: Path) -> None:
    path = tmp_path / "mymodels.py"
    path.write_text(FACTORY)
    task = build_task(task_cfg(model=f"{path}:make"), 2)
    model = task.make_model()
    assert type(model).__name__ == "Bag" and model.embed.num_embeddings == 256
    assert torch.equal(model.head.weight, task.make_model().head.weight)  # seeded from the run
    assert task.loss(model, task.batch(0, 0)).item() == pytest.approx(5.55, abs=0.3)  # ln 256
    custom = build_task(task_cfg(model=f"{path}:with_loss"), 2)
    model = custom.make_model()
    x, _ = custom.batch(0, 0)
    assert custom.loss(model, (x, x)).item() == pytest.approx(model(x).square().mean().item())
    sys.path.insert(0, str(tmp_path))
    try:
        dotted = build_task(task_cfg(model="mymodels:make"), 2).make_model()
    finally:
        sys.path.remove(str(tmp_path))
    assert type(dotted).__name__ == "Bag"
    with pytest.raises(TaskError, match="returned str; expected an nn.Module"):
        build_task(task_cfg(model=f"{path}:not_a_model"), 2).make_model()
    with pytest.raises(TaskError, match="has no function 'missing'"):
        build_task(task_cfg(model=f"{path}:missing"), 2).make_model()
    with pytest.raises(TaskError, match="cannot import 'no_such_module_here'"):
        build_task(task_cfg(model="no_such_module_here:make"), 2).make_model()


def test_a_vocabulary_larger_than_the_embedding_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "small.py"
    path.write_text(FACTORY)
    with pytest.raises(TaskError, match=r"\(bytes\) has 256 tokens, more than the 255 rows"):
        build_task(task_cfg(model=f"{path}:small"), 2).make_model()


def test_hf_model_from_a_config_needs_no_weights_and_no_hub(tmp_path: Path) -> None:
    task = build_task(task_cfg(model=f"hf:{TINY_LLAMA}", tokenizer="bytes"), 2)
    model = task.make_model()
    assert type(model).__name__ == "LlamaForCausalLM" and os.environ["HF_HUB_OFFLINE"] == "1"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    again = task.make_model()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    loss = task.loss(model, task.batch(0, 0)).item()
    assert loss == pytest.approx(torch.log(torch.tensor(1024.0)).item(), abs=0.5)
    model.save_pretrained(tmp_path / "ckpt")  # a folder with weights: they are loaded
    (tmp_path / "ckpt" / "tokenizer.json").write_text(train_bpe(("hello world " * 50,), 300).to_str())
    loaded_task = build_task(task_cfg(model=f"hf:{tmp_path / 'ckpt'}", data=str(ROOT / "docs")), 2)
    assert loaded_task.tokenizer.name.endswith("tokenizer.json")  # auto: the folder's tokenizer
    loaded = loaded_task.make_model(seed=99)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters(), strict=True))


def test_hf_sequence_longer_than_the_context_is_an_error(tmp_path: Path) -> None:
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8}))
    with pytest.raises(TaskError, match="task.seq_len 16 is longer than the model's context: "
                                        "max_position_embeddings is 8"):
        build_task(task_cfg(model=f"hf:{tmp_path}", tokenizer="bytes"), 2).make_model()
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TaskError, match="cannot read the config"):
        build_task(task_cfg(model=f"hf:{tmp_path}", tokenizer="bytes"), 2).make_model()


def test_bad_data_names_the_file_and_the_problem(records: Path, tmp_path: Path) -> None:
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(TaskError, match=r"broken.jsonl is not a readable json file: line 2 is not JSON"):
        build_task(task_cfg(data=str(bad)), 2)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(TaskError, match="junk.parquet is not a readable parquet file"):
        build_task(task_cfg(data=str(junk)), 2)
    with pytest.raises(TaskError, match=r"corpus.jsonl has no column 'body' \(its columns: id, text\)"):
        build_task(task_cfg(data=str(records / "corpus.jsonl"), text_field="body"), 2)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(json.dumps({"text": 12}) + "\n")
    with pytest.raises(TaskError, match="numbers.jsonl row 0: 'text' is int, expected text"):
        build_task(task_cfg(data=str(numbers)), 2)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "short " * 5}) + "\n")
    (tmp_path / "tok.json").write_text(train_bpe(("short " * 50,), 300).to_str())
    with pytest.raises(TaskError, match=r"corpus too small: \d+ tokens from task.data .*short.jsonl"):
        build_task(task_cfg(data=str(short), tokenizer=str(tmp_path / "tok.json")), 2)
    (tmp_path / "bad-tokenizer.json").write_text("[]")
    with pytest.raises(TaskError, match="bad-tokenizer.json is not a tokenizers JSON file"):
        build_task(task_cfg(tokenizer=str(tmp_path / "bad-tokenizer.json")), 2)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"task.model": "gpt-huge"}, "task.model: 'gpt-huge' is not one of"),
    ({"task.model": "hf:/no/such/folder"}, "task.model: '/no/such/folder' does not exist"),
    ({"task.model": "models.py:"}, "is not module:function"),
    ({"task.model": "models.py:1abc"}, "is not module:function"),
    ({"task.tokenizer": "train:50"}, "train:VOCAB wants a vocabulary size in the allowed range 300.."),
    ({"task.tokenizer": "/no/tokenizer.json"}, "task.tokenizer: '/no/tokenizer.json' does not exist"),
    ({"task.data": "/no/corpus.jsonl"}, "task.data: '/no/corpus.jsonl' does not exist"),
    ({"task.text_field": ""}, "task.text_field: '' is not a column name"),
    ({"worker.precision": "fp16"}, "worker.precision: 'fp16' is not one of auto, fp32, bf16"),
])
def test_config_checks_the_new_fields(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_every_example_config_is_valid() -> None:
    for path in sorted((ROOT / "examples").glob("*/run.toml")):
        cfg = load_config(path)
        assert cfg.task.model != "gpt-tiny", path


def test_importing_geoloco_sets_no_environment_variable() -> None:
    """Not even the API's names (geoloco.run_local, .Coordinator, .Worker) set any: only
    building a transformers model or reading datasets does (HF_HUB_OFFLINE)."""
    script = ("import os, json; before = dict(os.environ); import geoloco; "
              "geoloco.run_local, geoloco.Coordinator, geoloco.Worker, geoloco.load_config; "
              "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
