"""Wall clock of `ucp convert` against DeepSpeed's `ds_to_universal` on the same DeepSpeed checkpoint.

Both turn a native ZeRO checkpoint into a topology-independent one. Each round drops the page
cache first (cold reads, as after a job ends), then runs the command in a fresh interpreter and
times the command itself; outputs are deleted between rounds, outside the timing. ucp convert
fsyncs what it writes and ds_to_universal does not, so the `sync` that follows each command is
timed too and reported apart ("sync s").

    python tools/bench_convert.py --model gpt-100m --rounds 3 [--json]
    python tools/bench_convert.py --model tiny --rounds 1            # smoke run

The DeepSpeed checkpoint comes from tools/peers (cached under $UCP_PEER_CACHE).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.argtypes import positive_int  # noqa: E402
from tools.peers.deepspeed_ckpt import make_checkpoint, peer_env, read_latest  # noqa: E402


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); False when not allowed."""
    from aio.tune import drop_page_cache

    return drop_page_cache()[0]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds of the command, seconds of the sync after it); raises with its output if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    t1 = time.perf_counter()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    subprocess.run(["sync"], check=True)
    return t1 - t0, time.perf_counter() - t1


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-100m", help="training.models preset (default gpt-100m)")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=positive_int, default=1)
    p.add_argument("--seq", type=positive_int, default=64, help="sequence length for the (cheap) training run")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--scratch", type=Path, default=None, help="where outputs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)

    ckpt = make_checkpoint(
        world_size=a.world_size, zero_stage=a.zero_stage, dtype=a.dtype, steps=a.steps, model_config=a.model, seq=a.seq
    )
    tag = read_latest(ckpt)
    src_bytes = dir_bytes(ckpt / tag)
    scratch = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=a.scratch))
    env = peer_env()
    rows: dict[str, list[dict[str, float]]] = {"ucp convert": [], "ds_to_universal": []}
    dropped = True
    out_bytes: dict[str, int] = {}
    try:
        for _ in range(a.rounds):
            dst = scratch / "ucp"
            dropped &= drop_caches()
            run, sync = timed([sys.executable, "-m", "ucp.cli.main", "convert", str(ckpt), str(dst), "--json"], env)
            rows["ucp convert"].append({"s": run, "sync_s": sync})
            out_bytes["ucp convert"] = dir_bytes(dst)
            shutil.rmtree(dst)
            udst = scratch / "ds" / f"{tag}_universal"
            dropped &= drop_caches()
            run, sync = timed(
                [
                    sys.executable,
                    "-m",
                    "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder",
                    str(ckpt / tag),
                    "--output_folder",
                    str(udst),
                    "--inject_missing_state",
                ],
                env,
            )
            rows["ds_to_universal"].append({"s": run, "sync_s": sync})
            out_bytes["ds_to_universal"] = dir_bytes(udst)
            shutil.rmtree(scratch / "ds")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = {k: {m: statistics.median(r[m] for r in v) for m in ("s", "sync_s")} for k, v in rows.items()}
    ratio = med["ds_to_universal"]["s"] / med["ucp convert"]["s"]
    ratio_sync = sum(med["ds_to_universal"].values()) / sum(med["ucp convert"].values())
    result = {
        "checkpoint": str(ckpt),
        "model": a.model,
        "zero_stage": a.zero_stage,
        "world_size": a.world_size,
        "dtype": a.dtype,
        "source_bytes": src_bytes,
        "rounds": a.rounds,
        "page_cache_dropped": dropped,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "median": {
            k: {"seconds": round(v["s"], 3), "sync_seconds": round(v["sync_s"], 3), "output_bytes": out_bytes[k]}
            for k, v in med.items()
        },
        "runs": {k: [{m: round(x, 3) for m, x in r.items()} for r in v] for k, v in rows.items()},
        "speedup": round(ratio, 2),
        "speedup_with_sync": round(ratio_sync, 2),
        "target_speedup": 3.0,
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{a.model} ZeRO-{a.zero_stage} {a.dtype} W={a.world_size}: {src_bytes / 1e6:.0f} MB native checkpoint, "
        f"{a.rounds} round(s), page cache {'dropped' if dropped else 'NOT dropped'} before each run"
    )
    print(f"{'tool':<18}{'median s':>10}{'sync s':>9}{'output MB':>11}")
    for k, v in result["median"].items():
        print(f"{k:<18}{v['seconds']:>10.2f}{v['sync_seconds']:>9.2f}{v['output_bytes'] / 1e6:>11.0f}")
    print(f"ucp convert is {ratio:.2f}x faster ({ratio_sync:.2f}x counting the syncs); target 3x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
