"""TensorBoard scalars of every closed round (losses, learning rate, bytes, where the time
went) in ``run_dir/tensorboard``, written with torch.utils.tensorboard when
``monitoring.tensorboard`` is on (docs/monitoring.md)."""

from __future__ import annotations

from pathlib import Path

from geoloco.config import ConfigError
from geoloco.coordinator.metrics import RoundMetrics
from geoloco.run_dir import TENSORBOARD_DIR

# scalar tag -> RoundMetrics attribute (None values are left out)
SCALARS = {
    "loss/val": "val_loss", "loss/train": "train_loss", "inner/lr": "lr",
    "bytes/upload_per_worker": "upload_bytes_mean", "bytes/download_per_worker": "download_bytes_per_worker",
    "seconds/round": "round_seconds", "seconds/compute": "compute_seconds", "seconds/wait": "wait_seconds",
    "seconds/close": "close_seconds", "seconds/coordinator_apply": "coordinator_apply_seconds",
    "frames/rejected": "rejected_frames", "frames/late": "late_frames",
    "coding/max_coefficient": "max_coefficient",
}


class TensorBoardScalars:
    """A RoundObserver writing one event file; the step is the round number."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("monitoring.tensorboard needs the tensorboard package: "
                              "pip install 'geoloco[tensorboard]'") from None
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_round(self, m: RoundMetrics) -> None:
        for tag, attribute in SCALARS.items():
            value = getattr(m, attribute)
            if value is not None:
                self.writer.add_scalar(tag, value, m.round, walltime=m.time)
        self.writer.add_scalar("workers/arrived", len(m.arrived), m.round, walltime=m.time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
