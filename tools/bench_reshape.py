"""Benchmark ``ucp reshape`` against the floor of any rewrite: ``cp -r`` + ``sync`` of the same files.

    .venv/bin/python tools/bench_reshape.py --rounds 3            # ~2.1 GiB checkpoint, caches dropped per step
    .venv/bin/python tools/bench_reshape.py --layers 2 --rounds 1  # a quick smoke run
    .venv/bin/python tools/bench_reshape.py --layers 2 --vocab 262144 --rounds 1  # 768 MiB tensors
    .venv/bin/python tools/bench_reshape.py --source deepspeed --rounds 3 --drop data  # issue 21's check

The source is a reference-GPT training checkpoint (fp32 weights, fp32 masters, Adam moments: 16
bytes per parameter) laid out for tp=2 × dp=2 with ZeRO-2, as four rank files. Each round times,
with the page cache dropped before each step (root only; otherwise the run says so):

* ``cp -r SRC DST`` then ``sync`` — every byte read and written once, no layout work;
* ``ucp reshape SRC DST --tp 1 --dp 4 --zero 1`` — another TP/DP split and ZeRO stage;
* ``ucp reshape SRC DST`` — consolidated (one piece per tensor);
* where ``fio`` is installed and the checkpoint holds at least 64 MiB, fio reading the checkpoint's data files with O_DIRECT while writing as many
  bytes (concurrently, fsynced): the device's floor for the reshape's data movement at that moment, to
  hold the reshape's own ``io`` phase against.

Each reshape runs as its own ``ucp`` process; its peak RSS is checked against the issue's bound,
1 GiB + 2 × the largest tensor. Medians over rounds; ``--json`` for the raw numbers.

``--source deepspeed``: the source is instead ``ucp convert`` of a real DeepSpeed 0.19.8 checkpoint
(tools/peers: the gpt-100m GPT, ZeRO-2, fp32, 2 ranks, 1.56 GB; DeepSpeed must be installed), and each
round times, interleaved, ``cp -r`` + ``sync`` of the converted checkpoint, ``ucp reshape SRC DST --dp 4``
with no layout file (the importer recorded DeepSpeed's; the ZeRO stage stays 2), ``ucp convert`` of the
DeepSpeed checkpoint and DeepSpeed's ``ds_to_universal`` of it (each followed by a timed ``sync``: ucp
fsyncs, ds_to_universal does not). Targets (issue 21): reshape <= 1.25 x the copy with peak RSS <= 1 GiB;
``ucp convert`` >= 3 x faster than ``ds_to_universal``. The reshape's own split of its time (imports,
setup, io, exit: ``UCP_TIMINGS=1``) is reported where the ``ucp`` command prints it.
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
from ucp.bench.report import cpu_model  # noqa: E402


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
    from ucp.conversion.placement import layout_metadata

    return {
        "mesh": engine.mesh.as_dict(),
        "zero_stage": engine.cfg.zero_stage,
        "dtype": engine.cfg.dtype,
        **layout_metadata(engine.layout, engine.shapes),
    }


def _run(cmd: list[str], env: dict[str, str] | None = None, stderr: list[str] | None = None) -> str:
    """Run ``cmd`` (an argument list: no shell parses the paths); its stdout, or exit with its output.
    ``stderr``: where to append what it printed on stderr."""
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if stderr is not None:
        stderr.append(res.stderr)
    return _checked(res)


TIMINGS_PREFIX = "ucp timings:"  # ucp.cli.timings' line: "ucp timings: imports=0.41 setup=0.03 io=1.9 exit=0.01 ..."


def parse_timings(stderr: str) -> dict[str, float] | None:
    """The phase split a ``ucp`` command printed with ``UCP_TIMINGS=1``, or None if it printed none."""
    for line in stderr.splitlines():
        if line.startswith(TIMINGS_PREFIX):
            pairs = (kv.split("=", 1) for kv in line[len(TIMINGS_PREFIX) :].split())
            return {k: float(v) for k, v in pairs}
    return None


def make_deepspeed_source(root: Path, model: str) -> tuple[Path, Path]:
    """(the DeepSpeed checkpoint root, its ``ucp convert`` under ``root``): ZeRO-2, fp32, 2 ranks, one
    step of ``model`` (tools/peers caches the DeepSpeed checkpoint; the conversion is made once)."""
    from tools.peers.deepspeed_ckpt import deepspeed_missing, make_checkpoint

    missing = deepspeed_missing()
    if missing is not None:
        raise SystemExit(f"--source deepspeed: {missing}")
    ds = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=1, model_config=model, seq=64)
    src = root / f"src-ds-{model}-z2-w2"
    if not (src / "manifest.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        _run([*UCP, "convert", str(ds), str(src), "--json"])
    return ds, src


def copy_and_sync(src: Path, dst: Path) -> str:
    """The floor of any rewrite: ``cp -r SRC DST``, then ``sync`` so the copy is on the device."""
    for cmd in (["cp", "-r", str(src), str(dst)], ["sync"]):
        _checked(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True))
    return ""


FIO_MIN_BYTES = 64 << 20  # smaller checkpoints (smoke runs) get no fio step: a few 8 MiB requests say nothing


def fio_read_write(src: Path, dst: Path, files: list[str]) -> str:
    """The device's floor for reading and writing the same bytes at once: fio reading the checkpoint's data
    files with O_DIRECT (8 MiB requests, 8 in flight) while a second job writes as many bytes to a new file
    under ``dst`` the same way, fsynced; both concurrent, as a reshape's reads and writes are."""
    dst.mkdir(parents=True)
    size = sum((src / f).stat().st_size for f in files)
    common = ["--bs=8m", "--iodepth=8", "--ioengine=libaio", "--direct=1", "--output-format=terse"]
    read = ["--name=read", "--rw=read", "--filename=" + ":".join(str(src / f).replace(":", "\\:") for f in files)]
    write = ["--name=write", "--rw=write", f"--filename={dst / 'fio.out'}", f"--size={size}", "--end_fsync=1"]
    return _checked(subprocess.run(["fio", *read, *common, *write, *common], capture_output=True, text=True))


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


def synced(step: Step, syncs: list[float]) -> Step:
    """``step`` then ``sync``; the sync's seconds are appended to ``syncs`` (and counted in the step's time)."""

    def run() -> str:
        out = step()
        t0 = time.perf_counter()
        os.sync()
        syncs.append(time.perf_counter() - t0)
        return out

    return run


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
    p.add_argument(
        "--source",
        choices=("engine", "deepspeed"),
        default="engine",
        help="engine: a tp2 x dp2 ZeRO-2 reference-GPT checkpoint; deepspeed: ucp convert of a DeepSpeed ZeRO-2 one",
    )
    p.add_argument("--model", default="gpt-100m", help="--source deepspeed: the GPT preset DeepSpeed trains")
    p.add_argument(
        "--no-convert", action="store_true", help="--source deepspeed: leave out ucp convert and ds_to_universal"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    args.root = args.root.absolute()  # the steps run with cwd=ROOT: a relative --root must mean the same there
    args.root.mkdir(parents=True, exist_ok=True)
    ds: Path | None = None
    if args.source == "deepspeed":
        ds, src = make_deepspeed_source(args.root, args.model)
    else:
        src = make_source(args.root, args.layers, args.vocab)

    import ucp

    manifest = ucp.read_manifest(src)
    size = sum(f.size for f in manifest.files.values())
    largest = max(t.nbytes for t in manifest.tensors.values())
    rss_bound = (1 << 30) + (2 * largest if ds is None else 0)
    cold = drop_caches(args.drop, src)
    dst = args.root / "dst"
    reshape = [*UCP, "reshape", str(src), str(dst)]
    budget = ["--memory-budget", args.memory_budget, "--json"]
    timings_env = {**os.environ, "UCP_TIMINGS": "1"}
    stderr: dict[str, list[str]] = {}
    syncs: dict[str, list[float]] = {"ucp convert": [], "ds_to_universal": []}
    drops: dict[str, Path] = {}  # a step's source, where it is not the checkpoint being reshaped
    steps: dict[str, Step] = {"cp -r + sync": lambda: copy_and_sync(src, dst)}
    if shutil.which("fio") and size >= FIO_MIN_BYTES:
        steps["fio read + write"] = lambda: fio_read_write(src, dst, sorted(manifest.files))
    if ds is None:
        steps["reshape tp1 dp4 ZeRO-1"] = lambda: _run([*reshape, "--tp", "1", "--dp", "4", "--zero", "1", *budget])
        steps["reshape consolidated"] = lambda: _run([*reshape, *budget])
    else:
        steps["reshape dp4, no layout"] = lambda: _run(
            [*reshape, "--dp", "4", *budget], timings_env, stderr.setdefault("reshape dp4, no layout", [])
        )
    if ds is not None and not args.no_convert:
        from tools.peers.deepspeed_ckpt import peer_env, read_latest

        tag = read_latest(ds)
        steps["ucp convert"] = synced(
            lambda: _run([*UCP, "convert", str(ds), str(dst), "--json"]), syncs["ucp convert"]
        )
        steps["ds_to_universal"] = synced(
            lambda: _run(
                [
                    sys.executable,
                    *("-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ds / tag)),
                    *("--output_folder", str(dst), "--inject_missing_state"),
                ],
                peer_env(),
            ),
            syncs["ds_to_universal"],
        )
        drops = {"ucp convert": ds, "ds_to_universal": ds}
    times: dict[str, list[float]] = {k: [] for k in steps}
    rss: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, step in steps.items():
            seconds, doc = timed(step, drops.get(name, src), dst, args.drop)
            times[name].append(seconds)
            if doc is not None and "peak_rss_bytes" in doc and name.startswith("reshape"):
                rss[name] = max(rss.get(name, 0), int(doc["peak_rss_bytes"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["cp -r + sync"]
    split = {
        k: {ph: statistics.median(t[ph] for t in parsed) for ph in parsed[0]}
        for k, outs in stderr.items()
        if (parsed := [t for t in map(parse_timings, outs) if t is not None])
    }
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
        "phase_seconds": split,
        "phase_runs": {k: [parse_timings(o) for o in outs] for k, outs in stderr.items()},
        "load_average": os.getloadavg(),
        "cpu": cpu_model(),
    }
    if "ucp convert" in med:
        result["convert_sync_seconds"] = {k: statistics.median(v) for k, v in syncs.items()}
        result["convert_speedup"] = med["ds_to_universal"] / med["ucp convert"]
        result["pass"]["ucp convert"] = result["convert_speedup"] >= 3.0
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"CPU: {result['cpu']}; load average (1/5/15 min) at the end: {result['load_average']}")
    what = "tp2 x dp2 ZeRO-2" if ds is None else f"ucp convert of DeepSpeed {args.model} ZeRO-2, 2 ranks"
    print(
        f"checkpoint: {size / 2**30:.2f} GiB in {len(manifest.files)} files ({what}), largest tensor "
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
        if k in syncs or k.startswith("fio"):  # another source or output: no ratio to the copy
            print(f"{k:<26}{v:>10.2f}")
            continue
        print(f"{k:<26}{v:>10.2f}{size / v / 1e9:>8.2f}{v / floor:>7.2f}{peak:>11}{verdict:>9}")
    for k, phases in split.items():
        print(f"{k}, median split: " + " ".join(f"{ph}={v:.2f}" for ph, v in phases.items()))
    bound = "1 GiB" if ds is not None else "1 GiB + 2 x largest tensor"
    print(f"targets: <= 1.25 x cp, peak RSS <= {rss_bound / 2**20:.0f} MiB ({bound})")
    if "ucp convert" in med:
        sy = result["convert_sync_seconds"]
        print(
            f"ucp convert {med['ucp convert']:.2f} s (sync {sy['ucp convert']:.2f}), ds_to_universal "
            f"{med['ds_to_universal']:.2f} s (sync {sy['ds_to_universal']:.2f}): "
            f"{result['convert_speedup']:.2f}x (target >= 3x, each with its sync)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
