"""The C++ kernels' build directory: a lock file left by a killed builder never blocks later processes."""

from __future__ import annotations

import subprocess
import sys

from kernels import _build


def test_a_lock_left_by_a_killed_builder_is_removed_and_the_extension_loads(cpp_backend: None) -> None:
    _build.extension()  # built (once) into the cache, so the child only loads it
    where = _build.cache_dir() / _build._key()
    stale = where / "lock"  # torch's plain lock file, as a builder killed mid-build leaves it
    stale.write_text("")
    try:
        code = "from kernels import _build; mod, why = _build.extension(); print(mod is not None, why)"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("True C++ extension"), proc.stdout + proc.stderr[-3000:]
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)  # never leave it for the other tests
