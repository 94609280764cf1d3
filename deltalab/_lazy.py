"""Package attributes imported on first use (PEP 562), so that importing a package, as every
`deltalab` command does for its parser, loads neither torch nor transformers."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(
    package: str, sources: dict[str, str], submodules: tuple[str, ...] = ()
) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: each name of `sources` (name -> module) is
    imported from its module when first read, each of `submodules` is `package.name`."""

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(sources[name]), name)

    return __getattr__
