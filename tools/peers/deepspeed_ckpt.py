"""Real DeepSpeed checkpoints on demand, and DeepSpeed's own readings of them.

Why: UCP's DeepSpeed importer must be tested against files DeepSpeed wrote, and its results
compared with what DeepSpeed's own tools (zero_to_fp32, ds_to_universal) make of the same files.
This module drives DeepSpeed in separate processes only, so the caller never imports deepspeed
(its CPU accelerator set-up, logging and fork pools stay out of the test process):

    from tools.peers.deepspeed_ckpt import make_checkpoint, reference_fp32, reference_universal
    ckpt = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=3, model_config="tiny")
    weights = reference_fp32(ckpt)           # {name: fp32 tensor}, via zero_to_fp32
    udir = reference_universal(ckpt)         # ckpt/global_step3_universal, via ds_to_universal

Checkpoints are cached by their parameters under $UCP_PEER_CACHE (default /tmp/ucp-peer-cache)
when `out_dir` is None. The on-disk layouts are described in tools/peers/README.md.

CLI (also the entry point of the helper processes):
    python tools/peers/deepspeed_ckpt.py make --zero-stage 3 --world-size 4 --dtype bf16
    python tools/peers/deepspeed_ckpt.py fp32 CKPT_DIR --output weights.safetensors
    python tools/peers/deepspeed_ckpt.py universal CKPT_DIR
    python tools/peers/deepspeed_ckpt.py matrix --stages 1 2 3 --worlds 2 4   # timings
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # when run as a script, make `training` importable
    sys.path.insert(0, str(REPO_ROOT))

from training.models import PRESETS, GPTConfig  # noqa: E402

if TYPE_CHECKING:
    import torch

TRAIN_SCRIPT = Path(__file__).with_name("deepspeed_train.py")
DEFAULT_CACHE = "/tmp/ucp-peer-cache"
Dtype = Literal["fp32", "bf16"]

__all__ = [
    "PeerError",
    "deepspeed_missing",
    "make_checkpoint",
    "read_latest",
    "reference_fp32",
    "reference_universal",
    "peer_env",
]


class PeerError(RuntimeError):
    """A DeepSpeed helper process failed; the message carries the command and its output tail."""


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed peer cannot run here, or None when it can (for pytest skips)."""
    for mod in ("deepspeed", "huggingface_hub", "safetensors"):
        if importlib.util.find_spec(mod) is None:
            return (
                f"python package {mod!r} is not installed (DeepSpeed peer: "
                "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8 huggingface_hub)"
            )
    return None


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for DeepSpeed helper processes: CPU accelerator, 1 thread each, repo on path."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _run(cmd: Sequence[str], timeout: float, log: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run `cmd` in its own session; on timeout kill the whole group (torchrun's workers too)."""
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or peer_env(),
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if log:
            log.write_text(out)
        raise PeerError(
            f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{_tail(out)}"
            + (f"\n(full output: {log})" if log else "")
        ) from None
    except BaseException:  # e.g. Ctrl-C in the test run: leave no orphaned ranks behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if log:
        log.write_text(out)
    if proc.returncode != 0:
        raise PeerError(
            f"exit status {proc.returncode}: {' '.join(cmd)}\n{_tail(out)}" + (f"\n(full output: {log})" if log else "")
        )
    return out


def _tail(text: str, lines: int = 25) -> str:
    """The first error in the output (torchrun buries workers' errors under its own traceback)
    followed by the last `lines` lines, without torch's deprecation noise."""
    keep = [ln for ln in text.splitlines() if "FutureWarning" not in ln and "return func(" not in ln]
    first = next((i for i, ln in enumerate(keep) if re.search(r"error|Traceback|terminate", ln, re.I)), None)
    head = keep[max(0, first - 2) : first + 12] if first is not None and first < len(keep) - lines else []
    return "\n".join([*head, *(["..."] if head else []), *keep[-lines:]])


def _config(model_config: GPTConfig | str) -> GPTConfig:
    return PRESETS[model_config] if isinstance(model_config, str) else model_config


def _train_cmd(
    out_dir: Path,
    world_size: int,
    zero_stage: int,
    dtype: str,
    steps: int,
    cfg: GPTConfig,
    seed: int,
    lr: float,
    micro_batch: int,
    grad_accum: int,
    extra_args: Sequence[str],
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        str(TRAIN_SCRIPT),
        "--out-dir",
        str(out_dir),
        "--loss-file",
        str(out_dir / "loss.json"),
        "--zero-stage",
        str(zero_stage),
        "--dtype",
        dtype,
        "--steps",
        str(steps),
        "--model-json",
        cfg.model_dump_json(),
        "--seed",
        str(seed),
        "--lr",
        repr(lr),
        "--micro-batch",
        str(micro_batch),
        "--grad-accum",
        str(grad_accum),
        *extra_args,
    ]


def _source_digest() -> str:
    """Digest of the code that decides what gets trained, so edits invalidate cached runs."""
    h = hashlib.sha256()
    for path in (TRAIN_SCRIPT, REPO_ROOT / "training" / "models" / "gpt.py"):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_key(params: dict) -> str:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    return f"ds-z{params['zero_stage']}-{params['dtype']}-w{params['world_size']}-s{params['steps']}-{digest}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive lock so concurrent test processes build a cache entry once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def make_checkpoint(
    out_dir: str | Path | None = None,
    world_size: int = 2,
    zero_stage: int = 2,
    dtype: Dtype = "fp32",
    steps: int = 3,
    model_config: GPTConfig | str = "tiny",
    *,
    seed: int = 1234,
    lr: float = 1e-3,
    micro_batch: int = 2,
    grad_accum: int = 1,
    seq: int | None = None,
    ds_config: dict | None = None,
    load_dir: str | Path | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 900,
) -> Path:
    """Train the reference GPT with DeepSpeed and return the checkpoint root directory.

    The root holds `latest` (naming the tag `global_step{steps}`), the tag folder, DeepSpeed's
    `zero_to_fp32.py`/`zero_to_torch.py`, `loss.json` (per-step losses) and `train.log`.

    out_dir: None caches the result under $UCP_PEER_CACHE, keyed by every argument, the harness
        sources and the DeepSpeed/torch versions; a path trains there (it must not hold a
        checkpoint yet) and caches nothing.
    model_config: a GPTConfig or a name in training.models.PRESETS.
    seq: sequence length, default the model's max_seq.
    ds_config: merged into the DeepSpeed config, e.g. {"zero_optimization":
        {"parameter_alignment": True}}.
    load_dir: resume from this checkpoint root and train on until global step `steps`.
    extra_args: passed to deepspeed_train.py verbatim.
    timeout: seconds before the whole torchrun process group is killed (PeerError).
    """
    cfg = _config(model_config)
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    if seq is not None:
        extra_args = [*extra_args, "--seq", str(seq)]
    if ds_config:
        extra_args = [*extra_args, "--ds-config-extra", json.dumps(ds_config, sort_keys=True)]
    if load_dir is not None:
        extra_args = [*extra_args, "--load-dir", str(Path(load_dir).resolve())]
    train_cmd = functools.partial(
        _train_cmd,
        world_size=world_size,
        zero_stage=zero_stage,
        dtype=dtype,
        steps=steps,
        cfg=cfg,
        seed=seed,
        lr=lr,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        extra_args=list(extra_args),
    )
    if out_dir is not None:
        out = Path(out_dir)
        if (out / "latest").exists():
            raise FileExistsError(f"{out} already holds a DeepSpeed checkpoint ('latest' exists)")
        out.mkdir(parents=True, exist_ok=True)
        _run(train_cmd(out), timeout, log=out / "train.log")
        return out

    from tools.peers.deepspeed_train import HARNESS_VERSION  # light: no deepspeed import

    params = dict(
        world_size=world_size,
        zero_stage=zero_stage,
        dtype=dtype,
        steps=steps,
        model=cfg.model_dump(),
        seed=seed,
        lr=lr,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        extra_args=list(extra_args),
        harness=HARNESS_VERSION,
        sources=_source_digest(),
        deepspeed=importlib.metadata.version("deepspeed"),
        torch=importlib.metadata.version("torch"),
    )
    cache = Path(os.environ.get("UCP_PEER_CACHE", DEFAULT_CACHE))
    final = cache / _cache_key(params)
    with _locked(cache / (final.name + ".lock")):
        if (final / "harness.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=cache))
        try:
            _run(train_cmd(tmp), timeout, log=tmp / "train.log")
            (tmp / "harness.json").write_text(json.dumps(params, indent=1))
            if final.exists():  # an incomplete leftover from a killed run
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def read_latest(ckpt_dir: str | Path) -> str:
    """The tag named by DeepSpeed's `latest` file in a checkpoint root."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"no 'latest' file in DeepSpeed checkpoint root {ckpt_dir}")
    return latest.read_text().strip()


def reference_fp32(ckpt_dir: str | Path, tag: str | None = None, timeout: float = 600) -> dict[str, torch.Tensor]:
    """DeepSpeed's consolidated fp32 weights (zero_to_fp32) for a checkpoint root.

    Computed once in a fresh process with `get_fp32_state_dict_from_zero_checkpoint` and passed
    back as `<root>/<tag>.zero_to_fp32.safetensors` (kept as a cache next to the checkpoint).
    """
    from safetensors.torch import load_file

    root = Path(ckpt_dir)
    tag = tag or read_latest(root)
    target = root / f"{tag}.zero_to_fp32.safetensors"
    with _locked(root / ".harness.lock"):
        if not target.is_file():
            _run(
                [sys.executable, str(Path(__file__)), "fp32", str(root), "--tag", tag, "--output", str(target)], timeout
            )
    return load_file(target)


def reference_universal(ckpt_dir: str | Path, tag: str | None = None, timeout: float = 600) -> Path:
    """Run DeepSpeed's `ds_to_universal` on a checkpoint; return `<root>/<tag>_universal`.

    A fresh interpreter each time: its ProcessPoolExecutor can deadlock when forked from a
    process that already ran torch ops. ds_to_universal writes `<root>/latest_universal` last,
    so an output folder without it is an interrupted run and is rebuilt.
    """
    root = Path(ckpt_dir)
    tag = tag or read_latest(root)
    out = root / f"{tag}_universal"
    latest_u = root / "latest_universal"
    with _locked(root / ".harness.lock"):
        if out.is_dir() and latest_u.is_file() and latest_u.read_text().strip() == out.name:
            return out
        shutil.rmtree(out, ignore_errors=True)
        _run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(root / tag),
                "--output_folder",
                str(out),
                "--inject_missing_state",
            ],
            timeout,
            log=root / f"{tag}_universal.log",
        )
    return out


# --- helper-process entry points and CLI ------------------------------------------------------


def _fp32_worker(root: str, tag: str, output: str) -> None:
    """In a fresh process: zero_to_fp32 -> safetensors (shared tensors cloned apart)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    flat = {k: v.detach().contiguous().clone() for k, v in state.items()}
    tmp = output + ".tmp"
    save_file(flat, tmp, metadata={"source": "deepspeed.utils.zero_to_fp32", "tag": tag})
    os.replace(tmp, output)


def _matrix(
    stages: Sequence[int],
    worlds: Sequence[int],
    dtypes: Sequence[str],
    steps: int,
    model: str,
    universal: bool,
    keep: Path | None = None,
) -> list[dict]:
    """Time generation (and DeepSpeed's conversions) for each combination, uncached."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ucp-peer-matrix-") as scratch:
        tmp = keep or scratch
        for dtype in dtypes:
            for stage in stages:
                for world in worlds:
                    out = Path(tmp) / f"z{stage}-{dtype}-w{world}"
                    t0 = time.perf_counter()
                    make_checkpoint(out, world, stage, dtype, steps, model)  # type: ignore[arg-type]
                    t1 = time.perf_counter()
                    reference_fp32(out)
                    t2 = time.perf_counter()
                    if universal:
                        reference_universal(out)
                    t3 = time.perf_counter()
                    inner = json.loads((out / "loss.json").read_text())["seconds"]
                    row = dict(
                        stage=stage,
                        world=world,
                        dtype=dtype,
                        make_s=round(t1 - t0, 1),
                        ds_init_s=round(inner["init"], 1),
                        fp32_s=round(t2 - t1, 1),
                        universal_s=round(t3 - t2, 1) if universal else None,
                    )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="train and save (cached unless --out-dir)")
    mk.add_argument("--out-dir", type=Path)
    mk.add_argument("--world-size", type=int, default=2)
    mk.add_argument("--zero-stage", type=int, default=2)
    mk.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    mk.add_argument("--steps", type=int, default=3)
    mk.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    mk.add_argument("--seed", type=int, default=1234)
    mk.add_argument("--seq", type=int, help="sequence length (default: the model's max_seq)")
    fp = sub.add_parser("fp32", help="zero_to_fp32 -> safetensors")
    fp.add_argument("ckpt_dir")
    fp.add_argument("--tag")
    fp.add_argument("--output")
    un = sub.add_parser("universal", help="ds_to_universal in a fresh process")
    un.add_argument("ckpt_dir")
    un.add_argument("--tag")
    mx = sub.add_parser("matrix", help="time generation for stages x world sizes x dtypes")
    mx.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    mx.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    mx.add_argument("--dtypes", nargs="+", default=["fp32"])
    mx.add_argument("--steps", type=int, default=3)
    mx.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    mx.add_argument("--no-universal", action="store_true")
    mx.add_argument("--keep-dir", type=Path, help="keep the checkpoints here (default: deleted)")
    a = p.parse_args(argv)

    if a.cmd == "make":
        print(make_checkpoint(a.out_dir, a.world_size, a.zero_stage, a.dtype, a.steps, a.model, seed=a.seed, seq=a.seq))
    elif a.cmd == "fp32":
        tag = a.tag or read_latest(a.ckpt_dir)
        if a.output:
            _fp32_worker(a.ckpt_dir, tag, a.output)
        else:
            print(
                f"{len(reference_fp32(a.ckpt_dir, tag))} tensors in "
                f"{Path(a.ckpt_dir) / (tag + '.zero_to_fp32.safetensors')}"
            )
    elif a.cmd == "universal":
        print(reference_universal(a.ckpt_dir, a.tag))
    else:
        _matrix(a.stages, a.worlds, a.dtypes, a.steps, a.model, not a.no_universal, a.keep_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
