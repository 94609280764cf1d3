"""lm-evaluation-harness's own command with the deltalab model registered:

    python -m deltalab.lm_eval --model deltalab --model_args pretrained=runs/default/model \\
        --tasks lambada_openai

Every argument is lm-eval's (`python -m deltalab.lm_eval --help`); `deltalab eval --task
lm-eval:TASKS` runs the same model without it. lm-eval 0.4.x reads no plugin entry points, so
the model is registered here, by the command that needs it, rather than at interpreter start.
"""

from __future__ import annotations

MODEL = "deltalab"
IMPLEMENTATION = "deltalab.eval.lm_eval_model:DeltaLabLM"


def register() -> None:
    """Adds the `deltalab` model to lm-eval's model registry (by import path: torch and the
    model load only when it is used), after lm-eval's built-in models."""
    import lm_eval.models  # noqa: F401  (registers the built-in models)
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=IMPLEMENTATION)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    register()
    cli_evaluate()


if __name__ == "__main__":
    main()
