"""Conversions: reshape to another layout, importers of foreign checkpoints, exporters.

This package is also ``ucp.convert``, the function (``ucp.convert(src, dst, ...)``, see
:func:`ucp.convert.api.convert`): the package module is callable, so that ``ucp.convert`` is the
same object whether the package was imported first (the import system sets it on ``ucp``) or the
name was looked up first. Importing it stays light (no torch): the call imports the converter.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ucp.convert.api import convert as _convert

        return _convert(*args, **kwargs)


if TYPE_CHECKING:  # static tools see the function
    from ucp.convert.api import convert
else:
    sys.modules[__name__].__class__ = _CallableModule
    convert = sys.modules[__name__]  # ucp._EXPORTS["convert"]: the package itself, callable
