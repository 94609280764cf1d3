"""Functional core of deltalab: tensors in, tensors out, no nn.Module."""

from deltalab.ops.delta_rule import delta_rule, delta_rule_step
from deltalab.ops.kdn import (
    kdn_diag,
    kdn_diag_step,
    kdn_exact,
    kdn_gain_diag,
    kdn_gain_iso,
    kdn_iso,
    kdn_iso_step,
)
from deltalab.ops.lm_loss import linear_cross_entropy
from deltalab.ops.mobius import mobius_scan
from deltalab.ops.short_conv import short_conv

__all__ = [
    "delta_rule",
    "delta_rule_step",
    "kdn_diag",
    "kdn_diag_step",
    "kdn_exact",
    "kdn_gain_diag",
    "kdn_gain_iso",
    "kdn_iso",
    "kdn_iso_step",
    "linear_cross_entropy",
    "mobius_scan",
    "short_conv",
]
