"""reshard's modules import one another one way only: each can be imported first, on its own, and the
graph of their imports (counting imports inside functions and under TYPE_CHECKING) has no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import reshard

PACKAGE = Path(reshard.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _sibling_imports(module: str) -> list[tuple[str, bool]]:
    """(imported sibling, whether the import sits inside a function) for every import of a reshard module."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level == 1 and child.module:
                    found.append((child.module.split(".")[0], in_function))
                elif child.level == 1:
                    found.extend((a.name, in_function) for a in child.names)
                elif child.module and child.module.startswith("reshard."):
                    found.append((child.module.split(".")[1], in_function))
            elif isinstance(child, ast.Import):
                found.extend((a.name.split(".")[1], in_function) for a in child.names if a.name.startswith("reshard."))
            visit(child, inner)

    visit(tree, False)
    return [(m, f) for m, f in found if m in MODULES]


def test_no_import_cycle() -> None:
    graph = {m: sorted({dep for dep, _ in _sibling_imports(m)}) for m in MODULES}
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        for dep in graph[m]:
            walk(dep, [*path, m])
        done.add(m)

    for m in MODULES:
        walk(m, [])


def test_no_function_level_sibling_imports() -> None:
    lazy = {m: [dep for dep, in_fn in _sibling_imports(m) if in_fn] for m in MODULES}
    assert not {m: deps for m, deps in lazy.items() if deps}, "imports inside functions hide a cycle"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first(module: str) -> None:
    """The module alone, first in a fresh interpreter, without the package's __init__ deciding the order."""
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('reshard'); pkg.__path__ = [{str(PACKAGE)!r}]; sys.modules['reshard'] = pkg\n"
        f"importlib.import_module('reshard.{module}')\n"
        "import reshard.layout, reshard.resolve, reshard.pipeline, reshard.spec\n"
        "assert reshard.layout.Layout.resolve\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_layout_keeps_its_face() -> None:
    """Layout is still the class users load, replace and resolve; the models stay importable from reshard.layout."""
    from reshard import Box, Layout, Mesh
    from reshard.layout import Pipeline, RankCoord, Rule, Zero, validation_line

    layout = Layout(mesh=Mesh(tp=2), rules=(Rule(name="w", dims="(tp r) c"),))
    assert type(Layout.from_json(layout.to_json())) is Layout and type(layout.replace(mesh=Mesh(tp=1))) is Layout
    view = layout.resolve({"w": (4, 3)}, 1)
    assert [s.glob for s in view.tensors["w"].slots] == [Box((2, 0), (2, 3))]  # rank 1 holds rows 2..3
    layout.check({"w": (4, 3)})
    assert len(layout.resolve_all({"w": (4, 3)})) == 2
    assert (
        Pipeline.__module__ == RankCoord.__module__ == Zero.__module__ == validation_line.__module__ == "reshard.spec"
    )
