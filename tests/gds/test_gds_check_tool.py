"""``tools/gpu_check_gds.py``, the script prepared for a lent GPU, runs on any machine: here it times the
staged path and, for ``ucp.load(map_location="cuda")``, reports the clear refusal where CUDA is absent
(or, on a GPU, loads through each path bit-exactly)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check_gds.py"


def test_the_gpu_check_runs_and_reports_the_load_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("_gpu_check_gds", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rc = tool.main(["--size-mib", "1", "--repeat", "1", "--dir", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and all(r["bit_exact"] for r in out["results"])
    loads = out["ucp_load"]
    if out["capabilities"]["cuda_available"]:
        assert loads["ran"] and all(r["bit_exact"] and r["path_as_asked"] for r in loads["results"])
        assert [r["path"] for r in loads["results"]][:2] == ["staged", "staged"]
    else:
        assert loads == {
            "ran": False,
            "error": "map_location='cuda': CUDA is not available in this process "
            "(no GPU visible, or torch built without CUDA); load to 'cpu' instead",
        }
    assert list(tmp_path.iterdir()) == []  # the work directory is removed
