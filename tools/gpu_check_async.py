"""Time UCP saves of a state held on the GPU: sync save, async-save stall, load(into=) CUDA tensors; JSON out.

Prepared for a short session on a GPU machine::

    python tools/gpu_check_async.py --size-gib 2 --rounds 3 --dir /path/on/local/disk

The state is bf16 weights + fp32 master, exp_avg, exp_avg_sq (14 bytes per parameter) as CUDA
tensors. ``ucp.async_save`` snapshots them into pinned host staging with copies queued on a side
stream, so its stall is the time to queue them; the first async save (staging allocated and
pinned) is reported apart. Every load is compared bit for bit with the saved state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

import torch  # noqa: E402

import ucp  # noqa: E402


def make_state(size_gib: float, device: torch.device) -> dict:
    params = int(size_gib * (1 << 30) / 14)
    rows = 4096
    n = max(1, params // (rows * 1024))
    g = torch.Generator(device=device).manual_seed(0)
    state: dict = {"model": {}, "optimizer": {"fp32_master": {}, "exp_avg": {}, "exp_avg_sq": {}}}
    for i in range(n):
        w = torch.randn(rows, 1024, device=device, generator=g)
        state["model"][f"layer{i}.w"] = w.to(torch.bfloat16)
        for k in ("fp32_master", "exp_avg", "exp_avg_sq"):
            state["optimizer"][k][f"layer{i}.w"] = torch.randn(rows, 1024, device=device, generator=g)
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA device: nothing to measure"}))
        return 0
    dev = torch.device("cuda")
    root = Path(tempfile.mkdtemp(prefix="ucp-gpu-", dir=a.dir))
    try:
        state = make_state(a.size_gib, dev)
        total = nbytes(state)
        torch.cuda.synchronize()
        out: dict = {"cuda": True, "gpu": torch.cuda.get_device_name(), "bytes": total, "torch": torch.__version__}
        sync_s, stall_s, result_s, load_s = [], [], [], []
        h = ucp.async_save(state, root / "first")  # allocates and pins the staging: reported apart
        t0 = time.perf_counter()
        h.result()
        out["first_async_stall_s"] = round(h.snapshot_seconds, 4)
        out["first_async_result_s"] = round(time.perf_counter() - t0 + h.snapshot_seconds, 3)
        for r in range(a.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ucp.save(state, root / f"sync{r}")
            sync_s.append(time.perf_counter() - t0)
            before = [t.clone() for t in _tensors(state)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = ucp.async_save(state, root / f"async{r}")
            stall_s.append(time.perf_counter() - t0)
            for t in _tensors(state):  # training goes on and changes the tensors at once
                t.add_(1)
            h.result()
            result_s.append(time.perf_counter() - t0)
            into = {
                "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                "optimizer": {g: {k: torch.empty_like(v) for k, v in d.items()} for g, d in state["optimizer"].items()},
            }
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ucp.load(root / f"sync{r}", into=into)
            torch.cuda.synchronize()
            load_s.append(time.perf_counter() - t0)
            same = all(torch.equal(x, y) for x, y in zip(_tensors(into), before))  # saved before the change
            back = ucp.load(root / f"async{r}")  # the values as of the call, not the changed ones
            same_async = all(torch.equal(x, y.cpu()) for x, y in zip(_tensors(back), before))
            del before, into, back
            if not (same and same_async):
                out["error"] = f"round {r}: loaded data differs (sync {same}, async {same_async})"
                break
            shutil.rmtree(root / f"sync{r}")
            shutil.rmtree(root / f"async{r}")
        med = statistics.median
        out.update(
            {
                "rounds": len(sync_s),
                "sync_save_s": round(med(sync_s), 3),
                "sync_save_gbps": round(total / med(sync_s) / 1e9, 2),
                "async_stall_s": round(med(stall_s), 4),
                "async_result_s": round(med(result_s), 3),
                "stall_vs_sync": round(med(stall_s) / med(sync_s), 4),
                "load_into_cuda_s": round(med(load_s), 3),
                "load_into_cuda_gbps": round(total / med(load_s) / 1e9, 2),
                "samples": {"sync": sync_s, "stall": stall_s, "result": result_s, "load": load_s},
            }
        )
        print(json.dumps(out, indent=1))
        return 0 if "error" not in out else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
