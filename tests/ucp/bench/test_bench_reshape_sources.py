"""tools/bench_reshape.py --source deepspeed: the steps it times, in order, and the targets it checks.

The DeepSpeed checkpoint, the ``ucp`` and ``ds_to_universal`` processes are faked (no DeepSpeed run, no
page cache dropped on the shared machine); the ``cp -r`` step runs for real on a small checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

import ucp

REPO = Path(__file__).resolve().parents[3]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_bench_reshape_sources", REPO / "tools" / "bench_reshape.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_timings_reads_the_ucp_timings_line() -> None:
    module = _bench()
    err = "warning: x\nucp timings: imports=0.412 setup=0.031 io=1.920 exit=0.004 total=2.367\n"
    assert module.parse_timings(err) == {"imports": 0.412, "setup": 0.031, "io": 1.92, "exit": 0.004, "total": 2.367}
    assert module.parse_timings("no such line\n") is None


def test_deepspeed_source_times_copy_reshape_and_both_converters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _bench()
    ds, src = tmp_path / "ds", tmp_path / "converted"
    (ds / "global_step1").mkdir(parents=True)
    (ds / "latest").write_text("global_step1")
    ucp.save({"w": torch.arange(8.0)}, src)
    monkeypatch.setattr(module, "make_deepspeed_source", lambda root, model: (ds, src))
    monkeypatch.setattr(module, "drop_caches", lambda mode, s: True)  # never drop the shared page cache
    commands: list[list[str]] = []

    def run(cmd: list[str], env: dict[str, str] | None = None, stderr: list[str] | None = None) -> str:
        commands.append(cmd)
        dst = Path(cmd[cmd.index("reshape") + 2]) if "reshape" in cmd else None
        if "convert" in cmd:
            dst = Path(cmd[cmd.index("convert") + 2])
        if "--output_folder" in cmd:
            dst = Path(cmd[cmd.index("--output_folder") + 1])
        assert dst is not None
        dst.mkdir(parents=True)
        if stderr is not None:
            assert env is not None and env["UCP_TIMINGS"] == "1"
            stderr.append("ucp timings: imports=0.5 setup=0.1 io=1.0 exit=0.0 total=1.6\n")
        return json.dumps({"peak_rss_bytes": 300 << 20})

    monkeypatch.setattr(module, "_run", run)
    assert module.main(["--source", "deepspeed", "--root", str(tmp_path / "w"), "--rounds", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["seconds"]) == ["cp -r + sync", "reshape dp4, no layout", "ucp convert", "ds_to_universal"]
    reshapes = [c for c in commands if "reshape" in c]
    assert len(reshapes) == 2 and all(c[c.index("reshape") + 1] == str(src) for c in reshapes)
    assert all("--dp" in c and c[c.index("--dp") + 1] == "4" and "--layout" not in c for c in reshapes)
    assert all(c[c.index("--input_folder") + 1] == str(ds / "global_step1") for c in commands if "--input_folder" in c)
    assert out["rss_bound_bytes"] == 1 << 30  # issue 21's bound: 1 GiB flat
    assert out["phase_runs"]["reshape dp4, no layout"][0]["io"] == 1.0
    assert set(out["pass"]) == {"reshape dp4, no layout", "ucp convert"}
    assert out["convert_speedup"] == pytest.approx(
        out["median_seconds"]["ds_to_universal"] / out["median_seconds"]["ucp convert"]
    )
