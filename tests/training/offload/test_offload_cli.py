"""``python -m training.run`` with optimizer offload: --offload-optimizer/--nvme-path/--sub-group-size/
--swap-budget and a DeepSpeed --ds-config; same losses as without; bad options exit 2 naming the fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.run import main, parse_args

ARGS = ["--steps", "3", "--model", "tiny", "--micro-batch", "2", "--seq-len", "32", "--lr", "1e-2", "--clip", "1.0"]


def losses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[float]:
    assert main(argv) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return [x["loss"] for x in out if "step" in x]


def test_nvme_offload_from_the_command_line_gives_the_same_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = losses(ARGS, capsys)
    offload = ["--offload-optimizer", "nvme", "--nvme-path", str(tmp_path), "--sub-group-size", "65536"]
    assert losses([*ARGS, *offload, "--swap-budget", "4MiB"], capsys) == plain
    assert list(tmp_path.iterdir()) == []  # the run's swap directory went with it


def test_a_deepspeed_config_file_drives_the_offload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = tmp_path / "ds.json"
    zero = {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    ds.write_text(json.dumps({"train_batch_size": 2, "zero_optimization": zero}))
    args = parse_args([*ARGS, "--zero", "2", "--ds-config", str(ds)], world=1)
    assert args.offload.offload_optimizer.device == "cpu" and args.offload.zero_stage == 2
    args = parse_args([*ARGS, "--zero", "2", "--ds-config", str(ds), "--offload-optimizer", "none"], world=1)
    assert args.offload.offload_optimizer.device == "none"  # the option overrides the file
    assert losses([*ARGS, "--zero", "2", "--ds-config", str(ds)], capsys) == losses([*ARGS, "--zero", "2"], capsys)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--offload-optimizer", "nvme"], "device 'nvme' needs nvme_path"),
        (["--offload-optimizer", "nvme", "--nvme-path", "/x", "--swap-budget", "8M"], "is ambiguous"),
        (["--zero", "1", "--ds-config", "STAGE3"], "--ds-config names ZeRO stage 3, --zero is 1"),
        (["--ds-config", "TYPO"], "zero_optimization.sub_grop_size: unknown key"),
        (["--ds-config", "/no/such.json"], "No such file or directory"),
    ],
)
def test_bad_offload_options_exit_2_naming_the_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    files = {"STAGE3": {"zero_optimization": {"stage": 3}}, "TYPO": {"zero_optimization": {"sub_grop_size": 1}}}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    extra = [str(tmp_path / x) if x in files else x for x in extra]
    with pytest.raises(SystemExit) as info:
        parse_args([*ARGS, *extra], world=1)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
