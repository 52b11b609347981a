"""The state dict's shape as JSON: encode on save, check and rebuild on load.

The manifest's ``state`` field mirrors the saved state dict with every tensor
replaced by ``{"tensor": name}``. Tagged nodes keep what JSON alone would lose
(int keys, tuples, non-finite floats), so that load returns exactly the
structure that was saved. See docs/format.md, "State tree".
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ucp.errors import ManifestError, UnsupportedStateError
from ucp.format.sharding import TensorLike, is_tensor_like

# Python nesting allowed on save; keeps the manifest's JSON well under pydantic's depth limit (~200).
MAX_DEPTH = 64
TAGS = ("dict", "items", "tuple", "float", "tensor")
RESERVED_NAMES = frozenset({"__metadata__"})  # a safetensors header key
PAD_PREFIX = "__pad__."  # data-file entries that only align the next piece (docs/format.md)
MESSAGE_KEY_CHARS = 40  # a manifest key or value quoted in an error message is cut to this many characters
ENTRY_SEP = "#"  # a tensor's further pieces in one data file are entries "<name>#<k>" (docs/format.md)


def is_reserved(name: str) -> bool:
    """Names no logical tensor may take: safetensors' metadata key, padding entries, names with '#'."""
    return name in RESERVED_NAMES or name.startswith(PAD_PREFIX) or ENTRY_SEP in name


@dataclass
class Leaf:
    """A tensor found in the state dict: its logical name, key path and value."""

    name: str
    path: tuple[Any, ...]
    value: TensorLike


@dataclass
class EncodedState:
    tree: dict[str, Any]
    leaves: list[Leaf] = field(default_factory=list)


def plain_key(key: str | int) -> str | int:
    """A dict key as stored: the plain str or int value of a key of a subclass (e.g. an enum member)."""
    return str.__str__(key) if isinstance(key, str) else int(key)


def path_str(path: tuple[Any, ...]) -> str:
    """A readable key path for error messages: ``optimizer['state'][0]['exp_avg']``."""
    return "state_dict" + "".join(f"[{k!r}]" for k in path)


def encode_state(state: Any, *, is_leaf: Callable[[Any], bool] = is_tensor_like) -> EncodedState:
    """Split a state dict into its JSON tree and its tensor leaves (in traversal order).

    ``is_leaf``: what counts as a tensor (an importer's on-disk tensors, for one).
    """
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"a state dict must be a dict, got {type(state).__name__}")
    out = EncodedState(tree={})
    names: set[str] = set()
    out.tree = _encode(state, (), 0, out.leaves, names, is_leaf)
    return out


def _encode(
    obj: Any, path: tuple[Any, ...], depth: int, leaves: list[Leaf], names: set[str], is_leaf: Callable[[Any], bool]
) -> Any:
    if depth > MAX_DEPTH:
        raise UnsupportedStateError(f"{path_str(path)}: nested deeper than {MAX_DEPTH} levels")
    if is_leaf(obj):
        name = _unique_name(path, names)
        leaves.append(Leaf(name, path, obj))
        return {"tensor": name}
    if obj is None:
        return None
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, str):
        return str.__str__(obj)  # a plain str even for str subclasses (enums)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        value = float(obj)
        if math.isfinite(value):
            return value
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    np = sys.modules.get("numpy")  # no numpy scalar exists before numpy is imported: no need to import it
    if np is not None and isinstance(obj, np.generic) and obj.shape == ():
        return _encode(obj.item(), path, depth, leaves, names, is_leaf)
    if isinstance(obj, dict):
        keys = list(obj.keys())
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise UnsupportedStateError(
                    f"{path_str(path)}: key {k!r} of type {type(k).__name__} is not supported (only str and int keys)"
                )
        if all(isinstance(k, str) for k in keys):
            return {
                "dict": {
                    plain_key(k): _encode(v, path + (k,), depth + 1, leaves, names, is_leaf) for k, v in obj.items()
                }
            }
        return {
            "items": [
                [plain_key(k), _encode(v, path + (k,), depth + 1, leaves, names, is_leaf)] for k, v in obj.items()
            ]
        }
    if isinstance(obj, list):
        return [_encode(v, path + (i,), depth + 1, leaves, names, is_leaf) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, path + (i,), depth + 1, leaves, names, is_leaf) for i, v in enumerate(obj)]}
    raise UnsupportedStateError(
        f"{path_str(path)}: values of type {type(obj).__module__}.{type(obj).__qualname__} cannot be saved "
        "(tensors, None, bool, int, float, str, and dicts/lists/tuples of them can)"
    )


def _unique_name(path: tuple[Any, ...], names: set[str]) -> str:
    return unique_name(".".join(str(plain_key(k)) if isinstance(k, (str, int)) else str(k) for k in path), names)


def unique_name(base: str, names: set[str]) -> str:
    """A legal tensor name for ``base`` not in ``names`` (added to it): ``#`` becomes ``_``, a reserved prefix
    gets a leading ``_``, a name taken or reserved a ``~N`` suffix. ``ucp.save`` (key paths) and the DCP
    mapping (FQNs) name tensors with this."""
    # '#' would let a name equal another tensor's "<name>#<k>" entry: replace it, so no saved name holds one
    base = base.replace(ENTRY_SEP, "_")
    if base.startswith(PAD_PREFIX):  # no suffix can make it legal: move it out of the reserved prefix
        base = "_" + base
    name, n = base, 1
    while name in names or is_reserved(name):
        name = f"{base}~{n}"
        n += 1
    names.add(name)
    return name


# -- reading --------------------------------------------------------------------------------------


def node_kind(node: Any) -> str:
    """One of: scalar, list, dict, items, tuple, float, tensor (callers check the tree first)."""
    if isinstance(node, list):
        return "list"
    if isinstance(node, dict):
        return next(iter(node))
    return "scalar"


def check_tree(tree: Any) -> list[str]:
    """Check a manifest's state tree; returns the tensor names it references, in order.

    Raises ManifestError naming the path of the first malformed node (``state['a'][0]: ...``);
    the manifest reader prefixes the manifest's location.
    """
    if not (isinstance(tree, dict) and len(tree) == 1 and next(iter(tree)) in ("dict", "items")):
        raise ManifestError("state: the root must be a dict node ({'dict': ...} or {'items': ...})")
    refs: list[str] = []
    _check(tree, (), refs)
    return refs


def _brief(value: Any) -> str:
    """``repr(value)``, cut short: an untrusted manifest's keys and values may be megabytes long."""
    if isinstance(value, str) and len(value) > MESSAGE_KEY_CHARS:
        return f"{value[:MESSAGE_KEY_CHARS]!r}... ({len(value)} chars)"
    text = repr(value)
    return text if len(text) <= MESSAGE_KEY_CHARS else text[:MESSAGE_KEY_CHARS] + "..."


def _where(path: tuple[Any, ...]) -> str:
    """A node's path for a message: ``state['a'][0]`` (long keys cut short)."""
    return "state" + "".join(f"[{_brief(k)}]" for k in path)


def _check(node: Any, path: tuple[Any, ...], refs: list[str]) -> None:
    """Check one node and those under it. The path is kept as keys and only formatted when an
    error is raised: every node of a large tree is visited, few are ever named."""
    if len(path) > 2 * MAX_DEPTH + 8:
        raise ManifestError(f"{_where(path)}: state tree nested too deeply")
    if node is None or isinstance(node, (bool, int, float, str)):
        return
    if isinstance(node, list):
        for i, v in enumerate(node):
            _check(v, path + (i,), refs)
        return
    if not isinstance(node, dict) or len(node) != 1 or next(iter(node)) not in TAGS:
        raise ManifestError(f"{_where(path)}: a state node must be a JSON scalar, a list, or one of {TAGS}")
    tag, value = next(iter(node.items()))
    if tag == "dict":
        if not isinstance(value, dict):
            raise ManifestError(f"{_where(path)}: 'dict' must hold a JSON object")
        for k, v in value.items():
            _check(v, path + (k,), refs)
    elif tag == "items":
        if not isinstance(value, list):
            raise ManifestError(f"{_where(path)}: 'items' must hold a list of [key, value] pairs")
        seen: set[tuple[type, Any]] = set()
        for i, item in enumerate(value):
            if not (isinstance(item, list) and len(item) == 2):
                raise ManifestError(f"{_where(path)}: 'items' entry {i} is not a [key, value] pair")
            k = item[0]
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise ManifestError(f"{_where(path)}: 'items' key {_brief(k)} must be a string or an integer")
            if (type(k), k) in seen:
                raise ManifestError(f"{_where(path)}: duplicate key {_brief(k)}")
            seen.add((type(k), k))
            _check(item[1], path + (k,), refs)
    elif tag == "tuple":
        if not isinstance(value, list):
            raise ManifestError(f"{_where(path)}: 'tuple' must hold a list")
        for i, v in enumerate(value):
            _check(v, path + (i,), refs)
    elif tag == "float":
        if value not in ("nan", "inf", "-inf"):
            raise ManifestError(f"{_where(path)}: 'float' must be 'nan', 'inf' or '-inf', got {_brief(value)}")
    else:  # tensor
        if not isinstance(value, str):
            raise ManifestError(f"{_where(path)}: 'tensor' must name a tensor")
        refs.append(value)


def dict_items(node: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """(key, child node) pairs of a checked 'dict' or 'items' node."""
    tag, value = next(iter(node.items()))
    if tag == "dict":
        yield from value.items()
    else:
        for k, v in value:
            yield k, v


def decode_state(node: Any, tensor: Callable[[str], Any]) -> Any:
    """Rebuild the Python value of a checked tree node; ``tensor(name)`` supplies the tensors."""
    if isinstance(node, list):
        return [decode_state(v, tensor) for v in node]
    if not isinstance(node, dict):
        return node
    tag, value = next(iter(node.items()))
    if tag in ("dict", "items"):
        return {k: decode_state(v, tensor) for k, v in dict_items(node)}
    if tag == "tuple":
        return tuple(decode_state(v, tensor) for v in value)
    if tag == "float":
        return float(value)
    return tensor(value)


def tensor_refs(node: Any) -> Iterator[str]:
    """Names of the tensors referenced under a checked node."""
    if isinstance(node, list):
        for v in node:
            yield from tensor_refs(v)
    elif isinstance(node, dict):
        tag, value = next(iter(node.items()))
        if tag == "tensor":
            yield value
        elif tag in ("dict", "items"):
            for _, v in dict_items(node):
                yield from tensor_refs(v)
        elif tag == "tuple":
            for v in value:
                yield from tensor_refs(v)


def merge_trees(trees: list[Any]) -> Any:
    """Merge the state trees of several ranks: dicts by key (first rank wins on a conflict), lists by position.

    Ranks that hold different parts of a model (pipeline stages) contribute their own keys;
    values present on several ranks are assumed equal and taken from the lowest rank.
    """
    base = trees[0]
    for other in trees[1:]:
        base = _merge(base, other)
    return base


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        ta, tb = next(iter(a)), next(iter(b))
        if ta in ("dict", "items") and tb in ("dict", "items"):
            merged: dict[tuple[type, Any], tuple[Any, Any]] = {}
            for k, v in dict_items(a):
                merged[(type(k), k)] = (k, v)
            for k, v in dict_items(b):
                key = (type(k), k)
                merged[key] = (k, _merge(merged[key][1], v)) if key in merged else (k, v)
            pairs = list(merged.values())
            if all(isinstance(k, str) for k, _ in pairs):
                return {"dict": {k: v for k, v in pairs}}
            return {"items": [[k, v] for k, v in pairs]}
        if ta == tb == "tuple" and len(a["tuple"]) == len(b["tuple"]):
            return {"tuple": [_merge(x, y) for x, y in zip(a["tuple"], b["tuple"])]}
        return a
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_merge(x, y) for x, y in zip(a, b)]
    return a
