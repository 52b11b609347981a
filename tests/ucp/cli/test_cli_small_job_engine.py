"""One-shot commands on a small source move its bytes with aio's thread engine (``ucp.cli.common.small_job_engine``).

Issue 21: a process that made a kernel AIO context waits ~35 ms as it ends (the context's teardown waits for an
RCU grace period), more than a small command's data movement; so no ``[aio]`` ring is mapped in such a process.
Larger sources keep libaio, and the choice does not outlive a command run in-process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO  # noqa: E402
from safetensors.torch import save_file

import ucp  # noqa: E402
from aio import AioConfig
from aio.engines import LibaioEngine, ThreadEngine, create_engine, libaio_status
from ucp.cli import common

# Runs the console script's main() and, as the process ends, writes how many kernel AIO rings it has mapped.
_PROBE = (
    "import atexit, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write(str(sum('[aio]' in l for l in open('/proc/self/maps')))))\n"
    "from ucp.cli.main import main\n"
    "main()\n"
)

pytestmark = pytest.mark.skipif(not libaio_status()[0], reason="kernel AIO unavailable: nothing to avoid")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("small-job")
    model = {f"l{i}.w": torch.randn(64, 64) for i in range(4)}
    ucp.save({"model": model, "step": 1}, root / "ck", step=1)
    save_file(model, root / "model.safetensors")
    return {"ck": root / "ck", "hf": root / "model.safetensors"}


@pytest.mark.parametrize("command", ["reshape", "convert", "export", "verify"])
def test_a_small_one_shot_command_maps_no_kernel_aio_ring(src: dict[str, Path], tmp_path: Path, command: str) -> None:
    argv = {
        "reshape": ["reshape", str(src["ck"]), str(tmp_path / "dst"), "--dp", "2", "--zero", "1"],
        "convert": ["convert", str(src["hf"]), str(tmp_path / "dst")],
        "export": ["export", str(src["ck"]), str(tmp_path / "dst")],
        "verify": ["verify", str(src["ck"])],
    }[command]
    out = tmp_path / "rings"
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, str(out), *argv], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.read_text() == "0"
    if command in ("reshape", "convert"):  # what the thread engine wrote is whole
        assert ucp.verify(tmp_path / "dst").ok


def test_the_choice_follows_the_source_size_and_ends_with_the_block(
    src: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def built() -> type:
        engine = create_engine(AioConfig())
        engine.close()
        return type(engine)

    size = sum(f.stat().st_size for f in src["ck"].iterdir())
    with common.small_job_engine(src["ck"]):
        assert built() is ThreadEngine
    assert built() is LibaioEngine
    monkeypatch.setattr(common, "SMALL_SOURCE_BYTES", size - 1)  # one byte too many: libaio stays
    with common.small_job_engine(src["ck"]):
        assert built() is LibaioEngine
    for other in ("s3://bucket/ck", None):  # nothing local to size: no change
        with common.small_job_engine(other):
            assert built() is LibaioEngine
