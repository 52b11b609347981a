"""Every CLI option that stands for an API argument defaults to what the API defaults to: the value
is defined once, in the API, and the CLI either reads it or is pinned to it here."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import typer.main

from aio.sizes import format_size, parse_size
from ucp.cli.main import app


def _defaults(*path: str) -> dict[str, Any]:
    cmd: Any = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {p.name: p.default for p in cmd.params if p.name}


def _api(fn: Any) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}


def test_reshape() -> None:
    from ucp.conversion.reshape import DEFAULT_MEMORY_BUDGET, reshape

    cli, api = _defaults("reshape"), _api(reshape)
    assert api["memory_budget"] == DEFAULT_MEMORY_BUDGET
    assert cli["memory_budget"] is None  # not given: the command passes DEFAULT_MEMORY_BUDGET
    assert cli["workers"] == api["workers"]
    assert cli["overwrite"] == api["overwrite"]
    group: Any = typer.main.get_command(app)
    option = next(p for p in group.commands["reshape"].params if p.name == "memory_budget")
    assert f"{format_size(DEFAULT_MEMORY_BUDGET)}" in (option.help or "")  # the help states the API's number


def test_export() -> None:
    from ucp.conversion.exporters import export
    from ucp.conversion.exporters.zarr_export import DEFAULT_CHUNK_BYTES

    cli, api = _defaults("export"), _api(export)
    assert parse_size(cli["memory_budget"]) == api["memory_budget"]
    assert cli["max_shard_size"] is api["max_shard_size"] is None
    assert cli["format"].value == api["format"]
    assert cli["chunk_mb"] * (1 << 20) == DEFAULT_CHUNK_BYTES
    assert cli["compressor"].value == "zstd" and cli["level"] is None  # the zarr exporter's defaults
    assert cli["overwrite"] == api["overwrite"] and (not cli["no_verify"]) == api["verify"]


def test_convert() -> None:
    from ucp.conversion.importers import convert

    cli, api = _defaults("convert"), _api(convert)
    assert cli["source_format"] == api["source_format"]
    assert cli["trust_pickle"] == api["trust_pickle"]
    assert cli["force"] == api["overwrite"]


def test_tune() -> None:
    from aio.config import GIB
    from aio.tune import run_tune

    cli, api = _defaults("tune"), _api(run_tune)
    assert cli["size_gib"] * GIB == api["size"]
    assert cli["repeats"] == api["repeats"]


@pytest.mark.parametrize("command", ["io", "save"])
def test_bench(command: str) -> None:
    from ucp.bench.io import BenchIoOptions
    from ucp.bench.save import BenchSaveOptions

    model = {"io": BenchIoOptions, "save": BenchSaveOptions}[command]
    api = model()
    cli = _defaults("bench", command)
    assert cli["size_gib"] == api.size_gib
    assert cli["rounds"] == api.rounds
    assert cli["drop_caches"] == api.drop_caches
    assert cli["raw"].value == api.raw
    assert cli["fio_iomem"] == api.fio_iomem
    assert cli["directory"] is api.directory is None
    if command == "save":
        assert isinstance(api, BenchSaveOptions)
        assert [int(r) for r in cli["ranks"].split(",")] == api.ranks
        assert cli["async_snapshot"].split(",") == api.async_snapshots
        assert cli["async_compute_s"] == api.async_compute_s
