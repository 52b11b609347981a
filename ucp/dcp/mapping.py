"""DCP's view of a UCP checkpoint and back: keys, chunks and plain values, all derived from the manifest.

torch.distributed.checkpoint (DCP) names every entry of a state dict by its *fully qualified name*
(FQN): the key path joined with ``.`` (dict keys as ``str(k)``, list positions as numbers), and
describes a tensor by its dtype, global size and *chunks* (boxes). A UCP manifest holds all of that:
the state tree gives the key paths, each tensor entry its dtype, shape and pieces. So nothing
DCP-specific is stored: the reader rebuilds DCP's ``Metadata`` from any UCP manifest (written by
``ucp.save`` or through :class:`ucp.dcp.Writer`), and the writer turns DCP's FQNs, chunks and
plain values into an ordinary manifest.

Plain (non-tensor) values are what DCP calls bytes items (it pickles them with ``torch.save``).
UCP stores them as JSON in the state tree instead, never as a pickle: ``None``, bools, ints,
floats (NaN and infinities included), strings, and lists/tuples/dicts of them. Anything else
(an ``io.BytesIO``, an arbitrary object) is refused by the writer with an
:class:`~ucp.errors.UnsupportedStateError` naming its FQN.

How the state tree maps to FQNs mirrors DCP's own flattening (``traverse_state_dict``): dicts are
walked (an empty one holds nothing); a list is walked when it holds a dict, a tensor or a list
that is walked, and is one plain value otherwise; a tuple is one plain value (DCP does not walk
tuples) unless it holds tensors, which are then listed as ``<fqn>.<i>`` like a list's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from reshard.box import Box, flat_range_to_boxes
from ucp.errors import CheckpointError, UnsupportedStateError
from ucp.format.dtypes import dtype_name, torch_dtype
from ucp.format.manifest import Manifest
from ucp.format.tree import (
    decode_state,
    dict_items,
    encode_state,
    node_kind,
    tensor_refs,
    unique_name,
)

DCP_VERSION = "1.0.0"  # the metadata version DCP's FileSystemWriter records (torch's CURRENT_DCP_VERSION)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Chunk:
    """One DCP chunk of a stored tensor: a box of it (a piece, or a contiguous box of a flat piece)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass
class DcpView:
    """A UCP manifest as DCP sees it: every FQN's tensor name (tensors) or JSON node (plain values)."""

    metadata: Metadata
    tensors: dict[str, str] = field(default_factory=dict)  # FQN -> logical tensor name
    values: dict[str, Any] = field(default_factory=dict)  # FQN -> state-tree node (no tensors in it)
    paths: dict[str, Path] = field(default_factory=dict)  # FQN -> key path (DCP's planner_data)

    def value(self, fqn: str) -> Any:
        """The plain Python value stored under ``fqn`` (decoded from the manifest's JSON)."""
        return decode_state(self.values[fqn], _no_tensor)


def _no_tensor(name: str) -> Any:  # a plain-value node holds no tensor (dcp_view only files tensor-free ones)
    raise AssertionError(f"tensor {name!r} inside a plain value")


def fqn_of(path: Path) -> str:
    """DCP's key for a key path: its parts joined with ``.``."""
    return ".".join(map(str, path))


# -- manifest -> DCP -------------------------------------------------------------------------------


def dcp_view(manifest: Manifest, *, source: str) -> DcpView:
    """DCP's ``Metadata`` for a checked manifest (chunks from the pieces), with the FQN maps the reader
    needs; ``source`` names the manifest in errors (two entries with the same FQN)."""
    view = DcpView(metadata=Metadata(state_dict_metadata={}))
    _walk(manifest.state, (), view, source)
    md = view.metadata.state_dict_metadata
    for fqn in view.paths:  # the state tree's order, which DCP's flattening of the same state dict has
        name = view.tensors.get(fqn)
        if name is None:
            md[fqn] = BytesStorageMetadata()
            continue
        entry = manifest.tensors[name]
        shape = tuple(entry.shape)
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
            for p in entry.pieces
            for c in piece_chunks(p.region(), shape)
        ]
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(entry.dtype)), size=torch.Size(shape), chunks=chunks
        )
    view.metadata.planner_data = dict(view.paths)
    view.metadata.version = DCP_VERSION
    return view


def piece_chunks(region: Any, shape: tuple[int, ...]) -> list[Chunk]:
    """A piece's region as DCP chunks: a box as itself; a flat range (ZeRO-style) as its contiguous boxes."""
    if isinstance(region, Box):
        return [Chunk(tuple(region.offsets), tuple(region.shape))]
    return [Chunk(tuple(b.offsets), tuple(b.shape)) for _, b in flat_range_to_boxes(region.start, region.stop, shape)]


def _walk(node: Any, path: Path, view: DcpView, source: str) -> None:
    kind = node_kind(node)
    if kind in ("dict", "items"):
        for k, child in dict_items(node):
            _walk(child, path + (str(k),), view, source)
        return
    if kind == "tensor":
        _add(view, path, source, tensor=node["tensor"])
    elif kind in ("list", "tuple") and _walked(node):
        for i, child in enumerate(node if kind == "list" else node["tuple"]):
            _walk(child, path + (i,), view, source)
    else:
        _add(view, path, source, value=node)


def _walked(node: Any) -> bool:
    """Whether DCP's flattening walks into this list (or this tuple holds tensors, which must be listed)."""
    if any(True for _ in tensor_refs(node)):
        return True
    return isinstance(node, list) and any(
        node_kind(v) in ("dict", "items") or (isinstance(v, list) and _walked(v)) for v in node
    )


def _add(view: DcpView, path: Path, source: str, *, tensor: str | None = None, value: Any = None) -> None:
    fqn = fqn_of(path)
    if fqn in view.paths:
        raise CheckpointError(
            f"{source}: state entries {_brief(view.paths[fqn])} and {_brief(path)} both have the DCP key {fqn!r}; "
            "DCP cannot tell them apart (load this checkpoint with ucp.load)"
        )
    view.paths[fqn] = path
    if tensor is not None:
        view.tensors[fqn] = tensor
    else:
        view.values[fqn] = value


def _brief(path: Path) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


# -- DCP -> manifest -------------------------------------------------------------------------------


def tensor_names(fqns: Sequence[str]) -> dict[str, str]:
    """A logical tensor name for each tensor FQN (computed once, by the coordinator, so all ranks agree):
    the FQN itself where the format allows it; ``#`` becomes ``_``, a reserved prefix gets a leading
    ``_``, and a name taken already a ``~N`` suffix (as ``ucp.save`` names key paths)."""
    taken: set[str] = set()
    out: dict[str, str] = {}
    for fqn in fqns:
        out[fqn] = unique_name(fqn, taken)
    return out


def value_node(fqn: str, value: Any) -> Any:
    """The JSON state-tree node of a plain value; UnsupportedStateError naming ``fqn`` for anything that is
    not plain JSON-like data (UCP never pickles)."""
    try:
        encoded = encode_state({"v": value}, is_leaf=lambda obj: isinstance(obj, torch.Tensor))
    except UnsupportedStateError as exc:
        detail = str(exc).split(": ", 1)[-1]
        raise UnsupportedStateError(f"{fqn!r}: {detail}; {_PLAIN_ONLY}") from None
    if encoded.leaves:
        raise UnsupportedStateError(f"{fqn!r}: a tuple holding tensors cannot be saved through DCP; {_PLAIN_ONLY}")
    return encoded.tree["dict"]["v"]


_PLAIN_ONLY = (
    "ucp.dcp.Writer stores non-tensor values as JSON in the manifest, never as pickles: only None, bool, int, "
    "float, str and lists/tuples/dicts of them (save bytes as a uint8 tensor, e.g. torch.frombuffer(data, "
    "dtype=torch.uint8))"
)


def state_tree(nodes: Mapping[str, Any], paths: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest's state tree from DCP's FQN -> node (in order) and its planner's FQN -> key path.

    With the default planner's paths the tree is the state dict's own nesting (``ucp.load`` returns
    ``{"model": {...}, ...}``, as given to ``dcp.save``): a str key is a dict key, an int a list
    position (DCP's flattening makes both so). Without usable paths (another planner, or
    ``flatten_state_dict=False``) the tree is flat: one entry per FQN.
    """
    nested = _nested(nodes, paths) if paths is not None else None
    if nested is not None:
        return nested
    return {"dict": dict(nodes)}


@dataclass
class _Leaf:
    """A state-tree node placed at its key path (kept apart from the containers being built around it)."""

    node: Any


def _nested(nodes: Mapping[str, Any], paths: Mapping[str, Any]) -> dict[str, Any] | None:
    """The nested tree, or None when the paths do not describe one (then the tree stays flat)."""
    root: dict[str, Any] = {}
    for fqn, node in nodes.items():
        path = paths.get(fqn)
        if not isinstance(path, tuple) or not path or not isinstance(path[0], str) or fqn_of(path) != fqn:
            return None
        container: Any = root
        for i, key in enumerate(path):
            last = i == len(path) - 1
            want: Any = _Leaf(node) if last else ({} if isinstance(path[i + 1], str) else [])
            if isinstance(container, dict) and isinstance(key, str):
                current = container.setdefault(key, want)
            elif isinstance(container, list) and type(key) is int and 0 <= key:
                container.extend([None] * (key + 1 - len(container)))  # positions no FQN fills stay None, as in DCP
                if container[key] is None:
                    container[key] = want
                current = container[key]
            else:
                return None
            if current is not want and (last or type(current) is not type(want)):
                return None  # two FQNs at one place, or a place both a dict and a list
            container = current
    return _to_tree(root)


def _to_tree(obj: Any) -> Any:
    if isinstance(obj, _Leaf):
        return obj.node
    if isinstance(obj, dict):
        return {"dict": {k: _to_tree(v) for k, v in obj.items()}}
    return [None if v is None else _to_tree(v) for v in obj]


def dtype_of(dtype: torch.dtype, fqn: str) -> str:
    """The format's dtype string; UnsupportedStateError naming ``fqn`` for dtypes it cannot hold."""
    return dtype_name(dtype, tensor=fqn)
