"""Interrupting long-running ``ucp`` commands and saves: Ctrl-C, SIGTERM, closed or broken output streams.

What a user may expect when a command is stopped: it ends within moments, with the conventional exit
code (130 after Ctrl-C) and no traceback; the destination is never left partial; no temporary
directory (``.<dst>.tmp-*``, ``.<dst>.export-tmp-*``) stays behind; the source is untouched.

The interrupts are made deterministic: each command runs in a subprocess through a small runner
(written to the test's tmp dir) that wraps one internal step — a reshape batch being read, a piece
being written by a save, a tensor being exported — records every call in a log, and can send the
process a signal at the N-th call (from inside the process: the same delivery as a Ctrl-C from the
terminal). Assertions count calls and look at files and exit codes, never at timings.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TIMEOUT = 60  # seconds a subprocess may take; a command that does not end by then is a hang

RUNNER = textwrap.dedent(r'''
    import os, signal, sys, threading, time

    SIG = os.environ.get("UCP_T_SIGNAL", "")
    AT = os.environ.get("UCP_T_AT", "")
    NTH = int(os.environ.get("UCP_T_NTH", "1"))
    DELAY = float(os.environ.get("UCP_T_DELAY", "0"))
    LOG = os.environ["UCP_T_LOG"]
    _lock = threading.Lock()
    _count = {}


    def hit(point):
        """Record a call of ``point``; at the NTH call of AT, signal this process."""
        with _lock:
            n = _count[point] = _count.get(point, 0) + 1
            with open(LOG, "a") as f:
                f.write(f"{point} {n}\n")
        if SIG and point == AT and n == NTH:
            os.kill(os.getpid(), getattr(signal, SIG))


    def patch_reshape():
        import ucp.conversion.reshape as r
        orig = r._fill

        def fill(*a, **k):  # one batch of a reshape read from the source; DELAY: a slow disk
            hit("fill")
            time.sleep(DELAY)
            return orig(*a, **k)
        r._fill = fill


    class Tripwire(list):
        def __iter__(self):
            for v in list.__iter__(self):
                hit("piece")
                yield v


    def patch_save():
        import ucp.saving.sync_save as s
        orig = s.write_rank_file

        def write(storage, rel, plan, views, **k):  # each piece of the rank file, as it is written
            return orig(storage, rel, plan, Tripwire(views), **k)
        s.write_rank_file = write
        import ucp.conversion.reshape as r  # convert's torch-free path writes through the reshape's writer
        r.write_rank_file = write


    def patch_export():
        import ucp.conversion.exporters.hf as h
        orig = h.export_hf

        def export_hf(*a, progress=None, **k):
            def p(*x):  # after each tensor written
                if progress is not None:
                    progress(*x)
                hit("tensor")
            return orig(*a, progress=p, **k)
        h.export_hf = export_hf


    mode = sys.argv[1]
    if mode == "save":
        patch_save()
        import torch, ucp
        sd = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}
        ucp.save(sd, sys.argv[2], step=1)
        print("saved")
    else:
        {"reshape": patch_reshape, "convert": patch_save, "export": patch_export}[mode]()
        from ucp.cli.main import main
        sys.argv = ["ucp", *sys.argv[1:]]
        main()
''')

N_TENSORS = 24  # a reshape under a 1 MiB budget reads each 512 KiB tensor as a batch of its own


# -- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A UCP checkpoint (``model`` section, 24 tensors, 12 MiB) and a safetensors file (8 MiB)."""
    import torch
    from safetensors.torch import save_file

    import ucp

    root = tmp_path_factory.mktemp("interrupt-sources")
    ckpt = root / "src"
    ucp.save(
        {"model": {f"layer{i}.weight": torch.full((1 << 17,), float(i)) for i in range(N_TENSORS)}}, str(ckpt), step=7
    )
    hf = root / "model.safetensors"
    save_file({f"l{i}.weight": torch.full((1 << 18,), float(i)) for i in range(8)}, str(hf))
    return {"ckpt": ckpt, "hf": hf}


def digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of the file), to show a source was left untouched."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def leftovers(dst: Path) -> list[str]:
    """Temporary siblings of ``dst`` (``.<name>.tmp-*``, ``.<name>.export-tmp-*``, ``.<name>.old-*``)."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def runner(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    return script, tmp_path / "calls.log"


def calls(log: Path, point: str) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.split()[0] == point) if log.exists() else 0


def run_runner(
    tmp_path: Path, args: list[str], *, sig: str = "", at: str = "", nth: int = 1, delay: float = 0.0
) -> tuple[subprocess.CompletedProcess, Path]:
    script, log = runner(tmp_path)
    env = dict(
        os.environ, UCP_T_SIGNAL=sig, UCP_T_AT=at, UCP_T_NTH=str(nth), UCP_T_DELAY=str(delay), UCP_T_LOG=str(log)
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args[0]} did not end within {TIMEOUT} s of its interrupt: {exc.stderr!r}")
    return proc, log


def ucp_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ucp.cli", *args]


# -- Ctrl-C: what works ---------------------------------------------------------------------------------


def test_reshape_ctrl_c_from_outside_exits_130_and_leaves_nothing(tmp_path: Path, sources: dict[str, Path]) -> None:
    """A real SIGINT from another process, sent once the reshape is reading batches."""
    src, dst = sources["ckpt"], tmp_path / "dst"
    before = digest(src)
    script, log = runner(tmp_path)
    env = dict(os.environ, UCP_T_DELAY="0.1", UCP_T_LOG=str(log))
    proc = subprocess.Popen(
        [sys.executable, str(script), "reshape", str(src), str(dst), "--memory-budget", "1MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while calls(log, "fill") < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the reshape ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert not dst.exists()
    assert leftovers(dst) == []
    assert digest(src) == before


def assert_stopped_cleanly(proc: subprocess.CompletedProcess, src: Path, dst: Path, before: dict[str, str]) -> None:
    """A command stopped by Ctrl-C: exit 130, no traceback, no destination or temp dir, source untouched."""
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not dst.exists()
    assert leftovers(dst) == []
    assert digest(src) == before


def test_export_ctrl_c_exits_130_and_leaves_nothing(tmp_path: Path, sources: dict[str, Path]) -> None:
    src, dst = sources["ckpt"], tmp_path / "out"
    before = digest(src)
    proc, log = run_runner(tmp_path, ["export", str(src), str(dst)], sig="SIGINT", at="tensor", nth=2)
    assert calls(log, "tensor") == 2
    assert_stopped_cleanly(proc, src, dst, before)


def test_convert_ctrl_c_mid_write_exits_130_and_leaves_nothing(tmp_path: Path, sources: dict[str, Path]) -> None:
    src, dst = sources["hf"], tmp_path / "conv"
    before = digest(src)
    proc, log = run_runner(tmp_path, ["convert", str(src), str(dst)], sig="SIGINT", at="piece", nth=3)
    assert calls(log, "piece") >= 3  # the writer's thread may take the pieces left before the main thread unwinds
    assert_stopped_cleanly(proc, src, dst, before)


def test_library_save_ctrl_c_mid_write_leaves_nothing(tmp_path: Path) -> None:
    """A script's ``ucp.save`` interrupted while writing: the KeyboardInterrupt propagates (a script's
    traceback is Python's business), and neither the checkpoint nor its temporary directory is left."""
    dst = tmp_path / "ckpt"
    proc, log = run_runner(tmp_path, ["save", str(dst)], sig="SIGINT", at="piece", nth=2)
    assert calls(log, "piece") == 2
    assert proc.returncode != 0 and "saved" not in proc.stdout
    assert proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr
    assert not dst.exists()
    assert leftovers(dst) == []


# -- Ctrl-C: bugs -----------------------------------------------------------------------------------


def test_reshape_ctrl_c_stops_reading_promptly(tmp_path: Path, sources: dict[str, Path]) -> None:
    """Ctrl-C during batch 2 of 24: the batches already being read may finish, but the reshape must not read
    (and write, and then throw away) all the others — on a 100 GB checkpoint that is minutes of I/O."""
    src, dst = sources["ckpt"], tmp_path / "dst"
    proc, log = run_runner(
        tmp_path, ["reshape", str(src), str(dst), "--memory-budget", "1MiB"], sig="SIGINT", at="fill", nth=2, delay=0.05
    )
    assert proc.returncode == 130, proc.stderr
    assert not dst.exists() and leftovers(dst) == []
    assert calls(log, "fill") <= N_TENSORS // 2, f"{calls(log, 'fill')} of {N_TENSORS} batches read after Ctrl-C"


def test_save_interrupted_in_io_submit_leaves_later_saves_working(tmp_path: Path) -> None:
    """Ctrl-C lands while io_submit blocks (O_DIRECT writes on ext4 often block there): a real SIGINT sent
    during the call. In a notebook the user then saves again: that save must work."""
    script = tmp_path / "libaio_interrupt.py"
    script.write_text(
        textwrap.dedent(r"""
        import os, signal, sys, time, torch, ucp
        from aio.engines import libaio_engine as le
        if le._pylibaio is None:
            print("NO-LIBAIO"); sys.exit(0)
        real = le._raw.io_submit
        calls = [0]
        def io_submit(*a):
            r = real(*a)
            calls[0] += 1
            if calls[0] == 1:
                os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C arriving while the syscall ran
            return r
        le._raw.io_submit = io_submit
        sd = {"w": torch.arange(1 << 22, dtype=torch.float32)}
        try:
            ucp.save(sd, sys.argv[1])
            print("NOT-INTERRUPTED"); sys.exit(0)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        le._raw.io_submit = real
        time.sleep(0.3)  # the interrupted request completes meanwhile
        try:
            ucp.save(sd, sys.argv[1])
            ok = torch.equal(ucp.load(sys.argv[1])["w"], sd["w"])
            print("second save ok" if ok else "second save wrong")
        except Exception as exc:
            print(f"second save failed: {type(exc).__name__}: {exc}")
    """)
    )
    dst = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), str(dst)], capture_output=True, text=True, timeout=TIMEOUT)
    if "NO-LIBAIO" in proc.stdout or "NOT-INTERRUPTED" in proc.stdout:
        pytest.skip("ucp.save does not write through libaio here")
    assert "interrupted" in proc.stdout, proc.stderr
    assert "Semaphore released too many times" not in proc.stderr
    assert "second save ok" in proc.stdout, proc.stdout + proc.stderr


# -- SIGTERM (what `timeout`, `kill`, Slurm and `docker stop` send) -------------------------------------


@pytest.mark.parametrize("command", ["reshape", "export", "convert"])
def test_sigterm_leaves_no_temp_dir(tmp_path: Path, sources: dict[str, Path], command: str) -> None:
    dst = tmp_path / "dst"
    if command == "reshape":
        args, at = ["reshape", str(sources["ckpt"]), str(dst), "--memory-budget", "1MiB"], "fill"
    elif command == "export":
        args, at = ["export", str(sources["ckpt"]), str(dst)], "tensor"
    else:
        args, at = ["convert", str(sources["hf"]), str(dst)], "piece"
    proc, log = run_runner(tmp_path, args, sig="SIGTERM", at=at, nth=2)
    assert calls(log, at) >= 2
    assert proc.returncode != 0
    assert not dst.exists()
    assert leftovers(dst) == [], "left behind by a terminated " + command


# -- temporary directories of a reshape in flight ----------------------------------------------------


def test_reshape_in_flight_into_manager_root_is_not_a_leftover(
    tmp_path: Path, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ucp.conversion.reshape as reshape_mod
    from ucp.manager import clean_leftovers, list_checkpoints

    root = tmp_path / "run"
    root.mkdir()
    seen: dict = {}
    orig = reshape_mod._fill

    def fill(*args, **kwargs):
        if not seen:  # what another process's CheckpointManager / `ucp ls` sees meanwhile
            seen["status"] = [i.status for i in list_checkpoints(root)]
            seen["removed"] = clean_leftovers(root)
        return orig(*args, **kwargs)

    monkeypatch.setattr(reshape_mod, "_fill", fill)
    report = reshape_mod.reshape(str(sources["ckpt"]), str(root / "step-00000007"))
    assert report.tensors == N_TENSORS
    assert seen == {"status": ["saving"], "removed": []}


# -- closed or broken output streams -------------------------------------------------------------------


def test_broken_stdout_pipe_no_traceback(tmp_path: Path, sources: dict[str, Path]) -> None:
    """`ucp ... | head -1` where head has gone: no traceback; a reshape's result is still committed."""
    dst = tmp_path / "dst"
    for args in (["inspect", str(sources["ckpt"]), "--json"], ["reshape", str(sources["ckpt"]), str(dst), "--json"]):
        r, w = os.pipe()
        os.close(r)
        try:
            proc = subprocess.run(ucp_cli(*args), stdout=w, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
        finally:
            os.close(w)
        assert "Traceback" not in proc.stderr, proc.stderr
    import ucp

    assert ucp.verify(str(dst)).ok
    assert leftovers(dst) == []


def test_progress_bar_silent_when_stderr_is_not_a_terminal(tmp_path: Path, sources: dict[str, Path]) -> None:
    dst = tmp_path / "dst"
    proc = subprocess.run(
        ucp_cli("reshape", str(sources["ckpt"]), str(dst)), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "reshaped" in proc.stdout


def test_cli_runs_with_stdout_closed(tmp_path: Path, sources: dict[str, Path]) -> None:
    dst = tmp_path / "dst"
    cmd = ["bash", "-c", 'exec "$0" "$@" >&-', *ucp_cli("reshape", str(sources["ckpt"]), str(dst))]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert (dst / "manifest.json").is_file()


def test_cli_exit_code_with_stderr_closed(tmp_path: Path, sources: dict[str, Path]) -> None:
    dst = tmp_path / "dst"
    cmd = ["bash", "-c", 'exec "$0" "$@" 2>&-', *ucp_cli("reshape", str(sources["ckpt"]), str(dst))]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=TIMEOUT)
    assert (dst / "manifest.json").is_file()
    assert proc.returncode == 0


# -- async saves at process exit -----------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["return", "sys.exit", "exit_now", "KeyboardInterrupt"])
def test_async_save_in_flight_is_committed_at_exit(tmp_path: Path, ending: str) -> None:
    dst = tmp_path / "ckpt"
    code = textwrap.dedent(f"""
        import sys, torch, ucp
        from ucp.shutdown import exit_now
        sd = {{f"t{{i}}": torch.full((1 << 20,), float(i)) for i in range(8)}}
        ucp.async_save(sd, {str(dst)!r}, step=3)
        ending = {ending!r}
        if ending == "sys.exit":
            sys.exit(0)
        if ending == "exit_now":
            exit_now(0)
        if ending == "KeyboardInterrupt":
            raise KeyboardInterrupt
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    # an uncaught KeyboardInterrupt ends Python by SIGINT (a shell shows 130)
    assert proc.returncode == (-signal.SIGINT if ending == "KeyboardInterrupt" else 0), proc.stderr
    import torch

    import ucp

    loaded = ucp.load(str(dst))
    assert all(torch.equal(loaded[f"t{i}"], torch.full((1 << 20,), float(i))) for i in range(8))
    assert ucp.read_manifest(str(dst)).step == 3
    assert leftovers(dst) == []


def test_async_save_abandoned_by_os_exit_is_never_a_partial_checkpoint(tmp_path: Path) -> None:
    """``os._exit`` skips every exit hook: the save is lost, but what is left is no checkpoint at all."""
    dst = tmp_path / "ckpt"
    code = textwrap.dedent(f"""
        import os, torch, ucp
        ucp.async_save({{"w": torch.ones(1 << 22)}}, {str(dst)!r})
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    import ucp

    if dst.exists():  # the writer was fast enough to commit before the exit
        assert ucp.verify(str(dst)).ok
    else:
        with pytest.raises(ucp.CheckpointError):
            ucp.load(str(dst))
