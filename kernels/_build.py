"""Build (once) and load the C++ extension, or say why the pure-torch path is used instead.

The extension is JIT-built with ``torch.utils.cpp_extension.load`` into a cache directory keyed by
the source's hash and path, the torch install and version and the flags (``$UCP_KERNELS_CACHE``, default
``~/.cache/ucp-kernels``), so each machine compiles it once. ``UCP_KERNELS=torch`` forces the
fallback; ``UCP_KERNELS=cpp`` makes a failed build an error instead of a silent fallback.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("csrc") / "ucp_kernels.cpp"
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: tuple[ModuleType | None, str] | None = None


def cache_dir() -> Path:
    """Where built extensions live; one sub-directory per (source and its path, torch, flags) hash."""
    root = os.environ.get("UCP_KERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ucp-kernels")
    return Path(root)


def _key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    # ninja's build file records the source's path and torch's include paths: two checkouts or
    # virtual environments sharing one build directory would rebuild it in turn, each run
    h.update(str(SOURCE.resolve()).encode())
    h.update(str(Path(torch.__file__).resolve().parent).encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _builder_lock(where: Path) -> Iterator[None]:
    """Hold ``where``'s build lock: one process builds or loads there at a time.

    torch's own lock is a plain file that a killed builder leaves behind, after which every later
    process waits for it forever. An ``flock`` dies with its holder, so whoever holds it knows
    that a torch lock file left in ``where`` belongs to no live builder and removes it.
    """
    fd = os.open(where / "build.flock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (where / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _build() -> tuple[ModuleType | None, str]:
    mode = os.environ.get("UCP_KERNELS", "").strip().lower()
    if mode not in ("", "auto", "cpp", "torch"):
        raise ValueError(f"UCP_KERNELS={mode!r}: expected 'cpp', 'torch' or unset")
    if mode == "torch":
        return None, "UCP_KERNELS=torch forces the pure-torch path"
    try:
        from torch.utils import cpp_extension

        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed")
        key = _key()
        where = cache_dir() / key
        where.mkdir(parents=True, exist_ok=True)
        with _builder_lock(where):
            mod = cpp_extension.load(
                name=f"ucp_kernels_{key}",
                sources=[str(SOURCE)],
                extra_cflags=list(CFLAGS),  # copies: load() appends its own flags to the lists it is given
                extra_ldflags=list(LDFLAGS),
                build_directory=str(where),
                verbose=False,
            )
        return mod, f"C++ extension ({mod.isa()}), built in {where}"
    except Exception as e:  # any build failure: fall back, keeping the reason
        if mode == "cpp":
            raise RuntimeError(f"UCP_KERNELS=cpp but the C++ extension could not be built: {e}") from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"C++ extension unavailable ({first}); using the pure-torch path"


def extension() -> tuple[ModuleType | None, str]:
    """``(module or None, reason)``, decided once per process (thread-safe)."""
    global _state
    with _lock:
        if _state is None:
            _state = _build()
        return _state


def reset() -> None:
    """Forget the decision (tests that flip ``UCP_KERNELS``)."""
    global _state
    with _lock:
        _state = None
