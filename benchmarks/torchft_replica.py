"""One torchft DiLoCo replica on GeoLoCo's task, for benchmarks/peers.py: the same model,
data partition, H, inner AdamW with its warm-up and cosine schedule, gradient clipping and
tokens as a GeoLoCo worker of the same run config, with torchft's ``local_sgd.DiLoCo``
(an all-reduce of the fp32 pseudo-gradients over Gloo, then Nesterov SGD) for the outer
step; ``--wire-dtype bf16`` all-reduces them in bf16 instead (``bf16_wire``: torchft 0.2.0
has no such option). torchft is a benchmark-only extra (``pip install torchft==0.2.0``; docs/decisions.md).

    python -m benchmarks.torchft_replica --config run.json --replica I --lighthouse URL \\
        --host ADDR --out replica-I.json

Each replica is a replica group of one rank with its own TCPStore on ``--host`` (the address
its peers reach it by). It prints nothing but torchft's log and writes, as JSON: per round
the seconds of the inner phase (compute) and of the synchronisation (the optimizer step that
ends the round, where DiLoCo all-reduces and applies the outer step), replica 0's
validation loss after every ``--val-every``-th round (its next inner phase, and so the next
all-reduce, waits for it) and at the end, and the parameters' digest (every replica must
end on the same one).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from geoloco.config import RunConfig, validate
from geoloco.replica import param_digest, replica_tensors
from geoloco.schedule import lr_at
from geoloco.tasks import build_task

log = logging.getLogger("torchft_replica")
# the quorum waits this many collective timeouts: after a peer is killed, a replica whose
# all-reduce failed at once waits in the quorum for those its all-reduce still holds
QUORUM_TIMEOUTS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True, help="the run config, as JSON (RunConfig.to_json)")
    p.add_argument("--replica", type=int, required=True, help="replica id = data partition")
    p.add_argument("--lighthouse", required=True, help="torchft lighthouse URL, e.g. http://10.213.0.1:29510")
    p.add_argument("--host", default="127.0.0.1", help="the address peers reach this replica by")
    p.add_argument("--store-port", type=int, default=0, help="its TCPStore's port (0: a free one)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="torchft's connect and collective timeouts (the quorum's is 3x): size them to the "
                   "slowest link")
    p.add_argument("--wire-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the pseudo-gradients' dtype on the wire (bf16: rounded, summed by Gloo in bf16)")
    p.add_argument("--val-every", type=int, default=0,
                   help="replica 0 measures the validation loss after every K-th round (0: at the end only)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport (what a restarted replica heals from), advertised
    at ``host``, the address its peers reach this replica by: torchft names it by the
    machine's hostname, which on the test bed's namespaces (one machine) resolves to each
    namespace's own loopback."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class HostTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return HostTransport(timeout=timeout, num_chunks=0)


def bf16_wire(pg_class: type) -> type:
    """``pg_class`` (torchft's ProcessGroupGloo) all-reducing fp32 tensors as bf16: each is
    rounded to bf16, all-reduced (Gloo's ring sums in bf16, rounding at every hop), waited
    for and copied back as fp32, and a completed Work is returned, so DiLoCo's averaging and
    outer step see fp32 tensors as before. torchft 0.2.0's own ``should_quantize`` is an fp8
    all-reduce through Triton, on CUDA only. Waiting inside the call costs no overlap here:
    DiLoCo's bucket of gpt-tiny is one, and a Gloo group runs its collectives in order."""
    from torchft.work import _DummyWork

    class Bf16Wire(pg_class):
        def allreduce(self, tensors, opts):  # noqa: ANN001, ANN202 - torch's signature
            if not all(t.dtype == torch.float32 for t in tensors):
                return super().allreduce(tensors, opts)
            wire = [t.to(torch.bfloat16) for t in tensors]
            super().allreduce(wire, opts).wait()  # raises on a failed peer, as the manager expects
            for t, w in zip(tensors, wire, strict=True):
                t.copy_(w)
            return _DummyWork(tensors)

    return Bf16Wire


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    cfg = validate(RunConfig.from_dict(json.loads(args.config.read_text())))
    if cfg.compression.method != "diloco":
        raise SystemExit("torchft_replica runs dense DiLoCo: give a config with compression.method diloco")
    task = build_task(cfg.task, cfg.workers, seed=cfg.seed)
    model = task.make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(trainable, lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2),
                              weight_decay=cfg.inner.weight_decay)
    outer = torch.optim.SGD(trainable, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    timeout = timedelta(seconds=args.timeout_s)
    port = args.store_port or free_port(args.host)
    store = TCPStore(args.host, port, is_master=True, wait_for_workers=False)  # noqa: F841 - kept alive

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    pg_class = bf16_wire(ProcessGroupGloo) if args.wire_dtype == "bf16" else ProcessGroupGloo
    manager = Manager(
        pg=pg_class(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=cfg.workers, use_async_quorum=False, rank=0, world_size=1,
        store_addr=args.host, store_port=port, lighthouse_addr=args.lighthouse,
        replica_id=f"replica-{args.replica}", hostname=args.host, init_sync=False,
        checkpoint_transport=host_transport(args.host, timeout),
        timeout=timeout, quorum_timeout=QUORUM_TIMEOUTS * timeout, connect_timeout=timeout)
    H, total = cfg.inner.steps, cfg.rounds * cfg.inner.steps
    rounds = []
    initial = task.val_loss(model) if args.replica == 0 else None  # before the clock starts
    start = time.monotonic()
    with DiLoCo(manager, [model], inner, outer, sync_every=H, use_bucketization=True):
        # by torchft's step, not a count of our own: a replica started again after a kill
        # heals to its peers' step at its first quorum, and a round whose all-reduce failed
        # (a peer killed during it) is not committed and is trained again
        while (r := manager.current_step()) < cfg.rounds:
            began = time.monotonic()
            batches, losses = task.batches(args.replica, r * H), []  # the round's data, as a worker's
            for step in range(H):
                for group in inner.param_groups:
                    group["lr"] = lr_at(cfg.inner, r * H + step, total)
                loss = task.loss(model, next(batches))
                inner.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.inner.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(trainable, cfg.inner.grad_clip)
                losses.append(float(loss))
                if step == H - 1:
                    synced = time.monotonic()
                inner.step()  # DiLoCo's hook: on the H-th step, all-reduce and the outer step
            ended = time.monotonic()
            done = manager.current_step()  # r + 1 once committed; the peers' step + 1 after a heal
            rounds.append({"round": done - 1, "committed": done > r, "time": time.time(),
                           "compute_s": synced - began, "sync_s": ended - synced,
                           "round_s": ended - began, "elapsed_s": ended - start,
                           "train_loss": sum(losses) / len(losses)})
            if args.replica == 0 and args.val_every and done > r and done % args.val_every == 0:
                rounds[-1]["val_loss"] = task.val_loss(model)  # the global θ after the outer step
            log.info("round %d: %.2fs (sync %.2fs), loss %.4f%s", done - 1, ended - began, ended - synced,
                     rounds[-1]["train_loss"], "" if done > r else " (not committed)")
    theta = [t.detach().float() for _, t in replica_tensors(model)]
    result = {"replica": args.replica, "rounds": rounds, "steps": manager.current_step(),
              "digest": param_digest(theta), "wall_s": time.monotonic() - start,
              "initial_val_loss": initial,
              "final_val_loss": task.val_loss(model) if args.replica == 0 else None}
    if result["final_val_loss"] is not None and not math.isfinite(result["final_val_loss"]):
        log.error("the validation loss is %s", result["final_val_loss"])
    args.out.write_text(json.dumps(result))
    manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
