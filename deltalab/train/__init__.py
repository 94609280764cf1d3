"""Training: `deltalab train` (typed run config, loop, checkpoints, DDP/FSDP2 under torchrun)."""

from deltalab._lazy import lazy_attributes

__all__ = ["RunConfig", "TrainResult", "load_run_config", "train"]

# The config loads without torch: `deltalab train` checks it before the loop imports torch.
__getattr__ = lazy_attributes(
    __name__,
    {
        "RunConfig": "deltalab.train.config",
        "load_run_config": "deltalab.train.config_io",
        "TrainResult": "deltalab.train.loop",
        "train": "deltalab.train.loop",
    },
)
