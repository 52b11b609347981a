"""Reading an exported zarr store back through plain zarr (no ucp), each step checked so a test
fails on a wrong node kind rather than an attribute error (and mypy sees the narrowed types)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr


def open_group(path: str | Path, mode: Literal["r", "r+", "a", "w", "w-"] = "a") -> zarr.Group:
    """The group at ``path`` as ``zarr.open`` finds it (it must be a group); ``mode`` as zarr.open's."""
    group = zarr.open(str(path), mode=mode)
    assert isinstance(group, zarr.Group), path
    return group


def array(group: zarr.Group, name: str) -> zarr.Array:
    """The member ``name`` of ``group`` (it must be an array)."""
    arr = group[name]
    assert isinstance(arr, zarr.Array), name
    return arr


def values(arr: zarr.Array) -> np.ndarray:
    """All of ``arr`` as a numpy array (a 0-d array reads back as a numpy scalar: made a 0-d array)."""
    data = arr[...]
    assert isinstance(data, (np.ndarray, np.generic)), type(data)
    return np.asarray(data)


def ucp_attrs(group: zarr.Group) -> dict[str, Any]:
    """The ``ucp`` attribute the exporter writes on the root group (a JSON object)."""
    attrs = group.attrs["ucp"]
    assert isinstance(attrs, dict), attrs
    return attrs
