"""deltalab: delta-rule linear attention with uncertainty-aware and sensitivity-gated memories."""

__version__ = "0.1.0"
