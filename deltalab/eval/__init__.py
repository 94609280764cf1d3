"""The evaluation suite behind `deltalab eval`: perplexity, streaming extrapolation, MQAR,
passkey retrieval, RULER-style needles and variable tracking, and an lm-evaluation-harness
adapter. Each task is a function of (typed settings, checkpoint, seed) that returns metrics; the
command writes them to results.json and prints a table (`deltalab.eval.cli`).
"""

from deltalab._lazy import lazy_attributes

__all__ = ["EvalError", "LoadedCheckpoint", "load_checkpoint"]

__getattr__ = lazy_attributes(
    __name__,
    {
        "EvalError": "deltalab.errors",
        "LoadedCheckpoint": "deltalab.eval.common",
        "load_checkpoint": "deltalab.eval.common",
    },
)
