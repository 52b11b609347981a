"""Time tensor write/read through gds's kvikio and staged paths; print JSON figures.

Prepared for a short session on a GPU machine::

    python tools/gpu_check_gds.py --size-mib 1024 --dir /path/on/nvme

Each available path writes a ~1 GiB uint8 tensor (fsync included in the time),
the file is evicted from the page cache (so reads hit the device, not RAM), and
it is read back into a preallocated tensor and compared bit for bit. Without a
GPU the same run happens on a CPU tensor through the staged path only, and the
JSON says so. Figures are GB/s (1e9 bytes per second).

Then ``ucp.load(path, map_location="cuda")`` of a checkpoint of the same size
(a few float32/bfloat16/int64 tensors) is timed through each path: staged with
CRC checks (``gds="off"``), staged without, and KvikIO straight into device
memory (``gds="on", verify=False``) where KvikIO is usable; each result is
compared bit for bit against a CPU load. Without CUDA that check does not run
and the JSON carries the CheckpointError ``ucp.load`` raises instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

import torch  # noqa: E402

import gds  # noqa: E402
import ucp  # noqa: E402
from aio import AioConfig  # noqa: E402
from aio.tune import evict_file  # noqa: E402

MIB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, src: torch.Tensor, workdir: Path, repeat: int, staging_mib: int) -> dict:
    path = workdir / f"gds_check_{mode}.bin"
    dst = torch.empty_like(src)
    writes, reads, dropped = [], [], True
    with gds.GdsHandle(AioConfig(fsync=True), mode=mode, staging_bytes=staging_mib * MIB) as h:  # type: ignore[arg-type]
        for _ in range(repeat):
            sync(src.device)
            t0 = time.perf_counter()
            h.write_tensor(path, src)
            sync(src.device)
            writes.append(time.perf_counter() - t0)
            dropped &= evict_file(path)
            t0 = time.perf_counter()
            h.read_into_tensor(path, dst)
            sync(src.device)
            reads.append(time.perf_counter() - t0)
        exact = bool(torch.equal(dst, src))
        engine = h.io.engine_name
    path.unlink(missing_ok=True)
    gbps = lambda secs: round(src.numel() / min(secs) / 1e9, 3)  # noqa: E731 - best of the repeats
    return {
        "mode": mode,
        "aio_engine": engine,
        "write_s": [round(s, 4) for s in writes],
        "read_s": [round(s, 4) for s in reads],
        "write_gbps_best": gbps(writes),
        "read_gbps_best": gbps(reads),
        "bit_exact": exact,
        "page_cache_dropped": dropped,
    }


def load_state(nbytes: int) -> dict[str, torch.Tensor]:
    """A checkpoint's worth of tensors (~``nbytes``): float32, bfloat16 and int64, of uneven sizes."""
    gen = torch.Generator().manual_seed(1)
    quarter = max(nbytes // 4, 64)
    return {
        "f32": torch.randn(quarter // 4, generator=gen).reshape(-1, 16),
        "bf16": torch.randn(quarter // 2, generator=gen).to(torch.bfloat16),
        "i64": torch.randint(0, 1 << 40, (quarter // 8,), generator=gen),
        "f32b": torch.randn(quarter // 4 + 3, generator=gen),
        "small": torch.arange(7, dtype=torch.int32),
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def run_load(workdir: Path, nbytes: int, caps: gds.CapabilityReport, repeat: int) -> dict:
    """``ucp.load(map_location="cuda")`` through the staged and the KvikIO paths, bit-exact against a CPU load."""
    path = workdir / "ckpt"
    ucp.save(load_state(nbytes), path)
    files = [f for f in path.iterdir() if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    reference = ucp.load(path)
    if not caps.cuda_available:
        try:
            ucp.load(path, map_location="cuda")
        except ucp.CheckpointError as exc:
            return {"ran": False, "error": str(exc)}
        return {"ran": False, "error": "ucp.load(map_location='cuda') did not refuse a machine without CUDA"}
    options = [("staged, verified", {"gds": "off", "verify": True}), ("staged", {"gds": "off", "verify": False})]
    if caps.kvikio_usable:
        options.append(("kvikio direct", {"gds": "on", "verify": False}))
    results = []
    for label, kw in options:
        times = []
        for _ in range(repeat):
            dropped = all([evict_file(f) for f in files])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            report = ucp.load(path, map_location="cuda", strict=False, **kw)  # type: ignore[call-overload]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out = report.state
        plan = report.device_plan
        exact = all(same_bytes(out[k].cpu(), v) for k, v in reference.items()) and all(
            out[k].device.type == "cuda" for k in reference
        )
        want = "gds" if kw["gds"] == "on" else "staged"
        results.append(
            {
                "label": label,
                "options": kw,
                "path": plan.path if plan else None,
                "reason": plan.reason if plan else None,
                "direct_tensors": len(plan.direct) if plan else 0,
                "load_s": [round(t, 4) for t in times],
                "gbps_best": round(total / min(times) / 1e9, 3),
                "bit_exact": exact,
                "path_as_asked": plan is not None and plan.path == want,
                "page_cache_dropped": dropped,
            }
        )
    return {"ran": True, "checkpoint_bytes": total, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="tensor size in MiB (default 1024)")
    parser.add_argument("--dir", default=None, help="directory for the test file (default: a temp dir under cwd)")
    parser.add_argument("--repeat", type=int, default=2, help="timed write+read rounds per mode")
    parser.add_argument("--staging-mib", type=int, default=gds.DEFAULT_STAGING_BYTES // MIB)
    args = parser.parse_args(argv)

    caps = gds.capabilities()
    print(caps.summary(), file=sys.stderr)
    device = torch.device("cuda" if caps.cuda_available else "cpu")
    modes = ["staged"] + (["kvikio"] if caps.kvikio_usable else [])
    nbytes = args.size_mib * MIB
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)

    workdir = Path(tempfile.mkdtemp(prefix="gds_check_", dir=args.dir or os.getcwd()))
    try:
        results = [run_mode(m, src, workdir, args.repeat, args.staging_mib) for m in modes]
        del src
        loads = run_load(workdir, nbytes, caps, args.repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    if device.type == "cpu":
        note = "no CUDA device: only the staged path ran, on a CPU tensor (host memcpy instead of H2D/D2H)"
    elif "kvikio" not in modes:
        note = "CUDA present but kvikio not usable: only the staged path ran; see capabilities.reasons"
    else:
        note = "kvikio and staged paths ran on a CUDA tensor"
    out = {
        "size_bytes": nbytes,
        "device": str(device) if device.type == "cpu" else f"cuda ({', '.join(caps.device_names)})",
        "filesystem_dir": str(Path(args.dir or os.getcwd()).resolve()),
        "results": results,
        "ucp_load": loads,
        "note": note,
        "capabilities": caps.model_dump(),
    }
    print(json.dumps(out, indent=2))
    load_ok = all(r["bit_exact"] and r["path_as_asked"] for r in loads.get("results", []))
    return 0 if all(r["bit_exact"] for r in results) and load_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
