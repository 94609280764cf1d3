"""Functional core of deltalab: tensors in, tensors out, no nn.Module."""

from deltalab.ops.delta_rule import delta_rule, delta_rule_step

__all__ = ["delta_rule", "delta_rule_step"]
