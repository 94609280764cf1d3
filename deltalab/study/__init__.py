"""Studies: a grid of `deltalab train` runs (mixers x seeds x learning rates x sizes) with
matched parameter counts, the `deltalab eval` tasks of each, and one report (`deltalab study`).

spec.py reads and checks the YAML spec; plan.py expands the grid, matches parameter counts and
checks every run's config before anything trains; runner.py runs the jobs as subprocesses,
several at a time, skipping finished runs and resuming interrupted ones; stats.py has the
means, standard deviations and paired t-intervals; report.py writes study.json, study.md and
the figures.
"""

from deltalab.study.plan import StudyPlan, make_plan
from deltalab.study.spec import StudySpec, load_spec, parse_spec

__all__ = ["StudyPlan", "StudySpec", "load_spec", "make_plan", "parse_spec"]
