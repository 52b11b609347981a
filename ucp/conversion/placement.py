"""Which regions of a checkpoint's tensors each rank of a target layout writes.

A :class:`reshard.Layout` speaks of *parameters* (``layers.0.attn.qkv.weight``); a checkpoint
holds them in *sections* of its state tree: the weights (``model.<param>``) and optimizer
states shaped like the parameters (``optimizer.exp_avg.<param>`` ...); the section ``""`` is the
root of the tree (a plain ``ucp.save(model.state_dict())``: tensor names are the parameter names
themselves). Weights are laid out as the layout's weight buffers (under ZeRO-3: the parameter
partitions), optimizer states as its ZeRO group partitions. Tensors outside every section (or
of parameters the layout does not list) are written whole, by one rank.

A checkpoint written by the training engine records its layout, parameter shapes and sections
in the manifest's ``metadata`` (:func:`layout_metadata`), so ``ucp reshape`` can change the mesh
or ZeRO stage without being told the model again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Sequence

from pydantic import ValidationError

from reshard import Box, FlatRange, Layout, LayoutError, Resolver, merge_slots
from reshard.layout import validation_line
from ucp.errors import LayoutMismatchError
from ucp.format.manifest import Manifest

SectionKind = Literal["weights", "state"]
# The training engine's sections (training.engine.Engine.state_dict_for_checkpoint).
DEFAULT_SECTIONS: dict[str, SectionKind] = {
    "model": "weights",
    "optimizer.fp32_master": "state",
    "optimizer.exp_avg": "state",
    "optimizer.exp_avg_sq": "state",
}


def layout_metadata(
    layout: Layout, shapes: Mapping[str, Sequence[int]], sections: Mapping[str, SectionKind] = DEFAULT_SECTIONS
) -> dict[str, Any]:
    """Manifest metadata describing how the checkpoint's tensors are laid out (JSON values)."""
    return {
        "layout": layout.model_dump(mode="json"),
        "shapes": [[name, [int(d) for d in shape]] for name, shape in shapes.items()],
        "sections": dict(sections),
    }


@dataclass(frozen=True)
class RecordedLayout:
    """What a manifest's metadata says about its layout (any part may be missing)."""

    layout: Layout | None
    shapes: dict[str, tuple[int, ...]] | None
    sections: dict[str, SectionKind]


def recorded_layout(manifest: Manifest, source: str = "manifest.json") -> RecordedLayout:
    """The layout, parameter shapes and sections recorded in ``manifest.metadata`` (checked)."""
    meta = manifest.metadata
    layout = None
    if meta.get("layout") is not None:
        try:
            layout = Layout.model_validate(meta["layout"])
        except ValidationError as exc:
            raise LayoutError(f"{source}: metadata.layout is not a valid layout: {validation_line(exc)}") from None
        except ValueError as exc:
            raise LayoutError(f"{source}: metadata.layout is not a valid layout: {exc}") from None
    shapes = None
    if meta.get("shapes") is not None:
        try:
            shapes = {str(n): tuple(int(d) for d in s) for n, s in meta["shapes"]}
        except (TypeError, ValueError):
            raise LayoutError(f"{source}: metadata.shapes must be a list of [name, shape] pairs") from None
    sections = default_sections(manifest)
    if meta.get("sections") is not None:
        raw = meta["sections"]
        if not isinstance(raw, dict) or any(v not in ("weights", "state") for v in raw.values()):
            raise LayoutError(f"{source}: metadata.sections must map section prefixes to 'weights' or 'state'")
        sections = dict(raw)
    return RecordedLayout(layout, shapes, sections)


def default_sections(manifest: Manifest) -> dict[str, SectionKind]:
    """The sections of a checkpoint that recorded none: the training engine's (DEFAULT_SECTIONS) when
    some tensor lies in one of them, else the root as the weights (a plain ``model.state_dict()``, a
    Hugging Face import), so that ZeRO-3 partitions its tensors as parameters."""
    if any(n.startswith(s + ".") for n in manifest.tensors for s in DEFAULT_SECTIONS):
        return dict(DEFAULT_SECTIONS)
    return {"": "weights"}


def tensor_name(section: str, param: str) -> str:
    """The checkpoint tensor holding ``param`` in ``section`` (``""``: the root of the state tree)."""
    return f"{section}.{param}" if section else param


def section_param(name: str, section: str, sections: Iterable[str]) -> str | None:
    """The parameter that tensor ``name`` holds in ``section``, or None when it lies outside it.

    The root section holds the tensors that no other section does.
    """
    if section:
        return name[len(section) + 1 :] if name.startswith(section + ".") else None
    return None if any(s and name.startswith(s + ".") for s in sections) else name


def _section_list(sections: Iterable[str]) -> str:
    return ", ".join(s if s else "'' (the root)" for s in sections)


def param_shapes(manifest: Manifest, sections: Mapping[str, SectionKind]) -> dict[str, tuple[int, ...]]:
    """Parameter shapes read off the checkpoint's weights section(s), in manifest order."""
    out: dict[str, tuple[int, ...]] = {}
    for section, kind in sections.items():
        if kind != "weights":
            continue
        for name, entry in manifest.tensors.items():
            param = section_param(name, section, sections)
            if param is not None:
                out.setdefault(param, tuple(entry.shape))
    return out


@dataclass(frozen=True)
class Placement:
    """Region ``region`` of checkpoint tensor ``tensor`` goes to a rank's file."""

    tensor: str
    region: Box | FlatRange


@dataclass(frozen=True)
class RankPlacements:
    """Per target rank what it writes, and the tensors written whole by one rank (not in the layout)."""

    ranks: list[list[Placement]]
    whole: list[str]


def place(
    manifest: Manifest,
    layout: Layout,
    shapes: Mapping[str, Sequence[int]],
    sections: Mapping[str, SectionKind] = DEFAULT_SECTIONS,
) -> RankPlacements:
    """Lay the checkpoint's tensors out as ``layout`` says: for every rank, the regions it saves.

    Raises LayoutError (bad or unfitting layout, naming the tensor) or LayoutMismatchError (the
    checkpoint's tensor shapes disagree with ``shapes``).
    """
    shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
    for section in sections:
        for param, shape in shapes.items():
            name = tensor_name(section, param)
            entry = manifest.tensors.get(name)
            if entry is not None and tuple(entry.shape) != shape:
                raise LayoutMismatchError(
                    f"tensor '{name}': the checkpoint's shape is {entry.shape}, the layout's model says {list(shape)}"
                )
    missing = [p for p in shapes if not any(tensor_name(s, p) in manifest.tensors for s in sections)]
    if missing:
        hint = (
            " (its tensors are at the root of the state tree: give sections={'': 'weights'})"
            if "" not in sections and missing[0] in manifest.tensors
            else ""
        )
        raise LayoutMismatchError(
            f"the layout's model has parameter {missing[0]!r} but the checkpoint holds it in "
            f"no section ({_section_list(sections)})"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + hint
        )
    resolver = Resolver(layout, shapes)
    placed: set[str] = set()
    ranks: list[list[Placement]] = []
    for coord in layout.mesh.coords():
        view = resolver.view(coord)
        mine: list[Placement] = []
        for section, kind in sections.items():
            buffers = view.weights() if kind == "weights" else view.optimizer_state(section, lambda p, k: p)
            for buf in buffers:
                for slot in merge_slots(buf.slots):
                    name = tensor_name(section, slot.tensor)
                    if slot.replica == 0 and name in manifest.tensors:
                        mine.append(Placement(name, slot.glob))
                        placed.add(name)
        ranks.append(mine)
    return RankPlacements(ranks, [n for n in manifest.tensors if n not in placed])
