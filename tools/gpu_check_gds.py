"""Time tensor write/read through gds's kvikio and staged paths; print JSON figures.

Prepared for a short session on a GPU machine::

    python tools/gpu_check_gds.py --size-mib 1024 --dir /path/on/nvme

Each available path writes a ~1 GiB uint8 tensor (fsync included in the time),
the file is evicted from the page cache (so reads hit the device, not RAM), and
it is read back into a preallocated tensor and compared bit for bit. Without a
GPU the same run happens on a CPU tensor through the staged path only, and the
JSON says so. Figures are GB/s (1e9 bytes per second).
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
        "note": note,
        "capabilities": caps.model_dump(),
    }
    print(json.dumps(out, indent=2))
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
