"""Every checkpoint command on s3:// URLs (the loopback S3 server): the AWS variables or --storage-options
point it at the endpoint; bad input exits non-zero naming the URL."""

from __future__ import annotations

import json

import torch
from s3_endpoint import object_keys, s3_bucket, s3_server  # noqa: F401
from typer.testing import CliRunner

import ucp
from ucp.cli.main import app

runner = CliRunner()


def test_commands_work_on_s3_urls(s3_server, s3_bucket, tmp_path, monkeypatch):  # noqa: F811
    state = {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)}}
    ucp.CheckpointManager(f"s3://{s3_bucket}/run").save(state, 5)
    ck = f"s3://{s3_bucket}/run/step-00000005"
    result = runner.invoke(app, ["inspect", ck])
    assert result.exit_code == 0 and "model.w" in result.stdout, result.output
    assert runner.invoke(app, ["verify", ck]).exit_code == 0
    doc = json.loads(runner.invoke(app, ["ls", f"s3://{s3_bucket}/run", "--json"]).stdout)
    assert doc["latest"] == 5 and [c["status"] for c in doc["checkpoints"]] == ["complete"]
    result = runner.invoke(
        app, ["reshape", ck, f"s3://{s3_bucket}/out/r", "--storage-options", '{"part_size": "5MiB"}']
    )
    assert result.exit_code == 0, result.output
    assert torch.equal(ucp.load(f"s3://{s3_bucket}/out/r")["model"]["w"], state["model"]["w"])
    result = runner.invoke(app, ["export", ck, str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["convert", str(tmp_path / "hf"), f"s3://{s3_bucket}/out/c"])
    assert result.exit_code == 0, result.output
    converted = ucp.load(f"s3://{s3_bucket}/out/c")
    assert any(torch.equal(t, state["model"]["w"]) for t in _tensors(converted)), converted.keys()
    # the endpoint and credentials from --storage-options alone, with the environment pointing nowhere
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    opts = json.dumps({"endpoint_url": s3_server.url, "secret": s3_server.secret, "max_retries": 0})
    assert runner.invoke(app, ["verify", ck, "--storage-options", opts]).exit_code == 0
    assert runner.invoke(app, ["inspect", ck, "--storage-options", opts]).exit_code == 0
    assert runner.invoke(app, ["ls", f"s3://{s3_bucket}/run", "--storage-options", opts]).exit_code == 0


def test_bad_input_exits_non_zero_naming_the_url(s3_server, s3_bucket, tmp_path):  # noqa: F811
    ucp.save({"w": torch.ones(4)}, f"s3://{s3_bucket}/ck")
    s3_server.client().put_object(Bucket=s3_bucket, Key="junk/notes.txt", Body=b"hello")
    before = object_keys(s3_server, s3_bucket)
    wrong = '{"secret": "wrong", "max_retries": 0}'
    cases = [
        (["inspect", f"s3://{s3_bucket}/ck", "--storage-options", wrong], f"s3://{s3_bucket}/ck/manifest.json"),
        (["verify", f"s3://{s3_bucket}/ck", "--storage-options", wrong], f"s3://{s3_bucket}/ck"),
        (["ls", f"s3://{s3_bucket}", "--storage-options", wrong], f"s3://{s3_bucket}"),
        (["inspect", "s3://no-such-bucket-y/ck"], "bucket 'no-such-bucket-y' does not exist"),
        (["ls", "s3://no-such-bucket-y/run"], "bucket 'no-such-bucket-y' does not exist"),
        (["verify", f"s3://{s3_bucket}/junk"], f"s3://{s3_bucket}/junk"),
        (["inspect", f"s3://{s3_bucket}/junk"], f"s3://{s3_bucket}/junk"),
        (["reshape", f"s3://{s3_bucket}/junk", f"s3://{s3_bucket}/out"], f"s3://{s3_bucket}/junk"),
        (["export", f"s3://{s3_bucket}/junk", str(tmp_path / "x")], f"s3://{s3_bucket}/junk"),
        (["ls", f"s3://{s3_bucket}/ck"], "is a checkpoint, not a CheckpointManager root"),
        (["reshape", f"s3://{s3_bucket}/ck", f"s3://{s3_bucket}/o2", "--storage-options", wrong], f"s3://{s3_bucket}"),
    ]
    for args, named in cases:
        result = runner.invoke(app, args)
        assert result.exit_code != 0, (args, result.output)
        assert named in " ".join(result.output.split()), (args, result.output)
    assert object_keys(s3_server, s3_bucket) == before  # nothing written anywhere


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


def test_a_commands_storage_options_do_not_outlive_it(s3_bucket):  # noqa: F811
    from ucp.store import storage

    runner.invoke(
        app, ["reshape", f"s3://{s3_bucket}/a", f"s3://{s3_bucket}/b", "--storage-options", '{"secret": "x"}']
    )
    assert storage._default_url_options is None
