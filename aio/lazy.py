"""Lazy public names for a package (PEP 562): each resolved from its submodule on first use.

``aio`` and ``ucp`` use it so that importing them (or any of their submodules, e.g. the command
line) stays cheap: no torch, no numpy until a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, str]], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to (submodule, attribute);
    a resolved name is stored in ``namespace`` (the package's globals) so later lookups are plain reads."""

    def __getattr__(name: str) -> Any:
        try:
            module, attr = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f".{module}", package), attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
