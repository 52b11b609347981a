"""Benchmark the first call a user makes: ``state = ucp.load(path)`` in a fresh process, cold.

    .venv/bin/python tools/bench_cold_load.py --rounds 2            # 2 GiB as 16 and as 400 fp32 tensors
    .venv/bin/python tools/bench_cold_load.py --gib 0.25 --rounds 1  # a quick smoke run

One run, interleaved: every round times, each in its own fresh Python process and with the whole
page cache dropped first (root; otherwise only the files are evicted and the report says so):

* ``fio`` sequential O_DIRECT reads of the UCP data file (libaio; 1 MiB blocks at queue depth 32, and
  8 MiB at 8): the device, whichever of the two is faster (its median) is the limit ratios are taken to;
* ``ucp.load(path)`` of the state saved as 16 tensors, and as 400 tensors; and of the 16 tensors
  reshaped for dp=4 under ZeRO-3 (each tensor in four pieces, one per rank file: a sharded full load);
* ``torch.load(path, weights_only=True)`` of the same 16 / 400 tensors;
* ``safetensors.torch.load_file`` of the same, then every page of every tensor touched (timed: its
  tensors are not in memory until then).

Each loader process times only its load call (imports done before), then checks every tensor's
bytes against the CRC-32C computed when the state was made (bit-exact, outside the timing).
Medians over rounds; the table is the one report model (ucp.bench.report); ``--json`` prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.argtypes import positive_int  # noqa: E402

SHAPES = {16: 16, 400: 400}  # tensor counts measured

# The loader process: argv = method path; prints {"seconds": s, "ok": bool, "bytes": n}.
CHILD = r"""
import json, sys, time
import crc32c, torch
method, path, crcs = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
if method == "ucp":
    import ucp
    load = ucp.load  # resolves the lazy export (imports the loader), as `from ucp import load` would
    t = time.perf_counter(); state = load(path); seconds = time.perf_counter() - t
elif method == "torch":
    t = time.perf_counter(); state = torch.load(path, weights_only=True); seconds = time.perf_counter() - t
else:
    from safetensors.torch import load_file
    t = time.perf_counter()
    state = load_file(path)
    for v in state.values():
        v.reshape(-1).view(torch.uint8)[::4096].sum()  # touch every page
    seconds = time.perf_counter() - t
ok = sorted(state) == sorted(crcs) and all(
    crc32c.crc32c(memoryview(state[k].reshape(-1).view(torch.uint8).numpy())) == c for k, c in crcs.items()
)
print(json.dumps({"seconds": seconds, "ok": ok, "bytes": sum(v.nbytes for v in state.values())}))
"""


def make_states(root: Path, total: int) -> dict[int, dict[str, Path]]:
    """Per tensor count: the state saved by ucp, torch.save and safetensors, plus its CRCs (made once)."""
    import crc32c
    import torch
    from safetensors.torch import save_file

    import ucp
    from reshard import plain_layout
    from ucp.conversion.reshape import reshape

    out: dict[int, dict[str, Path]] = {}
    for count in SHAPES:
        d = root / f"n{count}-{total}"
        paths = {
            "ucp": d / "ucp",
            "ucp-z3": d / "ucp-z3-dp4",
            "torch": d / "state.pt",
            "safetensors": d / "state.safetensors",
            "crcs": d / "crcs.json",
        }
        out[count] = paths
        if paths["crcs"].exists():
            continue
        d.mkdir(parents=True, exist_ok=True)
        per = total // count // 4
        g = torch.Generator().manual_seed(count)
        state = {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(count)}
        ucp.save(state, paths["ucp"])
        reshape(paths["ucp"], paths["ucp-z3"], layout=plain_layout(4, 3))
        torch.save(state, paths["torch"])
        save_file(state, str(paths["safetensors"]))
        crcs = {k: crc32c.crc32c(v.view(torch.uint8).numpy().data) for k, v in state.items()}
        os.sync()
        paths["crcs"].write_text(json.dumps(crcs))
    return out


def drop(paths: list[Path]) -> bool:
    from aio.tune import drop_page_cache, evict_file

    if drop_page_cache()[0]:
        return True
    os.sync()
    files = [f for p in paths for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file()]
    return all([evict_file(f) for f in files])


def run_loader(method: str, path: Path, crcs: Path) -> tuple[float, bool, int]:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, method, str(path), str(crcs)], capture_output=True, text=True, cwd=ROOT
    )
    if res.returncode != 0:
        raise SystemExit(f"{method} {path}: {res.stderr.strip()[-2000:]}")
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return float(doc["seconds"]), bool(doc["ok"]), int(doc["bytes"])


FIO = {"fio-1m": ("1M", 32), "fio-8m": ("8M", 8)}  # block size, queue depth


def run_fio(file: Path, bs: str, depth: int) -> float:
    """fio's O_DIRECT sequential read of ``file``: seconds."""
    res = subprocess.run(
        [
            "fio", "--name=read", f"--filename={file}", "--rw=read", "--direct=1", f"--bs={bs}", f"--iodepth={depth}",
            "--ioengine=libaio", "--output-format=json", "--readonly",
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = json.loads(res.stdout)["jobs"][0]["read"]
    return float(job["io_bytes"]) / (float(job["bw_bytes"]) or 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ucp-bench-cold-load"), help="where the states live")
    ap.add_argument("--gib", type=float, default=2.0, help="state size in GiB")
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from ucp.bench.report import BenchReport, ReportCheck, ReportRow, source_commit, to_json, to_markdown

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    total = int(args.gib * (1 << 30))
    states = make_states(args.dir, total)
    data_file = next((states[16]["ucp"]).glob("*.safetensors"))
    samples: dict[str, list[float]] = {}
    nbytes: dict[str, int] = {}
    verified: dict[str, bool] = {}
    cold = True
    for _ in range(args.rounds):
        for key, (bs, depth) in FIO.items():
            cold &= drop([data_file])
            samples.setdefault(key, []).append(run_fio(data_file, bs, depth))
            nbytes[key] = data_file.stat().st_size
        for count, paths in states.items():
            for method in (*(("ucp", "ucp-z3") if count == 16 else ("ucp",)), "torch", "safetensors"):
                cold &= drop([paths[method]])
                s, ok, n = run_loader(method.split("-")[0], paths[method], paths["crcs"])
                key = f"{method}-{count}"
                samples.setdefault(key, []).append(s)
                nbytes[key], verified[key] = n, verified.get(key, True) and ok

    def gbps(key: str) -> float:
        return nbytes[key] / statistics.median(samples[key]) / 1e9

    labels = {
        "ucp": "ucp.load(path), fresh process",
        "ucp-z3": "ucp.load(path) of dp=4 ZeRO-3 pieces, fresh process",
        "torch": "torch.load(weights_only=True)",
        "safetensors": "safetensors load_file + touch",
    }
    device = max(gbps(k) for k in FIO)
    rows = [
        ReportRow(
            name=key, method=f"fio O_DIRECT read (libaio, {bs}iB, QD {depth})", op="read", bytes=nbytes[key],
            seconds=statistics.median(samples[key]), gbps=gbps(key), min_gbps=nbytes[key] / max(samples[key]) / 1e9,
            max_gbps=nbytes[key] / min(samples[key]) / 1e9, vs_device=gbps(key) / device,
        )
        for key, (bs, depth) in FIO.items()
    ]  # fmt: skip
    checks: list[ReportCheck] = []
    for count in states:
        for method in (*(("ucp", "ucp-z3") if count == 16 else ("ucp",)), "torch", "safetensors"):
            key = f"{method}-{count}"
            peers = {p: gbps(key) / gbps(f"{p}-{count}") for p in ("torch", "safetensors")}
            rows.append(
                ReportRow(
                    name=key, method=f"{labels[method]}, {count} tensors", op="load", bytes=nbytes[key],
                    seconds=statistics.median(samples[key]), gbps=gbps(key),
                    min_gbps=nbytes[key] / max(samples[key]) / 1e9, max_gbps=nbytes[key] / min(samples[key]) / 1e9,
                    vs_device=gbps(key) / device, vs_peers=peers if method.startswith("ucp") else {}, verified=verified[key],
                )
            )  # fmt: skip
        u = f"ucp-{count}"
        for what, ratio, want in (
            ("fio (the faster of its two runs)", gbps(u) / device, 0.9),
            ("torch.load", gbps(u) / gbps(f"torch-{count}"), 1.5),
            ("safetensors", gbps(u) / gbps(f"safetensors-{count}"), 1.2),
        ):
            checks.append(
                ReportCheck(
                    description=f"ucp.load {count} tensors >= {want}x {what}",
                    method=u,
                    ratio=ratio,
                    passed=ratio >= want,
                )
            )
    report = BenchReport(
        bench="tools/bench_cold_load.py",
        date=started,
        commit=source_commit(ROOT),
        command=" ".join([".venv/bin/python", "tools/bench_cold_load.py", *(argv or sys.argv[1:])]),
        device="fio",
        peers=["torch", "safetensors"],
        rows=rows,
        notes=[
            f"{args.rounds} rounds, interleaved, medians; "
            + ("whole page cache dropped before each read" if cold else "files evicted only (not root)"),
            "each load in a fresh process, timed around the load call only; bit-exact: CRC-32C of every tensor",
            f"cpu: {_cpu()}",
        ],
        checks=checks,
    )
    if args.json:
        print(to_json(report))
    else:
        print(to_markdown(report))
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{os.cpu_count()} cpus"


if __name__ == "__main__":
    raise SystemExit(main())
