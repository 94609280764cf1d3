"""Training: `deltalab train` (typed run config, loop, checkpoints, DDP/FSDP2 under torchrun)."""

from deltalab.train.config import RunConfig, load_run_config
from deltalab.train.loop import TrainResult, train

__all__ = ["RunConfig", "TrainResult", "load_run_config", "train"]
