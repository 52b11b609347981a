"""The device read paths run on a CPU "device": the staged ring (host staging buffers, copies into a ring
of device buffers, streams and events as no-ops) and the gds ring (KvikIO's file object stood in by one
reading with os.pread) give the plain CPU path's tokens and logits, with the KV cache in memory and
offloaded; the metrics say which device and read path ran; a device or read path this machine cannot
serve is a clear error naming the device or the missing extra."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from inference_models import save_hf, tiny_llama
from typer.testing import CliRunner

import training.inference.executor as executor_mod
from training.inference.api import infer
from training.inference.config import load_model
from training.inference.device import choose_read_path
from training.inference.errors import InferenceError
from training.inference.executor import Executor
from training.inference.generate import Sampling, generate
from training.inference.sources import open_weights
from ucp.cli.main import app

pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4]]
NEW = 5


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(tiny_llama(), tmp_path_factory.mktemp("device") / "hf")


class FakeCuFile:
    """kvikio.CuFile's pread, on the CPU: reads into a uint8 tensor with os.pread, a future of the count.
    ``short`` makes every read one byte short (KvikIO reports a short read as a smaller count)."""

    short = False

    def __init__(self, path: str, mode: str) -> None:
        assert mode == "r"
        self.fd = os.open(path, os.O_RDONLY)

    def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> Any:
        data = os.pread(self.fd, size - self.short, file_offset)
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        fut: Future[int] = Future()
        fut.set_result(len(data))
        return SimpleNamespace(get=fut.result)

    def close(self) -> None:
        os.close(self.fd)


FAKE_KVIKIO = SimpleNamespace(CuFile=FakeCuFile)


def run(path: Path, read_path: str, budget: int, kv_budget: int | None, tmp: Path) -> tuple[Any, ...]:
    model, source = load_model(open_weights(path))
    with Executor(model, source, budget, read_path=read_path, kvikio=FAKE_KVIKIO, pin_layers=False) as ex:
        assert ex.read_path == read_path and ex.device == torch.device("cpu")
        g = generate(ex, PROMPTS, NEW, keep_logits=True, kv_budget=kv_budget, kv_dir=tmp)
        s = generate(ex, PROMPTS, NEW, Sampling(temperature=1.0, top_k=20, seed=1)).tokens
        return g, s, ex.stats, ex.staging_bytes, ex.plan


# edges resident, KV cache in memory / everything streamed, KV cache on disk (one layer's block of 3)
@pytest.mark.parametrize(("budget", "kv"), [(1 << 20, False), (256 << 10, True)])
@pytest.mark.parametrize("path", ["staged", "gds"])
def test_device_read_paths_on_a_cpu_device_match_the_cpu_path(
    weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, kv: bool, budget: int
) -> None:
    if path == "gds":  # on a CPU the choice refuses gds: take it anyway, KvikIO stood in
        monkeypatch.setattr(executor_mod, "choose_read_path", lambda device, asked, caps: asked)
    kv_budget = 2 * 2 * 4096 if kv else None  # offloaded, through DeviceKV
    base, base_sampled, base_stats, _, base_plan = run(weights, "cpu", budget, kv_budget, tmp_path)
    got, sampled, stats, staging, plan = run(weights, path, budget, kv_budget, tmp_path)
    assert (base_plan.grain, plan.grain) == ("tensor", "layer")  # the finer grain is the cpu path's
    assert plan.streamed and (len(plan.streamed) == 5) == (budget < 1 << 20)
    assert got.tokens == base.tokens and sampled == base_sampled
    for a, b in zip(got.logits, base.logits):
        assert torch.equal(a, b)
    assert got.kv.offloaded == kv and (got.kv.bytes_read > 0) == kv
    passes = 2 * NEW * len(plan.streamed)  # two generations of NEW passes (the reader may be ahead by the ring)
    assert passes <= stats.groups_read <= passes + plan.slots
    assert 2 * NEW * len(base_plan.units) <= base_stats.groups_read
    assert staging == (0 if path == "gds" else 2 * plan.slot_bytes)


def test_gds_short_read_names_the_file(weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_mod, "choose_read_path", lambda device, asked, caps: asked)
    monkeypatch.setattr(FakeCuFile, "short", True)
    model, source = load_model(open_weights(weights))
    with Executor(model, source, 1 << 20, read_path="gds", kvikio=FAKE_KVIKIO, pin_layers=False) as ex:
        with pytest.raises(InferenceError, match=r"model\.safetensors: KvikIO read \d+ of \d+ bytes at offset"):
            generate(ex, PROMPTS, 2)


def test_metrics_name_device_and_read_path(weights: Path) -> None:
    plain = infer(weights, PROMPTS, max_new_tokens=3, memory_budget=1 << 20, pin_layers=False)
    staged = infer(weights, PROMPTS, max_new_tokens=3, memory_budget=1 << 20, pin_layers=False, read_path="staged")
    assert staged.tokens == plain.tokens
    assert (plain.metrics.device, plain.metrics.read_path, plain.metrics.staging_bytes) == ("cpu", "cpu", 0)
    assert (staged.metrics.device, staged.metrics.read_path) == ("cpu", "staged")
    assert (plain.metrics.read_path_reason, staged.metrics.read_path_reason) == ("auto on cpu", "asked for")
    assert staged.metrics.staging_bytes == 2 * staged.metrics.ring_bytes // (staged.metrics.prefetch_depth + 1)
    assert staged.metrics.pinned_bytes == (staged.metrics.staging_bytes if torch.cuda.is_available() else 0)
    out = CliRunner().invoke(
        app,
        [
            *"infer --prompt 1 --max-new-tokens 2 --no-pin-layers --memory-budget 1MiB --read-path staged --json".split(),
            str(weights),
        ],
    )
    assert out.exit_code == 0, out.output
    m = json.loads(out.output)["metrics"]
    assert (m["device"], m["read_path"]) == ("cpu", "staged") and m["staging_bytes"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_cuda_without_cuda_is_an_error_naming_the_device(weights: Path) -> None:
    with pytest.raises(InferenceError, match=r"device 'cuda' asked for, but CUDA is not usable in this process: "):
        infer(weights, PROMPTS, max_new_tokens=2, device="cuda")
    out = CliRunner().invoke(app, ["infer", str(weights), "--prompt", "1 2", "--device", "cuda:1"])
    assert out.exit_code == 2 and "device 'cuda:1' asked for, but CUDA is not usable" in out.output


def caps(kvikio: bool) -> Any:
    return SimpleNamespace(kvikio_importable=kvikio, kvikio_error=None if kvikio else "ModuleNotFoundError: kvikio")


CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_read_path_choice_and_its_errors() -> None:
    assert choose_read_path(CPU, None, caps(True)) == "cpu"
    assert choose_read_path(GPU, None, caps(True)) == "gds"
    assert choose_read_path(GPU, "auto", caps(False)) == "staged"
    assert choose_read_path(CPU, "staged", caps(False)) == "staged"
    assert choose_read_path(GPU, "gds", caps(True)) == "gds"
    with pytest.raises(InferenceError, match=r"read path 'gds' needs KvikIO, which is not importable here "):
        choose_read_path(GPU, "gds", caps(False))
    with pytest.raises(InferenceError, match=r"install the 'gds' extra, pip install 'ucp\[gds\]'"):
        choose_read_path(GPU, "gds", caps(False))
    with pytest.raises(InferenceError, match=r"read path 'gds' reads weights into GPU memory, but device 'cpu'"):
        choose_read_path(CPU, "gds", caps(True))
    with pytest.raises(InferenceError, match=r"read path 'cpu' computes on the CPU, but device 'cuda:0'"):
        choose_read_path(GPU, "cpu", caps(True))
    with pytest.raises(InferenceError, match=r"read path 'nvme' is not one of auto, cpu, staged, gds"):
        choose_read_path(CPU, "nvme", caps(True))


def test_cli_gds_on_the_cpu_names_the_device(weights: Path) -> None:
    out = CliRunner().invoke(app, ["infer", str(weights), "--prompt", "1 2", "--read-path", "gds"])
    assert out.exit_code == 2 and "read path 'gds' reads weights into GPU memory, but device 'cpu'" in out.output


class BrokenCuFile(FakeCuFile):
    def __init__(self, path: str, mode: str) -> None:
        raise OSError(5, "cuFileHandleRegister failed")


def test_auto_falls_back_to_staged_when_kvikio_cannot_read(weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_mod, "choose_read_path", lambda device, asked, caps: "gds")  # as on a GPU with KvikIO
    model, source = load_model(open_weights(weights))
    with Executor(model, source, 1 << 20, kvikio=FAKE_KVIKIO, pin_layers=False) as ex:
        assert (ex.read_path, ex.read_path_reason) == ("gds", "auto on cpu")
    with Executor(model, source, 1 << 20, kvikio=SimpleNamespace(CuFile=BrokenCuFile), pin_layers=False) as ex:
        assert ex.read_path == "staged"
        assert ex.read_path_reason.startswith("auto: KvikIO could not read ") and "cuFileHandleRegister" in str(
            ex.read_path_reason
        )
        assert len(generate(ex, PROMPTS, 2).tokens) == 2


def test_gpu_check_script_refuses_without_cuda_and_dry_runs_on_the_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tools import gpu_check_infer

    if not torch.cuda.is_available():
        assert gpu_check_infer.main([]) == 2
        assert "device 'cuda' asked for, but CUDA is not usable here" in capsys.readouterr().err
    tiny = "--device cpu --layers 2 --hidden 64 --intermediate 96 --heads 4 --kv-heads 2 --vocab 128 --batch 2"
    assert gpu_check_infer.main([*tiny.split(), "--new-tokens", "4", "--budget", "256KiB", "--dir", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out.split("\n| read path")[0])
    assert summary["correct"] and set(summary["paths"]) == {"cpu", "staged"}
    assert summary["paths"]["staged"]["staging_bytes"] > 0 and summary["paths"]["staged"]["reason"] == "asked for"
