"""Makes `lm_eval --model deltalab` work: when `lm_eval.models` is imported, registers the
`deltalab` model lazily (by import path, so torch and deltalab load only if it is used).

lm-eval 0.4.x has no plugin entry points; installing deltalab puts `deltalab-lm-eval.pth` in
site-packages, whose one line imports this module at interpreter start. It is kept outside the
`deltalab` package, whose import loads torch, and costs one meta-path finder otherwise.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "lm_eval.models"
MODEL = "deltalab"
IMPLEMENTATION = "deltalab.eval.lm_eval_model:DeltaLabLM"


def register(registry_module: object = None) -> None:
    """Adds the deltalab model to lm-eval's model registry (once)."""
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=IMPLEMENTATION)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        # The real spec, found by the finders after this one.
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "lm_eval.models" in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


install()
