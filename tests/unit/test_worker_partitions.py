"""The worker's side of pipelined gradient coding (geoloco.worker.partitions): which
partitions a round trains and the coded message combined from the latest Δ of each."""

from __future__ import annotations

import pytest
import torch

from geoloco.protos import geoloco_pb2 as pb
from geoloco.worker.partitions import LatestDeltas


def delta(value: float) -> list[torch.Tensor]:
    return [torch.full((2, 3), value), torch.full((4,), value)]


def test_a_restarted_worker_also_trains_the_partitions_it_has_no_delta_for() -> None:
    deltas = LatestDeltas()
    task = pb.WorkerTask(round=5, train_partitions=[2], send_partitions=[1, 2], send_coefficients=[1.0, 1.0])
    assert deltas.to_train(task) == [2, 1]
    deltas.keep(1, delta(1.0))
    assert deltas.to_train(task) == [2]


def test_message_combines_the_latest_deltas_with_the_send_coefficients() -> None:
    deltas = LatestDeltas()
    deltas.keep(0, delta(1.0))
    deltas.keep(1, delta(10.0))
    deltas.keep(0, delta(2.0))  # the newer Δ of partition 0 replaces the older one
    task = pb.WorkerTask(round=1, train_partitions=[0], send_partitions=[0, 1], send_coefficients=[0.5, -2.0])
    message = deltas.message(task)
    assert all(torch.equal(m, torch.full_like(m, 0.5 * 2.0 - 2.0 * 10.0)) for m in message)


def test_without_gradient_coding_the_message_is_the_trained_delta_itself() -> None:
    deltas = LatestDeltas()
    deltas.keep(3, delta(4.0))
    assert deltas.message(pb.WorkerTask(round=0, train_partitions=[3])) is deltas.latest[3]


def test_sending_a_partition_never_trained_is_an_error() -> None:
    task = pb.WorkerTask(round=7, train_partitions=[0], send_partitions=[0, 1], send_coefficients=[1.0, 1.0])
    deltas = LatestDeltas()
    deltas.keep(0, delta(1.0))
    with pytest.raises(RuntimeError, match=r"round 7: asked to send partitions \[1\]"):
        deltas.message(task)
