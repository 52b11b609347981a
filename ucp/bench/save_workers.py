"""The ranks of ``ucp bench save``: each a process holding its part of a GPT-like training state.

The parent (:mod:`ucp.bench.save`) starts one process per rank and sends commands
as JSON lines on stdin ("save torch into DIR", "load ucp DIR", ...); each rank
answers one JSON line on its original stdout (everything else it prints goes to
stderr, a log file). Ranks of a multi-rank world run in a gloo process group and
bracket every timed operation with barriers, so rank 0's clock measures the
whole world's operation.

The state (per parameter: bf16 weight, fp32 master weight, Adam exp_avg and
exp_avg_sq = 14 bytes) is laid out ZeRO-1 style: bf16 weights replicated on
every rank, fp32 master and Adam states split in halves (``FlatShard``) across
ranks. Every method writes each byte of the state exactly once: UCP writes a
replicated tensor from one rank by its own rule; for torch.save, safetensors and
DCP each rank saves its shards plus its share of the bf16 weights (the same
largest-first rule), so all methods move the same bytes. On load every rank
restores exactly the part it saved.

    python -m ucp.bench.save_workers CONFIG_JSON
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from pydantic import BaseModel, Field

if TYPE_CHECKING:  # the worker imports ucp only when it first saves
    from ucp.saving.options import Snapshot

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight + fp32 master + exp_avg + exp_avg_sq
STEP = 1000
FILL_BLOCK = 8 << 20


# -- the model ------------------------------------------------------------------------------------


class GptSpec(BaseModel):
    """A GPT-2-like decoder: token and position embeddings, ``n_layer`` blocks, final layer norm."""

    d_model: int
    n_layer: int
    vocab: int
    n_ctx: int

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.d_model
        shapes: dict[str, tuple[int, ...]] = {"wte.weight": (self.vocab, d), "wpe.weight": (self.n_ctx, d)}
        for i in range(self.n_layer):
            p = f"h.{i}."
            shapes.update(
                {
                    p + "ln_1.weight": (d,),
                    p + "ln_1.bias": (d,),
                    p + "attn.c_attn.weight": (3 * d, d),
                    p + "attn.c_attn.bias": (3 * d,),
                    p + "attn.c_proj.weight": (d, d),
                    p + "attn.c_proj.bias": (d,),
                    p + "ln_2.weight": (d,),
                    p + "ln_2.bias": (d,),
                    p + "mlp.c_fc.weight": (4 * d, d),
                    p + "mlp.c_fc.bias": (4 * d,),
                    p + "mlp.c_proj.weight": (d, 4 * d),
                    p + "mlp.c_proj.bias": (d,),
                }
            )
        shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
        return shapes

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    @property
    def state_bytes(self) -> int:
        return self.params * BYTES_PER_PARAM


def gpt_spec(size_bytes: int) -> GptSpec:
    """Dimensions whose training state (14 bytes per parameter) is ``size_bytes`` to within one vocab row.

    Blocks hold ~60 % of the parameters (up to 8 layers, d_model a multiple of 64); the
    vocabulary takes the rest.
    """
    params = max(1, size_bytes // BYTES_PER_PARAM)
    n_ctx = 1024
    d = max(64, int(math.sqrt(0.6 * params / (12 * 8))) // 64 * 64)
    n_ctx = min(n_ctx, max(16, params // (8 * d)))
    per_layer = 12 * d * d + 13 * d
    fixed = n_ctx * d + 2 * d
    n_layer = max(1, min(8, int(0.6 * params) // per_layer))
    vocab = (params - fixed - n_layer * per_layer) // d
    if vocab < 16:
        vocab = 16  # tiny sizes: the state ends up a little larger than asked
    return GptSpec(d_model=d, n_layer=n_layer, vocab=vocab, n_ctx=n_ctx)


# -- filling tensors fast with unique, incompressible bytes ---------------------------------------


class Filler:
    """Fills buffers with bytes that differ per (key, 8 MiB chunk): one random block XOR a key per chunk.

    Memory speed, deterministic (replicated tensors come out equal on every rank), nothing
    for a compressing or deduplicating device to exploit.
    """

    def __init__(self, seed: int = 0) -> None:
        self.base = np.frombuffer(np.random.default_rng(seed).bytes(FILL_BLOCK), dtype=np.uint64)

    def fill(self, dest: np.ndarray, key: str) -> None:
        seed = zlib.crc32(key.encode()) + 1
        words = dest.nbytes // 8
        d64 = dest[: words * 8].view(np.uint64)
        per = FILL_BLOCK // 8
        for i, start in enumerate(range(0, words, per)):
            n = min(per, words - start)
            k = np.uint64(((seed << 32) ^ (0x9E3779B97F4A7C15 * (i + 1))) & 0xFFFFFFFFFFFFFFFF)
            np.bitwise_xor(self.base[:n], k, out=d64[start : start + n])
        tail = dest.nbytes - words * 8
        if tail:
            dest[words * 8 :] = self.base.view(np.uint8)[:tail] ^ np.uint8(seed & 0xFF)


def filled(shape: tuple[int, ...], dtype: Any, filler: Filler, key: str) -> Any:
    import torch

    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        filler.fill(t.view(-1).view(torch.uint8).numpy(), key)
    return t


# -- one rank's state -----------------------------------------------------------------------------


def bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def share_of_replicated(shapes: dict[str, tuple[int, ...]], itemsize: int, world: int) -> dict[str, int]:
    """Which rank saves (and restores) each replicated bf16 weight for the non-UCP methods:
    largest first, to the rank with the fewest bytes so far (UCP's own rule, reimplemented)."""
    load = [0] * world
    owner = {}
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]) * itemsize, n)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += max(1, math.prod(shapes[name]) * itemsize)
    return owner


@dataclass
class RankState:
    """One rank's state in the forms the methods take.

    ``plain``: what this rank saves with torch.save / safetensors / DCP (plain tensors: its
    shards and its share of the bf16 weights), also the in-place load target.
    ``ucp``: what it hands to ``ucp.save`` (all bf16 weights, replicated; shards as FlatShard).
    ``ucp_into``: what it restores with ``ucp.load(into=)`` — the same tensors as ``plain``.
    All three share the tensors' memory.
    """

    plain: dict[str, Any]
    ucp: dict[str, Any]
    ucp_into: dict[str, Any]
    paths: list[tuple[Any, ...]] = field(default_factory=list)  # key paths of plain's tensors

    def nbytes(self) -> int:
        return sum(get_path(self.plain, p).nbytes for p in self.paths)


def _saved_tensors(tree: Any) -> list[Any]:
    """The tensors of a state dict as ``ucp.save`` gets it (a FlatShard's local part)."""
    import torch

    from ucp import FlatShard

    if isinstance(tree, FlatShard):
        return [tree.local]
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _saved_tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _saved_tensors(v)]
    return []


def get_path(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def tensor_paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [prefix]
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in tensor_paths(v, prefix + (k,))]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in tensor_paths(v, prefix + (i,))]
    return []


def build_state(spec: GptSpec, rank: int, world: int, seed: int = 0) -> RankState:
    import torch

    from ucp import FlatShard

    filler = Filler(seed)
    shapes = spec.param_shapes()
    names = list(shapes)
    owner = share_of_replicated(shapes, 2, world)
    model = {n: filled(s, torch.bfloat16, filler, f"model.{n}") for n, s in shapes.items()}

    def shard(kind: str, name: str) -> tuple[Any, Any]:
        """(local tensor, what ucp.save gets) of this rank's part of an fp32 tensor."""
        shape = shapes[name]
        if world == 1:
            t = filled(shape, torch.float32, filler, f"{kind}.{name}")
            return t, t
        lo, hi = bounds(math.prod(shape), world, rank)
        t = filled((hi - lo,), torch.float32, filler, f"{kind}.{name}.rank{rank}")
        return t, FlatShard(t, shape, lo)

    master, master_u, opt, opt_u = {}, {}, {}, {}
    for i, n in enumerate(names):
        master[n], master_u[n] = shard("master", n)
        ea, ea_u = shard("exp_avg", n)
        es, es_u = shard("exp_avg_sq", n)
        opt[i] = {"step": STEP, "exp_avg": ea, "exp_avg_sq": es}
        opt_u[i] = {"step": STEP, "exp_avg": ea_u, "exp_avg_sq": es_u}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(names)))}]
    extras = {"step": STEP, "scheduler": {"last_epoch": STEP, "base_lrs": [3e-4]}}

    def whole(model_part: dict[str, Any], master_part: dict[str, Any], opt_part: dict[int, Any]) -> dict[str, Any]:
        return {
            "model": model_part,
            "master": master_part,
            "optimizer": {"state": opt_part, "param_groups": groups},
            **extras,
        }

    mine = {n: t for n, t in model.items() if owner[n] == rank}
    plain = whole(mine, master, opt)
    ucp_state = whole(model, master_u, opt_u)
    into = whole(mine, master_u, opt_u)
    state = RankState(plain=plain, ucp=ucp_state, ucp_into=into)
    state.paths = tensor_paths(plain)
    return state


def str_keys(tree: Any) -> Any:
    """The containers of ``tree`` copied with str keys; leaves (tensors included) shared."""
    if isinstance(tree, dict):
        return {str(k): str_keys(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [str_keys(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(str_keys(v) for v in tree)
    return tree


def flat_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in path)


def non_tensors(tree: Any) -> Any:
    """The state without its tensors, as JSON-able values (safetensors keeps it as metadata)."""
    import torch

    if isinstance(tree, dict):
        return {str(k): non_tensors(v) for k, v in tree.items() if not isinstance(v, torch.Tensor)}
    if isinstance(tree, (list, tuple)):
        return [non_tensors(v) for v in tree if not isinstance(v, torch.Tensor)]
    return tree


# -- the methods ----------------------------------------------------------------------------------


class Comm:
    """Barriers of the world (no-ops for one rank)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def fsync_file(path: str) -> None:
    from ucp.bench.methods import fsync_path

    fsync_path(path)


class Worker:
    """One rank: builds its state, then runs the parent's commands."""

    def __init__(self, cfg: "WorkerConfig") -> None:
        self.cfg = cfg
        self.rank, self.world = cfg.rank, cfg.world
        self.comm = Comm(cfg.world)
        self.state = build_state(cfg.spec, cfg.rank, cfg.world, cfg.seed)
        self.loaded: Any = None
        self._checks: list[tuple[tuple[Any, ...], Any]] = []  # (path, expected bytes) of the next check
        self._savers: dict[str, Any] = {}
        self._iteration_s: float | None = (
            None  # seconds per busy_compute iteration, idle  # AsyncSaver per snapshot mode, reused (its staging too) across rounds
        )

    # -- helpers

    def _aio(self) -> Any:
        return self.cfg.aio_config or None

    def dcp_state(self) -> dict[str, Any]:
        """A fresh str-keyed copy of the containers of ``plain`` around the same tensors.

        DCP takes one flat namespace for all ranks: plain tensors with equal keys are taken as
        replicas and written once, so each rank's keys get a rank prefix. Its load writes
        non-tensor values back under str keys (``"0"`` next to the int key ``0``), so it gets
        containers of its own; the tensors are shared and loaded in place.
        """
        view = str_keys(self.state.plain)
        return view if self.world == 1 else {f"rank{self.rank}": view}

    def rank_file(self, directory: str, ext: str) -> str:
        return os.path.join(directory, f"rank-{self.rank}.{ext}")

    # -- operations

    def save(self, method: str, directory: str) -> None:
        import torch

        if method == "ucp":
            import ucp

            ucp.save(self.state.ucp, os.path.join(directory, "ckpt"), step=STEP, aio_config=self._aio())
        elif method == "torch":
            path = self.rank_file(directory, "pt")
            torch.save(self.state.plain, path)
            fsync_file(path)
        elif method == "safetensors":
            from safetensors.torch import save_file

            path = self.rank_file(directory, "safetensors")
            tensors = {flat_name(p): get_path(self.state.plain, p) for p in self.state.paths}
            save_file(tensors, path, metadata={"state": json.dumps(non_tensors(self.state.plain))})
            fsync_file(path)
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():  # one rank: no_dist=True, which DCP warns about
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(
                    self.dcp_state(),
                    storage_writer=dcp.FileSystemWriter(os.path.join(directory, "dcp")),
                    no_dist=self.world == 1,
                )
        elif method == "ucp-dcp":
            import torch.distributed.checkpoint as dcp

            import ucp.dcp

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(
                    self.dcp_state(),
                    storage_writer=ucp.dcp.Writer(os.path.join(directory, "ckpt"), aio_config=self._aio()),
                    no_dist=self.world == 1,
                )
        else:
            raise ValueError(f"unknown save method {method!r}")

    def load(self, method: str, variant: str, directory: str) -> None:
        """Load what ``save`` wrote; full loads keep the result in ``self.loaded`` for the check."""
        import torch

        if method == "ucp":
            import ucp

            path = os.path.join(directory, "ckpt")
            if variant == "full":
                self.loaded = ucp.load(path, aio_config=self._aio())
            else:
                ucp.load(path, into=self.state.ucp_into, strict=False, aio_config=self._aio())  # this rank's tensors
        elif method == "torch":
            self.loaded = torch.load(self.rank_file(directory, "pt"), weights_only=True, mmap=False)
        elif method == "safetensors":
            from safetensors.torch import load_file

            from ucp.bench.methods import touch_pages

            self.loaded = load_file(self.rank_file(directory, "safetensors"))
            for t in self.loaded.values():  # load_file maps lazily: make it read
                touch_pages(t)
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    self.dcp_state(),
                    storage_reader=dcp.FileSystemReader(os.path.join(directory, "dcp")),
                    no_dist=self.world == 1,
                )
        elif method == "ucp-dcp":
            import torch.distributed.checkpoint as dcp

            import ucp.dcp

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    self.dcp_state(),
                    storage_reader=ucp.dcp.Reader(os.path.join(directory, "ckpt"), aio_config=self._aio()),
                    no_dist=self.world == 1,
                )
        else:
            raise ValueError(f"unknown load method {method!r}")

    def async_save(self, directory: str, snapshot: Snapshot = "sync", compute_s: float = 0.0) -> dict[str, float]:
        """Seconds of an async save followed by a simulated training step.

        The saver is an ``AsyncSaver(snapshot=...)``, reused across rounds. After the call returns,
        a fixed amount of CPU work (``compute_s`` s of it with no save in flight) stands for the
        forward/backward; then ``wait_snapshot`` (deferred copies), then the optimizer step, simulated
        by rewriting every saved tensor's bytes in place. Both are also timed just before, with no
        save in flight.

        * ``stall_s``: the time training was held — until the call returned, plus the wait, plus how
          much longer the step took (copy-on-write: writes to pages not copied yet wait);
        * ``compute_slower_s``: how much longer the compute took (not a stall: the copy and the
          writer share the CPUs and memory bandwidth with it);
        * ``seconds``: until the save's result.
        """
        fn, _ = find_async_save()
        if fn is None:
            raise RuntimeError("ucp.async_save does not exist")
        import ucp

        saver = self._savers.get(snapshot)
        if saver is None:
            saver = self._savers[snapshot] = ucp.AsyncSaver(snapshot=snapshot)
        work = self.compute_iterations(compute_s)
        self.comm.barrier()
        base_compute, base_step = busy_compute(work), self.rewrite_state()
        self.comm.barrier()
        t0 = time.perf_counter()
        handle = saver.save(self.state.ucp, os.path.join(directory, "ckpt"), step=STEP, aio_config=self._aio())
        returned = time.perf_counter() - t0
        computed = busy_compute(work)
        t1 = time.perf_counter()
        handle.wait_snapshot()
        waited = time.perf_counter() - t1
        step_slower = max(0.0, self.rewrite_state() - base_step)
        handle.result()
        self.comm.barrier()
        return {
            "stall_s": returned + waited + step_slower,
            "waited_s": waited,
            "step_slower_s": step_slower,
            "compute_slower_s": max(0.0, computed - base_compute),
            "seconds": time.perf_counter() - t0,
        }

    def compute_iterations(self, seconds: float) -> int:
        """How many :func:`busy_compute` iterations take ``seconds`` here (measured once, idle)."""
        if seconds <= 0:
            return 0
        if self._iteration_s is None:
            self.comm.barrier()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.5:
                busy_compute(8)
                n += 8
            self._iteration_s = (time.perf_counter() - t0) / n
        return max(1, round(seconds / self._iteration_s))

    def rewrite_state(self) -> float:
        """Seconds to rewrite every tensor ``ucp.save`` gets, in place, with the same bytes (numpy: no
        fast path can skip it) — the memory traffic of an optimizer step."""
        import numpy as np
        import torch

        t0 = time.perf_counter()
        for t in _saved_tensors(self.state.ucp):
            if t.numel():
                b = t.view(-1).view(torch.uint8).numpy()
                np.bitwise_or(b, 0, out=b)
        return time.perf_counter() - t0

    # -- the bit-exact check

    def prepare_check(self, method: str, variant: str, seed: int) -> None:
        """Pick the tensors to compare after the next load; for in-place loads keep their bytes and
        invert them in memory, so that a load that leaves them alone cannot pass."""
        import torch

        rng = np.random.default_rng(seed)
        paths = self.state.paths
        largest = max(paths, key=lambda p: get_path(self.state.plain, p).nbytes)
        picks = {largest} | {paths[int(i)] for i in rng.choice(len(paths), size=min(4, len(paths)), replace=False)}
        self._checks = []
        for p in sorted(picks, key=str):
            t = get_path(self.state.plain, p)
            expected = t.view(-1).view(torch.uint8).clone()
            self._checks.append((p, expected))
            if self.in_place(method, variant):
                t.view(-1).view(torch.uint8).bitwise_not_()

    @staticmethod
    def in_place(method: str, variant: str) -> bool:
        return method in ("dcp", "ucp-dcp") or (method == "ucp" and variant == "into")

    def check(self, method: str, variant: str) -> str | None:
        """None when every sampled tensor came back bit-exact, else what differs."""
        import torch

        bad = None
        for path, expected in self._checks:
            if self.in_place(method, variant):
                got = get_path(self.state.plain, path)
            elif method == "safetensors":
                got = self.loaded.get(flat_name(path)) if self.loaded is not None else None
            else:
                try:
                    got = get_path(self.loaded, path)
                except (KeyError, IndexError, TypeError):
                    got = None
            if got is None:
                bad = bad or f"{flat_name(path)} missing from what {method} loaded"
                continue
            ok = got.dtype == get_path(self.state.plain, path).dtype and torch.equal(
                got.contiguous().view(-1).view(torch.uint8), expected
            )
            if not ok:
                bad = bad or f"{flat_name(path)} differs after {method} load ({variant}) on rank {self.rank}"
                if self.in_place(method, variant):  # undo the poison so later methods save real data
                    get_path(self.state.plain, path).view(-1).view(torch.uint8).copy_(expected)
        self._checks = []
        self.loaded = None
        return bad

    def check_saved_ucp(self, directory: str) -> str | None:
        """Read the sampled tensors back from a UCP checkpoint into fresh memory and compare."""
        import torch

        import ucp
        from ucp import FlatShard

        self.prepare_check("ucp", "full", 12345)
        into: dict[str, Any] = {}
        fresh = []
        for path, _ in self._checks:
            node = get_path(self.state.ucp_into, path)
            if isinstance(node, FlatShard):
                target: Any = FlatShard(torch.empty_like(node.local), node.global_shape, node.start)
                local = target.local
            else:
                target = local = torch.empty_like(node)
            cur = into
            for k in path[:-1]:
                cur = cur.setdefault(k, {})
            cur[path[-1]] = target
            fresh.append((path, local))
        ucp.load(
            os.path.join(directory, "ckpt"), into=into, strict=False, aio_config=self._aio()
        )  # a sample of tensors
        self.loaded = {}
        bad = None
        for (path, expected), (_, local) in zip(self._checks, fresh):
            if not torch.equal(local.view(-1).view(torch.uint8), expected):
                bad = bad or f"{flat_name(path)} differs in the checkpoint async_save wrote (rank {self.rank})"
        self._checks = []
        self.loaded = None
        return bad

    # -- the command loop

    def timed(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Barrier, run, barrier: rank 0's wall time is the world's time. CPU is this rank's."""
        self.comm.barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        fn()
        self.comm.barrier()
        return {"seconds": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "save":
            return self.timed(lambda: self.save(cmd["method"], cmd["dir"]))
        if op == "load":
            method, variant = cmd["method"], cmd.get("variant", "full")
            self.prepare_check(method, variant, cmd.get("seed", 0))
            reply = self.timed(lambda: self.load(method, variant, cmd["dir"]))
            reply["mismatch"] = self.check(method, variant)
            return reply
        if op == "async_save":
            c0 = cpu_seconds()
            reply = self.async_save(cmd["dir"], cmd.get("snapshot", "sync"), cmd.get("compute_s", 0.0))
            return {**reply, "cpu_s": cpu_seconds() - c0, "mismatch": self.check_saved_ucp(cmd["dir"])}
        if op == "has_async":
            fn, where = find_async_save()
            try:
                from ucp.saving.cow.snapshot import cow_unavailable
            except ImportError:
                return {"available": fn is not None, "where": where, "no_cow": "not in this build"}
            return {"available": fn is not None, "where": where, "no_cow": cow_unavailable()}
        raise ValueError(f"unknown command {op!r}")


def find_async_save() -> tuple[Callable[..., Any] | None, str]:
    """``ucp.async_save``, or (None, why) in a build without it."""
    import ucp

    fn = getattr(ucp, "async_save", None)
    return (fn, "ucp.async_save") if callable(fn) else (None, "ucp.async_save does not exist in this build")


def busy_compute(iterations: int) -> float:
    """Stand-in for a training step's forward/backward: matrix products on the CPU; returns the seconds."""
    import torch

    t0 = time.perf_counter()
    if iterations > 0:
        a = torch.randn(512, 512)
        for _ in range(iterations):
            a = torch.tanh(a @ a)
    return time.perf_counter() - t0


def cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class WorkerConfig(BaseModel):
    rank: int
    world: int
    init_file: str | None = Field(None, description="gloo rendezvous file (world > 1)")
    spec: GptSpec
    seed: int = 0
    aio_config: dict[str, Any] | None = None
    timeout_s: int = 1800


def main(argv: list[str]) -> int:
    cfg = WorkerConfig.model_validate_json(argv[0])
    # The protocol owns the original stdout; anything else printed (warnings, C libraries) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        if cfg.world > 1:
            from datetime import timedelta

            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"file://{cfg.init_file}",
                rank=cfg.rank,
                world_size=cfg.world,
                timeout=timedelta(seconds=cfg.timeout_s),
            )
        import safetensors.torch  # noqa: F401 - imported now so that no timed operation pays for it
        import torch.distributed.checkpoint  # noqa: F401

        import ucp  # noqa: F401

        t0 = time.perf_counter()
        worker = Worker(cfg)
        reply({"ok": True, "ready": True, "bytes": worker.state.nbytes(), "build_s": time.perf_counter() - t0})
    except BaseException:
        reply({"ok": False, "error": traceback.format_exc()[-4000:]})
        return 1
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            reply({"ok": True, **worker.handle(cmd)})
        except BaseException:
            reply({"ok": False, "error": traceback.format_exc()[-4000:]})
            return 1
    if cfg.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
