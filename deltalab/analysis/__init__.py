"""Analyses of trained or initial models: gate sensitivity and the ranks it allocates, state row
norms."""

from deltalab.analysis._plot import save_figure
from deltalab.analysis.gate_sensitivity import (
    SensitivityReport,
    gate_inputs,
    gate_sensitivity,
    perturb_gate,
    plot_gate_sensitivity,
    unit_directions,
)
from deltalab.analysis.rank_allocation import allocate_ranks
from deltalab.analysis.row_norms import RowNormReport, plot_row_norms, row_norms, spearman

__all__ = [
    "RowNormReport",
    "SensitivityReport",
    "allocate_ranks",
    "gate_inputs",
    "gate_sensitivity",
    "perturb_gate",
    "plot_gate_sensitivity",
    "plot_row_norms",
    "row_norms",
    "save_figure",
    "spearman",
    "unit_directions",
]
