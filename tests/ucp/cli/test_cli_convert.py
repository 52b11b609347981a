"""``ucp convert``: a real conversion with ``--json``, and the errors users meet (unsafe pickle, missing
path, unknown format, existing destination), each naming what is at fault."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import ucp  # noqa: E402
from tools.peers.deepspeed_ckpt import deepspeed_missing, make_checkpoint, reference_fp32  # noqa: E402
from ucp.cli.main import app  # noqa: E402
from ucp.conversion.importers import ConvertReport  # noqa: E402

runner = CliRunner()


def _text(result) -> str:  # noqa: ANN001 - click's Result
    return result.output + (result.stderr if result.stderr_bytes is not None else "")


@pytest.mark.skipif(deepspeed_missing() is not None, reason=deepspeed_missing() or "")
def test_convert_deepspeed_json(tmp_path: Path) -> None:
    ckpt = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=3)
    result = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, _text(result)
    report = ConvertReport.model_validate_json(result.stdout)
    assert (report.format, report.step, report.tensors) == ("deepspeed", 3, 160) and report.bytes > 0
    masters = ucp.load(tmp_path / "out")["optimizer"]["fp32_master"]
    for name, want in reference_fp32(ckpt).items():
        assert torch.equal(masters[name], want), name


def test_convert_hf_human_output(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2, 3)}, tmp_path / "model.safetensors")
    result = runner.invoke(app, ["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "out"), "--from", "hf"])
    assert result.exit_code == 0, _text(result)
    assert "converted" in result.stdout and "1 tensors" in result.stdout
    assert torch.equal(ucp.load(tmp_path / "out")["model"]["w"], torch.ones(2, 3))


def _fake_deepspeed(folder: Path, payload: object) -> Path:
    """A DeepSpeed-looking tag folder whose model-states pickle holds ``payload``."""
    tag = folder / "global_step1"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    torch.save({"module": {"w": torch.zeros(2)}, "extra": payload}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return folder


def test_unsafe_pickle_names_class_and_file(tmp_path: Path) -> None:
    src = _fake_deepspeed(tmp_path / "ds", datetime.date(2025, 1, 2))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out")])
    text = _text(result)
    assert result.exit_code == 2, text
    assert "datetime.date" in text and "mp_rank_00_model_states.pt" in text and "--trust-pickle" in text
    assert not (tmp_path / "out").exists()


def test_trust_pickle_gets_past_the_allow_list(tmp_path: Path) -> None:
    """With --trust-pickle the date loads; the fake checkpoint then fails on its (empty) optimizer file."""
    src = _fake_deepspeed(tmp_path / "ds", datetime.date(2025, 1, 2))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--trust-pickle"])
    text = _text(result)
    assert result.exit_code == 1 and "datetime.date" not in text  # a damaged checkpoint: 1
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in text and "zero_stage" in text


def test_missing_source(tmp_path: Path) -> None:
    result = runner.invoke(app, ["convert", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "nope" in _text(result) and "no such file" in _text(result)


def test_unknown_format_option_and_unknown_folder(tmp_path: Path) -> None:
    result = runner.invoke(app, ["convert", str(tmp_path), str(tmp_path / "out"), "--from", "megatron"])
    assert result.exit_code == 2 and "megatron" in _text(result)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hello")
    result = runner.invoke(app, ["convert", str(tmp_path / "src"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "not a checkpoint of a known format" in _text(result)


def test_existing_destination_needs_force(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("data")
    result = runner.invoke(app, ["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "out"), "--force"])
    assert result.exit_code == 2 and "not a UCP checkpoint" in _text(result)
    assert (tmp_path / "out" / "keep.txt").exists()
    ok = tmp_path / "ok"
    assert runner.invoke(app, ["convert", str(tmp_path / "model.safetensors"), str(ok)]).exit_code == 0
    again = runner.invoke(app, ["convert", str(tmp_path / "model.safetensors"), str(ok), "--json"])
    assert again.exit_code == 2 and "already exists" in _text(again)
    forced = runner.invoke(app, ["convert", str(tmp_path / "model.safetensors"), str(ok), "--json", "--force"])
    assert forced.exit_code == 0 and json.loads(forced.stdout)["tensors"] == 1


def test_convert_progress_shows_a_percentage_not_raw_byte_counts(monkeypatch) -> None:
    """The convert bar counts files while reading, then bytes while writing: it shows how far in percent."""
    import io

    from rich.console import Console

    from ucp.cli import common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err", Console(file=buf, force_terminal=True, width=120))
    with common.progress_bar("convert (deepspeed)", percent=True) as update:
        update(1_250_000_000, 2_500_000_000, "writing")
        common.err.file.flush()
    shown = buf.getvalue()
    assert "50%" in shown and "1250000000" not in shown
    buf.truncate(0)
    with common.progress_bar("reshape (MiB)") as update:  # the default still counts
        update(3, 7, "x")
    assert "3/7" in buf.getvalue()
