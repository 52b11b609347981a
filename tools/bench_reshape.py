"""Benchmark ``ucp reshape`` against the floor of any rewrite: ``cp -r`` + ``sync`` of the same files.

    .venv/bin/python tools/bench_reshape.py --rounds 3            # ~2.1 GiB checkpoint, caches dropped per step
    .venv/bin/python tools/bench_reshape.py --layers 2 --rounds 1  # a quick smoke run
    .venv/bin/python tools/bench_reshape.py --layers 2 --vocab 262144 --rounds 1  # 768 MiB tensors

The source is a reference-GPT training checkpoint (fp32 weights, fp32 masters, Adam moments: 16
bytes per parameter) laid out for tp=2 × dp=2 with ZeRO-2, as four rank files. Each round times,
with the page cache dropped before each step (root only; otherwise the run says so):

* ``cp -r SRC DST`` then ``sync`` — every byte read and written once, no layout work;
* ``ucp reshape SRC DST --tp 1 --dp 4 --zero 1`` — another TP/DP split and ZeRO stage;
* ``ucp reshape SRC DST`` — consolidated (one piece per tensor).

Each reshape runs as its own ``ucp`` process; its peak RSS is checked against the issue's bound,
1 GiB + 2 × the largest tensor. Medians over rounds; ``--json`` for the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
UCP = [sys.executable, "-m", "ucp.cli"]

from tools.argtypes import positive_int  # noqa: E402


def drop_caches(mode: str, src: Path) -> bool:
    """Make the next step read ``src`` from the device; False when that was not possible.

    ``all``: sync and drop the whole page cache (root only): programs start cold too (Python and
    torch take ~2 s more to start, cp almost nothing). ``data``: sync and evict only the
    checkpoint's files (``posix_fadvise(DONTNEED)``), as on a machine that runs these programs
    regularly.
    """
    from aio.tune import drop_page_cache, evict_file

    if mode == "all":
        return drop_page_cache()[0]
    os.sync()
    return all([evict_file(path) for path in src.rglob("*") if path.is_file()])


def make_source(root: Path, layers: int, vocab: int | None = None) -> Path:
    """A tp2 x dp2 ZeRO-2 checkpoint of a reference GPT with ``layers`` layers and the preset's
    vocabulary or ``vocab`` (large tensors: the embedding, its master and moments; made once, reused)."""
    src = root / (f"src-l{layers}" + (f"-v{vocab}" if vocab else ""))
    if (src / "manifest.json").exists():
        return src
    import ucp
    from training import Engine
    from training.models.gpt import PRESETS

    cfg = PRESETS["gpt-100m"].model_copy(update={"n_layer": layers, **({"vocab_size": vocab} if vocab else {})})
    one = root / f"one-{src.name}"
    shutil.rmtree(one, ignore_errors=True)
    engine = Engine(cfg, zero_stage=1)  # initial weights; optimizer states are zeros (the bytes cost the same)
    ucp.save(engine.state_dict_for_checkpoint(), one, metadata=_engine_metadata(engine))
    del engine
    _run([*UCP, "reshape", str(one), str(src), "--tp", "2", "--dp", "2", "--zero", "2", "--json"])
    shutil.rmtree(one)
    return src


def _engine_metadata(engine) -> dict:
    from ucp.convert.placement import layout_metadata

    return {
        "mesh": engine.mesh.as_dict(),
        "zero_stage": engine.cfg.zero_stage,
        "dtype": engine.cfg.dtype,
        **layout_metadata(engine.layout, engine.shapes),
    }


def _run(cmd: list[str]) -> str:
    """Run ``cmd`` (an argument list: no shell parses the paths); its stdout, or exit with its output."""
    return _checked(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True))


def copy_and_sync(src: Path, dst: Path) -> str:
    """The floor of any rewrite: ``cp -r SRC DST``, then ``sync`` so the copy is on the device."""
    for cmd in (["cp", "-r", str(src), str(dst)], ["sync"]):
        _checked(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True))
    return ""


def _checked(res: subprocess.CompletedProcess[str]) -> str:
    """The command's stdout, or exit with its command line and output if it failed."""
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(res.args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.stdout


Step = Callable[[], str]  # runs one benchmarked step; returns what it printed


def timed(step: Step, src: Path, dst: Path, drop: str) -> tuple[float, dict | None]:
    """Wall seconds of ``step`` (with caches dropped first), its --json output if any; removes ``dst`` after."""
    shutil.rmtree(dst, ignore_errors=True)
    drop_caches(drop, src)
    t0 = time.perf_counter()
    out = step()
    seconds = time.perf_counter() - t0
    doc = json.loads(out) if out.lstrip().startswith("{") else None
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    return seconds, doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=Path("/tmp/ucp-bench-reshape"), help="work directory")
    p.add_argument("--layers", type=positive_int, default=18, help="GPT layers (18: ~140M parameters, ~2.1 GiB)")
    p.add_argument(
        "--vocab",
        type=positive_int,
        default=None,
        help="vocabulary size (default: the preset's 8k; e.g. 262144 for 768 MiB tensors)",
    )
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--memory-budget", default="512MiB")
    p.add_argument(
        "--drop",
        choices=("data", "all"),
        default="all",
        help="before each step drop the whole page cache (all) or only the checkpoint's pages (data)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    args.root = args.root.absolute()  # the steps run with cwd=ROOT: a relative --root must mean the same there
    args.root.mkdir(parents=True, exist_ok=True)
    src = make_source(args.root, args.layers, args.vocab)

    import ucp

    manifest = ucp.read_manifest(src)
    size = sum(f.size for f in manifest.files.values())
    largest = max(t.nbytes for t in manifest.tensors.values())
    rss_bound = (1 << 30) + 2 * largest
    cold = drop_caches(args.drop, src)
    dst = args.root / "dst"
    reshape = [*UCP, "reshape", str(src), str(dst)]
    budget = ["--memory-budget", args.memory_budget, "--json"]
    steps: dict[str, Step] = {
        "cp -r + sync": lambda: copy_and_sync(src, dst),
        "reshape tp1 dp4 ZeRO-1": lambda: _run([*reshape, "--tp", "1", "--dp", "4", "--zero", "1", *budget]),
        "reshape consolidated": lambda: _run([*reshape, *budget]),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    rss: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, step in steps.items():
            seconds, doc = timed(step, src, dst, args.drop)
            times[name].append(seconds)
            if doc is not None:
                rss[name] = max(rss.get(name, 0), int(doc["peak_rss_bytes"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["cp -r + sync"]
    result = {
        "command": "python tools/bench_reshape.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "checkpoint_bytes": size,
        "files": len(manifest.files),
        "largest_tensor_bytes": largest,
        "caches_dropped": cold,
        "drop": args.drop,
        "rounds": args.rounds,
        "seconds": times,
        "median_seconds": med,
        "ratio_to_cp": {k: v / floor for k, v in med.items()},
        "peak_rss_bytes": rss,
        "rss_bound_bytes": rss_bound,
        "pass": {k: med[k] <= 1.25 * floor and rss[k] <= rss_bound for k in rss},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"checkpoint: {size / 2**30:.2f} GiB in {len(manifest.files)} files (tp2 x dp2 ZeRO-2), largest tensor "
        f"{largest / 2**20:.0f} MiB; before each step: "
        + (
            {"all": "whole page cache dropped", "data": "checkpoint pages evicted"}[args.drop]
            if cold
            else "page cache NOT dropped (not root)"
        )
    )
    print(f"{'step':<26}{'median s':>10}{'GB/s':>8}{'x cp':>7}{'peak RSS':>11}{'target':>9}")
    for k, v in med.items():
        peak = f"{rss[k] / 2**20:.0f} MiB" if k in rss else ""
        verdict = ("pass" if result["pass"][k] else "FAIL") if k in rss else ""
        print(f"{k:<26}{v:>10.2f}{size / v / 1e9:>8.2f}{v / floor:>7.2f}{peak:>11}{verdict:>9}")
    print(f"targets: <= 1.25 x cp, peak RSS <= {rss_bound / 2**20:.0f} MiB (1 GiB + 2 x largest tensor)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
