"""Fuzzing the manifest reader: whatever the bytes, it returns a Manifest or raises ManifestError."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp
from ucp.format.manifest import parse_manifest

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["F32", "BF16", "box", "flat", "tensor", "dict", "items", "../x", "rank-00000.safetensors"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)


def _valid() -> dict:
    """A real 2-rank manifest: box pieces, flat pieces, replicated and 0-d tensors, int keys, tuples."""
    import tempfile

    from ucp_helpers import save_ranks

    w = torch.arange(24.0).reshape(4, 6)
    states = [
        {
            "w": ucp.ShardedTensor(w[r * 2 : (r + 1) * 2], (4, 6), (r * 2, 0)),
            "f": ucp.FlatShard(w.reshape(-1)[r * 10 : 10 + r * 14], (4, 6), r * 10),
            "s": torch.tensor(1.0),
            "o": {0: {"x": torch.ones(2)}, "t": (1, float("nan"))},
            "k": [1],
        }
        for r in range(2)
    ]
    with tempfile.TemporaryDirectory() as d:
        save_ranks(f"{d}/ck", states, step=3, metadata={"a": 1})
        with open(f"{d}/ck/manifest.json") as f:
            return json.load(f)


VALID = _valid()


def _must_parse_or_refuse(data) -> None:
    try:
        m = parse_manifest(data)
    except ucp.ManifestError:
        return
    assert isinstance(m, ucp.Manifest)
    parse_manifest(m.to_json())  # what parsed must serialise to something that parses


def test_the_seed_manifest_is_valid():
    parse_manifest(json.dumps(VALID))


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_random_json(value):
    _must_parse_or_refuse(json.dumps(value))
    if isinstance(value, dict):
        _must_parse_or_refuse(json.dumps({**value, "format_version": 1}))


@given(st.binary(max_size=200))
@settings(max_examples=200, deadline=None)
def test_random_bytes(data):
    _must_parse_or_refuse(data)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = list(_paths(VALID))[1:]


@st.composite
def mutated(draw):
    raw = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = raw
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            parent[key]  # noqa: B018 - still there after earlier mutations?
        except (KeyError, IndexError, TypeError):
            continue
        action = draw(st.sampled_from(["replace", "delete", "int", "add"]))
        if action == "replace":
            parent[key] = draw(json_values)
        elif action == "delete":
            del parent[key]
        elif action == "int" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] = parent[key] + draw(st.sampled_from([-1, 1, -(2**40), 2**63, 2**64]))
        elif action == "add" and isinstance(parent[key], dict):
            parent[key][draw(st.text(max_size=6))] = draw(json_values)
        elif action == "add" and isinstance(parent[key], list):
            parent[key].append(draw(json_values))
    return raw


@given(mutated())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_manifests(raw):
    _must_parse_or_refuse(json.dumps(raw))


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_mutated_bytes(data):
    text = bytearray(json.dumps(VALID).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text) - 1))
        text[i] = data.draw(st.integers(0, 255))
    _must_parse_or_refuse(bytes(text))


@pytest.mark.parametrize("depth", [50, 150, 400, 3000])
def test_deep_nesting(depth):
    text = json.dumps(VALID).replace('"k": [1]', '"k": ' + "[" * depth + "]" * depth)
    assert text != json.dumps(VALID)
    _must_parse_or_refuse(text)
