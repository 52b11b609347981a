"""ucp's public face is listed once (``ucp._EXPORTS``): ``__all__`` is derived from it, every entry
resolves to the object it names, and the TYPE_CHECKING imports static tools read name the same
objects from the same modules."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import ucp


def test_every_export_resolves_to_what_it_names() -> None:
    for name, (module, attr) in ucp._EXPORTS.items():
        assert getattr(ucp, name) is getattr(importlib.import_module(f"ucp.{module}"), attr), name


def test_all_is_the_exports() -> None:
    """All but the names that would shadow a builtin in ``from ucp import *`` (``ucp.open``)."""
    assert ucp.NOT_STARRED == {"open"} and ucp.NOT_STARRED <= set(ucp._EXPORTS)
    assert ucp.__all__ == sorted(set(ucp._EXPORTS) - ucp.NOT_STARRED)
    assert set(ucp._EXPORTS) <= set(dir(ucp))
    namespace: dict[str, object] = {}
    exec("from ucp import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(ucp._EXPORTS) - ucp.NOT_STARRED


def test_static_imports_mirror_the_exports() -> None:
    """The ``if TYPE_CHECKING:`` block imports exactly the exported names, each from its _EXPORTS module."""
    tree = ast.parse(Path(ucp.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    static: dict[str, tuple[str, str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ucp."), ast.dump(node)
        for alias in node.names:
            static[alias.asname or alias.name] = (node.module.removeprefix("ucp."), alias.name)
    assert static == ucp._EXPORTS
