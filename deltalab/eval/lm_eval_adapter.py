"""`deltalab eval CHECKPOINT --task lm-eval:TASK1,TASK2`: lm-evaluation-harness tasks on a
checkpoint, through the `deltalab` model of `deltalab.eval.lm_eval_model`.

lm-eval is an optional dependency (`pip install 'deltalab[eval]'`); this module imports it only
when the task runs, so the rest of the suite works without it.
"""

from __future__ import annotations

from typing import Any

from deltalab.eval.common import EvalError
from deltalab.eval.settings import LmEvalSettings
from deltalab.eval.tasks import TaskContext, TaskOutcome

__all__ = ["LmEvalSettings", "run_lm_eval"]


def _import_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError as error:
        raise EvalError(
            "lm-eval:TASKS needs lm-evaluation-harness: pip install 'deltalab[eval]' "
            f"(lm-eval 0.4.x); import failed: {error}"
        ) from error
    return lm_eval


def run_lm_eval(settings: LmEvalSettings, ctx: TaskContext) -> TaskOutcome:
    _import_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from deltalab.errors import closest
    from deltalab.eval.lm_eval_model import DeltaLabLM

    loaded = ctx.checkpoint
    assert loaded is not None
    manager = TaskManager(include_path=settings.include_path)
    names = [t.strip() for t in settings.tasks.split(",") if t.strip()]
    known = manager.all_tasks
    for name in names:
        if name not in known:
            raise EvalError(f"lm-eval task {name!r} is not known to lm-eval{closest(name, known)}")
    model = DeltaLabLM(
        loaded=loaded,
        batch_size=settings.batch_size,
        segment_len=settings.segment_len,
        long_context=ctx.long_context,
        max_gen_toks=settings.max_gen_toks,
        seed=ctx.seed,
    )
    limit = settings.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    output = simple_evaluate(
        model=model,
        tasks=names,
        num_fewshot=settings.num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        random_seed=ctx.seed,
        numpy_random_seed=ctx.seed,
        torch_random_seed=ctx.seed,
        fewshot_random_seed=ctx.seed,
    )
    if output is None:
        raise EvalError("lm-eval returned no results")
    metrics: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for task, values in output["results"].items():
        entry: dict[str, Any] = {}
        for key, value in values.items():
            if key == "alias" or "_stderr," in key or not isinstance(value, int | float):
                continue
            metric = key.split(",")[0]
            stderr = values.get(key.replace(",", "_stderr,", 1))
            entry[metric] = {"value": value}
            if isinstance(stderr, int | float):
                # lm-eval's stderr: a normal 95% interval around the mean.
                entry[metric].update(
                    stderr=stderr, ci95=[value - 1.96 * stderr, value + 1.96 * stderr]
                )
            summary[f"{task}/{metric}"] = value
        metrics[task] = entry
    metrics["n_samples"] = output.get("n-samples", {})
    metrics["lm_eval_versions"] = output.get("versions", {})
    return TaskOutcome(metrics=metrics, summary=summary, table=make_table(output).strip())
