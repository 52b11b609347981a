"""aio.sizes: the one byte-size rule (plain numbers are bytes, KB/MB/GB powers of 10, KiB/MiB/GiB powers
of 2) and the one formatter, and the CLI options that read sizes agreeing on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aio.sizes import SIZE_HELP, format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        (" 7 ", 7),
        ("1e9", 10**9),
        ("100B", 100),
        ("1KB", 10**3),
        ("2MB", 2 * 10**6),
        ("1GB", 10**9),
        ("1.5GB", 1_500_000_000),
        ("3TB", 3 * 10**12),
        ("1KiB", 1 << 10),
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("1.5 KiB", 1536),
        ("2TiB", 2 << 40),
        ("8 mib", 8 << 20),
        ("8mb", 8 * 10**6),
        ("0.5GiB", 1 << 29),
    ],
)
def test_both_families(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_numbers_are_bytes() -> None:
    assert parse_size(4096) == 4096 and parse_size(1e9) == 10**9 and parse_size(1.9) == 1


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("8M", "'8M' is ambiguous: write 8MB (powers of 10) or 8MiB (powers of 2)"),
        ("1g", "'1g' is ambiguous: write 1GB (powers of 10) or 1GiB (powers of 2)"),
        ("2XB", "cannot read '2XB' as a size"),
        ("8 potatoes", "cannot read '8 potatoes' as a size"),
        ("", "cannot read '' as a size"),
        ("GB", "cannot read 'GB' as a size"),
        ("-1", "cannot read '-1' as a size"),
        ("nan", "cannot read 'nan' as a size"),
        ("1e999", "cannot read '1e999' as a size"),
        ("0", "--opt 0: the size must be at least 1 B"),
        (True, "expected a size in bytes, got True"),
    ],
)
def test_bad_input_names_the_option_and_value(bad: object, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(bad, what="--opt")  # type: ignore[arg-type]
    assert str(info.value).startswith("--opt") and needle in str(info.value)


def test_minimum() -> None:
    assert parse_size("1MiB", minimum=1 << 20) == 1 << 20
    with pytest.raises(ValueError, match=r"--budget 1MB: the size must be at least 1 MiB"):
        parse_size("1MB", what="--budget", minimum=1 << 20)  # 10^6 < 2^20


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (8 << 20, "8 MiB"),
        (12_345_678, "11.8 MiB"),
        (384 << 20, "384 MiB"),
        (3 << 29, "1.5 GiB"),
        (5 << 40, "5 TiB"),
    ],
)
def test_format(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("n", [1, 4096, 1536, 8 << 20, 384 << 20, 3 << 29, 5 << 40])
def test_format_parses_back(n: int) -> None:
    assert parse_size(format_size(n)) == n


def test_cli_options_agree(tmp_path: Path) -> None:
    """``ucp reshape --memory-budget 1GB`` and ``ucp tune --block-sizes`` read sizes by the same rule, and
    their help says so."""
    import ucp
    from ucp.cli.main import app
    from ucp.conversion.reshape import DEFAULT_MEMORY_BUDGET

    runner = CliRunner()
    src = tmp_path / "src"
    ucp.save({"w": __import__("torch").arange(8.0)}, src)
    got = runner.invoke(app, ["reshape", str(src), str(tmp_path / "a"), "--memory-budget", "1GB", "--json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["memory_budget"] == 10**9
    got = runner.invoke(app, ["reshape", str(src), str(tmp_path / "b"), "--memory-budget", "1GiB", "--json"])
    assert json.loads(got.stdout)["memory_budget"] == 1 << 30
    got = runner.invoke(app, ["reshape", str(src), str(tmp_path / "c"), "--json"])
    assert json.loads(got.stdout)["memory_budget"] == DEFAULT_MEMORY_BUDGET
    # the same spelling in tune: 1GB is 10^9 bytes there too, so not a multiple of 4096
    got = runner.invoke(app, ["tune", "--dir", str(tmp_path), "--block-sizes", "1GB"])
    assert got.exit_code != 0 and "block_size must be a positive multiple of 4096" in got.output
    for command in (["reshape"], ["tune"], ["export"], ["bench", "io"]):
        help_text = " ".join(runner.invoke(app, [*command, "--help"]).stdout.replace("│", " ").split())
        assert "KB/MB/GB are powers of 10" in help_text, command
    assert SIZE_HELP.startswith("plain numbers are bytes")
