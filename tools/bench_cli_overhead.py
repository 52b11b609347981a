"""Benchmark what one-shot commands spend outside their data movement (issue 21: at most 0.3 s).

    .venv/bin/python tools/bench_cli_overhead.py                  # 7 rounds on a 1 MiB checkpoint
    .venv/bin/python tools/bench_cli_overhead.py --rounds 3 --json
    .venv/bin/python tools/bench_cli_overhead.py --deepspeed /path/to/ds_root   # adds `ucp convert` of it

Each round runs ``ucp reshape`` (to ``--dp 2 --zero 1``), ``ucp convert`` (a safetensors file), ``ucp
export`` (to safetensors) and ``ucp verify`` once each, interleaved, every one in a fresh process
(``python -m ucp.cli``, what the ``ucp`` script runs) with ``UCP_TIMINGS=1``, which prints the phase
split on stderr (ucp/cli/timings.py): ``imports`` (interpreter start-up included), ``setup``, ``io`` (the
library call that moves data) and ``exit``. Wall time is taken around the process from outside, so it
also holds fork/exec and the kernel's teardown. The data are small (16 tensors, 1 MiB), so ``io`` is
itself nearly all fixed cost; ``wall - io`` is what the target bounds. Medians over rounds; the page
cache is warm (the data are tiny; cold reads are the other benchmarks' business).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.argtypes import positive_int  # noqa: E402

TARGET_S = 0.3
PHASES = ("imports", "setup", "io", "exit")
LINE = re.compile(r"^ucp timings: imports=(\S+) setup=(\S+) io=(\S+) exit=(\S+) total=(\S+)$", re.M)


def make_sources(root: Path, tensors: int, kib: int) -> dict[str, Path]:
    """A UCP checkpoint (``model`` section) and the same model as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    import ucp

    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(kib * 256, generator=g) for i in range(tensors)}
    ucp.save({"model": model, "step": 1}, root / "ckpt", step=1)
    save_file(model, root / "model.safetensors")
    return {"ckpt": root / "ckpt", "hf": root / "model.safetensors"}


def commands(sources: dict[str, Path], work: Path, deepspeed: Path | None) -> dict[str, tuple[list[str], Path | None]]:
    """name -> (argv after ``ucp``, the output to remove before each run)."""
    out = {
        "reshape": (
            ["reshape", str(sources["ckpt"]), str(work / "reshaped"), "--dp", "2", "--zero", "1"],
            work / "reshaped",
        ),
        "convert": (["convert", str(sources["hf"]), str(work / "converted")], work / "converted"),
        "export": (["export", str(sources["ckpt"]), str(work / "exported")], work / "exported"),
        "verify": (["verify", str(sources["ckpt"])], None),
    }
    if deepspeed is not None:
        out["convert (DeepSpeed)"] = (["convert", str(deepspeed), str(work / "from-ds")], work / "from-ds")
    return out


def run_once(argv: list[str]) -> dict[str, float]:
    """One fresh ``python -m ucp.cli ARGV``: its phases, its wall time from outside and its CPU time."""
    env = dict(os.environ, UCP_TIMINGS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ucp.cli", *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"ucp {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    found = LINE.findall(proc.stderr)
    if len(found) != 1:
        raise SystemExit(f"ucp {' '.join(argv)} printed no timings line:\n{proc.stderr[-2000:]}")
    values = dict(zip((*PHASES, "total"), map(float, found[0])))
    return {**values, "wall": wall, "cpu": cpu}


def median_table(samples: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    rows = []
    for name, runs in samples.items():
        med = {k: statistics.median(r[k] for r in runs) for k in (*PHASES, "total", "wall", "cpu")}
        over_io = statistics.median(r["wall"] - r["io"] for r in runs)
        walls = sorted(r["wall"] for r in runs)
        rows.append({"command": name, **med, "wall_minus_io": over_io, "wall_min": walls[0], "wall_max": walls[-1]})
    return rows


def markdown(rows: list[dict[str, Any]], runs: int) -> str:
    head = (
        f"| command | imports s | setup s | io s | exit s | outside the process s | wall s (min–max) | CPU s | "
        f"wall − io s | ≤ {TARGET_S} s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"
    )
    lines = [head]
    for r in rows:
        ok = "yes" if r["wall_minus_io"] <= TARGET_S else "no"
        lines.append(
            f"| `ucp {r['command']}` | {r['imports']:.3f} | {r['setup']:.3f} | {r['io']:.3f} | {r['exit']:.3f} | "
            f"{r['wall'] - r['total']:.3f} | {r['wall']:.3f} ({r['wall_min']:.3f}–{r['wall_max']:.3f}) | "
            f"{r['cpu']:.3f} | {r['wall_minus_io']:.3f} | {ok} |"
        )
    lines.append(
        f"\nMedians of {runs} fresh processes per command, interleaved. CPU: the process's user + system time "
        "(what its start-up costs when it need not wait for a core)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=7, help="fresh processes per command (default 7)")
    parser.add_argument("--tensors", type=positive_int, default=16, help="tensors in the checkpoint (default 16)")
    parser.add_argument("--kib", type=positive_int, default=64, help="KiB per tensor (default 64)")
    parser.add_argument("--deepspeed", type=Path, help="also time `ucp convert` of this DeepSpeed checkpoint root")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.deepspeed is not None and not args.deepspeed.is_dir():
        parser.error(f"--deepspeed {args.deepspeed} is not a directory")
    work = Path(tempfile.mkdtemp(prefix="ucp-cli-bench-", dir=args.dir))
    try:
        sources = make_sources(work, args.tensors, args.kib)
        cmds = commands(sources, work, args.deepspeed)
        run_once(cmds["verify"][0])  # warm-up: .pyc files and the page cache, not counted
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in cmds}
        load_before = os.getloadavg()[0]
        for _ in range(args.rounds):
            for name, (cmd, output) in cmds.items():
                if output is not None:
                    shutil.rmtree(output, ignore_errors=True)
                samples[name].append(run_once(cmd))
        load_after = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = median_table(samples)
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "tools/bench_cli_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
        "data": f"{args.tensors} fp32 tensors x {args.kib} KiB",
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "target_s": TARGET_S,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['date']}, {report['data']}, load average {load_before:.2f} -> {load_after:.2f}\n")
        print(markdown(rows, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
