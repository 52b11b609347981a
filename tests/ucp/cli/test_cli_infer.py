"""``ucp infer``: token ids without a tokenizer, text through tokenizer.json, batches from a prompts file,
the --json metrics, and bad input exiting 2 with one line naming the fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from inference_models import hf_greedy, save_hf, tiny_llama
from typer.testing import CliRunner

from ucp.cli.main import app

pytest.importorskip("transformers")
runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    hf = tiny_llama()
    return hf, save_hf(hf, tmp_path_factory.mktemp("infer") / "hf")


def test_json_tokens_equal_transformers_and_metrics_are_reported(model_dir: tuple[object, Path]) -> None:
    hf, path = model_dir
    args = ["infer", str(path), "--prompt", "5 9 2 77", "--prompt", "3,1,4,1", "--max-new-tokens", "5"]
    result = runner.invoke(app, [*args, "--memory-budget", "1MiB", "--prefetch", "1", "--no-pin-layers", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [o["tokens"] for o in doc["outputs"]] == hf_greedy(hf, torch.tensor([[5, 9, 2, 77], [3, 1, 4, 1]]), 5)
    assert [o["text"] for o in doc["outputs"]] == [None, None]
    m = doc["metrics"]
    assert m["batch"] == 2 and m["new_tokens"] == 5 and m["prefetch_depth"] == 1
    assert m["budget_bytes"] == 1 << 20 and m["resident_bytes"] + m["ring_bytes"] <= m["budget_bytes"]
    assert m["pinned_layers"] == 0 and m["streamed_layers"] == 3 and not m["kv_offloaded"]
    layer_bytes = 4 * (3 * 64 * 96 + 64 * 64 * 2 + 2 * 32 * 64 + 2 * 64)
    assert m["streamed_bytes_per_pass"] >= 3 * layer_bytes  # the three layers stream every pass
    assert m["bytes_read"] >= 5 * m["streamed_bytes_per_pass"]  # prefill + 4 decode passes
    assert m["bytes_read_per_token"] == m["bytes_read"] / 10
    assert 0.0 <= m["read_hidden_fraction"] <= 1.0
    assert m["time_to_first_token_s"] > 0 and m["decode_tokens_per_s"] > 0 and m["read_gb_per_s"] > 0
    assert m["peak_rss_bytes"] > 0 and m["kv_cache_bytes"] == 2 * 3 * 2 * 2 * 16 * (4 + 5) * 4


def test_prompts_file_in_batches_and_human_output(model_dir: tuple[object, Path], tmp_path: Path) -> None:
    hf, path = model_dir
    f = tmp_path / "prompts.txt"
    f.write_text("1 2 3\n\n7 8\n100 101 102 103\n")
    result = runner.invoke(
        app, ["infer", str(path), "--prompts-file", str(f), "--batch-size", "2", "--max-new-tokens", "3"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for prompt, line in zip(["1 2 3", "7 8", "100 101 102 103"], lines):
        want = hf_greedy(hf, torch.tensor([[int(t) for t in prompt.split()]]), 3)[0]
        assert line == f"{prompt} -> {' '.join(map(str, want))}"
    assert "tokens/s" in lines[3] and "read per token" in lines[3] and "hidden" in lines[3]


def test_text_prompts_through_tokenizer_json(model_dir: tuple[object, Path], tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    _, src = model_dir
    path = tmp_path / "with-tok"
    path.mkdir()
    for p in src.iterdir():
        (path / p.name).write_bytes(p.read_bytes())
    words = [f"w{i}" for i in range(128)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path / "tokenizer.json"))
    result = runner.invoke(app, ["infer", str(path), "--prompt", "w5 w9 w2 w77", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)["outputs"][0]
    ids = runner.invoke(app, ["infer", str(src), "--prompt", "5 9 2 77", "--max-new-tokens", "4", "--json"])
    assert out["tokens"] == json.loads(ids.stdout)["outputs"][0]["tokens"]
    assert out["text"] == " ".join(words[t] for t in out["tokens"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--memory-budget", "30KiB"],
            "error: memory budget 30 KiB is too small: final norm and head needs a buffer of 40 KiB",
        ),
        (["--memory-budget", "12M"], "ambiguous"),
        (["--prompts-file", "x.txt"], "give --prompt (repeatable) or --prompts-file, not both"),
        (["--top-p", "0"], "--top-p must be > 0"),
        (["--dtype", "int8"], "--dtype 'int8': expected float32, bfloat16 or float16"),
    ],
)
def test_bad_input_exits_2_naming_the_fault(model_dir: tuple[object, Path], extra: list[str], message: str) -> None:
    _, path = model_dir
    result = runner.invoke(app, ["infer", str(path), "--prompt", "1 2", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_missing_weights_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["infer", str(tmp_path / "nope"), "--prompt", "1"])
    assert result.exit_code == 2 and "nope: no such file or directory" in result.stderr


def test_cli_defaults_are_the_api_defaults() -> None:
    import inspect as pyinspect

    import typer.main

    from aio.sizes import parse_size
    from training.inference.api import infer
    from training.inference.generate import Sampling

    cmd = typer.main.get_command(app).commands["infer"]  # type: ignore[attr-defined]
    cli = {p.name: p.default for p in cmd.params}
    api = {n: p.default for n, p in pyinspect.signature(infer).parameters.items()}
    assert cli["max_new_tokens"] == api["max_new_tokens"]
    assert parse_size(cli["memory_budget"]) == api["memory_budget"]
    assert cli["prefetch"] is api["prefetch"] is None and cli["batch_size"] is api["batch_size"] is None
    assert getattr(torch, cli["dtype"]) == api["dtype"]
    s = Sampling()
    assert (cli["temperature"], cli["top_k"], cli["top_p"], cli["seed"]) == (s.temperature, s.top_k, s.top_p, s.seed)
