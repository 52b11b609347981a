"""Tensor-name patterns: ``*`` matches any run of characters, ``{i}`` a decimal integer, the rest is literal.

Kept apart from rules so that the pipeline (which reads the layer index out of ``{i}``) and ZeRO
groups share one definition of what a name pattern means.
"""

from __future__ import annotations

import re
from functools import lru_cache

from .errors import LayoutError


@lru_cache(maxsize=4096)
def name_regex(pattern: str) -> re.Pattern[str]:
    """Compile a name pattern to a regex matching whole names; each ``{i}`` is a capture group."""
    if not isinstance(pattern, str) or not pattern:
        raise LayoutError(f"a name pattern must be a non-empty string, got {pattern!r}")
    out = []
    for piece in re.split(r"(\*|\{i\})", pattern):
        if piece == "*":
            out.append(".*")
        elif piece == "{i}":
            out.append(r"(\d+)")
        elif "{" in piece or "}" in piece:
            raise LayoutError(f"name pattern {pattern!r}: the only placeholder is {{i}} (a layer index)")
        else:
            out.append(re.escape(piece))
    return re.compile("".join(out) + r"\Z")


def name_matches(pattern: str, name: str) -> bool:
    return name_regex(pattern).match(name) is not None


def layer_index(pattern: str, name: str) -> int | None:
    """The layer index a pattern with exactly one ``{i}`` reads from ``name``, or None when it does not match."""
    m = name_regex(pattern).match(name)
    if m is None:
        return None
    return int(m.group(1))
