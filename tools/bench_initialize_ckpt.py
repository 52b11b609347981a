#!/usr/bin/env python
"""What checkpointing costs a Hugging Face model trained through ``training.initialize``, beside DeepSpeed's own
engine on the same model and DeepSpeed config, in one run.

    .venv/bin/python tools/bench_initialize_ckpt.py                    # GPT-2 124M, ZeRO-3 bf16 (about 8 min, 2 cores)
    .venv/bin/python tools/bench_initialize_ckpt.py --layers 2 --hidden 256 --steps 4 --every 2 --rounds 1
    .venv/bin/python tools/bench_initialize_ckpt.py --offload nvme --nvme-path /data --json out.json

Ways, each a DeepSpeed JSON config's run of one ``transformers.GPT2LMHeadModel`` (a config, random weights, no
dropout; the same seed, weights and token batches for every way):

* ``none``: training through ``training.initialize`` with no checkpoint;
* ``ucp-sync``: ``engine.save_checkpoint(dir)`` after every ``--every`` steps;
* ``ucp-decoupled``: the same with the config's ``checkpoint.writer.decoupled: true``; the final
  ``engine.close()`` (the last save's wait) is counted;
* ``deepspeed-none``, ``deepspeed-sync``, ``deepspeed-decoupled``: DeepSpeed's engine (``DS_ACCELERATOR=cpu``,
  gloo, one rank) on the same config, with its own ``checkpoint.writer.decoupled`` for the last (committed at the
  next step's boundary, and at the end); ``deepspeed-none`` is the baseline of their overhead. A way that fails
  is reported unavailable with its error, never measured. Seen with DeepSpeed 0.19.8 on its CPU accelerator: the
  decoupled writer runs at ZeRO-3 with ``--ds-writer PYTHON`` (the default here) only: its own default, FAST, pins
  an I/O buffer, which the CPU accelerator cannot, and at ZeRO-1/2 the ZeRO state cannot be handed to its writer
  process ("Cowardly refusing to serialize non-leaf tensor which requires_grad"); NVMe offload needs its
  ``async_io`` op built (libaio's headers).

The ways run in ``--rounds`` rounds, each way once per round in a fresh process of its own (one rank, fresh output
and swap directories), the order rotated from round to round so that load drifting over the run hits every way
alike. A process builds the model and engine (untimed), trains ``--warmup`` untimed steps (a saving way saves after
the first of them: that first save sets up what the later ones reuse, and its time is reported apart as "first
save s"), then ``--steps`` timed steps with a save after every ``--every``, then ends (``close()``; DeepSpeed:
the commit of its last decoupled save, then ``destroy()``).

Reported per way (medians over every round's samples): the training step (forward, backward, optimizer step:
what a decoupled save makes the step after it wait for, and its writer's share of the CPU, land here), the
``save_checkpoint`` call, the wait at the step after a save (ucp: for the save's snapshot; DeepSpeed: its commit
of the decoupled save), "blocked" (the call plus that wait, per save), the end, the end-to-end time (first timed
step to the end of the run), its ratio to the same engine's ``none``, the last checkpoint's bytes on disk, the
write rate (sync: bytes / call; ucp-decoupled: bytes / (call to committed); DeepSpeed's decoupled writer's finish
is not observable) beside fio's O_DIRECT sequential write on the same directory (tools/bench_offload.py's ``fio``),
and the training process's peak RSS. UCP fdatasyncs a checkpoint before it counts as saved; DeepSpeed's
``torch.save`` does not. The losses of the UCP ways (none, ucp-sync, ucp-decoupled) must be bit-equal (the same
training); DeepSpeed's are compared with a relative difference. Progress goes to stderr, the markdown to stdout;
the exit status is 1 when the UCP losses differ or a UCP way fails.

Defaults (GPT-2 12 x 768, vocab 50257, seq 128: 124M parameters; micro-batch 2, ZeRO-3 (the stage at which
DeepSpeed's decoupled writer runs here), bf16, no offload; 2 warm-up + 4 timed steps, a save every 2; 2 rounds;
fio 1G) keep the run under 10 minutes on a 2-core machine: 8 min 14 s measured (12 processes of 20 to 55 s, of
which 10 to 20 s are imports, the model's build and the engine's); a larger machine can afford ``--rounds 3`` and
more steps.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from aio.sizes import format_size  # noqa: E402
from tools.argtypes import positive_int  # noqa: E402
from tools.bench_offload import ds_offload, fio, proc_status  # noqa: E402
from ucp.bench.report import cpu_model, source_commit  # noqa: E402

UCP_WAYS = ("none", "ucp-sync", "ucp-decoupled")
DS_WAYS = ("deepspeed-none", "deepspeed-sync", "deepspeed-decoupled")
WAYS = (*UCP_WAYS, *DS_WAYS)
OFFLOAD_METHOD = {"none": "memory", "cpu": "cpu", "nvme": "nvme"}  # tools/bench_offload.py's names of the offloads
SEED, LR, WEIGHT_DECAY = 1234, 1e-3, 0.01
# the options the report records
CONFIG_KEYS: tuple[str, ...] = ("layers", "hidden", "vocab", "seq_len", "micro_batch", "zero", "precision", "offload")
CONFIG_KEYS += ("ds_writer", "steps", "warmup", "every", "rounds", "threads", "fio_size")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0], allow_abbrev=False)
    p.add_argument("--layers", type=positive_int, default=12, help="GPT-2 n_layer")
    p.add_argument("--hidden", type=positive_int, default=768, help="GPT-2 n_embd (heads: hidden / 64)")
    p.add_argument("--vocab", type=positive_int, default=50257)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--micro-batch", type=positive_int, default=2)
    p.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="zero_optimization.stage")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--offload", default="none", choices=tuple(OFFLOAD_METHOD), help="offload_optimizer.device")
    p.add_argument("--nvme-path", type=Path, default=None, help="offload nvme: swap directory (default: --dir's)")
    p.add_argument("--sub-group-size", type=int, default=10_000_000, help="zero_optimization.sub_group_size")
    p.add_argument("--buffer-count", type=int, default=16, help="offload_optimizer.buffer_count (nvme)")
    p.add_argument(
        "--ds-writer",
        default="PYTHON",
        choices=("PYTHON", "FAST"),
        help="checkpoint.writer.type of the decoupled ways (DeepSpeed's default, FAST, pins its I/O buffer, which "
        "the CPU accelerator cannot, and needs the async_io op; UCP ignores the key)",
    )
    p.add_argument("--steps", type=positive_int, default=4, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (a saving way saves after the first)")
    p.add_argument("--every", type=positive_int, default=2, help="save after every N timed steps")
    p.add_argument("--rounds", type=positive_int, default=2, help="processes per way, interleaved")
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: the cores)")
    p.add_argument("--dir", type=Path, default=None, help="parent of the run's directory (default: the temp dir)")
    p.add_argument("--fio-size", default="1G", help="fio's file size ('0': no fio)")
    p.add_argument("--timeout", type=positive_int, default=1200, help="seconds one process may take")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and logs")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--swap-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.hidden % max(1, args.hidden // 64):
        p.error(f"--hidden {args.hidden}: not a multiple of its head count {args.hidden // 64}")
    return args


# -- what every way trains ------------------------------------------------------------------------------------


def gpt2(args: argparse.Namespace) -> Any:
    """The model, its weights from ``SEED`` (every way starts from the same)."""
    import torch
    import transformers

    config = transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers,
        n_head=max(1, args.hidden // 64), bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: a run is a function of weights and data
    )  # fmt: skip
    torch.manual_seed(SEED)
    return transformers.GPT2LMHeadModel(config)


def batch(step: int, args: argparse.Namespace) -> Any:
    """Step ``step``'s tokens (``micro_batch`` x ``seq_len``), the same for every way."""
    import torch

    g = torch.Generator().manual_seed(SEED * 1000 + step)
    return torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=g)


def ds_config(args: argparse.Namespace, way: str, nvme_path: Path) -> dict[str, Any]:
    """The one DeepSpeed config both engines get (tools/peers/deepspeed_train.py's AdamW run, with torch's AdamW
    on DeepSpeed's side, so that no op is JIT-built; the offload keys of tools/bench_offload.py), plus
    ``checkpoint.writer.decoupled`` for the decoupled ways."""
    from tools.peers.deepspeed_train import deepspeed_config

    zero = ds_offload(OFFLOAD_METHOD[args.offload], args, str(nvme_path))
    ns = argparse.Namespace(
        micro_batch=args.micro_batch, grad_accum=1, lr=LR, weight_decay=WEIGHT_DECAY, zero_stage=args.zero,
        dtype=args.precision, grad_clip=0.0, ds_config_extra=json.dumps({"zero_optimization": zero}),
    )  # fmt: skip
    cfg: dict[str, Any] = deepspeed_config(ns)
    if way.endswith("-decoupled"):
        # data_parallel: DeepSpeed 0.19.8 cannot pick its writing ranks without it unless given a model-parallel
        # unit (AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank'); type: --ds-writer.
        # UCP logs both as ignored (they tune DeepSpeed's own writer).
        writer = {"decoupled": True, "data_parallel": "replica", "type": args.ds_writer}
        cfg["checkpoint"] = {"writer": writer}
    return cfg


# -- one way, in its own process -------------------------------------------------------------------------------


class Driver:
    """What the timing loop drives: ``step(s)`` returns the loss, ``save(dir)`` checkpoints (and may return a
    handle whose commit it reports), ``waited()`` the seconds the engine has spent waiting on saves so far,
    ``close()`` ends the run."""

    def __init__(
        self,
        step: Callable[[int], float],
        save: Callable[[Path], Any],
        waited: Callable[[], float],
        close: Callable[[], None],
        params: int,
    ) -> None:
        self.step, self.save, self.waited, self.close, self.params = step, save, waited, close, params


def timed(fn: Callable[[], Any], total: list[float]) -> Callable[[], Any]:
    """``fn`` adding the seconds each call takes to ``total[0]``."""

    def wrapper() -> Any:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            total[0] += time.perf_counter() - t

    return wrapper


def train_step(engine: Any, args: argparse.Namespace, s: int) -> float:
    """Step ``s`` of either engine (they share DeepSpeed's calls); returns its loss."""
    x = batch(s, args)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float())


def ucp_engine(args: argparse.Namespace, way: str, nvme_path: Path) -> Driver:
    import training

    model = gpt2(args)
    params = sum(p.numel() for p in model.parameters())
    engine = training.initialize(model, config=ds_config(args, way, nvme_path))
    waited = [0.0]
    # the step's wait for a decoupled save's snapshot (and its copies of swap files) before it changes the weights
    engine._saves.wait_snapshot = timed(engine._saves.wait_snapshot, waited)

    def save(root: Path) -> Any:
        engine.save_checkpoint(root)
        return engine._decoupled[-1].handle if engine._decoupled else None  # a decoupled save in flight

    return Driver(partial(train_step, engine, args), save, lambda: waited[0], engine.close, params)


def ds_engine(args: argparse.Namespace, way: str, nvme_path: Path) -> Driver:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one rank on one node, as DeepSpeed's launcher describes it (its checkpoint writers read CROSS_*)
    os.environ |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    os.environ |= {"LOCAL_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    os.environ.setdefault("MASTER_PORT", str(port))
    import deepspeed

    from tools.peers.deepspeed_train import skip_shm_op

    skip_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    model = gpt2(args)
    params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args, way, nvme_path)
    )
    decoupled = engine.checkpoint_engine.is_decoupled()
    if way.endswith("-decoupled") and not decoupled:
        raise RuntimeError(f"DeepSpeed made a {type(engine.checkpoint_engine).__name__}, not a decoupled one")
    waited = [0.0]
    # the step's commit of the decoupled save before it (the writer process's whole write)
    commit = engine._commit_decoupled_checkpoint = timed(engine._commit_decoupled_checkpoint, waited)

    def close() -> None:
        if decoupled:
            commit()  # the last save: committed and named in `latest`, as the next step would have
        engine.destroy()

    def save(root: Path) -> None:
        engine.save_checkpoint(str(root))

    return Driver(partial(train_step, engine, args), save, lambda: waited[0], close, params)


def run_way(args: argparse.Namespace) -> dict[str, Any]:
    """Train one way in this process; its measurements."""
    import torch

    way = args.worker
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    ckpt = args.run_dir / "ckpt"
    saves = not way.endswith("none")
    t0 = time.perf_counter()
    driver = (ds_engine if way.startswith("deepspeed") else ucp_engine)(args, way, args.swap_dir)
    out: dict[str, Any] = {"params": driver.params, "init_s": time.perf_counter() - t0, "losses": []}
    out |= {"step_s": [], "save_call_s": [], "next_wait_s": [], "commit_s": [], "first_save_s": None}
    last_tag = None
    for s in range(args.warmup):
        out["losses"].append(driver.step(s))
        if s == 0 and saves:
            c = time.perf_counter()
            driver.save(ckpt)
            out["first_save_s"] = time.perf_counter() - c
            last_tag = "global_step1"
    start = time.perf_counter()
    pending = False  # a save made after the last step: the next step's wait is its
    for i in range(args.steps):
        w0, t = driver.waited(), time.perf_counter()
        out["losses"].append(driver.step(args.warmup + i))
        out["step_s"].append(time.perf_counter() - t)
        if pending:
            out["next_wait_s"].append(driver.waited() - w0)
            pending = False
        if saves and (i + 1) % args.every == 0:
            c = time.perf_counter()
            handle = driver.save(ckpt)
            out["save_call_s"].append(time.perf_counter() - c)
            pending = i + 1 < args.steps
            last_tag = f"global_step{args.warmup + i + 1}"
            if handle is not None:  # ucp-decoupled: the time from the call to the commit

                def committed(_h: Any, c: float = c, into: list[float] = out["commit_s"]) -> None:
                    into.append(time.perf_counter() - c)

                handle.add_done_callback(committed)
    c = time.perf_counter()
    driver.close()
    end = time.perf_counter()
    out |= {"close_s": end - c, "e2e_s": end - start, **proc_status()}
    out["size"] = checkpoint_size(ckpt, last_tag) if last_tag else 0
    return out


def checkpoint_size(root: Path, tag: str) -> int:
    """The bytes of checkpoint ``root/tag`` (its files, recursively), once ``root/latest`` names it (the run's last
    save committed)."""
    latest = root / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    if named != tag:
        raise RuntimeError(f"{root}: 'latest' names {named!r} after the run, not its last checkpoint {tag!r}")
    return sum(f.stat().st_size for f in (root / tag).rglob("*") if f.is_file())


def worker_main(args: argparse.Namespace) -> int:
    result = run_way(args)
    (args.run_dir / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # DeepSpeed's gloo group and writer process: no teardown at exit (tools/peers/deepspeed_train.py)


# -- the parent ------------------------------------------------------------------------------------------------


class Unavailable(Exception):
    """A way's process failed; the message is its error."""


def spawn(args: argparse.Namespace, argv: list[str], way: str, run_dir: Path, swap_dir: Path) -> dict[str, Any]:
    """One way in a fresh process (its own session: DeepSpeed's writer process goes with it), its checkpoints
    under ``run_dir``, an NVMe tier's swap files in ``swap_dir``; its result, or :class:`Unavailable` with the
    error its log ends with."""
    run_dir.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if way.startswith("deepspeed"):
        env["DS_ACCELERATOR"] = "cpu"
    log = run_dir / "log.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", way, "--run-dir", str(run_dir)]
    cmd += ["--swap-dir", str(swap_dir)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise Unavailable(f"timed out after {args.timeout} s") from None
        except BaseException:  # Ctrl-C: leave no process training on behind us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    result = run_dir / "result.json"
    if rc != 0 or not result.is_file():
        raise Unavailable(error_of(log.read_text(errors="replace")) or f"exit status {rc}")
    answer: dict[str, Any] = json.loads(result.read_text())
    return answer


def error_of(log: str) -> str | None:
    """The last exception line of a log (``SomeError: ...``), the training process's first (DeepSpeed prefixes its
    lines with ``[rank0]:``; a helper process of its may fail after it, of that); else its last non-blank line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [
        (ln.startswith("[rank"), ln) for ln in lines if re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b", ln)
    ]
    if errors:
        rank = [ln for own, ln in errors if own]
        return re.sub(r"^\[rank\d+\]:\s*", "", (rank or [ln for _, ln in errors])[-1])
    return lines[-1] if lines else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-initialize-ckpt-", dir=args.dir))
    load = os.getloadavg()[0]
    speeds = fio(root, args.fio_size) if args.fio_size != "0" else None
    if speeds is not None:
        print(f"fio on {root}: write {speeds['write']:.2f} GB/s, read {speeds['read']:.2f} GB/s", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in args.ways}
    unavailable: dict[str, str] = {}
    try:
        for r in range(args.rounds):
            order = args.ways[r % len(args.ways) :] + args.ways[: r % len(args.ways)]
            for way in order:
                if way in unavailable:
                    continue
                run_dir = root / f"{way}-r{r}"
                swap_dir = Path(tempfile.mkdtemp(prefix=f"swap-{way}-r{r}-", dir=args.nvme_path or root))
                t = time.perf_counter()
                try:
                    runs[way].append(spawn(args, argv, way, run_dir, swap_dir))
                    got = runs[way][-1]
                    print(
                        f"round {r} {way}: {time.perf_counter() - t:.0f} s (init {got['init_s']:.0f} s, end-to-end "
                        f"{got['e2e_s']:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                except Unavailable as exc:
                    if way in UCP_WAYS:
                        tail = (run_dir / "log.txt").read_text(errors="replace").splitlines()[-30:]
                        raise SystemExit("\n".join([*tail, f"{way} failed: {exc}"])) from None
                    unavailable[way] = str(exc)
                    print(f"round {r} {way}: unavailable: {exc}", file=sys.stderr, flush=True)
                finally:
                    if not args.keep:
                        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
                    shutil.rmtree(swap_dir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(args, runs, unavailable, speeds, (load, os.getloadavg()[0]))
    print(report(summary, argv))
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "runs": runs}, indent=1))
    return 0 if summary["ucp_losses_bit_equal"] is not False else 1


# -- summary ---------------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
    unavailable: dict[str, str],
    speeds: dict[str, float] | None,
    loads: tuple[float, float],
) -> dict[str, Any]:
    """Per way, medians over every round's samples; the losses compared."""
    import torch

    ways: dict[str, dict[str, Any]] = {}
    for way, got in runs.items():
        if not got:
            continue

        def pooled(key: str, got: list[dict[str, Any]] = got) -> list[float]:
            return [x for g in got for x in g[key]]

        calls, waits = pooled("save_call_s"), pooled("next_wait_s")
        # a save's block: its call plus the wait its next step made (saves with a next step: the first of each run's)
        blocked = [c + w for g in got for c, w in zip(g["save_call_s"], g["next_wait_s"])]
        size = got[-1]["size"]
        row: dict[str, Any] = {
            "runs": len(got),
            "step_s": median(pooled("step_s")),
            "save_call_s": median(calls),
            "next_wait_s": median(waits),
            "blocked_s": median(blocked),
            "first_save_s": median([g["first_save_s"] for g in got if g["first_save_s"] is not None]),
            "close_s": median([g["close_s"] for g in got]),
            "e2e_s": median([g["e2e_s"] for g in got]),
            "init_s": median([g["init_s"] for g in got]),
            "size_bytes": size,
            "hwm": max(g["hwm"] for g in got),
            "params": got[-1]["params"],
        }
        commits = pooled("commit_s")
        if way.endswith("-sync") and row["save_call_s"]:
            row["write_GBps"] = size / row["save_call_s"] / 1e9
        elif commits:
            row["commit_s"] = median(commits)
            row["write_GBps"] = size / row["commit_s"] / 1e9
        ways[way] = row
    for way, row in ways.items():
        base = ways.get("deepspeed-none" if way.startswith("deepspeed") else "none")
        if base is not None:
            row["e2e_ratio"] = row["e2e_s"] / base["e2e_s"]
    losses = {w: [g["losses"] for g in got] for w, got in runs.items() if got}
    ucp = [run for w in UCP_WAYS for run in losses.get(w, [])]
    ds = [run for w in DS_WAYS for run in losses.get(w, [])]
    rel = None
    if ucp and ds:
        rel = max(abs(a - b) / abs(b) for run in ds for a, b in zip(run, ucp[0]))
    versions = {"torch": str(torch.__version__)}
    for pkg in ("transformers", "deepspeed"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "config": {k: getattr(args, k) for k in CONFIG_KEYS}
        | {
            "cores": os.cpu_count(),
            "ds_config_decoupled": ds_config(args, "ucp-decoupled", args.nvme_path or Path("SWAP")),
        },
        "commit": source_commit(REPO),
        "cpu": cpu_model(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": list(loads),
        "fio": speeds,
        "ways": ways,
        "unavailable": unavailable,
        "ucp_ways": [w for w in UCP_WAYS if w in losses],
        "ucp_losses_bit_equal": all(run == ucp[0] for run in ucp) if len(ucp) > 1 else None,
        "deepspeed_losses_equal": all(run == ds[0] for run in ds) if len(ds) > 1 else None,
        "deepspeed_vs_ucp_max_rel": rel,
    }


def report(summary: dict[str, Any], argv: list[str]) -> str:
    """The markdown: what was run, the table, the losses, what was unavailable."""
    c, v = summary["config"], summary["versions"]
    params = next((r["params"] for r in summary["ways"].values()), None)

    def num(x: float | None, fmt: str = "{:.3f}") -> str:
        return "–" if x is None else fmt.format(x)

    def yes(x: bool | None) -> str:
        return "–" if x is None else ("yes" if x else "NO")

    fio_w = summary["fio"]["write"] if summary["fio"] else None
    lines = [
        f"Measured at commit {summary['commit']}, {summary['date']}, {summary['cpu']} ({c['cores']} vCPUs), "
        + ", ".join(f"{k} {x}" for k, x in v.items())
        + f"; load average before {summary['load'][0]:.2f}, after {summary['load'][1]:.2f}",
        "",
        f"Command: `.venv/bin/python tools/bench_initialize_ckpt.py {' '.join(argv)}`",
        "",
        f"GPT-2 {c['layers']} x {c['hidden']}, vocab {c['vocab']} ({num(params and params / 1e6, '{:.1f}')}M "
        f"parameters), micro-batch {c['micro_batch']} x seq {c['seq_len']}, ZeRO-{c['zero']} {c['precision']}, "
        f"offload_optimizer {c['offload']}; {c['warmup']} warm-up + {c['steps']} timed steps per process, a save "
        f"every {c['every']}; {c['rounds']} interleaved round(s), one process per way and round. fio O_DIRECT "
        f"sequential write on the checkpoint directory: {num(fio_w, '{:.2f}')} GB/s.",
        "",
        "| way | step s | save call s | next-step wait s | blocked s | first save s | end s | end-to-end s "
        "| × none | ckpt MB | write GB/s | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for way, r in summary["ways"].items():
        rate = num(r.get("write_GBps"), "{:.2f}")
        if rate != "–" and fio_w:
            rate += f" ({r['write_GBps'] / fio_w:.0%} of fio)"
        lines.append(
            f"| {way} | {num(r['step_s'])} | {num(r['save_call_s'])} | {num(r['next_wait_s'])} | "
            f"{num(r['blocked_s'])} | {num(r['first_save_s'])} | {num(r['close_s'])} | {num(r['e2e_s'], '{:.1f}')} "
            f"| {num(r.get('e2e_ratio'), '{:.2f}')} | {num(r['size_bytes'] / 1e6 if r['size_bytes'] else None, '{:.0f}')} "
            f"| {rate} | {format_size(r['hwm'])} |"
        )
    for way, reason in summary["unavailable"].items():
        lines.append(f"| {way} | unavailable: {reason} |" + " |" * 10)
    lines += [
        "",
        f"Losses bit-equal across the UCP ways ({', '.join(summary['ucp_ways'])}; every round): "
        f"{yes(summary['ucp_losses_bit_equal'])}. DeepSpeed's ways equal to each other: "
        f"{yes(summary['deepspeed_losses_equal'])}; against UCP's: max relative difference "
        f"{num(summary['deepspeed_vs_ucp_max_rel'], '{:.1e}')}.",
        "",
        "step s: forward + backward + optimizer step (a decoupled save's wait and its writer's CPU share land "
        "here). blocked s: per save, the save_checkpoint call plus the wait it caused at the next step (ucp: the "
        "snapshot; DeepSpeed: the commit of its decoupled save). first save s: the warm-up save (one-time set-up). "
        "end s: close() (ucp) or DeepSpeed's commit of its last decoupled save and destroy(). × none: end-to-end "
        "over the same engine's none way. write GB/s: sync = bytes / call; ucp-decoupled = bytes / (call to "
        "committed). UCP fdatasyncs a checkpoint before it counts; DeepSpeed's torch.save does not.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
