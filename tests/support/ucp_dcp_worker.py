"""One rank of torch.distributed.checkpoint saves and loads through ucp.dcp (tests/ucp/dcp/test_dcp_backend.py).

usage: python ucp_dcp_worker.py RANK WORLD INIT_FILE OUT_DIR

1. ``dcp.save`` of DTensors of every dtype (row- and column-sharded, unevenly; replicated), a torch
   ShardedTensor with two row blocks per rank, a plain tensor and plain values through ``ucp.dcp.Writer``
   into OUT_DIR/dcp;
2. ``dcp.load`` of it through ``ucp.dcp.Reader`` into DTensors placed differently (rows <-> columns,
   sharded <-> replicated): every rank checks its local shards bit-exactly;
3. ``ucp.save`` of the same tensors as ShardedTensor rows and FlatShard ranges into OUT_DIR/ucp,
   then ``dcp.load`` of that through ``ucp.dcp.Reader`` into row-sharded DTensors, checked the same way;
4. ``ucp.save`` of the DTensors of step 1, then ``dcp.load`` of them into the placements of step 2.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import torch
from world import init_gloo

from ucp.format.dtypes import DTYPE_NAMES, torch_dtype

SHAPE = (5, 3)  # 5 rows, 3 columns: uneven over 2 ranks both ways
DTYPES = sorted(DTYPE_NAMES)
BLOCKS = torch.arange(8 * 3, dtype=torch.float64).reshape(8, 3)  # 4 row blocks: 0 and 2 on rank 0, 1 and 3 on 1
VALUES = {"step": 3, "lr": 0.5, "betas": (0.9, 0.95), "names": ["a", "b"]}


def full_tensor(name: str, i: int) -> torch.Tensor:
    """Random bytes as ``name``'s dtype (NaN payloads, -0.0...), the same on every rank (seeded)."""
    dtype = torch_dtype(name)
    raw = np.random.default_rng(i).integers(0, 256, size=math.prod(SHAPE) * dtype.itemsize, dtype=np.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return torch.from_numpy(raw).view(dtype).reshape(SHAPE)


def full_state() -> dict[str, torch.Tensor]:
    return {name: full_tensor(name, i) for i, name in enumerate(DTYPES)}


def placement(i: int, flip: bool) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    kind = (i + flip) % 3
    return Replicate() if kind == 2 else Shard(kind)


def local_part(full: torch.Tensor, mesh: Any, place: Any) -> tuple[torch.Tensor, tuple[slice, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, [place])
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return full[index].contiguous(), index


def dtensor(full: torch.Tensor, mesh: Any, place: Any) -> Any:
    """A DTensor made of this rank's part of ``full`` (no collective: gloo moves few of these dtypes)."""
    from torch.distributed.tensor import DTensor

    local, _ = local_part(full, mesh, place)
    return DTensor.from_local(local, mesh, [place], run_check=False, shape=full.shape, stride=full.stride())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_dtensors(state: dict[str, Any], full: dict[str, torch.Tensor], mesh: Any, what: str) -> None:
    for name, t in state.items():
        _, index = local_part(full[name], mesh, t.placements[0])
        assert same_bytes(t.to_local(), full[name][index].contiguous()), f"{what}: {name} differs"


def interleaved(full: torch.Tensor, rank: int, world: int) -> Any:
    """A torch ShardedTensor holding row blocks ``rank`` and ``rank + world`` of ``full`` (two chunks of one
    tensor on each rank: the writer stores them as two pieces of one file)."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rows = full.shape[0] // (2 * world)
    shards = [
        Shard.from_tensor_and_offsets(full[b * rows : (b + 1) * rows].clone(), [b * rows, 0], rank)
        for b in (rank, rank + world)
    ]
    return init_from_local_shards(shards, list(full.shape))


def main(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import ucp
    import ucp.dcp

    warnings.simplefilter("ignore")
    init_gloo(init, rank, world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = full_state()
        state = {
            "model": {n: dtensor(t, mesh, placement(i, False)) for i, (n, t) in enumerate(full.items())},
            "plain": full["F32"].clone(),
            "blocks": interleaved(BLOCKS, rank, world),
            **VALUES,
        }
        dcp.save(state, storage_writer=ucp.dcp.Writer(f"{out}/dcp", step=3))

        fresh: dict[str, Any] = {
            "model": {
                n: dtensor(torch.zeros_like(t), mesh, placement(i, True)) for i, (n, t) in enumerate(full.items())
            },
            "plain": torch.zeros(SHAPE),
            "blocks": dtensor(torch.zeros_like(BLOCKS), mesh, placement(2, False)),  # replicated: all of it
            **{k: None for k in VALUES},
        }
        dcp.load(fresh, storage_reader=ucp.dcp.Reader(f"{out}/dcp"))
        assert same_bytes(fresh["blocks"].to_local(), BLOCKS)
        check_dtensors(fresh["model"], full, mesh, "dcp.save -> dcp.load")
        assert same_bytes(fresh["plain"], full["F32"])
        assert {k: fresh[k] for k in VALUES} == VALUES, {k: fresh[k] for k in VALUES}

        rows: dict[
            str, ucp.ShardedTensor | ucp.FlatShard
        ] = {}  # ucp.save: rows of the even dtypes, flat ranges (cut mid-row) of the odd ones
        for i, (n, t) in enumerate(full.items()):
            if i % 2:
                cut = 7 if rank == 0 else 8
                start = 0 if rank == 0 else 7
                rows[n] = ucp.FlatShard(t.reshape(-1)[start : start + cut].clone(), SHAPE, start)
            else:
                local, index = local_part(t, mesh, placement(0, False))
                rows[n] = ucp.ShardedTensor(local, SHAPE, (index[0].start, 0))
        ucp.save({"model": rows, **VALUES}, f"{out}/ucp")
        into: dict[str, Any] = {
            "model": {n: dtensor(torch.zeros_like(t), mesh, placement(0, False)) for n, t in full.items()},
            **{k: None for k in VALUES},
        }
        dcp.load(into, storage_reader=ucp.dcp.Reader(f"{out}/ucp"))
        check_dtensors(into["model"], full, mesh, "ucp.save -> dcp.load")
        assert {k: into[k] for k in VALUES} == VALUES

        ucp.save({"model": state["model"]}, f"{out}/ucp-dtensors")  # ucp.save's own DTensor path
        flipped = {n: dtensor(torch.zeros_like(t), mesh, placement(i, True)) for i, (n, t) in enumerate(full.items())}
        dcp.load({"model": flipped}, storage_reader=ucp.dcp.Reader(f"{out}/ucp-dtensors"))
        check_dtensors(flipped, full, mesh, "ucp.save(DTensors) -> dcp.load")
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: OK", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
