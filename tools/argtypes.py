"""argparse types shared by the benchmark runners in tools/."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a count that must be at least 1 (checked before any expensive setup)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
