"""``convert`` of safetensors and ``export`` to safetensors (no cast) move bytes without importing torch.

Why: importing torch takes ~1.5 s on the reference VM, longer than converting or exporting a small model
(issue 21: one-shot commands spend at most 0.3 s outside their data movement). Each library call runs
in a fresh process that must end without torch in ``sys.modules``; the output is then checked here,
bit for bit, against the input. What the byte copy cannot express (an empty tensor) and what needs
torch (a cast) still work, through torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO  # noqa: E402
from safetensors.torch import load_file, save_file
from ucp_helpers import same_bytes  # noqa: E402

import ucp  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int8, torch.bool]


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {f"w_{str(d).removeprefix('torch.')}": (torch.randn(7, 5, generator=g) * 50).to(d) for d in DTYPES}
    out["scalar"] = torch.tensor(3.5)
    out["odd.bytes"] = torch.arange(3, dtype=torch.int8)  # puts later tensors at odd offsets in its file
    return out


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter; its last stdout line, which must report that torch stayed out."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def _check_model(dst: Path, want: dict[str, torch.Tensor]) -> None:
    got = ucp.load(dst)["model"]
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and same_bytes(got[name], t), name
    assert ucp.verify(dst).ok


def test_convert_of_a_safetensors_file_imports_no_torch(tmp_path: Path) -> None:
    want = _weights()
    save_file(want, tmp_path / "model.safetensors")
    code = (
        "import sys; from ucp.conversion.importers import convert; "
        f"r = convert({str(tmp_path / 'model.safetensors')!r}, {str(tmp_path / 'out')!r}); "
        "print(r.tensors, 'torch' in sys.modules)"
    )
    assert _fresh(code) == f"{len(want)} False"
    _check_model(tmp_path / "out", want)
    assert ucp.read_manifest(tmp_path / "out").metadata["source"]["format"] == "hf"


def test_convert_of_a_sharded_set_imports_no_torch(tmp_path: Path) -> None:
    want = _weights()
    names = sorted(want)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for file, keys in shards.items():
        save_file({k: want[k] for k in keys}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    code = (
        "import sys; from ucp.conversion.importers import convert; "
        f"convert({str(tmp_path)!r}, {str(tmp_path / 'out')!r}); print('torch' in sys.modules)"
    )
    assert _fresh(code) == "False"
    _check_model(tmp_path / "out", want)


def test_an_empty_tensor_takes_the_torch_path_and_converts_exactly(tmp_path: Path) -> None:
    want = {**_weights(), "empty": torch.zeros(0, 3)}
    save_file(want, tmp_path / "model.safetensors")
    code = (
        "import sys; from ucp.conversion.importers import convert; "
        f"convert({str(tmp_path / 'model.safetensors')!r}, {str(tmp_path / 'out')!r}); print('torch' in sys.modules)"
    )
    assert _fresh(code) == "True"
    _check_model(tmp_path / "out", want)


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model = {**_weights(), "empty": torch.zeros(0, 2)}
    ucp.save({"model": model, "step": 3}, tmp_path / "ck")
    return tmp_path / "ck", model


def test_export_without_a_cast_imports_no_torch(ckpt, tmp_path: Path) -> None:
    src, model = ckpt
    code = (
        "import sys; from ucp.conversion.exporters import export; "
        f"r = export({str(src)!r}, {str(tmp_path / 'hf')!r}, max_shard_size=200); "
        "print(len(r.files), 'torch' in sys.modules)"
    )
    files, torch_loaded = _fresh(code).split()
    assert int(files) > 2 and torch_loaded == "False"  # several shards and their index
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got = {k: v for f in sorted(set(index["weight_map"].values())) for k, v in load_file(tmp_path / "hf" / f).items()}
    assert sorted(got) == sorted(model)
    for name, t in model.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and same_bytes(got[name], t), name


def test_export_with_a_cast_still_casts(ckpt, tmp_path: Path) -> None:
    src, model = ckpt
    code = (
        "import sys; from ucp.conversion.exporters import export; "
        f"export({str(src)!r}, {str(tmp_path / 'hf')!r}, dtype='bf16'); print('torch' in sys.modules)"
    )
    assert _fresh(code) == "True"
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for name, t in model.items():
        expect = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == expect.dtype and same_bytes(got[name], expect), name
