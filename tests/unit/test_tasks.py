"""Tasks: deterministic model init and batches, batches inside their partition, preset
sizes, a few AdamW steps lowering the loss, user corpora and corpus errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geoloco.config import ConfigError, RunConfig, TaskConfig
from geoloco.tasks import (
    PRESETS,
    build_model,
    build_task,
    count_parameters,
    load_corpus,
    stdlib_root,
)
from geoloco.tasks.corpus import pinned_bytes


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a shared 2-core machine a second
    spinning thread costs far more than it gives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def task():
    return build_task(TaskConfig(), 4, seed=0)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_same_seed_gives_identical_weights_and_leaves_global_rng_alone(task):
    rng_before = torch.get_rng_state()
    a, b = _state(task.make_model()), _state(task.make_model())
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _state(task.make_model(seed=1))
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_parameter_names_are_stable_and_head_is_tied(task):
    names = [n for n, _ in task.make_model().named_parameters()]
    n_layer = PRESETS["gpt-tiny"][0]
    per_block = [
        "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
        "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.fc.weight", "mlp.fc.bias",
        "mlp.proj.weight", "mlp.proj.bias",
    ]
    expected = ["wte.weight", "wpe.weight"]
    expected += [f"blocks.{i}.{n}" for i in range(n_layer) for n in per_block]
    expected += ["ln_f.weight", "ln_f.bias"]
    assert names == expected


def test_init_statistics_follow_gpt2(task):
    params = dict(task.make_model().named_parameters())
    assert params["wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(params["blocks.0.ln1.weight"] == 1) and torch.all(params["ln_f.bias"] == 0)
    assert torch.all(params["blocks.0.mlp.fc.bias"] == 0)
    assert params["blocks.0.mlp.proj.weight"].std().item() < 0.01  # 0.02 / sqrt(2 * n_layer)


def test_batches_are_a_function_of_partition_step_and_seed(task):
    again = build_task(TaskConfig(), 4, seed=0)
    x, y = task.batch(2, 7)
    assert x.shape == y.shape == (16, 64) and x.dtype == torch.int64
    assert torch.equal(x, again.batch(2, 7)[0]) and torch.equal(y, again.batch(2, 7)[1])
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    assert not torch.equal(x, task.batch(2, 8)[0])
    assert not torch.equal(x, task.batch(1, 7)[0])
    assert not torch.equal(x, build_task(TaskConfig(), 4, seed=1).batch(2, 7)[0])


def test_batches_are_windows_of_their_partition(task):
    for p, windows in enumerate(task.partition_windows):
        allowed = set((windows * task.window).tolist())
        for step in range(20):
            assert set(task.batch_offsets(p, step).tolist()) <= allowed
    x, _ = task.batch(3, 0)
    first = task.batch_offsets(3, 0)[0]
    assert torch.equal(x[0], task.data[first : first + 64].long())
    assert task.n_tokens == TaskConfig().corpus_bytes


def test_validation_set_has_val_windows_windows_in_stream_order(task):
    assert len(task.val_offsets) == TaskConfig().val_windows == 1024
    assert task.val_offsets.diff().min() >= task.window  # non-overlapping
    assert task.val_offsets.max() + task.window <= task.n_tokens


@pytest.mark.parametrize(
    "model, stated",
    [("gpt-nano", 0.12e6), ("gpt-tiny", 1e6), ("gpt-small", 10e6), ("gpt-medium", 30e6), ("gpt-100m", 100e6)],
)
def test_preset_sizes(model, stated):
    n = count_parameters(model, seq_len=64)
    assert 0.7 * stated <= n <= 1.3 * stated
    if model == "gpt-100m":
        assert n >= 100e6


@pytest.mark.parametrize("model, seq_len", [("gpt-tiny", 64), ("gpt-small", 256)])
def test_analytic_count_matches_the_built_model(model, seq_len):
    built = build_model(model, seq_len, seed=0)
    assert count_parameters(model, seq_len) == sum(p.numel() for p in built.parameters())


def test_few_adamw_steps_lower_the_validation_loss():
    task = build_task(TaskConfig(seq_len=32, batch_size=8, val_windows=128), 4, seed=0)  # fast
    model = task.make_model()
    before = task.val_loss(model)
    assert before == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(9):
        loss = task.loss(model, task.batch(step % 4, step))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert model.training  # val_loss restores the mode it found
    after = task.val_loss(model)
    assert after < before - 0.5  # from ln 256 towards the byte unigram entropy


def test_val_loss_restores_eval_mode_too():
    task = build_task(TaskConfig(seq_len=16, val_windows=8), 2)
    model = task.make_model().eval()
    task.val_loss(model)
    assert not model.training


def test_stdlib_corpus_is_this_pythons_sources_in_sorted_order():
    corpus = load_corpus("stdlib", 10_000)
    assert len(corpus) == 10_000
    assert corpus.startswith((stdlib_root() / "__future__.py").read_bytes()[:10_000])
    assert build_task(TaskConfig(data="stdlib", corpus_bytes=100_000, val_windows=8), 2).n_tokens == 100_000


def test_default_corpus_is_the_pinned_one():
    assert load_corpus(None, 50_000) == pinned_bytes()[:50_000]
    assert build_task(TaskConfig(corpus_bytes=50_000, val_windows=8), 2).n_tokens == 50_000


def test_build_from_run_config():
    cfg = RunConfig()
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    assert task.n_partitions == 4 and len(task.partition_sizes) == 4


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_data_folder_is_read_in_sorted_order_skipping_binary(tmp_path):
    _write(tmp_path / "b.txt", b"B" * 30_000)
    _write(tmp_path / "a" / "z.md", "\u00e9".encode() * 15_000)
    _write(tmp_path / "c.bin", b"\x00\x01\x02" * 1000)
    _write(tmp_path / "d.txt", b"\xff\xfe not utf-8")
    cfg = TaskConfig(data=str(tmp_path), corpus_bytes=1_000_000, val_windows=8)
    task = build_task(cfg, 3, seed=0)
    assert task.n_tokens == 60_000
    assert bytes(task.data[:30_000].tolist()) == "\u00e9".encode() * 15_000
    assert bytes(task.data[30_000:].tolist()) == b"B" * 30_000


def test_data_file_is_capped_by_corpus_bytes(tmp_path):
    _write(tmp_path / "one.txt", b"hello world\n" * 10_000)
    task = build_task(TaskConfig(data=str(tmp_path / "one.txt"), corpus_bytes=50_000, val_windows=8), 2)
    assert task.n_tokens == 50_000


def test_empty_corpus_is_an_error(tmp_path):
    _write(tmp_path / "only.bin", b"\x00" * 100)
    with pytest.raises(ConfigError, match="empty corpus"):
        build_task(TaskConfig(data=str(tmp_path)), 2)


def test_too_small_corpus_names_the_sizes(tmp_path):
    _write(tmp_path / "tiny.txt", b"x" * 8_500)
    with pytest.raises(ConfigError, match="corpus too small: 8500 bytes"):
        build_task(TaskConfig(data=str(tmp_path)), 4)


def test_bad_partition_or_step_names_the_range(task):
    with pytest.raises(ValueError, match="partition 4 is outside the allowed range 0..3"):
        task.batch(4, 0)
    with pytest.raises(ValueError, match="step -1"):
        task.batch(0, -1)
