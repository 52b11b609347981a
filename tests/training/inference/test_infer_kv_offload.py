"""The KV cache offloaded to disk when it exceeds its budget: the same logits and greedy tokens as the
in-memory cache, the exact K/V bytes written and read back, the file gone afterwards, through the
Python API and ``ucp infer --kv-budget``; a budget below one layer's block is a clear error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from inference_models import save_hf, tiny_llama
from typer.testing import CliRunner

from training.inference.api import infer
from training.inference.config import load_model
from training.inference.errors import BudgetError, InferenceError
from training.inference.executor import Executor
from training.inference.generate import Sampling, generate
from training.inference.sources import open_weights
from ucp.cli.main import app

pytest.importorskip("transformers")

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 16  # tiny_llama
PAGE = 4096


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(tiny_llama(), tmp_path_factory.mktemp("kv") / "hf")


def executor(path: Path) -> Executor:
    model, source = load_model(open_weights(path))
    return Executor(model, source, 1 << 20)


def block(batch: int, tokens: int) -> int:
    """One layer's K/V block on disk: K and V, each page-rounded."""
    return 2 * -(-batch * KV_HEADS * HEAD_DIM * 4 * tokens // PAGE) * PAGE


@pytest.mark.parametrize("slots", [1, 2])  # 3 blocks hold the whole cache: in memory
def test_offloaded_cache_gives_the_in_memory_logits_and_tokens(weights: Path, tmp_path: Path, slots: int) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4]]  # unequal: left padding and masks through the disk cache
    new = 6
    with executor(weights) as ex:
        mem = generate(ex, prompts, new, keep_logits=True)
        budget = slots * block(2, 7 + new)
        disk = generate(ex, prompts, new, keep_logits=True, kv_budget=budget, kv_dir=tmp_path)
        sampled = [
            generate(ex, prompts, new, Sampling(temperature=1.0, seed=3), kv_budget=kv).tokens for kv in (None, budget)
        ]
    assert not mem.kv.offloaded and mem.kv.resident_bytes == mem.kv.total_bytes
    assert disk.kv.offloaded and disk.kv.slots == slots and disk.kv.resident_bytes == slots * block(2, 13) <= budget
    assert disk.tokens == mem.tokens
    assert sampled[0] == sampled[1]
    for a, b in zip(disk.logits, mem.logits):
        assert torch.equal(a, b)
    assert os.listdir(tmp_path) == []  # the cache's file and directory are removed


def test_bytes_written_and_read_back_are_the_pages_each_step_touches(weights: Path, tmp_path: Path) -> None:
    """Batch 1: a token is 128 bytes of K (and of V) per layer, so each step's tokens lie in one page: the
    prefill writes it, every decode step reads back and rewrites one page of K and one of V per layer."""
    new = 20
    with executor(weights) as ex:
        g = generate(ex, [[1, 2, 3]], new, kv_budget=block(1, 23), kv_dir=tmp_path)
    page_pass = LAYERS * 2 * PAGE
    assert g.kv.offloaded and g.kv.slots == 1
    assert g.kv.bytes_written == page_pass * new  # prefill + 19 decode passes
    # the prefill reads nothing back; the reader may have read ahead one layer for a pass that never came
    assert page_pass * (new - 1) <= g.kv.bytes_read <= page_pass * (new - 1) + 2 * PAGE


def test_infer_reports_the_offloaded_cache(weights: Path, tmp_path: Path) -> None:
    prompts = [[1, 2, 3], [9, 8]]
    plain = infer(weights, prompts, max_new_tokens=4)
    assert not plain.metrics.kv_offloaded and plain.metrics.kv_bytes_read == 0
    off = infer(weights, prompts, max_new_tokens=4, kv_budget=block(2, 7), kv_dir=tmp_path)
    m = off.metrics
    assert off.tokens == plain.tokens
    assert m.kv_offloaded and m.kv_resident_bytes == block(2, 7) < m.kv_cache_bytes == plain.metrics.kv_cache_bytes
    assert m.kv_bytes_written > 0 and m.kv_bytes_read > 0

    res = CliRunner().invoke(
        app,
        [
            "infer", str(weights), "--prompt", "1 2 3", "--max-new-tokens", "20", "--json",
            "--kv-budget", str(block(1, 23)), "--kv-dir", str(tmp_path),
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["outputs"][0]["tokens"][:4] == plain.tokens[0]
    assert doc["metrics"]["kv_offloaded"] and doc["metrics"]["kv_bytes_read"] > 0
    # the default budget holds every layer: pinned, nothing streamed, yet the cache still goes through disk
    assert doc["metrics"]["pinned_layers"] == LAYERS and doc["metrics"]["bytes_read"] == 0


def test_kv_budget_below_one_layer_block_names_the_budget_needed(weights: Path, tmp_path: Path) -> None:
    need = block(4, 3 + 10)
    with executor(weights) as ex, pytest.raises(BudgetError) as err:
        generate(ex, [[1, 2, 3]] * 4, 10, kv_budget=need - 1, kv_dir=tmp_path)
    msg = str(err.value)
    assert "KV cache budget" in msg and f"({need} bytes)" in msg and "batch 4 x 13 tokens" in msg
    res = CliRunner().invoke(
        app, ["infer", str(weights), "--prompt", "1 2 3", "--max-new-tokens", "10", "--kv-budget", "1KiB"]
    )
    assert res.exit_code == 2 and "KV cache budget 1 KiB is too small" in res.output, res.output
    assert os.listdir(tmp_path) == []


def test_a_kv_read_failure_reaches_compute_naming_the_file(weights: Path, tmp_path: Path) -> None:
    def lose_the_file(n: int) -> None:  # after the prefill: the cache's file is gone under the run
        if n == 1:
            for f in tmp_path.glob("ucp-kv-*/kv.bin"):
                f.unlink()

    with (
        executor(weights) as ex,
        pytest.raises(InferenceError, match=r"reading the KV cache of layer \d from .*kv.bin"),
    ):
        generate(ex, [[1, 2, 3]], 20, kv_budget=block(1, 23), kv_dir=tmp_path, on_token=lose_the_file)
    assert os.listdir(tmp_path) == []
