"""Start a gloo world of real processes for a test, and wait for it.

Every multi-process test runs ``python SCRIPT ARGS...`` once per rank (the rank among its arguments),
with gloo bound to loopback and one OpenMP thread per rank (the CI machine has 2 cores). Ranks meet
through a ``file://`` rendezvous file (see :func:`init_gloo`), so no port is ever taken or raced for.
A rank that exits with an unexpected code fails the test with the tail of every failing rank's output;
a world that hangs is killed, never left behind.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Callable, Mapping, NoReturn, Sequence

WORLD_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def world_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment (PYTHONPATH holds tests/support, see tests/conftest.py), set up for gloo."""
    return {**os.environ, **WORLD_ENV, **(extra or {})}


def start_world(
    script: str | Path,
    args: Callable[[int], Sequence[str]],
    world: int,
    env: Mapping[str, str] | None = None,
    logs: Sequence[IO[str]] | None = None,
    **popen: object,
) -> list[subprocess.Popen]:
    """Start ``python script *args(rank)`` for each rank, stdout and stderr merged into one pipe (or into
    ``logs[rank]``); ``popen``: more subprocess.Popen options. The caller waits (see :func:`wait_world`)."""
    procs = []
    for rank in range(world):
        out: object = logs[rank] if logs is not None else subprocess.PIPE
        options: dict[str, object] = {"stdout": out, "stderr": subprocess.STDOUT, "text": True, **popen}
        cmd = [sys.executable, str(script), *map(str, args(rank))]
        procs.append(subprocess.Popen(cmd, env=world_env(env), **options))  # type: ignore[call-overload]
    return procs


def wait_world(
    procs: list[subprocess.Popen], timeout: float = 180, allowed_rc: Mapping[int, int] | None = None
) -> list[str]:
    """Wait for every rank (killing them all if one outlives ``timeout``); assert each exited as expected
    (0, or ``allowed_rc[rank]``); return each rank's output."""
    outs: list[str] = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate()
            raise
        outs.append(out or "")
    allowed = allowed_rc or {}
    failed = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != allowed.get(r, 0)]
    assert not failed, "\n".join(f"--- rank {r} rc={rc} ---\n{o[-3000:]}" for r, rc, o in failed)
    return outs


def run_world(
    script: str | Path,
    args: Callable[[int], Sequence[str]],
    world: int,
    timeout: float = 180,
    allowed_rc: Mapping[int, int] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Run ``python script *args(rank)`` on ``world`` ranks to the end; see :func:`wait_world`."""
    return wait_world(start_world(script, args, world, env), timeout, allowed_rc)


def init_gloo(init_file: str | Path, rank: int, world: int, timeout: datetime.timedelta | None = None) -> None:
    """In a rank: join the world through ``init_file`` (a fresh path shared by the ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)


def serve_scenarios(run: Callable[[dict[str, Any], int, int, Path], None]) -> NoReturn:
    """A rank's ``__main__`` for ``python WORKER RANK WORLD INIT_FILE OUT_DIR SCENARIOS_JSON`` (what the training
    tests' ``run_world`` starts): one torch thread, join the world, ``run(scenario, rank, world, out_dir)`` for
    each scenario with a barrier after each, leave the world, then exit at once (``os._exit(0)``, skipping the
    interpreter's teardown). A scenario that raises ends the rank with its traceback."""
    import torch
    import torch.distributed as dist

    rank, world, init, out, spec = sys.argv[1:6]
    scenarios = json.loads(Path(spec).read_text())
    torch.set_num_threads(1)
    init_gloo(init, int(rank), int(world))
    try:
        for sc in scenarios:
            run(sc, int(rank), int(world), Path(out))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
