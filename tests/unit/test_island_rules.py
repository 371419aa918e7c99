"""The island's pure parts (geoloco.worker.island): who is in an island, each rank's share
of a batch, what rank 0 sends, and the settings that make one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from geoloco.config import ConfigError, load_config
from geoloco.worker.island import Island, IslandError, cpu_state, own_rows, shard_blocks


def test_a_plain_worker_is_no_island(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Island.from_env() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert Island.from_env() is None


def test_torchruns_environment_names_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first GPU of a second node
    island = Island.from_env()
    assert (island.rank, island.size, island.local_rank, island.leader) == (2, 4, 0, False)
    assert island.describe() == "island of 4 ranks, ddp"
    assert Island.from_env("fsdp").sharded and not island.sharded
    with pytest.raises(IslandError, match="worker.parallel 'tp' is not available"):
        Island.from_env("tp")


def test_each_rank_takes_its_equal_share_of_the_batch_in_rank_order() -> None:
    inputs, targets = torch.arange(24).view(6, 4), torch.arange(24).view(6, 4) + 100
    shares = [Island(rank, 3, rank).shard((inputs, targets)) for rank in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shares]), inputs)
    assert torch.equal(torch.cat([s[1] for s in shares]), targets)
    assert all(len(s[0]) == 2 for s in shares)
    with pytest.raises(IslandError, match="make task.batch_size .* a multiple of 4"):
        Island(0, 4, 0).shard((inputs, targets))


def test_each_rank_owns_the_rows_torch_chunk_gives_it() -> None:
    whole = torch.arange(10.0).view(5, 2)
    rows = [own_rows(whole, r, 2) for r in range(2)]
    assert [tuple(r.shape) for r in rows] == [(3, 2), (2, 2)] and torch.equal(torch.cat(rows), whole)
    few = [own_rows(torch.ones(2, 3), r, 4) for r in range(4)]  # fewer rows than ranks: the last hold none
    assert [t.shape[0] for t in few] == [1, 1, 0, 0]
    assert own_rows(torch.tensor(3.0), 1, 2).item() == 3.0  # a scalar is everyone's


def test_a_model_is_sharded_by_the_blocks_of_its_outermost_list() -> None:
    """Which modules shard_model hands to fully_shard: checked on the selection itself,
    without a process group (the sharding runs in the island tests)."""
    inner = nn.ModuleList([nn.Linear(2, 2)])
    model = nn.Sequential(nn.Embedding(4, 2), nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), inner),
                                                              nn.ReLU()]))
    assert shard_blocks(model) == [model[1][0], model[1][1]]  # not the inner list, not a block without parameters
    assert shard_blocks(nn.Linear(2, 2)) == []


def test_what_rank_0_sends_holds_only_cpu_tensors() -> None:
    state = {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}
    moved = cpu_state(state)
    assert moved["param_groups"] == state["param_groups"]
    assert torch.equal(moved["state"][0]["exp_avg"], torch.ones(2))
    assert moved["state"][0]["exp_avg"].device.type == "cpu"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("worker.nproc_per_node", 0, "worker.nproc_per_node"),
    ("worker.parallel", "tp", "worker.parallel"),
])
def test_island_settings_are_checked(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={field: value})
