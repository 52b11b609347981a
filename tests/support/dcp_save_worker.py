"""One rank of a torch.distributed.checkpoint save of sharded DTensors, for the DCP importer's tests.

usage: python dcp_save_worker.py SCENARIO RANK WORLD INIT_FILE OUT_DIR
  rows   row-sharded weights, uneven split (tests/ucp/conversion/test_import_dcp.py), any world size
  mixed  rows, columns (bf16), an empty chunk, a replicated tensor and optimizer state; 2 ranks
         (tests/ucp/conversion/test_import_export_data.py)
"""

from __future__ import annotations

import sys

import torch
from world import init_gloo

FULL = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) / 7  # 7 rows: uneven split over 2 ranks


def save_rows(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init_gloo(init, rank, world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {"model": {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]), "b": torch.ones(3)}, "step": 5}
        dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def dcp_mixed_state() -> dict[str, torch.Tensor]:
    """The global tensors the ``mixed`` scenario shards (the same on every rank: seeded)."""
    g = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(7, 3, generator=g),
        "cols": torch.randn(4, 5, generator=g).bfloat16(),
        "tiny": torch.randn(1, 4, generator=g),
        "rep": torch.randn(3, generator=g),
    }


def save_mixed(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    assert world == 2, "the mixed scenario is laid out for 2 ranks"
    init_gloo(init, rank, world)
    try:
        mesh = init_device_mesh("cpu", (2,))
        f = dcp_mixed_state()
        state = {
            "model": {
                "rows": distribute_tensor(f["rows"], mesh, [Shard(0)]),  # 4 + 3 rows
                "cols": distribute_tensor(f["cols"], mesh, [Shard(1)]),  # 3 + 2 columns, bf16
                "tiny": distribute_tensor(f["tiny"], mesh, [Shard(0)]),  # rank 1's chunk is empty
                "rep": distribute_tensor(f["rep"], mesh, [Replicate()]),
            },
            "optim": {
                "state": {
                    "rows": {"exp_avg": distribute_tensor(f["rows"] * 2, mesh, [Shard(0)]), "step": torch.tensor(4.0)}
                }
            },
            "step": 4,
        }
        dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


SCENARIOS = {"rows": save_rows, "mixed": save_mixed}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
