"""Where things are, for tests wherever they sit in tests/: the repository root, tests/, tests/support."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
