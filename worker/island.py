"""A worker as an island of ranks: one worker id, one slot, one gRPC session, and N
processes that train its inner phase together over torch.distributed (Gloo on CPUs, NCCL on
GPUs), inside the island only (docs/deploy.md, "A region's GPUs as one worker").

Rank 0 is the worker the coordinator sees: it joins, fetches the state, pushes, follows the
rounds (and under ``ddp`` holds θ, the error feedback and the encoder). The other ranks never
open a connection to the coordinator; they follow rank 0's commands
(geoloco.worker.app.follow): build the task from the run config rank 0 received, train a
partition, take the inner AdamW state rank 0 restored, exit. Every rank takes its share of each batch
(``task.batch_size`` is the island's batch) and the gradients are averaged before every
AdamW step, so an island's pseudo-gradient is the one a single process would compute from
the same tokens, within float rounding:
- ``worker.parallel = "ddp"``: every rank keeps a whole model replica and its own copy of
  the AdamW state, identical on every rank;
- ``"fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``, each block of the model's
  outermost ``nn.ModuleList`` and the root) shards the parameters, their gradients and the
  AdamW state over the ranks, dim 0 in ``torch.chunk``'s pieces, and the outer state too:
  each rank holds θ, the pseudo-gradients, the running copy and (SparseLoCo) the error
  feedback for its own pieces of the layout, applies each round result to them and
  compresses them (geoloco.worker.island_state); what crosses the island is one tensor at
  a time. Each rank saves and restores its own shards (``optimizer_shard``;
  geoloco.worker.local_state). docs/deploy.md, "A region's GPUs as one worker".

Two ways in:
- ``geoloco worker --nproc-per-node N`` runs ``launch``: it starts the N ranks on this host,
  meeting in a FileStore in a private temporary folder (no listening store) with Gloo bound to
  loopback, and takes the whole island down when one rank dies, naming it;
- ``torchrun --nproc-per-node N -m geoloco.worker ...`` (several nodes, say): torchrun's
  environment (env:// rendezvous) and its agent do the same.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from geoloco.config import PARALLEL_MODES
from geoloco.stopping import EXIT_INTERRUPTED
from geoloco.tasks import Batch

log = logging.getLogger(__name__)

STORE_ENV = "GEOLOCO_ISLAND_STORE"  # launch's FileStore; unset under torchrun (env://)
LAUNCHER_PID_ENV = "GEOLOCO_ISLAND_PID"  # the launch process: what an operator signals
# How long a rank waits in one collective: rank 0 may wait on the coordinator for a long time
# between two commands (a slot wait, a slow round). A dead rank is noticed sooner: its
# connections close, and the launcher (or torchrun's agent) ends the island.
COLLECTIVE_TIMEOUT = timedelta(days=7)
STOP_GRACE_S = 30.0  # after a rank died: how long the others get to end before SIGKILL
POLL_S = 0.1


class IslandError(RuntimeError):
    """The island cannot go on: a rank died, or what a rank was given does not fit."""


@dataclass
class Island:
    """This process's place in its island: ``rank`` of ``size``, on ``local_rank``'s device."""

    rank: int
    size: int
    local_rank: int
    parallel: str = "ddp"
    device: torch.device | None = None

    @classmethod
    def from_env(cls, parallel: str = "ddp") -> Island | None:
        """The island torchrun or ``launch`` started this process in; None for a plain worker
        (no WORLD_SIZE, or a world of one)."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return None
        if parallel not in PARALLEL_MODES:
            raise IslandError(f"worker.parallel {parallel!r} is not available; use one of {PARALLEL_MODES}")
        rank = int(os.environ["RANK"])
        return cls(rank, size, int(os.environ.get("LOCAL_RANK", rank)), parallel)

    @property
    def leader(self) -> bool:
        """Rank 0: the one that speaks to the coordinator."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Under ``fsdp``: the model, its gradients and AdamW state are sharded over the ranks."""
        return self.parallel == "fsdp"

    def describe(self) -> str:
        return f"island of {self.size} ranks, {self.parallel}"

    def start(self, device_choice: str) -> torch.device:
        """Join the island's process group; returns this rank's training device (CUDA
        device ``local_rank`` where there is a GPU and ``device_choice`` allows it)."""
        use_cuda = device_choice != "cpu" and torch.cuda.is_available()
        if device_choice == "cuda" and not use_cuda:
            raise IslandError("worker.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        backend = "nccl" if use_cuda else "gloo"
        store_path = os.environ.get(STORE_ENV)
        if store_path:
            store = dist.FileStore(store_path, self.size)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size,
                                    timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(backend, rank=self.rank, world_size=self.size,
                                    timeout=COLLECTIVE_TIMEOUT)
        log.info("rank %d of %d joined the island (%s, %s)", self.rank, self.size, backend, self.device)
        return self.device

    def close(self) -> None:
        if dist.is_initialized():
            gc.collect()  # FSDP's modules (reference cycles) let go of the group first
            dist.destroy_process_group()

    def exit(self, code: int) -> NoReturn:
        """End this rank's process with ``code`` once its work is done and logged. Under
        ``fsdp`` without the interpreter's finalization: FSDP2's device mesh holds the
        island's process group past ``destroy_process_group``, and its Gloo threads, torn
        down during finalization, ended 2 of 7 exits of a test island in std::terminate
        (SIGABRT, or SIGSEGV) after the run had finished."""
        if not self.sharded:
            sys.exit(code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # ------------------------------------------------------------------ rank 0's commands

    def send(self, *command: Any) -> None:
        """Rank 0: the other ranks' next command, e.g. ("train", partition, round)."""
        dist.broadcast_object_list([command], src=0, device=self._object_device())

    def receive(self) -> tuple[Any, ...]:
        """The others: wait for rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        return tuple(box[0])

    def _object_device(self) -> torch.device | None:
        return self.device if self.device is not None and self.device.type == "cuda" else None

    # ------------------------------------------------------------------ the inner phase

    def broadcast(self, tensors: list[Tensor]) -> None:
        """Rank 0's ``tensors`` into every rank's (same shapes), as one flat message."""
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
            dist.broadcast(flat, src=0)
            if not self.leader:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()

    def counts(self, n: int) -> list[int]:
        """Every rank's ``n``, on rank 0 ([] elsewhere)."""
        sizes: list[Any] = [None] * self.size if self.leader else []
        dist.gather_object(int(n), sizes if self.leader else None, dst=0)
        return [int(x) for x in sizes] if self.leader else []

    def agree(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is true on every rank (one all-reduce)."""
        flag = torch.tensor([1 if ok else 0], device=self.device or torch.device("cpu"))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def shard_sizes(self, tensors: list[Tensor]) -> list[int]:
        """Every rank's count of the elements of ``tensors`` it holds, on rank 0 ([] elsewhere)."""
        return self.counts(sum(local_numel(t) for t in tensors))

    def shard(self, batch: Batch) -> Batch:
        """This rank's rows of the island's batch: an equal share, in rank order."""
        rows = len(batch[0])
        if rows % self.size:
            raise IslandError(f"a batch of {rows} sequences does not split between {self.size} ranks; "
                              f"make task.batch_size (the island's batch) a multiple of {self.size}")
        share = rows // self.size
        return tuple(t[self.rank * share:(self.rank + 1) * share] for t in batch)  # type: ignore[return-value]

    def average_gradients(self, params: list[Tensor], loss: float, stop: bool) -> tuple[float, bool]:
        """Average every rank's gradients of ``params`` and its ``loss`` (one all-reduce);
        returns (the island's loss, whether rank 0 asked to stop). Equal shares make the
        average the gradient of the whole batch's mean loss. Under ``fsdp`` the backward
        pass has averaged the gradients already (FSDP's reduce-scatter): the loss only."""
        with torch.no_grad():
            if self.sharded:
                params = []
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            device = grads[0].device if grads else self.device or torch.device("cpu")
            tail = torch.tensor([loss, 1.0 if stop and self.leader else 0.0], device=device)
            flat = torch.cat([g.reshape(-1).float() for g in grads] + [tail])
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                if p.grad is not None:
                    p.grad.copy_((flat[offset:offset + g.numel()] / self.size).view(g.shape))
                offset += g.numel()
            return float(flat[-2]) / self.size, bool(flat[-1] > 0)


def shard_model(model: nn.Module) -> None:
    """``fsdp``: FSDP2's ``fully_shard`` on each block of the model's outermost
    ``nn.ModuleList`` (a transformer's layers; one all-gather per block in the forward and
    backward passes), then on the whole model for what is left (embeddings, the last norm,
    tied weights). A model without such a list is sharded as one piece."""
    from torch.distributed.fsdp import fully_shard

    for block in shard_blocks(model):
        fully_shard(block)
    fully_shard(model)


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``shard_model`` shards one by one: those with parameters in each outermost
    ``nn.ModuleList`` (not in a list inside another)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        blocks.extend(b for b in module if any(True for _ in b.parameters()))
        inside.update(id(m) for m in module.modules())
    return blocks


def own_rows(whole: Tensor, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s rows of ``whole`` as FSDP2 shards it: ``torch.chunk`` along dim 0 into
    ``size`` pieces (fewer when the rows run out: the last ranks then hold none)."""
    if whole.dim() == 0:
        return whole
    pieces = torch.chunk(whole, size, dim=0)
    return pieces[rank] if rank < len(pieces) else whole[whole.shape[0]:]


def local_numel(t: Tensor) -> int:
    """Elements of ``t`` this process holds: its shard of a DTensor, else all."""
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def local_optimizer_state(state: dict) -> dict:
    """An optimizer state dict with its DTensors as this rank's plain local shards (on the
    CPU), to save in a file of its own."""
    def local(v: Any) -> Any:
        return v.to_local().cpu() if isinstance(v, DTensor) else v.cpu() if isinstance(v, Tensor) else v
    return {"state": {k: {n: local(v) for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": state["param_groups"]}


def sharded_optimizer_state(state: dict, params: list[Tensor]) -> dict:
    """``local_optimizer_state``'s inverse: each local shard made a DTensor again, placed as
    its parameter (``params`` in the optimizer's order). IslandError when a shard's shape is
    not this rank's (the island was sharded another way)."""
    out: dict = {"state": {}, "param_groups": state["param_groups"]}
    for k, entry in state["state"].items():
        p = params[int(k)]
        out["state"][k] = {}
        for name, v in entry.items():
            if isinstance(p, DTensor) and isinstance(v, Tensor) and v.dim() > 0:
                if tuple(v.shape) != tuple(p.to_local().shape):
                    raise IslandError(f"a saved AdamW shard of {tuple(v.shape)} for a parameter shard of "
                                      f"{tuple(p.to_local().shape)}")
                v = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements,
                                       run_check=False, shape=p.shape, stride=p.stride())
            out["state"][k][name] = v
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The tensors of an optimizer's state (AdamW: its moments), in a stable order."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, Tensor) and v.dim() > 0]


def cpu_state(value: Any, copy: bool = False) -> Any:
    """``value`` with every tensor moved to the CPU (what rank 0 sends to the others), or
    copied there (``copy``: a snapshot no later in-place step changes)."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, dict):
        return {k: cpu_state(v, copy) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_state(v, copy) for v in value)
    return value


# ---------------------------------------------------------------------- the launcher

def launch(argv: list[str], ranks: int, grace_s: float = STOP_GRACE_S,
           program: tuple[str, ...] = ("-m", "geoloco.cli")) -> int:
    """``geoloco worker --nproc-per-node N``: run ``geoloco <argv>`` (``python <program>
    <argv>``) as ranks 0..N-1 of one island on this host and wait for them. Returns rank 0's exit code, or, when a rank dies
    first, that rank's (128 + signal for a signal), after the others were stopped: rank 0 by
    SIGTERM (it reports "stopped" and ends the others), then what is left by SIGTERM, each
    step given ``grace_s`` before SIGKILL. SIGTERM to the launcher goes to rank 0; Ctrl-C reaches every rank from the
    terminal, and the ranks other than 0 ignore it."""
    with tempfile.TemporaryDirectory(prefix="geoloco-island-") as folder:  # mode 0700
        env = dict(os.environ, WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   **{STORE_ENV: os.path.join(folder, "store"), LAUNCHER_PID_ENV: str(os.getpid())})
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the island's traffic stays on this host
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")  # NCCL's bootstrap too (its data goes over the GPUs' links)
        procs = [subprocess.Popen([sys.executable, *program, *argv],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(ranks)]
        log.info("island of %d ranks started (pids %s)", ranks, " ".join(str(p.pid) for p in procs))
        previous = {s: signal.signal(s, h) for s, h in (
            (signal.SIGTERM, lambda *_: _signal(procs[0], signal.SIGTERM)),
            (signal.SIGINT, signal.SIG_IGN))}
        try:
            return _supervise(procs, grace_s)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _supervise(procs: list[subprocess.Popen], grace_s: float) -> int:
    """Wait until rank 0 ends (the others exit 0 when it tells them to) or a rank fails."""
    while True:
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            # the first to fail: a rank killed by a signal, else one of the others, else rank
            # 0 (a rank whose peer died fails right after it, on the broken connection)
            rank, code = min(failed, key=lambda f: (f[1] >= 0, f[0] == 0, f[0]))
            if (rank, code) == (0, EXIT_INTERRUPTED):
                log.info("island rank 0 stopped; waiting for the other ranks")
            else:
                log.error("island rank %d %s; stopping the island", rank, _describe_exit(code))
            _signal(procs[0], signal.SIGTERM)  # it stops cleanly and tells the others to exit
            _wait_all(procs[:1], grace_s)
            for proc in procs[1:]:  # what is still there did not hear it
                _signal(proc, signal.SIGTERM)
            _wait_all(procs[1:], grace_s)
            return _exit_code(code)
        if procs[0].returncode == 0:
            _wait_all(procs[1:], grace_s)
            late = [r for r, p in enumerate(procs) if p.returncode != 0]
            if late:
                log.error("island rank %d %s after rank 0 finished", late[0],
                          _describe_exit(procs[late[0]].returncode))
                return _exit_code(procs[late[0]].returncode)
            return 0
        time.sleep(POLL_S)


def _wait_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("island rank pid %d did not end within %.0fs: killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait()


def _signal(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        proc.send_signal(signum)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code
