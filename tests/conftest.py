"""Shared test helpers live in tests/support/ (plain modules, unique basenames, no packages).

This puts tests/support and the repository root (for tools/) on ``sys.path`` for the tests, and on
``PYTHONPATH`` for the worker processes they start (a worker script or a test file run as a script
imports the same helpers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"
REPO = SUPPORT.parents[1]

for _path in (str(REPO), str(SUPPORT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
_inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SUPPORT), str(REPO)] + [p for p in _inherited if p not in (str(SUPPORT), str(REPO))]
)
