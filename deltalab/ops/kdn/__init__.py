"""Kalman Delta Networks: uncertainty-aware gains for the generalized delta rule.

Isotropic and Diagonal KDN compute their gains with a Mobius scan of the posterior variance,
Exact KDN with the dense Riccati recursion; all three then run the memory through `delta_rule`
with a = gain, b = k, u = v. README.md in this folder has the math and the choices.
"""

from deltalab.ops.kdn.exact import kdn_exact
from deltalab.ops.kdn.gains import kdn_gain_diag, kdn_gain_iso
from deltalab.ops.kdn.mixers import kdn_diag, kdn_iso, scan_backend
from deltalab.ops.kdn.step import kdn_diag_step, kdn_iso_step

__all__ = [
    "kdn_diag",
    "kdn_diag_step",
    "kdn_exact",
    "kdn_gain_diag",
    "kdn_gain_iso",
    "kdn_iso",
    "kdn_iso_step",
    "scan_backend",
]
