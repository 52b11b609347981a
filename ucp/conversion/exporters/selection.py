"""Which tensors of a checkpoint an export writes, and under which names.

By default the ``model`` subtree of the saved state (what the training Engine saves
as the model's weights), named as in ``model.state_dict()`` (the ``model.`` prefix
stripped), so that the output loads straight into the model. ``section`` picks any
other subtree by its dotted key path (``optimizer.exp_avg``); ``""`` or ``"all"``
takes every tensor under its full key path. Output names are key paths below the section
(``layers.0.w``), as ``state_dict()`` gives them, not manifest names (which a save may alter). A checkpoint without a ``model``
subtree exports everything when no section is given.

Subtrees are found by walking the manifest's state tree (not by name prefix), so
a root key that merely starts with ``model`` is never taken for the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from ucp.conversion.exporters.options import ExportError
from ucp.format.dtypes import dtype_name, itemsize, torch_dtype
from ucp.format.manifest import Manifest, TensorEntry
from ucp.format.tree import dict_items, node_kind, tensor_refs

if TYPE_CHECKING:  # torch only for a cast: an export in the stored dtypes moves bytes without it
    import torch

DEFAULT_SECTION = "model"
ALL = ("", "all")


@dataclass(frozen=True)
class ExportTensor:
    """One tensor to export: its manifest ``name``, its name in the output, stored and output dtype
    (``out_dtype`` None: as stored, no torch needed)."""

    name: str
    out_name: str
    entry: TensorEntry
    out_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.entry.dtype)

    @property
    def torch_out_dtype(self) -> torch.dtype:
        return self.dtype if self.out_dtype is None else self.out_dtype

    @property
    def out_dtype_name(self) -> str:
        """The output dtype as safetensors names it (``"BF16"``)."""
        return self.entry.dtype if self.out_dtype is None else dtype_name(self.out_dtype, tensor=self.name)

    @property
    def out_itemsize(self) -> int:
        return itemsize(self.entry.dtype) if self.out_dtype is None else self.out_dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape)

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    @property
    def out_nbytes(self) -> int:
        return self.entry.numel * self.out_itemsize

    @property
    def cast(self) -> bool:
        return self.out_dtype is not None and self.out_dtype != self.dtype


@dataclass(frozen=True)
class Selection:
    section: str  # "" for every tensor
    tensors: list[ExportTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.out_nbytes for t in self.tensors)


def _children(node: Any) -> list[tuple[str, Any]]:
    """(key as text, child) of a container node; list/tuple items are keyed by their index."""
    kind = node_kind(node)
    if kind in ("dict", "items"):
        return [(str(k), v) for k, v in dict_items(node)]
    if kind == "list":
        return [(str(i), v) for i, v in enumerate(node)]
    if kind == "tuple":
        return [(str(i), v) for i, v in enumerate(node["tuple"])]
    return []


def find_section(state: Any, section: str) -> Any | None:
    """The state-tree node at dotted path ``section`` (keys may hold dots: longest key first), or None."""
    if section == "":
        return state
    for key, child in sorted(_children(state), key=lambda kv: -len(kv[0])):
        if section == key:
            return child
        if section.startswith(key + "."):
            found = find_section(child, section[len(key) + 1 :])
            if found is not None:
                return found
    return None


def key_paths(node: Any, prefix: str | None = None) -> Iterator[tuple[str, str | None]]:
    """(tensor name, dotted key path below ``node``) for every tensor under a state-tree node; the
    path is None for ``node`` itself being a tensor ("" is a key)."""
    if node_kind(node) == "tensor":
        yield node["tensor"], prefix
        return
    for key, child in _children(node):
        yield from key_paths(child, key if prefix is None else f"{prefix}.{key}")


def _sections_hint(manifest: Manifest) -> str:
    with_tensors = [k for k, v in _children(manifest.state) if next(tensor_refs(v), None) is not None]
    return ", ".join(repr(k) for k in with_tensors) or "none"


def cast_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """Floating tensors take ``cast_to``; integer, bool and complex tensors keep their dtype."""
    return cast_to if cast_to is not None and dtype.is_floating_point else dtype


def select_tensors(manifest: Manifest, section: str | None = None, *, dtype: torch.dtype | None = None) -> Selection:
    """The tensors to export (in manifest order) with their output names and dtypes."""
    if section is None:
        node = find_section(manifest.state, DEFAULT_SECTION)
        section = DEFAULT_SECTION if node is not None and next(tensor_refs(node), None) is not None else ""
    if section in ALL:
        section = ""
    node = find_section(manifest.state, section)
    if node is None:
        raise ExportError(
            f"section {section!r} is not in the checkpoint (sections holding tensors: {_sections_hint(manifest)})"
        )
    paths = dict(key_paths(node))
    if not paths:
        raise ExportError(
            f"section {section!r} holds no tensors (sections holding tensors: {_sections_hint(manifest)})"
        )
    tensors = []
    for name, entry in manifest.tensors.items():
        if name not in paths:
            continue
        # the key path, not the manifest name (which UCP may have altered: '#' -> '_', a '~N' suffix);
        # a section that is itself a tensor keeps the section's path
        path = paths[name]
        out = path if path is not None else (section or name)
        out_dtype = None if dtype is None else cast_dtype(torch_dtype(entry.dtype), dtype)
        tensors.append(ExportTensor(name, out, entry, out_dtype))
    seen: dict[str, str] = {}
    for t in tensors:
        if t.out_name in seen:
            raise ExportError(f"tensors {seen[t.out_name]!r} and {t.name!r} would both be exported as {t.out_name!r}")
        seen[t.out_name] = t.name
    return Selection(section, tensors)
