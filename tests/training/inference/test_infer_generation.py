"""Generation: a batch of unequal prompts gives each prompt's own tokens; sampling is seeded, top-k 1 and a
tiny top-p are greedy; a UCP checkpoint reshaped for tensor parallelism (tensors in many pieces) streams
to the same logits; the reference GPT streamed equals training.models.gpt.GPT in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_models import hf_logits, save_hf, save_ucp, tiny_llama

import ucp
from reshard.presets import ModelDims, llama_layout
from reshard.spec import Mesh
from training.inference.config import load_model
from training.inference.executor import Executor
from training.inference.generate import Sampling, generate
from training.inference.sources import open_weights
from training.models.gpt import GPT, PRESETS
from ucp.conversion.reshape import reshape

pytest.importorskip("transformers")


def executor(path: Path, budget: int = 1 << 20) -> Executor:
    model, source = load_model(open_weights(path))
    return Executor(model, source, budget)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(tiny_llama(), tmp_path_factory.mktemp("llama") / "hf")


def test_batch_of_unequal_prompts_equals_each_alone(llama_dir: Path) -> None:
    prompts = [[5, 9, 2, 77, 31, 8, 100], [3], [60, 61, 62, 63]]
    with executor(llama_dir) as ex:
        together = generate(ex, prompts, 7)
        alone = [generate(ex, [p], 7).tokens[0] for p in prompts]
    assert together.tokens == alone


def test_sampling_is_seeded_and_topk1_or_tiny_topp_is_greedy(llama_dir: Path) -> None:
    prompts = [[1, 2, 3], [4, 5, 6]]
    with executor(llama_dir) as ex:
        greedy = generate(ex, prompts, 8).tokens
        hot = Sampling(temperature=5.0, seed=7)
        a, b = generate(ex, prompts, 8, hot).tokens, generate(ex, prompts, 8, hot).tokens
        other = generate(ex, prompts, 8, Sampling(temperature=5.0, seed=8)).tokens
        topk1 = generate(ex, prompts, 8, Sampling(temperature=5.0, top_k=1, seed=3)).tokens
        topp = generate(ex, prompts, 8, Sampling(temperature=5.0, top_p=1e-6, seed=3)).tokens
    assert a == b
    assert a != other and a != greedy
    assert topk1 == greedy and topp == greedy


def test_top_k_and_top_p_keep_only_the_allowed_tokens(llama_dir: Path) -> None:
    from training.inference.generate import next_tokens

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(next_tokens(logits, Sampling(temperature=10.0, top_k=2), gen).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, ...: top_p 0.8 keeps the first two, 0.5 the first only
    assert probs[0] < 0.8 < probs[0] + probs[1]
    assert set(next_tokens(logits, Sampling(temperature=1.0, top_p=0.8), gen).tolist()) == {0, 1}
    assert set(next_tokens(logits, Sampling(temperature=1.0, top_p=0.5), gen).tolist()) == {0}


def test_checkpoint_reshaped_for_tensor_parallelism_streams_the_same_logits(tmp_path: Path) -> None:
    hf = tiny_llama()
    src = save_ucp(hf, tmp_path / "ckpt")
    dims = ModelDims(hidden=64, layers=3, heads=4, vocab=128, ffn=96, kv_heads=2)
    reshape(src, tmp_path / "tp2", layout=llama_layout(dims, Mesh(tp=2)), sections={"": "weights"})
    source = open_weights(tmp_path / "tp2")
    down = source["model.layers.0.mlp.down_proj.weight"]
    assert len({r.file for r in down.runs}) == 2 and len(down.runs) == 2 * 64  # row-parallel: each row from 2 files
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    with executor(tmp_path / "tp2") as ex:
        got = generate(ex, ids.tolist(), 2, keep_logits=True)
    torch.testing.assert_close(got.logits[0], hf_logits(hf, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_reference_gpt_streamed_equals_in_memory(tmp_path: Path, preset: str) -> None:
    cfg = PRESETS[preset]
    gpt = GPT(cfg, seed=3).eval()
    with torch.no_grad():  # biases and norms away from 0 and 1, so a misplaced one shows
        for name, p in gpt.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "gpt"
    ucp.save({"model": gpt.state_dict()}, path, metadata={"model": cfg.model_dump(mode="json")})
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with executor(path) as ex, torch.no_grad():
        assert ex.stats is not None
        got = generate(ex, ids.tolist(), 5, keep_logits=True)
        torch.testing.assert_close(got.logits[0], gpt(ids), rtol=1e-5, atol=1e-5)
        seq = ids
        for _ in range(5):  # greedy by recomputing the whole sequence in memory
            seq = torch.cat([seq, gpt(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got.tokens == seq[:, 10:].tolist()


def test_bf16_weights_computed_in_fp32_or_bf16(tmp_path: Path) -> None:
    hf = tiny_llama()
    path = save_hf(hf.to(torch.bfloat16), tmp_path / "bf16")
    assert open_weights(path)["model.layers.0.mlp.up_proj.weight"].dtype == "BF16"
    ref = hf.float()  # the bf16-rounded weights, in fp32: what fp32 compute over bf16 weights must give
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    model, source = load_model(open_weights(path))
    with Executor(model, source, 1 << 20) as ex:
        fp32 = generate(ex, ids.tolist(), 4, keep_logits=True)
    torch.testing.assert_close(fp32.logits[0], hf_logits(ref, ids), rtol=1e-5, atol=1e-5)
    with Executor(model, source, 1 << 20, dtype=torch.bfloat16, pin_layers=False) as ex:
        bf16 = generate(ex, ids.tolist(), 4, keep_logits=True)
        assert ex.plan.resident_bytes == 2 * 128 * 64 * 2 + 64 * 2  # resident tensors held in bf16
    assert bf16.logits[0].dtype == torch.bfloat16
    torch.testing.assert_close(bf16.logits[0].float(), fp32.logits[0], rtol=0.05, atol=0.05)
