"""One-shot commands (``reshape``, ``convert``, ``export``, ``verify``) in fresh processes, as users run them.

Issue 21: they spend at most 0.3 s outside their data movement. So they import no torch, no numpy and no
other command's module when they move only bytes, and nothing waits at exit on threads that have no work left (the process ends through
``ucp.shutdown.exit_now``, skipping module teardown). These tests hold what must not be lost on the
way: every output complete and verifiable (bit-exact tensors), the exit codes (0 done, 1 damaged,
2 bad input), all of stdout when it is a pipe, and ``UCP_TIMINGS=1``'s phase line on stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import REPO  # noqa: E402
from safetensors.torch import load_file, save_file
from ucp_helpers import same_bytes  # noqa: E402

import ucp  # noqa: E402

TIMINGS = re.compile(r"^ucp timings: imports=(\S+) setup=(\S+) io=(\S+) exit=(\S+) total=(\S+)$", re.M)


def ucp_cli(*argv: str, timings: bool = False, modules: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ucp.cli ARGV`` in a fresh process, stdout and stderr pipes.

    ``modules``: run the console script's ``main`` instead, and write there the names in ``sys.modules`` as the
    process ends (its exit handlers run last: :func:`ucp.shutdown.exit_now`). ``-X importtime`` would miss what
    ``importlib.import_module`` imports (the command modules)."""
    env = {k: v for k, v in os.environ.items() if k != "UCP_TIMINGS"}
    if timings:
        env["UCP_TIMINGS"] = "1"
    entry = ["-m", "ucp.cli"]
    if modules is not None:
        entry = ["-c", _PROBE, str(modules)]
    return subprocess.run(
        [sys.executable, *entry, *argv], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )


_PROBE = (
    "import atexit, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write('\\n'.join(sorted(sys.modules))))\n"
    "from ucp.cli.main import main\n"
    "main()\n"
)


def phases(run: subprocess.CompletedProcess[str]) -> dict[str, float]:
    found = TIMINGS.findall(run.stderr)
    assert len(found) == 1, run.stderr[-2000:]
    return dict(zip(("imports", "setup", "io", "exit", "total"), map(float, found[0])))


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "embed.weight": torch.randn(33, 16, generator=g).bfloat16(),
        **{f"layers.{i}.w": torch.randn(16, 16, generator=g) for i in range(6)},
        "layers.0.b": torch.randn(16, generator=g).half(),
        "ids": torch.arange(9, dtype=torch.int64),
        "big": torch.randn(128, 256, generator=g),  # 128 KiB: staged writes copy it in large blocks
    }


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one-shot")
    model = _model()
    ucp.save({"model": model, "step": 4}, root / "ck", step=4)
    save_file(model, root / "model.safetensors")
    return {"root": root, "ck": root / "ck", "hf": root / "model.safetensors", "model": model}


def _same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and same_bytes(got[k], v), k


def _verified(path: Path) -> None:
    run = ucp_cli("verify", str(path), "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["ok"], run.stdout + run.stderr


COMMANDS = ["reshape", "convert", "export", "verify"]


def _argv(command: str, src: dict[str, Any], dst: Path) -> list[str]:
    return {
        "reshape": ["reshape", str(src["ck"]), str(dst), "--dp", "2", "--zero", "1"],
        "convert": ["convert", str(src["hf"]), str(dst)],
        "export": ["export", str(src["ck"]), str(dst)],
        "verify": ["verify", str(src["ck"])],
    }[command]


def _check_output(command: str, src: dict[str, Any], dst: Path) -> None:
    """What the command wrote is complete: verifiable and bit-exact."""
    if command == "reshape":
        _verified(dst)
        _same_model(ucp.load(dst)["model"], src["model"])
        mesh = ucp.read_manifest(dst).topology.mesh
        assert mesh is not None and mesh["dp"] == 2
    elif command == "convert":
        _verified(dst)
        _same_model(ucp.load(dst)["model"], src["model"])
    elif command == "export":
        _same_model(load_file(dst / "model.safetensors"), src["model"])


@pytest.mark.parametrize("command", COMMANDS)
def test_outputs_are_complete_and_no_heavy_module_is_imported(
    src: dict[str, Any], tmp_path: Path, command: str
) -> None:
    dst = tmp_path / "dst"
    run = ucp_cli(*_argv(command, src, dst), modules=tmp_path / "modules.txt")
    assert run.returncode == 0, run.stderr[-3000:]
    modules = set((tmp_path / "modules.txt").read_text().split())
    assert "ucp.cli.main" in modules and f"ucp.cli.{command}" in modules  # the probe works here
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}, "torch imported"
    # nor numpy: bytes move through memoryviews (ucp.format.regions.RawArray), large copies through ctypes
    assert not {m for m in modules if m == "numpy" or m.startswith("numpy.")}, "numpy imported"
    others = {f"ucp.cli.{name}" for name in ("demo", "bench", "tune", "inspect", "ls", "infer", *COMMANDS)}
    assert not modules & (others - {f"ucp.cli.{command}"}), "another command's module imported"
    assert "rich.progress" not in modules  # no bar on a pipe: not even its module
    assert "rich._emoji_codes" not in modules  # no emoji codes: names print as they are
    if command in ("verify", "export"):  # reading a manifest needs the box math, not the layout language
        assert "reshard.box" in modules and "reshard.layout" not in modules
    word = {"reshape": "reshaped", "convert": "converted", "export": "exported", "verify": "OK"}[command]
    assert run.stdout.startswith(word) and run.stdout.endswith("\n"), run.stdout
    _check_output(command, src, dst)


@pytest.mark.parametrize("command", COMMANDS)
def test_json_on_a_pipe_arrives_whole(src: dict[str, Any], tmp_path: Path, command: str) -> None:
    dst = tmp_path / "dst"
    run = ucp_cli(*_argv(command, src, dst), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout)  # all of it: the process ended only after stdout was flushed
    if command == "verify":
        assert doc["ok"] and doc["tensors"] == len(src["model"]) + 0
    else:
        assert doc["tensors"] == len(src["model"])
    _check_output(command, src, dst)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_phase_timer_prints_its_phases_and_exit_waits_for_nothing(
    src: dict[str, Any], tmp_path: Path, command: str
) -> None:
    exits = []
    for attempt in range(3):  # the machine may be busy: the best of three runs
        dst = tmp_path / f"dst{attempt}"
        run = ucp_cli(*_argv(command, src, dst), timings=True)
        assert run.returncode == 0, run.stderr[-3000:]
        p = phases(run)
        assert all(v >= 0 for v in p.values()) and p["io"] > 0 and p["imports"] > 0, p
        assert abs(sum(p[k] for k in ("imports", "setup", "io", "exit")) - p["total"]) < 0.01, p
        assert run.stderr.rstrip().endswith(TIMINGS.findall(run.stderr)[0][-1])  # the last line of all
        _check_output(command, src, dst)
        exits.append(p["exit"])
    assert min(exits) < 0.03, exits  # joining the aio engine's idle reaper alone took 50-80 ms


def test_no_phase_line_unless_asked(src: dict[str, Any]) -> None:
    run = ucp_cli("verify", str(src["ck"]))
    assert run.returncode == 0 and "ucp timings" not in run.stderr + run.stdout


def test_exit_codes_stay_what_they_were(src: dict[str, Any], tmp_path: Path) -> None:
    # 2: bad input — DST in the way, a missing source, not a checkpoint
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    for argv in (
        ["reshape", str(src["ck"]), str(taken), "--dp", "2"],
        ["convert", str(tmp_path / "missing.safetensors"), str(tmp_path / "c")],
        ["export", str(tmp_path), str(tmp_path / "e")],
        ["verify", str(tmp_path / "missing")],
    ):
        run = ucp_cli(*argv, timings=True)
        assert run.returncode == 2, (argv, run.stderr)
        assert run.stderr.startswith("error:") and phases(run)["total"] > 0, run.stderr
    # 1: damaged data, its problems all on stdout
    damaged = tmp_path / "damaged"
    assert ucp_cli("reshape", str(src["ck"]), str(damaged)).returncode == 0
    manifest = ucp.read_manifest(damaged)
    piece = next(iter(manifest.tensors.values())).pieces[0]
    with open(damaged / piece.file, "r+b") as f:
        f.seek(piece.offset)
        first = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([first[0] ^ 0xFF]))
    run = ucp_cli("verify", str(damaged), timings=True)
    assert run.returncode == 1 and run.stdout.startswith("PROBLEMS") and run.stdout.endswith("\n"), run.stdout
    run = ucp_cli("export", str(damaged), str(tmp_path / "e2"))
    assert run.returncode == 1 and not (tmp_path / "e2").exists(), run.stderr
