"""Every module path the code base writes as a string still names something that exists.

Module paths in strings escape imports and type checks: ``python -m ucp.saving.background.worker``
(the writer process), ``"ucp.manager:after_commit"`` (a post-commit call), ``sys.modules[...]`` and
monkeypatch targets in tests. A module moved without updating them fails only at run time, in
another process. This test finds them with a grep over the tree and resolves each one.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ["ucp", "training", "tests", "docs", "aio", "gds", "reshard", "kernels"]
NAME = r"ucp(?:\.[A-Za-z_]\w*)+"
QUOTED = re.compile(rf"""["']({NAME})(?::([A-Za-z_]\w*))?["']""")  # "ucp.x.y" or "ucp.x.y:func"
RUN_AS_MAIN = re.compile(rf"""-m["',\s]+({NAME})\b""")  # python -m ucp.x.y, or [..., "-m", "ucp.x.y"]
PLACEHOLDERS = {"ucp.module:function"}  # a docstring's example of the "module:function" form


def _sources() -> list[Path]:
    files: list[Path] = []
    for top in SCANNED:
        base = ROOT / top
        if base.is_dir():
            files += [p for p in base.rglob("*") if p.suffix in (".py", ".md", ".sh") and p.is_file()]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]  # this file's patterns are examples


def _found() -> tuple[dict[str, str], dict[str, str]]:
    """(quoted paths, modules run with -m), each mapped to the first file naming it."""
    quoted: dict[str, str] = {}
    mains: dict[str, str] = {}
    for path in _sources():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = str(path.relative_to(ROOT))
        for m in QUOTED.finditer(text):
            key = m.group(1) + (f":{m.group(2)}" if m.group(2) else "")
            if key not in PLACEHOLDERS:
                quoted.setdefault(key, where)
        for m in RUN_AS_MAIN.finditer(text):
            mains.setdefault(m.group(1).rstrip("."), where)
    return quoted, mains


QUOTED_PATHS, MAIN_MODULES = _found()


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted`` and follow the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name) and exc.name.startswith("ucp"):
                continue  # this prefix is not a module: try a shorter one
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_grep_finds_the_paths_the_saving_code_depends_on() -> None:
    assert "ucp.manager:after_commit" in QUOTED_PATHS
    assert "ucp.saving.background.worker" in MAIN_MODULES
    assert "ucp.saving.cow.helper" in MAIN_MODULES


@pytest.mark.parametrize("written", sorted(QUOTED_PATHS))
def test_a_quoted_module_path_resolves(written: str) -> None:
    module, _, func = written.partition(":")
    try:
        obj = _resolve(module)
        if func:
            obj = getattr(obj, func)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{QUOTED_PATHS[written]} names {written!r}, which does not resolve: {exc}")
    if func:
        assert callable(obj), f"{QUOTED_PATHS[written]}: {written!r} is not callable"


@pytest.mark.parametrize("module", sorted(MAIN_MODULES))
def test_a_module_run_with_dash_m_exists_and_runs_as_main(module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{MAIN_MODULES[module]} runs `python -m {module}`, which does not exist"
    if spec.submodule_search_locations is not None:  # a package: runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module} has no __main__.py"
        return
    assert spec.origin is not None
    source = Path(spec.origin).read_text(encoding="utf-8")
    assert re.search(r"""^if __name__ == ["']__main__["']:""", source, re.M), (
        f"{MAIN_MODULES[module]} runs `python -m {module}`, but {spec.origin} does nothing when run as a script"
    )
