"""The data split (geoloco.tasks.lm): iid and contiguous partitions disjoint from each other
and from the fixed-seed validation set spread over the corpus, deterministic batches (the
same Δ on every replica of a partition), the true mean over the validation windows,
positions resumed under their split and refused under another, and the pinned
corpus (geoloco.tasks.corpus): its bytes, its SHA-256 and the error a corrupt file gives."""

from __future__ import annotations

import hashlib
import json
import lzma

import pytest
import torch

from geoloco.config import ConfigError, InnerConfig, TaskConfig, load_config
from geoloco.protos import geoloco_pb2 as pb
from geoloco.tasks import TaskError, build_task, corpus
from geoloco.tasks.lm import validation_windows
from geoloco.worker import local_state
from geoloco.worker.loop import Training
from geoloco.worker.trainer import InnerTrainer

CPU = torch.device("cpu")
CFG = {"seq_len": 16, "batch_size": 4, "val_windows": 64, "corpus_bytes": 200_000}
SPLITS = ("iid", "contiguous")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(partitioning: str = "iid", n: int = 4, seed: int = 0, **fields):
    return build_task(TaskConfig(**{**CFG, "partitioning": partitioning, **fields}), n, seed=seed)


def val_ids(task) -> torch.Tensor:
    return task.val_offsets // task.window


@pytest.mark.parametrize("partitioning", SPLITS)
def test_partitions_and_validation_set_are_disjoint_and_cover_the_windows(partitioning):
    task = make(partitioning)
    dealt = torch.cat([*task.partition_windows, val_ids(task)])
    assert len(dealt.unique()) == len(dealt) == task.n_windows == 200_000 // 17
    assert max(task.partition_sizes) - min(task.partition_sizes) <= 1
    for p in range(task.n_partitions):
        allowed = set((task.partition_windows[p] * task.window).tolist())
        offsets = torch.cat([task.batch_offsets(p, step) for step in range(50)])
        assert set(offsets.tolist()) <= allowed  # no batch reaches another partition or val


def test_iid_spreads_every_partition_over_the_corpus():
    task = make("iid")
    tenth = task.n_windows / 10
    for windows in task.partition_windows:
        counts = torch.bincount((windows / tenth).long().clamp(max=9), minlength=10)
        expected = len(windows) / 10
        assert counts.min() > 0.7 * expected and counts.max() < 1.3 * expected


def test_contiguous_keeps_stream_order_one_region_each():
    task = make("contiguous")
    windows = task.partition_windows
    assert all(bool((w.diff() > 0).all()) for w in windows)  # in stream order
    assert all(a.max() < b.min() for a, b in zip(windows, windows[1:], strict=False))
    # a region's windows are every training window between its first and last
    held_out = set(val_ids(task).tolist())
    for w in windows:
        span = set(range(int(w.min()), int(w.max()) + 1)) - held_out
        assert span == set(w.tolist())


def test_validation_windows_are_one_per_stratum_and_fixed():
    ids = validation_windows(10_000, 100)
    assert torch.equal(ids // 100, torch.arange(100))  # one in each hundredth of the stream
    assert torch.equal(ids, validation_windows(10_000, 100))
    assert len(set((ids % 100).tolist())) > 50  # at random places inside their strata


@pytest.mark.parametrize("partitioning", SPLITS)
def test_the_validation_set_is_the_same_for_every_seed_split_and_worker_count(partitioning):
    base = make("iid")
    for other in (make(partitioning, seed=7), make(partitioning, n=3)):
        assert torch.equal(other.val_offsets, base.val_offsets)


def test_iid_deal_follows_the_run_seed_contiguous_does_not():
    a, again, b = make("iid", seed=0), make("iid", seed=0), make("iid", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.partition_windows, again.partition_windows, strict=True))
    assert not torch.equal(a.partition_windows[0], b.partition_windows[0])
    c0, c1 = make("contiguous", seed=0), make("contiguous", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(c0.partition_windows, c1.partition_windows, strict=True))


@pytest.mark.parametrize("partitioning", SPLITS)
def test_batches_are_a_pure_function_of_seed_partition_and_step(partitioning):
    a, b = make(partitioning), make(partitioning)
    for p, step in ((0, 0), (2, 17), (3, 1000)):
        assert torch.equal(a.batch(p, step)[0], b.batch(p, step)[0])
        assert torch.equal(a.batch(p, step)[1], b.batch(p, step)[1])
    assert not torch.equal(a.batch(1, 3)[0], a.batch(1, 4)[0])
    assert not torch.equal(a.batch(1, 3)[0], make(partitioning, seed=5).batch(1, 3)[0])


def test_val_loss_is_the_mean_over_windows_with_a_partial_last_batch():
    task = make(val_windows=10, batch_size=4)  # batches of 4, 4 and 2 windows
    model = task.make_model()
    with torch.no_grad():
        per_window = [task.loss(model, task._windows(task.val_offsets[i : i + 1])).item()
                      for i in range(10)]
    assert task.val_loss(model) == pytest.approx(sum(per_window) / 10, rel=1e-5)


@pytest.mark.parametrize("partitioning", SPLITS)
def test_replicas_of_a_partition_compute_the_same_pseudo_gradient(partitioning):
    """Gradient coding's decode needs every replica of a partition in a round to train on
    the same batches: two workers' tasks and trainers, built apart, give the same Δ."""
    inner = InnerConfig(steps=2, warmup_steps=1)
    a, b = (InnerTrainer(make(partitioning), inner, rounds=4, device=CPU) for _ in range(2))
    theta = [p.detach().clone() for p in a.params]
    (da, _), (db, _) = a.train_partition(theta, 2, 3), b.train_partition(theta, 2, 3)
    assert all(torch.equal(x, y) for x, y in zip(da, db, strict=True))


@pytest.mark.parametrize("partitioning", SPLITS)
def test_a_trainers_data_positions_resume_under_its_split_only(partitioning):
    inner = InnerConfig(steps=2, warmup_steps=1)
    trainer = InnerTrainer(make(partitioning), inner, rounds=4, device=CPU)
    trainer.train_partition([p.detach().clone() for p in trainer.params], 1, 1)
    saved = trainer.data_state()
    resumed = InnerTrainer(make(partitioning), inner, rounds=4, device=CPU)
    resumed.load_data_state(saved)
    assert resumed.positions[1].step == 4
    other = "contiguous" if partitioning == "iid" else "iid"
    with pytest.raises(ValueError, match="saved for data"):
        InnerTrainer(make(other), inner, rounds=4, device=CPU).load_data_state(saved)


def test_split_fingerprint_changes_with_everything_that_moves_the_windows():
    base = make("iid")
    others = [make("contiguous"), make(val_windows=65), make(seq_len=17), make(n=3), make(seed=1)]
    prints = {base.split_fingerprint} | {t.split_fingerprint for t in others}
    assert len(prints) == 1 + len(others)
    assert {t.fingerprint for t in others if t.cfg.seq_len == 16} == {base.fingerprint}


def test_a_position_saved_under_one_partitioning_is_refused_under_another():
    iid, contiguous = make("iid"), make("contiguous")
    batches = iid.batches(1)
    next(batches)
    saved = batches.state_dict()
    assert saved == {"partition": 1, "step": 1, "data": iid.split_fingerprint}
    with pytest.raises(ValueError, match="task.partitioning"):
        contiguous.batches(1).load_state_dict(saved)
    same = make("iid").batches(1)
    same.load_state_dict(saved)
    assert torch.equal(next(same)[0], next(batches)[0])


def test_a_corpus_too_small_for_the_split_names_the_fields():
    with pytest.raises(TaskError, match="task.val_windows 1024 plus one for each of 4 partitions"):
        build_task(TaskConfig(seq_len=64, corpus_bytes=60_000), 4)  # 923 windows
    assert make(val_windows=200_000 // 17 - 4).partition_sizes == [1, 1, 1, 1]


def test_partitioning_and_val_windows_are_validated():
    with pytest.raises(ConfigError, match="task.partitioning: 'shuffled' is not one of iid, contiguous"):
        load_config(overrides={"task.partitioning": "shuffled"})
    with pytest.raises(ConfigError, match=r"task.val_windows: 0 is outside the allowed range 1\.\."):
        load_config(overrides={"task.val_windows": 0})
    with pytest.raises(ConfigError, match="task.val_batches was renamed: give task.val_windows"):
        load_config(overrides={"task.val_batches": 4})
    assert load_config().task.partitioning == "iid" and load_config().task.val_windows == 1024
    assert load_config(overrides={"task.data": "stdlib"}).task.data == "stdlib"  # a keyword, no path


def test_the_pinned_corpus_is_the_pinned_bytes():
    raw = lzma.decompress(corpus.CORPUS_FILE.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == corpus.CORPUS_SHA256
    assert corpus.corpus_fingerprint() == corpus.CORPUS_SHA256[:16]
    data = corpus.pinned_bytes()
    assert len(data) >= corpus.TARGET_BYTES and corpus.CORPUS_FILE.stat().st_size < 2_000_000
    assert data == "".join(corpus.pinned_documents()).encode()
    paths = corpus.pinned_paths()
    assert len(paths) == len(corpus.pinned_documents()) > 100
    assert paths != tuple(sorted(paths))  # picked and ordered by a hash, not alphabetically
    assert len({p.split("/")[0] for p in paths if "/" in p}) > 10  # from all over the library
    assert "Python Software Foundation" in corpus.LICENSE_FILE.read_text()


def test_a_corrupt_pinned_corpus_is_a_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "stdlib311.jsonl.xz"
    good = lzma.decompress(corpus.CORPUS_FILE.read_bytes())
    cases = {
        "SHA-256": lzma.compress(good.replace(b"def ", b"DEF ", 1), preset=0),
        "not an xz stream": corpus.CORPUS_FILE.read_bytes()[:1000],
    }
    monkeypatch.setattr(corpus, "CORPUS_FILE", bad)
    for problem, content in cases.items():
        bad.write_bytes(content)
        corpus.pinned_documents.cache_clear()
        with pytest.raises(TaskError, match=f"pinned corpus .* is corrupt \\({problem}"):
            corpus.pinned_documents()
    bad.unlink()
    corpus.pinned_documents.cache_clear()
    with pytest.raises(TaskError, match="the file is missing"):
        corpus.pinned_documents()
    monkeypatch.undo()
    corpus.pinned_documents.cache_clear()
    assert corpus.pinned_documents()  # the shipped file reads again


def _training(partitioning: str):
    """A worker's real Training, built from the Join reply a coordinator would send."""
    cfg = load_config(overrides={"workers": 2, "task.partitioning": partitioning,
                                 **{f"task.{k}": v for k, v in CFG.items()}, "inner.steps": 2})
    reply = pb.JoinReply(worker_id=0, session="s", run_config_json=json.dumps(cfg.to_dict()))
    return Training.from_join(reply, CPU)


def test_a_worker_state_saved_under_one_split_is_refused_under_another(tmp_path):
    iid = _training("iid")
    iid.trainer.train_partition([p.detach().clone() for p in iid.trainer.params], 1, 0)
    path = tmp_path / "worker-0.state.pt"
    local_state.save(path, iid, 1)
    assert local_state.load(path, _training("iid")) == (1, True)
    with pytest.raises(local_state.LocalStateError, match="another split of the data"):
        local_state.load(path, _training("contiguous"))
