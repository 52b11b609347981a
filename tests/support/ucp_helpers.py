"""Shared helpers for the ucp tests: tensors with awkward bit patterns, and byte-exact comparison."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random *bytes* viewed as ``dtype`` (NaN payloads, -0.0, subnormals); bool gets 0/1."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.uint8)).view(torch.bool).reshape(shape)
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    t = torch.from_numpy(raw).view(dtype) if n else torch.empty(0, dtype=dtype)
    return t.reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs with the same payload compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def assert_same_state(a: Any, b: Any, path: str = "state") -> None:
    """Deep equality of two state dicts: same container types, key types, values; tensors byte-exact."""
    if isinstance(a, dict):  # OrderedDict (module state dicts) comes back as a dict, same key order
        assert type(b) is dict, f"{path}: {type(b).__name__} is not a dict"
    else:
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert same_bytes(a, b), f"{path}: tensors differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(list(b.keys())[list(a.keys()).index(k)]), f"{path}: key type of {k!r}"
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# -- simulated ranks: N threads standing in for N processes (fast tests of multi-rank logic) --------

import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

from ucp.dist import Group  # noqa: E402


class _Shared:
    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list[Any] = [None] * n


class ThreadGroup(Group):
    """A Group whose collectives work between threads of one process."""

    def __init__(self, rank: int, world_size: int, shared: _Shared) -> None:
        super().__init__(rank, world_size, pg="threads")
        self._shared = shared

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.rank == src:
            self._shared.slots[0] = obj
        self._shared.barrier.wait()
        value = self._shared.slots[0]
        self._shared.barrier.wait()
        return value

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        self._shared.slots[self.rank] = obj
        self._shared.barrier.wait()
        out = list(self._shared.slots) if self.rank == dst else None
        self._shared.barrier.wait()
        return out


def run_ranks(world_size: int, fn: Callable[[Group], Any]) -> list[Any]:
    """Run ``fn(group)`` on ``world_size`` threads; returns results, re-raises the first error."""
    shared = _Shared(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadGroup(rank, world_size, shared))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def save_ranks(path: Path | str, states: list[dict[str, Any]], **kw: Any) -> list[Any]:
    """Save one state dict per simulated rank to ``path`` (through the real save code)."""
    from ucp.saving.sync_save import save_with
    from ucp.store.storage import open_storage

    def fn(group: Group) -> Any:
        storage, name = open_storage(path)
        with storage:
            return save_with(
                storage,
                name,
                states[group.rank],
                group,
                step=kw.get("step"),
                metadata=kw.get("metadata", {}),
                mesh=kw.get("mesh"),
                check_replicas=kw.get("check_replicas", False),
            )

    return run_ranks(len(states), fn)


def cli_error_line(result: Any, code: int, *needles: str) -> str:
    """A CLI run (click's Result) that failed with ``code``, no traceback, and exactly one ``error:``
    line on stderr holding every needle; returns that line."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output + result.stderr
    assert result.exit_code == code, result.output + result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level, keys joined with '.' (as manifest tensor names are)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[prefix + str(k)] = v
    return out


# -- memory: the data buffers (ucp.store.reader.FileBuffer) a reshape or partial read holds at once -----------


class TrackedFileBuffers:
    """Counts the bytes of the mappings behind ``FileBuffer`` objects (fresh or pooled) alive at once (``peak``).

    Every FileBuffer's memory comes from ``ucp.store.reader._anonymous``; a :class:`ucp.store.reader.MemoryPool`
    keeps its mappings until it is dropped, so pooled memory counts as held from its first use.
    ``modules`` is kept for the callers' readability (which modules' buffers are meant).
    """

    def __init__(self, monkeypatch: Any, *modules: Any) -> None:
        import weakref

        import ucp.store.reader

        self.live = self.peak = 0
        lock = threading.Lock()
        real, tracker = ucp.store.reader._anonymous, self

        def tracked(nbytes: int) -> Any:
            m = real(nbytes)
            size = len(m)
            with lock:
                tracker.live += size
                tracker.peak = max(tracker.peak, tracker.live)

            def freed() -> None:
                with lock:
                    tracker.live -= size

            weakref.finalize(m, freed)
            return m

        monkeypatch.setattr(ucp.store.reader, "_anonymous", tracked)
