"""Byte sizes as people write them, and as UCP prints them: the one parser and formatter of the code base.

The rule, everywhere (CLI options, ``ucp tune``, ``ucp bench``, the exporters and ``reshape``):

* a plain number is bytes: ``4096``, ``1e9``;
* SI suffixes are powers of 10: ``KB`` = 10^3, ``MB`` = 10^6, ``GB`` = 10^9, ``TB`` = 10^12, ``PB`` = 10^15;
* IEC suffixes are powers of 2: ``KiB`` = 2^10, ``MiB`` = 2^20, ``GiB`` = 2^30, ``TiB`` = 2^40, ``PiB`` = 2^50.

Suffixes are case-insensitive and may follow a space (``"512 mib"``). A bare ``K``/``M``/``G``/``T`` is
refused: tools disagree on whether ``8M`` is 8*10^6 or 8*2^20 bytes, so the writer says which.
It lives in ``aio`` because ``aio.tune`` needs it and ``aio`` sits below everything else.
"""

from __future__ import annotations

import math
import re

__all__ = ["SIZE_HELP", "format_size", "parse_size"]

SIZE_HELP = "plain numbers are bytes; KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2"
"""The rule in one phrase, for CLI help texts."""

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_AMBIGUOUS = {"k": ("KB", "KiB"), "m": ("MB", "MiB"), "g": ("GB", "GiB"), "t": ("TB", "TiB"), "p": ("PB", "PiB")}
_SIZE = re.compile(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(value: int | float | str, *, what: str = "size", minimum: int = 1) -> int:
    """Bytes (at least ``minimum``) from ``4096``, ``"1e9"``, ``"2GB"`` (2*10^9) or ``"512MiB"`` (512*2^20).

    A fractional result is rounded down (``"1.5B"`` is 1 byte). ValueError naming ``what`` and the
    value for anything else: an unknown or ambiguous suffix, a negative, NaN, a bool, or too few bytes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what}: expected a size in bytes, got {value!r}")
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = m.group(2).lower() if m else ""
        if m is not None and unit in _AMBIGUOUS:
            si, iec = _AMBIGUOUS[unit]
            raise ValueError(
                f"{what}: {value!r} is ambiguous: write {m.group(1)}{si} (powers of 10) or {m.group(1)}{iec} (powers of 2)"
            )
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r} as a size ({SIZE_HELP}; e.g. 4096, 2GB, 512MiB)")
        number = float(m.group(1)) * _UNITS[unit]
    else:
        number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{what}: cannot read {value!r} as a size ({SIZE_HELP})")
    if int(number) < minimum:
        raise ValueError(f"{what} {value}: the size must be at least {format_size(minimum)}")
    return int(number)


def format_size(n: int) -> str:
    """``n`` bytes in IEC units to three significant digits: ``"512 B"``, ``"4 KiB"``, ``"1.5 GiB"``, ``"12.3 MiB"``."""
    if n < 1024:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    power = min(len(units), (n.bit_length() - 1) // 10)
    value, unit = n / 1024**power, units[power - 1]
    decimals = 0 if value >= 100 else 1 if value >= 10 else 2
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}"
