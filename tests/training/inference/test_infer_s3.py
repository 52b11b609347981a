"""``ucp infer`` on an object store (the loopback S3 server): a sharded Hugging Face safetensors directory
and a UCP checkpoint on ``s3://`` stream layer by layer through ranged GETs to the same logits and tokens
as the local run; a missing bucket, prefix or object fails naming the URL, exit code non-zero."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from inference_models import save_hf, save_ucp, tiny_llama
from s3_endpoint import object_keys, s3_bucket, s3_server  # noqa: F401
from typer.testing import CliRunner

from training.inference.config import load_model
from training.inference.executor import Executor
from training.inference.generate import generate
from training.inference.sources import open_weights
from ucp.cli.main import app

pytest.importorskip("transformers")

PROMPTS = [[5, 9, 2, 77, 31], [3, 4]]


def upload_dir(server: Any, bucket: str, local: Path, prefix: str) -> str:
    client = server.client()
    for p in sorted(local.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{p.name}", Body=p.read_bytes())
    return f"s3://{bucket}/{prefix}"


def run(
    path: str | Path, prompts: list[list[int]] = PROMPTS, n: int = 5, read_path: str | None = None, **kw: Any
) -> tuple[list[list[int]], Any, int]:
    """Greedy tokens, the first step's logits and the bytes a pass streams, every layer read through the ring."""
    model, source = load_model(open_weights(path, **kw))
    with Executor(model, source, 1 << 20, pin_layers=False, read_path=read_path) as ex:
        got = generate(ex, prompts, n, keep_logits=True)
        assert ex.plan.streamed and ex.stats.groups_read > 0
        return got.tokens, got.logits[0], ex.plan.streamed_bytes_per_pass


def infer_cli(path: str, *extra: str, prompt: str = "5 9 2 77") -> Any:
    args = ["infer", path, "--prompt", prompt, "--max-new-tokens", "4", "--no-pin-layers", "--json", *extra]
    return CliRunner().invoke(app, args)


def cli_tokens(res: Any) -> list[int]:
    assert res.exit_code == 0, res.output
    tokens: list[int] = json.loads(res.stdout)["outputs"][0]["tokens"]
    return tokens


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, llama: Any) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = save_hf(llama, tmp_path_factory.mktemp("s3infer") / "hf", max_shard_size="60KB")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    assert (path / "model.safetensors.index.json").exists()
    return path


def test_sharded_safetensors_on_s3_streams_to_the_local_logits_and_tokens(s3_server, s3_bucket, hf_dir):  # noqa: F811
    url = upload_dir(s3_server, s3_bucket, hf_dir, "models/hf")
    source = open_weights(url)
    assert source.files.remote and all(r.file.startswith(url + "/") for t in source.tensors.values() for r in t.runs)
    local_tokens, local_logits, local_bytes = run(hf_dir)
    tokens, logits, streamed = run(url)
    assert tokens == local_tokens
    assert torch.equal(logits, local_logits)
    assert streamed == local_bytes > 0  # the same aligned spans, fetched by ranged GETs
    staged_tokens, staged_logits, _ = run(url, read_path="staged")  # the device ring's host staging, on the CPU
    assert staged_tokens == local_tokens and torch.equal(staged_logits, local_logits)

    res = infer_cli(url, prompt="w5 w9 w2 w77")  # text, through the tokenizer.json on the store
    expected = run(hf_dir, [[5, 9, 2, 77]], 4)[0][0]
    assert cli_tokens(res) == expected
    assert json.loads(res.stdout)["outputs"][0]["text"] == " ".join(f"w{t}" for t in expected)
    metrics = json.loads(res.stdout)["metrics"]
    assert metrics["engine"] == "s3" and metrics["bytes_read"] > 0 and metrics["streamed_layers"] == 2


def test_ucp_checkpoint_on_s3_with_storage_options(s3_server, s3_bucket, tmp_path, monkeypatch, llama):  # noqa: F811
    local = save_ucp(llama, tmp_path / "ckpt")
    url = f"s3://{s3_bucket}/run/ckpt"
    save_ucp(llama, url)
    # the endpoint from --storage-options, not the environment
    endpoint = s3_server.url
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    opts = {"endpoint_url": endpoint, "read_size": "64KiB", "concurrency": 4}
    tokens, logits, _ = run(url, storage_options=opts)
    local_tokens, local_logits, _ = run(local)
    assert tokens == local_tokens and torch.equal(logits, local_logits)
    assert cli_tokens(infer_cli(url, "--storage-options", json.dumps(opts))) == run(local, [[5, 9, 2, 77]], 4)[0][0]


def test_bad_urls_fail_naming_the_url(s3_server, s3_bucket, hf_dir, llama, monkeypatch):  # noqa: F811
    missing_bucket = f"s3://{s3_bucket}-absent/hf"
    res = infer_cli(missing_bucket)
    assert res.exit_code != 0 and f"{s3_bucket}-absent" in res.output and "does not exist" in res.output

    res = infer_cli(f"s3://{s3_bucket}/nothing/here")
    assert res.exit_code == 2 and f"s3://{s3_bucket}/nothing/here: no such object or prefix" in res.output

    url = upload_dir(s3_server, s3_bucket, hf_dir, "broken")
    # KvikIO reads local files: asked for, the gds read path is refused for a URL, naming it
    from training.inference import executor as executor_mod
    from training.inference.errors import InferenceError

    with monkeypatch.context() as mp:
        mp.setattr(executor_mod, "choose_read_path", lambda device, asked, caps: asked)
        model, source = load_model(open_weights(f"s3://{s3_bucket}/broken"))
        with pytest.raises(InferenceError, match=rf"s3://{s3_bucket}/broken: read path 'gds' reads local files"):
            Executor(model, source, 1 << 20, read_path="gds")

    shard = sorted(k for k in object_keys(s3_server, s3_bucket, "broken/") if k.endswith(".safetensors"))[-1]
    s3_server.client().delete_object(Bucket=s3_bucket, Key=shard)
    res = infer_cli(url)
    assert res.exit_code == 2 and f"s3://{s3_bucket}/{shard}: shard named in" in res.output

    # a UCP checkpoint whose data object is gone
    ckpt = f"s3://{s3_bucket}/ck"
    save_ucp(llama, ckpt)
    data = next(k for k in object_keys(s3_server, s3_bucket, "ck/") if k.endswith(".safetensors"))
    s3_server.client().delete_object(Bucket=s3_bucket, Key=data)
    res = infer_cli(ckpt)
    assert res.exit_code != 0 and f"s3://{s3_bucket}/{data}" in res.output, res.output

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    res = infer_cli(url)
    assert res.exit_code != 0 and "access denied" in res.output and url in res.output, res.output


def test_an_object_deleted_mid_run_fails_naming_it(s3_server, s3_bucket, hf_dir):  # noqa: F811
    url = upload_dir(s3_server, s3_bucket, hf_dir, "gone")
    model, source = load_model(open_weights(url))
    with Executor(model, source, 1 << 20, pin_layers=False) as ex:
        generate(ex, [[1, 2]], 1)
        files = sorted({f for g in ex.plan.streamed for f in g.reads})
        victim = files[0]
        s3_server.client().delete_object(Bucket=s3_bucket, Key=victim.split("/", 3)[3])
        with pytest.raises(FileNotFoundError, match=rf"reading {victim}: no such object"):
            generate(ex, [[1, 2]], 4)
