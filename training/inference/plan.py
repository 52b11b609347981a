"""How a weight budget is spent: what stays resident, what streams every pass, and the ring it streams through.

Two grains:

* **tensor** (the ``cpu`` read path, :func:`plan_tensors`): the ring is one aligned arena that streamed
  *parts* pass through in order; a part is one *stage* of a group (:meth:`StreamModel.layer_stages`:
  weights the model reads together, e.g. one projection and its bias), so the arena needs to hold only a
  few parts, not whole layers. It is sized ``max(2 x largest part, RING_TARGET)`` (RING_TARGET: the bytes
  this kind of disk wants in flight), or ``(prefetch + 1) x largest part``; the embedding and head stay
  resident when they fit beside that; what the budget holds beyond them and the ring keeps individual
  layer tensors resident, largest first, spread over the depth. Every resident byte is a byte not read
  on every pass, so at batch 1, where a pass is bound by the disk, this is the lever: the bytes streamed
  per pass are at least ``weights - (budget - ring)``, and decode tokens/s at most the disk's read rate
  divided by that.
* **layer** (the device paths, ``staged`` and ``gds``, :func:`plan_layers`): a ring of whole-layer buffers
  (two, or ``prefetch + 1``), whole layers pinned with the rest.

A budget too small to stream the largest unit (part or layer) is a :class:`BudgetError` naming its
largest tensor and the budget needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from aio.sizes import format_size
from training.inference.errors import BudgetError
from training.inference.layout import GroupLayout, join_layouts, round_down

RING_TARGET = (
    128 << 20
)  # bytes the tensor-grain ring holds at least: enough reads in flight for the disk (fio: 4 MiB x 32)
PRE, POST = "embedding", "final norm and head"


@dataclass
class Plan:
    """What stays resident, what streams, the ring's size and read-ahead."""

    budget: int
    resident: list[str]  # labels of groups kept in memory (the edges, whole layers)
    resident_bytes: int
    slot_bytes: int  # layer grain: one ring buffer; tensor grain: the largest part
    slots: int  # layer grain: ring buffers; tensor grain: largest parts the ring holds at once
    streamed: list[GroupLayout] = field(repr=False)  # groups read every pass (only their streamed tensors)
    pinned: list[int] = field(default_factory=list)  # layers wholly resident
    grain: Literal["layer", "tensor"] = "layer"
    units: list[GroupLayout] = field(default_factory=list, repr=False)  # what the ring reads in turn
    unit_group: list[int] = field(default_factory=list, repr=False)  # index into ``streamed`` of each unit
    pinned_tensors: list[str] = field(default_factory=list)  # layer tensors resident (tensor grain)
    arena_bytes: int = 0  # tensor grain: the ring's size

    def __post_init__(self) -> None:
        if not self.units:
            self.units = list(self.streamed)
            self.unit_group = list(range(len(self.streamed)))

    @property
    def prefetch(self) -> int:
        return self.slots - 1

    @property
    def ring_bytes(self) -> int:
        if not self.streamed:
            return 0
        return self.arena_bytes if self.grain == "tensor" else self.slots * self.slot_bytes

    @property
    def streamed_bytes_per_pass(self) -> int:
        return sum(u.read_bytes for u in self.units)


def _too_small(budget: int, unit: GroupLayout, needed: int) -> BudgetError:
    big = unit.largest
    return BudgetError(
        f"memory budget {format_size(budget)} is too small: {unit.label} needs a buffer of {format_size(unit.nbytes)} "
        f"(largest tensor {big.name!r}, {format_size(big.nbytes)}); a budget of at least "
        f"{format_size(needed)} ({needed} bytes) is needed to stream it"
    )


# -- tensor grain (the cpu read path) -------------------------------------------------------------

Stages = Sequence[Sequence[GroupLayout]]  # a group's stages, each a list of one-tensor layouts


def plan_tensors(
    pre: Stages,
    layers: Sequence[Stages],
    post: Stages,
    budget: int,
    *,
    edge_bytes: int,
    held: Mapping[str, int] | None = None,
    prefetch: int | None = None,
    pin: bool = True,
    ring_target: int = RING_TARGET,
) -> Plan:
    """Plan the tensor grain. Every layout is one tensor's (``label``: its name, ``nbytes``: its
    page-aligned buffer); ``held[name]``: its bytes when resident (default ``nbytes``); ``edge_bytes``:
    the embedding and head's resident bytes (a tied head counted once)."""
    held = dict(held or {})
    size = {t.label: held.get(t.label, t.nbytes) for g in (pre, *layers, post) for s in g for t in s}
    ahead = 2 if prefetch is None else prefetch + 1  # largest parts the ring must hold for its read-ahead

    def ring_for(parts: list[GroupLayout]) -> int:
        if not parts:
            return 0
        largest, total = max(p.nbytes for p in parts), sum(p.nbytes for p in parts)
        want = (prefetch + 1) * largest if prefetch is not None else max(2 * largest, ring_target)
        return max(largest, round_down(min(want, total)))

    labels = [f"layer {i}" for i in range(len(layers))]
    layer_parts = _parts(layers, labels, set())
    need = min(ahead * max((p.nbytes for p in layer_parts), default=0), sum(p.nbytes for p in layer_parts))
    if budget < edge_bytes + need:  # the edges do not fit beside the ring's minimum: everything streams
        groups, glabels = [pre, *layers, post], [PRE, *labels, POST]
        parts = _parts(groups, glabels, set())
        worst = max(parts, key=lambda p: p.nbytes)
        if budget < worst.nbytes:
            raise _too_small(budget, worst, worst.nbytes)
        ring = round_down(min(ring_for(parts), budget))
        return _tensor_plan(budget, [], 0, groups, glabels, set(), ring)
    room = budget - edge_bytes
    chosen: set[str] = set()
    if pin:
        every = [t.label for g in layers for s in g for t in s]
        if sum(size[n] for n in every) <= room:
            chosen = set(every)
        else:
            ring = round_down(min(ring_for(layer_parts), room))
            for _ in range(4):  # pinning the largest tensors can shrink the largest part, so the ring
                chosen = _pick_tensors(layers, size, room - ring)
                smaller = round_down(min(ring_for(_parts(layers, labels, chosen)), room))
                if smaller >= ring:
                    break
                ring = smaller
    pinned_bytes = sum(size[n] for n in chosen)
    ring = round_down(min(ring_for(_parts(layers, labels, chosen)), room - pinned_bytes))
    return _tensor_plan(budget, [PRE, POST], edge_bytes + pinned_bytes, list(layers), labels, chosen, ring)


def _tensor_plan(
    budget: int,
    edges: list[str],
    resident_bytes: int,
    groups: Sequence[Stages],
    labels: list[str],
    chosen: set[str],
    ring: int,
) -> Plan:
    units: list[GroupLayout] = []
    unit_group: list[int] = []
    streamed: list[GroupLayout] = []
    pinned: list[int] = []
    for g, label in zip(groups, labels):
        mine = _parts([g], [label], chosen)
        if not mine:  # a layer with every tensor resident
            pinned.append(int(label.removeprefix("layer ")))
            continue
        streamed.append(join_layouts(label, [t for s in g for t in s if t.label not in chosen]))
        units += mine
        unit_group += [len(streamed) - 1] * len(mine)
    largest = max((u.nbytes for u in units), default=0)
    order = [t.label for g in groups for s in g for t in s]
    return Plan(
        budget,
        [*edges, *(f"layer {i}" for i in pinned)],
        resident_bytes,
        largest,
        max(1, ring // largest if largest else 1),
        streamed,
        pinned,
        "tensor",
        units,
        unit_group,
        [n for n in order if n in chosen],
        ring if units else 0,
    )


def _parts(groups: Sequence[Stages], labels: Sequence[str], chosen: set[str]) -> list[GroupLayout]:
    """Each group's stages less the ``chosen`` (resident) tensors, joined into one layout per stage."""
    out = []
    for g, label in zip(groups, labels):
        for s in g:
            rest = [t for t in s if t.label not in chosen]
            if rest:
                out.append(join_layouts(label, rest))
    return out


def spread(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix is spread evenly over the range (van der Corput order)."""
    out: list[int] = []
    seen: set[int] = set()
    k = 0
    while len(out) < n:
        x, f, j = 0.0, 0.5, k
        while j:
            x, j, f = x + f * (j & 1), j >> 1, f / 2
        i = min(n - 1, int(x * n))
        if i not in seen:
            seen.add(i)
            out.append(i)
        k += 1
    return out


def _pick_tensors(layers: Sequence[Stages], size: Mapping[str, int], room: int) -> set[str]:
    """Layer tensors to keep resident in ``room`` bytes: largest first; among equal sizes, one of a kind per
    layer at a time, the layers in :func:`spread` order (each layer's streamed bytes stay alike)."""
    rank = {layer: r for r, layer in enumerate(spread(len(layers)))}
    cands = [
        (size[t.label], i, pos, t.label) for i, g in enumerate(layers) for pos, t in enumerate(t for s in g for t in s)
    ]
    cands.sort(key=lambda c: (-c[0], c[2], rank[c[1]]))
    chosen: set[str] = set()
    for nbytes, _, _, name in cands:
        if nbytes <= room:
            chosen.add(name)
            room -= nbytes
    return chosen


# -- layer grain (the device read paths) ----------------------------------------------------------


def plan_layers(
    pre: GroupLayout,
    layers: list[GroupLayout],
    post: GroupLayout,
    budget: int,
    *,
    resident_bytes: int,
    prefetch: int | None = None,
    layer_resident_bytes: list[int] | None = None,
) -> Plan:
    """Keep pre/post resident when the rest still leaves two layer buffers; else stream them too. With
    ``layer_resident_bytes`` (each layer's size held resident), pin whole layers in what the budget
    holds beyond the resident edges and a ring of ``prefetch + 1`` (default 2) buffers."""
    layer_slot = max((g.nbytes for g in layers), default=0)
    if budget >= resident_bytes + 2 * layer_slot or (budget >= resident_bytes + layer_slot and prefetch == 0):
        streamed, resident, resident_names, slot = layers, resident_bytes, [pre.label, post.label], layer_slot
    else:
        streamed, resident, resident_names = [pre, *layers, post], 0, []
        slot = max(g.nbytes for g in streamed)
    if budget < resident + slot:
        raise _too_small(budget, max(streamed, key=lambda g: g.nbytes), resident + slot)
    pinned: list[int] = []
    if layer_resident_bytes is not None and resident_names:
        pinned = _pick_layers(layer_resident_bytes, budget - resident, slot, 2 if prefetch is None else prefetch + 1)
        resident += sum(layer_resident_bytes[i] for i in pinned)
        resident_names += [layers[i].label for i in pinned]
        streamed = [g for i, g in enumerate(layers) if i not in set(pinned)]
    slots = (budget - resident) // slot
    slots = min(slots, len(streamed) + 1)
    if prefetch is not None:
        slots = min(slots, prefetch + 1)
    return Plan(budget, resident_names, resident, slot, max(1, slots), streamed, pinned)


def _pick_layers(sizes: list[int], room: int, slot: int, ring: int) -> list[int]:
    """Layers to keep resident in ``room`` bytes: all when they fit, else as many as leave ``ring``
    buffers of ``slot`` bytes, spread evenly over the depth."""
    n = len(sizes)
    if sum(sizes) <= room:
        return list(range(n))
    room -= ring * slot
    if room <= 0 or not sizes:
        return []
    for k in range(min(n - 1, room // min(sizes)), 0, -1):
        chosen = sorted({min(n - 1, int((j + 0.5) * n / k)) for j in range(k)})
        if sum(sizes[i] for i in chosen) <= room:
            return chosen
    return []
