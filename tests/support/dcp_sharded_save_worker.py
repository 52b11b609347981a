"""One rank of a 2-rank torch.distributed.checkpoint save of row-sharded DTensors (tests/ucp/convert/test_import_dcp.py).

usage: python dcp_sharded_save_worker.py RANK WORLD INIT_FILE OUT_DIR
"""

from __future__ import annotations

import sys

import torch
from world import init_gloo

FULL = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) / 7  # 7 rows: uneven split over 2 ranks


def _worker(rank: int, world: int, init: str, out: str) -> None:
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


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
