"""Studies: a grid of `deltalab train` runs (mixers x seeds x learning rates x sizes) with
matched parameter counts, the `deltalab eval` tasks of each, and one report (`deltalab study`).

spec.py reads and checks the YAML spec; plan.py expands the grid, matches parameter counts and
checks every run's config before anything trains; runner.py runs the jobs as subprocesses,
several at a time, skipping finished runs and resuming interrupted ones; stats.py has the
means, standard deviations, paired t-intervals, Holm's correction and the seeds an effect
needs; compare.py chooses each variant's learning rate on validation numbers and corrects the
report's comparisons as one family; report.py gathers study.json's data and writes the report's
files, markdown.py renders study.md, figures.py the figures.
"""

from deltalab._lazy import lazy_attributes

__all__ = ["StudyPlan", "StudySpec", "load_spec", "make_plan", "parse_spec"]

__getattr__ = lazy_attributes(
    __name__,
    {
        "StudyPlan": "deltalab.study.plan",
        "make_plan": "deltalab.study.plan",
        "StudySpec": "deltalab.study.spec",
        "load_spec": "deltalab.study.spec",
        "parse_spec": "deltalab.study.spec",
    },
)
