"""One rank of the training Engine resuming UCP imports of DeepSpeed checkpoints at other meshes, saving
again (tests/ucp/conversion/test_import_deepspeed.py).

usage: python engine_resume_worker.py RANK WORLD INIT_FILE SPEC_JSON
(SPEC_JSON: a list of {"src", "out", "mesh", "zero_stage", "dtype"})
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from world import init_gloo

import ucp


def _worker(rank: int, world: int, init: str, spec_file: str) -> None:
    import torch.distributed as dist

    from training import Engine

    torch.set_num_threads(1)
    init_gloo(init, rank, world)
    try:
        for case in json.loads(Path(spec_file).read_text()):
            engine = Engine(
                "tiny", mesh=case["mesh"], zero_stage=case["zero_stage"], dtype=case["dtype"], data_seed=1234
            )  # the peer run's data stream (recorded in the import)
            start = engine.load(case["src"])
            assert start == 3 and engine.optimizer.adam_step == 3, (start, engine.optimizer.adam_step)
            ucp.save(engine.state_dict_for_checkpoint(), case["out"], step=engine.step)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
