"""Cross-products for ``pytest.mark.parametrize`` with a covering subset in the default run.

The default (CI) run takes, for each value of the first axis, one value of the second in turn, so every
value of each axis is tested; the rest of the cross-product is marked ``full_matrix`` (run with
``UCP_FULL_MATRIX=1``, see the repository's conftest.py). Test ids are those of the plain cross-product.
"""

from __future__ import annotations

from typing import Any, Sequence

import pytest


def covering(first: Sequence[Any], second: Sequence[Any]) -> list[Any]:
    """``pytest.param(a, b)`` for every pair; the pairs outside the diagonal walk are ``full_matrix``."""
    params = []
    for i, a in enumerate(first):
        for j, b in enumerate(second):
            marks = () if j == i % len(second) else (pytest.mark.full_matrix,)
            params.append(pytest.param(a, b, marks=marks))
    return params
