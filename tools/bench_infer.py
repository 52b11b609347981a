"""Benchmark offloaded inference (``ucp infer``) against the disk's limit and the peers a user would try.

    .venv/bin/python tools/bench_infer.py --gib 0.25 --hidden 1024 --budget 128MiB   # a quick run
    .venv/bin/python tools/bench_infer.py --gib 2 --budget 512MiB --batches 1,4,16,64  # the issue's run

One run, interleaved over ``--rounds``; before every measurement the page cache is dropped (root;
otherwise the files are evicted) and each method runs in a fresh process:

* ``fio``: sequential O_DIRECT reads (libaio; 1 MiB x 32, ucp's 4 MiB x 32, 4 MiB x 64 and 16 MiB x 16, the
  fastest: this virtual disk gives more with more bytes in flight) of the weights file.
  The *physical limit* of batch-1 decode is fio's GB/s / the bytes streamed per token;
* ``ucp``: :func:`training.inference.api.infer` on the ``save_pretrained`` directory (and ``ucp-ckpt``
  on the same weights saved as a UCP checkpoint), within ``--budget``;
* ``mmap``: the same model code with every weight a view of a memory-mapped safetensors file (what
  ``safe_open``/``from_pretrained`` give): the page cache does the streaming;
* ``accelerate``: transformers' ``from_pretrained(device_map=..., offload_folder=...)`` disk offload,
  when ``accelerate`` is installed (it is not a dependency; the row says so when absent). Its row
  reports the weight bytes it kept resident (``max_memory``'s share, the rest on disk);
* ``ucp-acc``: ucp with the same resident weight bytes as the last ``accelerate`` run of that dtype, plus
  its ring (budget = accelerate's resident bytes + ucp's ring): on the CPU path the tensor-grain arena, single
  layer tensors pinned in the rest (docs/inference.md).

``--dtypes fp32,bf16`` runs ucp, mmap, accelerate and ucp-acc on the weights in each dtype (bf16: the
same model cast and saved again, computed in bf16). Each run is in a fresh memory cgroup (v1 or v2)
limited to its budget + ``--overhead`` (the interpreter, torch and the KV cache), when the benchmark
runs as root and cgroups are writable; the report says what was enforced and each row's peak cgroup
memory (resident set *and* page cache). Greedy tokens of every method are compared with ``ucp``'s of
the same dtype. The physical limit of each row is fio's GB/s / the bytes it streams per token.

Every method's child also counts the bytes the block layer read for it while it generated
(``/proc/self/io`` ``read_bytes``: O_DIRECT reads, page faults and readahead alike; page-cache hits
do not count), per forward pass: "disk read / pass" says whether a method's weights really came from the
disk on every pass, or partly from page cache that survived inside its memory limit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aio.memstat import peak_rss  # noqa: E402
from tools.bench_cold_load import drop, run_fio  # noqa: E402

# The child: argv = method, weights path, json args; moves itself into the cgroup first; prints one JSON line.
CHILD = r"""
import json, os, sys, time
method, path, a = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if a.get("cgroup_procs"):
    with open(a["cgroup_procs"], "w") as fh:
        fh.write(str(os.getpid()))
sys.path.insert(0, a["root"])
import torch
torch.set_num_threads(a["threads"])
prompts = [[(7 * i + j) % 1000 + 1 for j in range(a["prompt_len"])] for i in range(a["batch"])]
dtype = torch.bfloat16 if a["dtype"] == "bf16" else torch.float32
if method in ("ucp", "ucp-ckpt", "ucp-acc"):
    import training.inference.api as api
    from tools.bench_infer import DiskMeter
    meter = DiskMeter()
    api.generate = meter.wrap(api.generate)  # the generation only: not the resident weights' first read
    r = api.infer(path, prompts, max_new_tokens=a["new_tokens"], memory_budget=a["budget_bytes"], dtype=dtype)
    print(json.dumps({"tokens": r.tokens, **r.metrics.model_dump(), **meter.report()}))
elif method == "mmap":
    from tools.bench_infer import run_mmap
    print(json.dumps(run_mmap(path, prompts, a["new_tokens"], dtype)))
elif method == "accelerate":
    from tools.bench_infer import run_accelerate
    print(json.dumps(run_accelerate(path, prompts, a["new_tokens"], a["budget_bytes"], a["offload"], dtype)))
"""


def disk_read_bytes() -> int:
    """Bytes the block layer read for this process (all its threads): page-cache misses, readahead and
    O_DIRECT reads alike (``read_bytes`` of /proc/self/io); hits in the page cache do not count."""
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


class DiskMeter:
    """Disk bytes read during the wrapped generation calls, per forward pass (a call generating N tokens
    runs N passes: the prefill and N - 1 decode steps). Says whether a method's weights came from the
    disk on every pass or partly from a page cache that survived inside its memory limit."""

    def __init__(self) -> None:
        self.bytes, self.passes = 0, 0

    def wrap(self, fn: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            before = disk_read_bytes()
            try:
                return fn(*args, **kwargs)
            finally:
                self.bytes += disk_read_bytes() - before
                self.passes += int(kwargs.get("max_new_tokens", args[2] if len(args) > 2 else 0))

        return measured

    def report(self) -> dict[str, int]:
        return {"disk_bytes_per_pass": self.bytes // max(1, self.passes)}


def make_model(out: Path, gib: float, hidden: int, vocab: int) -> dict[str, object]:
    """A random Llama of about ``gib`` GiB of fp32 weights, saved with save_pretrained (fp32 in ``hf``,
    cast to bf16 in ``hf-bf16``) and as a UCP checkpoint (fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ucp

    heads, kv, ff = hidden // 64, max(1, hidden // 256), int(hidden * 2.6875) // 64 * 64
    layer = 4 * (2 * hidden * hidden + 2 * hidden * (kv * 64) + 3 * hidden * ff + 2 * hidden)
    layers = max(1, math.ceil((gib * (1 << 30) - 2 * 4 * vocab * hidden) / layer))  # at least ``gib``
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out / "hf", safe_serialization=True)
    ucp.save(
        {k: v.detach() for k, v in model.state_dict().items()}, out / "ckpt", metadata={"hf_config": cfg.to_dict()}
    )
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out / "hf-bf16", safe_serialization=True)
    return {"layers": layers, "hidden": hidden, "intermediate": ff, "vocab": vocab, "bytes": nbytes}


def run_mmap(path: str, prompts: list[list[int]], new_tokens: int, dtype: Any) -> dict[str, object]:
    """Generation with every weight a view of a memory-mapped safetensors file (the page cache streams)."""
    import mmap

    import torch

    from training.inference.config import load_model
    from training.inference.generate import generate
    from training.inference.model import Step
    from training.inference.sources import open_weights
    from ucp.format.dtypes import torch_dtype

    model, source = load_model(open_weights(path))
    maps: dict[str, mmap.mmap] = {}
    weights = {}
    for name, t in source.tensors.items():
        run = t.runs[0]
        if run.file not in maps:
            with open(run.file, "rb") as fh:
                maps[run.file] = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        m = maps[run.file]
        weights[name] = torch.frombuffer(
            memoryview(m)[run.offset : run.offset + run.length], dtype=torch_dtype(t.dtype)
        ).view(t.shape)

    class MmapRun:
        pass

        def __init__(self) -> None:
            self.model, self.dtype = model, dtype
            self.device, self.read_path = torch.device("cpu"), "cpu"  # what generate() asks of an executor

        @torch.inference_mode()
        def forward(self, step: Step) -> torch.Tensor:
            h = model.embed(weights, step).to(dtype)
            for i in range(model.n_layers):
                h = model.layer(i, weights, h, step)
            return model.head(weights, h)

    import warnings

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    meter = DiskMeter()
    g = meter.wrap(generate)(MmapRun(), prompts, new_tokens)
    decode_tokens = g.decode_steps * g.batch
    return {
        "tokens": g.tokens,
        "time_to_first_token_s": g.prefill_seconds,
        "decode_tokens_per_s": decode_tokens / g.decode_seconds if g.decode_seconds else 0.0,
        "peak_rss_bytes": peak_rss(),
        **meter.report(),
    }


def run_accelerate(
    path: str, prompts: list[list[int]], new_tokens: int, budget: int, offload: str, dtype: Any
) -> dict[str, object]:
    """transformers + accelerate disk offload: weights beyond ``max_memory`` go to ``offload_folder``."""

    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={"cpu": budget}, offload_folder=offload, torch_dtype=dtype
    )
    # offloaded parameters sit on the meta device until their module runs: the others stay resident
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    streamed = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "meta")
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        first = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0
        )
        t1 = time.perf_counter()
        meter = DiskMeter()
        out = meter.wrap(model.generate)(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    t2 = time.perf_counter()
    del first
    decode = max(1e-9, (t2 - t1) - (t1 - t0))  # the whole run less one prefill
    return {
        "tokens": out[:, ids.shape[1] :].tolist(),
        "time_to_first_token_s": t1 - t0,
        "decode_tokens_per_s": (new_tokens - 1) * len(prompts) / decode,
        "peak_rss_bytes": peak_rss(),
        "resident_bytes": resident,
        "streamed_bytes_per_pass": streamed,
        **meter.report(),
    }


PEAK_KNOBS = ("memory.peak", "memory.max_usage_in_bytes")  # v2, v1: the cgroup's peak (RSS + page cache)


def memory_cgroup(limit: int, tag: str) -> tuple[str | None, str]:
    """A fresh memory cgroup limited to ``limit`` bytes: (its directory, what was enforced)."""
    name = f"ucp-bench-infer-{os.getpid()}-{tag}"
    why = "no memory limit (no writable memory cgroup)"
    for base, knob in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
        if not os.path.exists(os.path.join(base, knob if base.endswith("memory") else "cgroup.controllers")):
            continue
        path = os.path.join(base, name)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, knob), "w") as fh:
                fh.write(str(limit))
            return path, f"cgroup {base} {knob}"
        except OSError as exc:
            why = f"no memory limit ({base}: {exc.strerror})"
    return None, why


def child(method: str, path: Path, args: dict[str, object], limit: int) -> dict[str, object]:
    """Run one measurement in a fresh process inside a fresh cgroup limited to ``limit`` bytes."""
    group, enforced = memory_cgroup(limit, f"{method}-{args['dtype']}-b{args['batch']}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args["threads"])}
    full = {**args, "cgroup_procs": os.path.join(group, "cgroup.procs") if group else None}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, method, str(path), json.dumps(full)], capture_output=True, text=True, env=env
    )
    peak = None
    if group:
        for knob in PEAK_KNOBS:
            try:
                with open(os.path.join(group, knob)) as fh:
                    peak = int(fh.read().strip())
                break
            except OSError:
                continue
        try:
            os.rmdir(group)
        except OSError:
            pass
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1][:300], "limit": limit}
    out: dict[str, object] = json.loads(lines[-1])
    out.update({"limit": limit, "enforced": enforced if group else enforced})
    if peak is not None:
        out["cgroup_peak_bytes"] = peak
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir", type=Path, default=None, help="where the model is written (default: a temp dir under /var/tmp)"
    )
    ap.add_argument("--gib", type=float, default=2.0, help="weights size (fp32) in GiB")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--budget", default="512MiB", help="weight memory budget of ucp (and max_memory of accelerate)")
    ap.add_argument(
        "--overhead", default="512MiB", help="memory-limit allowance beyond the budget (interpreter, torch, KV cache)"
    )
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes for ucp fp32 (the sweep)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--methods", default="fio,ucp,ucp-ckpt,mmap,accelerate,ucp-acc")
    ap.add_argument("--dtypes", default="fp32,bf16", help="weights dtypes: fp32, bf16 (ucp-ckpt and fio: fp32 only)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from aio.sizes import format_size, parse_size

    work = args.dir or Path(tempfile.mkdtemp(prefix="ucp-bench-infer-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "hf-bf16" / "config.json").exists():
        info = make_model(work, args.gib, args.hidden, args.vocab)
    else:
        info = {"reused": str(work)}
    budget, overhead = parse_size(args.budget), parse_size(args.overhead)
    head = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(head, capture_output=True, text=True).stdout.strip()  # the code measured, not HEAD after
    load_before = open("/proc/loadavg").read().split()[:3]
    methods, dtypes = args.methods.split(","), args.dtypes.split(",")
    weights_file = work / "hf" / "model.safetensors"
    if not weights_file.exists():
        weights_file = sorted((work / "hf").glob("*.safetensors"))[0]
    runs: dict[str, list[dict[str, object]]] = {}
    base = {"new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "threads": args.threads}
    base.update({"root": str(ROOT), "offload": str(work / "offload")})
    for _ in range(args.rounds):
        for dtype in dtypes:
            for method in methods:
                if dtype != "fp32" and method in ("fio", "ucp-ckpt"):
                    continue
                sweep = method == "ucp" and dtype == "fp32"
                for batch in [int(b) for b in args.batches.split(",")] if sweep else [1]:
                    key = f"{method} {dtype} b{batch}"
                    cold = drop([work])
                    if method == "fio":  # the fastest of three request shapes (the device's limit), each cold
                        shapes = {}  # 4 MiB x 32 is ucp's own request shape (executor.READ_CONFIG)
                        for bs, depth in (("1M", 32), ("4M", 32), ("4M", 64), ("16M", 16)):
                            drop([work])
                            shapes[f"{bs}x{depth}"] = (
                                weights_file.stat().st_size / run_fio(weights_file, bs, depth) / 1e9
                            )
                        best = max(shapes.values())
                        runs.setdefault(key, []).append({"gbps": best, "shapes": shapes})
                        continue
                    if method.startswith("accelerate"):
                        try:
                            import accelerate  # noqa: F401
                        except ImportError:
                            runs.setdefault(key, []).append({"error": "accelerate is not installed"})
                            continue
                    run_budget = budget
                    if method == "ucp-acc":  # accelerate's resident weights + ucp's own ring
                        acc = runs.get(f"accelerate {dtype} b1", [{}])[-1]
                        own = runs.get(f"ucp {dtype} b1", [{}])[-1]
                        if "resident_bytes" not in acc or "ring_bytes" not in own:
                            runs.setdefault(key, []).append({"error": "needs accelerate and ucp runs first"})
                            continue
                        run_budget = int(acc["resident_bytes"]) + int(own["ring_bytes"])  # type: ignore[call-overload]
                    folder = "ckpt" if method == "ucp-ckpt" else ("hf" if dtype == "fp32" else f"hf-{dtype}")
                    args_ = {**base, "batch": batch, "dtype": dtype, "budget_bytes": run_budget}
                    r = child(method.split("-")[0] if method == "ucp-acc" else method, work / folder, args_,
                              run_budget + overhead)  # fmt: skip
                    r["cold"], r["budget_bytes"] = cold, run_budget
                    runs.setdefault(key, []).append(r)
    fio = statistics.median(float(r["gbps"]) for r in runs.get("fio fp32 b1", [{"gbps": 0.0}]))  # type: ignore[arg-type]
    rows = []
    for key, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows.append({"method": key, "error": rs[0]["error"]})
            continue
        row: dict[str, object] = {"method": key}
        for field in (
            "decode_tokens_per_s",
            "time_to_first_token_s",
            "read_gb_per_s",
            "read_hidden_fraction",
            "peak_rss_bytes",
            "cgroup_peak_bytes",
            "gbps",
            "budget_bytes",
            "resident_bytes",
            "streamed_bytes_per_pass",
            "disk_bytes_per_pass",
            "pinned_layers",
            "limit",
        ):
            vals = [float(r[field]) for r in ok if field in r]  # type: ignore[arg-type]
            if vals:
                row[field] = statistics.median(vals)
        if "shapes" in ok[0]:
            row["shapes"] = ok[0]["shapes"]
        _, kind, bsize = key.split()
        ref = runs.get(f"ucp {kind} b1", [{}])[0].get("tokens")
        if "tokens" in ok[0] and ref is not None and bsize == "b1":
            row["same_tokens_as_ucp"] = ok[0]["tokens"] == ref
        # batch-1 decode streams every streamed group once per token: the physical limit is fio / that
        per_token = float(row.get("streamed_bytes_per_pass", 0.0))  # type: ignore[arg-type]
        if "decode_tokens_per_s" in row and per_token and fio and bsize == "b1":
            limit_tps = fio * 1e9 / per_token
            row["physical_limit_tokens_per_s"] = limit_tps
            row["vs_physical_limit"] = float(row["decode_tokens_per_s"]) / limit_tps  # type: ignore[arg-type]
        rows.append(row)
    report = {
        "model": info, "budget": args.budget, "overhead": args.overhead, "fio_gbps": fio, "rows": rows,
        "memory_limit": next((r.get("enforced") for rs in runs.values() for r in rs if r.get("enforced")), "none"),
        "commit": commit, "uptime_before": load_before, "uptime": open("/proc/loadavg").read().split()[:3],
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    print(
        "| method | dtype | batch | budget | resident | streamed/token | disk read/pass | decode tok/s | x limit | TTFT s | read GB/s "
        "| hidden | peak RSS | cgroup peak | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def size(r: dict[str, object], k: str) -> str:
        return format_size(int(r[k])) if k in r else ""  # type: ignore[call-overload]

    for r in rows:
        name, kind, bsize = str(r["method"]).split()
        if "error" in r:
            print(f"| {name} | {kind} | {bsize[1:]} | {r['error']} |")
            continue
        if "gbps" in r:
            print(f"| fio | | | | | | | {float(r['gbps']):.2f} GB/s | | | | | | | |")  # type: ignore[arg-type]
            continue

        def f(k: str, fmt: str, r: dict[str, object] = r) -> str:
            return format(r[k], fmt) if k in r else ""

        print(
            f"| {name} | {kind} | {bsize[1:]} | {size(r, 'budget_bytes')} | {size(r, 'resident_bytes')} | "
            f"{size(r, 'streamed_bytes_per_pass')} | {size(r, 'disk_bytes_per_pass')} | {f('decode_tokens_per_s', '.2f')} | {f('vs_physical_limit', '.2f')} | "
            f"{f('time_to_first_token_s', '.2f')} | {f('read_gb_per_s', '.2f')} | {f('read_hidden_fraction', '.2f')} | "
            f"{size(r, 'peak_rss_bytes')} | {size(r, 'cgroup_peak_bytes')} | {r.get('same_tokens_as_ucp', '')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
