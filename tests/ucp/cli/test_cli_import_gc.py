"""A ``ucp`` process's start-up (``ucp.cli.startup``, ``ucp.cli.main.main``): imports with the cyclic GC paused
and then frozen, pydantic's plugins not looked for, and none of it done to a process that runs a command
in-process (a test's CliRunner).

Issue 21: one-shot commands spend at most 0.3 s outside their data movement; the GC walking the start-up
imports' objects cost 3-4 % of their instructions, the plugin scan ~2 %.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO  # noqa: E402
from typer.testing import CliRunner

import ucp  # noqa: E402

# Runs the console script's main() and, as the process ends (its exit handlers run last), writes what the
# GC and the environment looked like then: after the command ran.
_PROBE = (
    "import atexit, gc, json, os, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write(json.dumps({'enabled': gc.isenabled(),"
    " 'frozen': gc.get_freeze_count(), 'plugins': os.environ.get('PYDANTIC_DISABLE_PLUGINS')})))\n"
    "from ucp.cli.main import main\n"
    "main()\n"
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("startup") / "ck"
    ucp.save({"model": {"w": torch.arange(64, dtype=torch.float32)}}, path, step=1)
    return path


def _probe(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    out = tmp_path / "state.json"
    environ = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**environ, **(env or {})},
    )
    return run.returncode, json.loads(out.read_text())


@pytest.mark.parametrize("argv", [["verify", "{ck}"], ["verify", "{missing}"]])
def test_a_ucp_process_freezes_its_imports_and_runs_with_the_gc_on(ckpt: Path, tmp_path: Path, argv: list[str]) -> None:
    args = [a.format(ck=ckpt, missing=tmp_path / "missing") for a in argv]
    code, state = _probe(tmp_path, *args)
    assert code == (0 if "{ck}" in argv else 2)
    assert state["enabled"], state  # paused for the imports only, also when the command fails
    assert state["frozen"] > 10_000, state  # typer, rich, pydantic and the command's modules
    assert state["plugins"] == "__all__", state


def test_a_plugin_setting_of_the_user_is_kept(ckpt: Path, tmp_path: Path) -> None:
    code, state = _probe(tmp_path, "verify", str(ckpt), env={"PYDANTIC_DISABLE_PLUGINS": ""})
    assert code == 0 and state["plugins"] == "", state  # empty: plugins looked for, as pydantic does


def test_a_command_run_in_process_leaves_the_hosts_gc_alone(ckpt: Path) -> None:
    from ucp.cli.main import build_app

    frozen, plugins = gc.get_freeze_count(), os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    result = CliRunner().invoke(build_app(["verify"]), ["verify", str(ckpt)])
    assert result.exit_code == 0 and result.output.startswith("OK"), result.output
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    assert os.environ.get("PYDANTIC_DISABLE_PLUGINS") == plugins
