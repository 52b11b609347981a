"""``reshard``'s public names resolve on first use, so reading a manifest (``reshard.box``) does not load
the layout language and planner; the names stay what they were when all were imported eagerly."""

from __future__ import annotations

import subprocess
import sys

from repo_paths import REPO  # noqa: E402


def _run(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_the_box_math_alone_loads_no_layout_code() -> None:
    code = "import sys, reshard.box; print(sorted(m for m in sys.modules if m.startswith('reshard.')))"
    assert _run(code) == "['reshard.box']"


def test_every_public_name_resolves_and_plan_stays_the_function() -> None:
    code = (
        "import reshard, reshard.plan, inspect\n"
        "from reshard import plan\n"
        "assert inspect.isfunction(plan) and reshard.plan is plan, plan\n"
        "names = [n for n in reshard.__all__ if getattr(reshard, n) is None]\n"
        "assert not names, names\n"
        "assert set(reshard.__all__) <= set(dir(reshard))\n"
        "print(len(reshard.__all__))"
    )
    assert int(_run(code)) == 42
    try:
        _run("import reshard; reshard.no_such_name")
    except AssertionError as exc:
        assert "has no attribute 'no_such_name'" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")
