"""Project-wide test switches.

Tests marked ``full_matrix`` (the whole cross-product of layouts or peer configurations) run only
with ``UCP_FULL_MATRIX=1``; CI runs the covering subset that the other tests form.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("UCP_FULL_MATRIX") == "1":
        return
    skip = pytest.mark.skip(reason="full matrix: set UCP_FULL_MATRIX=1 to run it")
    for item in items:
        if "full_matrix" in item.keywords:
            item.add_marker(skip)
