"""The public face of the I/O core: whole files and byte ranges, at device speed.

``AioHandle`` owns one engine and a pool of aligned staging blocks. It turns
arbitrary requests (any length, any offset, any buffer address) into the
aligned block requests O_DIRECT needs:

* writes stream through staging blocks of ``block_size``; the unaligned tail is
  written padded and the file truncated to its true size;
* reads go straight into the caller's buffer where address, offset and length
  allow, else through staging blocks, ``queue_depth`` of them in flight.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import errno
import operator
import os
import sys
import threading
from concurrent.futures import CancelledError, Future, wait
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeAlias, TypeGuard, cast

from .buffers import AlignedBuffer, BufferPool, address_of, round_down, round_up
from .config import AioConfig
from .engines import Engine, create_engine
from .engines.base import HELD_WAIT, signals_held
from .errors import AioError
from .files import OpenFile, open_file, preallocate, sync_file, truncate
from .prefetch import is_warm
from .scatter import ReadRequest, plan_reads

if TYPE_CHECKING:  # numpy is imported where an array is handled: reading a checkpoint needs none (start-up)
    import numpy as np

Bytes: TypeAlias = "memoryview | bytes | bytearray | np.ndarray | AlignedBuffer"  # and contiguous CPU torch tensors
_SINGLE = (memoryview, bytes, bytearray, AlignedBuffer)  # and numpy arrays (_is_array)


def _is_array(obj: object) -> TypeGuard[np.ndarray]:
    """A numpy array; numpy is not imported to tell (no array exists before it is)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def as_bytes_view(data: Bytes) -> memoryview:
    """A flat byte view, without copying, of any contiguous buffer: numpy arrays, AlignedBuffers, CPU tensors."""
    if isinstance(data, AlignedBuffer):
        return data.view()
    if _is_tensor(data):
        data = _tensor_bytes(data)
    if _is_array(data):
        if not data.flags.c_contiguous:
            raise ValueError("array must be C-contiguous")
        view = data.reshape(-1).view("u1").data  # == memoryview(arr); numpy's stubs give ndarray
    else:  # no Buffer protocol before Python 3.12; not an array here (_is_array narrows one way only)
        view = memoryview(cast(Any, data))
    if not view.c_contiguous:  # a strided view (even 1-D bytes) has no flat byte image to hand the kernel
        raise ValueError("buffer must be C-contiguous")
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def _tensor_bytes(t: Any) -> Any:  # a numpy array
    """The bytes of a contiguous CPU torch tensor (torch is imported only when one is passed)."""
    import torch

    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"tensor must be contiguous and on the CPU (got {t.device}, contiguous={t.is_contiguous()})")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _copy(dst: memoryview, src: memoryview) -> None:
    """memcpy that releases the GIL for large sizes: ``ctypes.memmove`` (a foreign call, made without the GIL)
    from a writable source, numpy's copy from a read-only one (ctypes takes no address of that; numpy's import
    costs a one-shot command ~0.1 s, so it is made only then)."""
    if src.nbytes < 65536:
        dst[:] = src
    elif dst.nbytes != src.nbytes or dst.readonly:
        raise ValueError(
            f"copying {src.nbytes} bytes into a {'read-only ' if dst.readonly else ''}{dst.nbytes}-byte buffer"
        )
    elif not src.readonly:
        ctypes.memmove(address_of(dst), address_of(src), src.nbytes)
    else:
        import numpy as np

        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class AioHandle:
    """Reads and writes files through one engine with bounded, reusable staging memory."""

    def __init__(self, config: AioConfig | None = None, *, engine: Engine | None = None) -> None:
        self.config = config or AioConfig()
        self.engine = engine or create_engine(self.config)
        self.pool = BufferPool(self.config.block_size, self.config.queue_depth + 2)
        self._closed = False

    @property
    def engine_name(self) -> str:
        return self.engine.name

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the engine (waiting for its requests); every later call raises ValueError."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()

    def _check_open(self, path: str | os.PathLike[str]) -> None:
        """Refuse before opening anything: a writer would truncate its target, then delete it on failing."""
        if self._closed:
            raise ValueError(f"I/O on a closed AioHandle ({os.fspath(path)!r})")

    def __enter__(self) -> "AioHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------
    def writer(
        self, path: str | os.PathLike[str], *, size_hint: int | None = None, fsync: bool | None = None
    ) -> "FileWriter":
        """A sequential writer to a new file at ``path`` (created or truncated)."""
        self._check_open(path)
        return FileWriter(self, path, size_hint=size_hint, fsync=self.config.fsync if fsync is None else fsync)

    def write_file(
        self, path: str | os.PathLike[str], data: Bytes | Iterable[Bytes], *, fsync: bool | None = None
    ) -> int:
        """Write ``data`` (one buffer or an iterable of buffers) as the whole content of ``path``."""
        self._check_open(path)
        parts: list[Any] = (
            [data] if isinstance(data, _SINGLE) or _is_array(data) or _is_tensor(data) else list(data)
        )  # Any: a tensor
        views = [as_bytes_view(p) for p in parts]
        with self.writer(path, size_hint=sum(v.nbytes for v in views), fsync=fsync) as w:
            for v in views:
                w.write(v)
        return w.size

    # -- reading ----------------------------------------------------------------------
    def read_file(self, path: str | os.PathLike[str], out: AlignedBuffer | None = None) -> AlignedBuffer:
        """Read all of ``path`` into an aligned buffer (``out`` when given and large enough)."""
        self._check_open(path)
        with open_file(path, "r", direct=self._read_direct(path)) as f:
            size = os.fstat(f.fd).st_size
            if out is None or out.capacity < size:
                out = AlignedBuffer(size)
            out.resize(size)
            self._read_all(f, [(0, out.view())])
        return out

    def read_into(self, path: str | os.PathLike[str], offset: int, dest: Bytes) -> int:
        """Read ``len(dest)`` bytes of ``path`` from ``offset``; an error if the file is shorter."""
        self._check_open(path)
        offset, view = _destination(path, offset, dest)
        with open_file(path, "r", direct=self._read_direct(path)) as f:
            self._read_all(f, [(offset, view)])
        return view.nbytes

    def read_ranges(self, path: str | os.PathLike[str], ranges: Iterable[tuple[int, Bytes]]) -> None:
        """Read several ``(offset, dest)`` ranges of one file, all in flight together.

        Every range is checked before any is submitted, so a bad one raises with nothing in flight.
        """
        self._check_open(path)
        checked = [_destination(path, offset, dest) for offset, dest in ranges]
        with open_file(path, "r", direct=self._read_direct(path)) as f:
            self._read_all(f, checked)

    def _read_direct(self, path: str | os.PathLike[str]) -> bool:
        """O_DIRECT for reads, except of files this process prefetched into the page cache (``aio.prefetch``)."""
        return self.config.use_direct and not is_warm(path)

    def _read_all(self, f: OpenFile, ranges: list[tuple[int, memoryview]]) -> None:
        """Read checked ``(offset, view)`` ranges of ``f``, all in flight together; raise the first error.

        The ranges become few large aligned requests (:mod:`aio.scatter`). Whatever ends the call early (a
        failed submit, a Ctrl-C), the requests already in flight are waited for before raising: they write
        into the caller's memory, which the caller may reuse or free once we return.
        """
        align = self.config.alignment if f.direct else 1
        requests = plan_reads(
            ranges, align=align, block_size=self.config.block_size, max_segments=self.engine.max_segments
        )
        futures: list[Future] = []
        try:
            for req in requests:
                self._submit_request(f, req, futures)
            _wait_all(futures)
        except BaseException:
            # Whatever was raised (a failed submit, a read error, a Ctrl-C landing anywhere in between, even
            # between two waits), nothing may still write into the caller's memory once we raise.
            _settle(futures)
            raise
        finally:  # an error raised from here must not keep the caller's buffers referenced by this frame
            futures, requests, ranges = [], [], []

    def _submit_request(self, f: OpenFile, req: ReadRequest, into: list[Future]) -> None:
        """Submit one planned read and append its future to ``into`` inside the guarded block, so a Ctrl-C landing
        after the submit finds the read either here (waited for) or in ``into`` (the caller waits for it); the
        future raises if the file ends before the wanted bytes. A request with staged segments holds a staging
        block until it completes and its bytes are copied out."""
        if not req.staged:
            inner: Future = Future()
            expected = _expect(inner, req.need, f, req.offset)
            try:
                self._submit_vector(f, req.offset, req.buffers(None), inner)
                into.append(expected)
            except BaseException as exc:  # e.g. a Ctrl-C: a read the engine took still writes into dest
                if not _never_taken(inner, exc):
                    _settle([expected])  # ... so wait for it, as the caller may reuse dest once we raise
                raise
            return
        block: AlignedBuffer | None = None
        result: Future = Future()
        inner = Future()

        def keep(taken: AlignedBuffer) -> None:  # Ctrl-C held off: taken, and given back when ``inner`` ends
            nonlocal block
            block = taken
            inner.add_done_callback(done)  # before the submit: however it ends, the block goes back once

        def done(fut: Future) -> None:
            assert block is not None
            got, error = _outcome(fut)
            error = error or _short(got, req.need, f, req.offset)
            try:
                if error is None:
                    for at, dest in req.copies:
                        _copy(dest, block.view(dest.nbytes, at))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                error = exc
            finally:
                self.pool.release(block)  # before the waiter wakes: a read returns with its blocks back
            _complete(result, got, error)

        try:
            _take(self.pool, keep)
            assert block is not None
            self._submit_vector(f, req.offset, req.buffers(block.view(req.staged)), inner)
            into.append(result)
        except BaseException as exc:  # e.g. a Ctrl-C: if the engine took the read, it copies into dest when done
            _never_taken(inner, exc)  # completes ``inner`` if the engine never took the read
            if block is not None:  # ``done`` completes ``result`` once ``inner`` is done, after copying into dest:
                _settle([result])  # wait for that even when ``inner`` is done already (its callbacks may still run)
            raise

    def _submit_vector(self, f: OpenFile, offset: int, buffers: list[memoryview], future: Future) -> None:
        if len(buffers) == 1:
            self.engine.submit_read(f, offset, buffers[0], future)
        else:
            self.engine.submit_readv(f, offset, buffers, future)


class FileWriter:
    """Streams bytes into a new file through aligned staging blocks, ``queue_depth`` in flight.

    A writer ends closed (the file complete) or aborted (the file deleted). A ``write`` that
    fails aborts it: its bytes may be partly on disk, so later bytes would land after a hole.
    Any ``write`` after the end, and a ``close`` after an abort, raise ValueError naming the file.
    """

    def __init__(self, handle: AioHandle, path: str | os.PathLike[str], *, size_hint: int | None, fsync: bool) -> None:
        self._h = handle
        self._cfg = handle.config
        self.path = os.fspath(path)
        self._fsync = fsync
        self._file = open_file(self.path, "w", direct=self._cfg.use_direct)
        # An open writer keeps one partly filled staging block between writes; widen the
        # pool by one for it, so that several writers open in one thread cannot starve it.
        handle.pool.reserve(1)
        self._reserved = True
        self._inflight: collections.deque[Future] = collections.deque()
        self._block: AlignedBuffer | None = None
        self._fill = 0  # bytes in the current staging block
        self._offset = 0  # file offset of the current staging block
        self.size = 0
        self._state = "open"  # then "closed" (complete) or "aborted" (deleted)
        self._error: BaseException | None = None  # what aborted it, when a write or close failed
        try:
            if size_hint:
                preallocate(self._file, round_up(size_hint, self._cfg.alignment))
        except BaseException:
            self.abort()
            raise

    @property
    def direct(self) -> bool:
        return self._file.direct

    def write(self, data: Bytes, *, borrow: bool = False) -> None:
        """Append ``data`` to the file.

        Bytes are copied into aligned staging blocks, except where the caller's memory
        lines up with the file: when ``address ≡ file position (mod alignment)`` the
        aligned middle of ``data`` is written straight from the caller's memory and only
        its unaligned head and tail are staged. Such writes read the caller's memory
        after they are submitted; by default ``write`` waits for them before returning.
        With ``borrow=True`` the caller promises the memory stays valid and unchanged
        until ``close()``, and ``write`` returns without waiting.

        ``data`` that is not a contiguous buffer is refused with the writer left as it was;
        any failure while writing aborts the writer (see the class docstring).
        """
        self._check_open("write to")
        view = as_bytes_view(data)
        try:
            self._write(view, borrow)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.size += view.nbytes

    def _write(self, view: memoryview, borrow: bool) -> None:
        """``write``'s work: stage or submit ``view`` from the current file position."""
        bs = self._cfg.block_size
        pos = 0
        borrowed: list[Future] = []  # requests that read the caller's memory
        while pos < view.nbytes:
            direct = self._direct_span(view, pos)
            if direct:
                head = direct[0]
                if head:
                    self._stage(view[pos : pos + head])
                    pos += head
                if self._fill:  # ends at an aligned file offset now: flush it as it is
                    self._flush_block(self._fill)
                for start in range(0, direct[1], bs):  # zero copy from the caller's memory
                    n = min(bs, direct[1] - start)
                    borrowed.append(self._submit(view[pos + start : pos + start + n], None))
                    self._offset += n
                pos += direct[1]
                continue
            pos += self._stage(view[pos : pos + bs - self._fill])
        if not borrow:
            _wait_all(borrowed)  # the caller may reuse its memory as soon as write() returns

    def _check_open(self, doing: str) -> None:
        """Refuse to go on once closed or aborted: the bytes would be dropped, or land after a hole."""
        if self._state == "open":
            return
        why = f" after an error ({self._error!r})" if self._error is not None else ""
        raise ValueError(f"{doing} {self.path!r}: the writer was {self._state}{why}")

    def _fail(self, exc: BaseException) -> None:
        """Abort after a failed write or close, remembering why for later calls' errors."""
        if self._error is None:
            self._error = exc
        self.abort()

    def _direct_span(self, view: memoryview, pos: int) -> tuple[int, int] | None:
        """(head bytes to stage, aligned bytes to write directly) from ``pos``, or None to stage all."""
        align = self._cfg.alignment
        remaining = view.nbytes - pos
        if remaining < _MIN_DIRECT + align or view.readonly:  # libaio submits writable buffers only
            return None
        file_pos = self._offset + self._fill
        addr = address_of(view[pos:])
        if (addr - file_pos) % align:
            return None
        head = -file_pos % align
        return head, round_down(remaining - head, align)

    def _stage(self, src: memoryview) -> int:
        """Copy as much of ``src`` as fits into the current staging block; flush it when full."""
        if self._block is None:
            _take(self._h.pool, self._keep_block)
        n = min(self._cfg.block_size - self._fill, src.nbytes)
        assert self._block is not None  # _keep_block set it
        _copy(self._block.view(n, self._fill), src[:n])
        self._fill += n
        if self._fill == self._cfg.block_size:
            self._flush_block(self._fill)
        return n

    def _keep_block(self, block: AlignedBuffer) -> None:
        self._block = block  # abort() gives it back from here

    def _flush_block(self, length: int) -> None:
        block, self._block = self._block, None
        assert block is not None
        self._submit(block.view(length), block)
        self._offset += self._fill
        self._fill = 0

    def _submit(self, view: memoryview, block: AlignedBuffer | None) -> Future:
        """Submit one write; the future waited for completes only once ``block`` (if any) is back in the pool."""
        fut: Future = Future()  # the engine's
        waited = fut if block is None else _after_release(fut, self._h.pool, block)
        try:
            while len(self._inflight) >= self._cfg.queue_depth:
                self._inflight[0].result()  # off the list only once done: abort() must still wait for it
                self._inflight.popleft()
            self._h.engine.submit_write(self._file, self._offset, view, fut)
        except BaseException as exc:
            if not _never_taken(fut, exc):
                self._inflight.append(waited)  # the kernel has it: abort() waits for it before the file goes
            raise
        self._inflight.append(waited)
        return waited

    def close(self) -> int:
        """Write the tail, wait for every request, trim padding, fsync. Returns the file size.

        Closing again returns the size again; closing an aborted writer raises ValueError.
        """
        if self._state == "closed":
            return self.size
        self._check_open("close")
        try:
            if self._fill:
                tail = self._fill
                padded = round_up(tail, self._cfg.alignment) if self.direct else tail
                assert self._block is not None
                self._block.view(padded - tail, tail)[:] = bytes(padded - tail)
                self._flush_block(padded)
            _wait_all(self._inflight)
            self._inflight.clear()
            if os.fstat(self._file.fd).st_size != self.size:
                truncate(self._file, self.size)
            if self._fsync:
                sync_file(self._file)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._file.close()
        self._state = "closed"
        self._unreserve()
        return self.size

    def abort(self) -> None:
        """Stop, wait for in-flight requests, close and delete the partial file (no-op once ended)."""
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            _settle(self._inflight)  # a Ctrl-C meanwhile is raised once everything below is done
        finally:
            self._inflight.clear()
            if self._block is not None:
                self._h.pool.release(self._block)
                self._block = None
            self._unreserve()
            self._file.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _unreserve(self) -> None:
        if self._reserved:
            self._reserved = False
            self._h.pool.reserve(-1)

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None and self._state != "aborted":  # an abort() inside the block stands
            self.close()
        else:
            self.abort()


_MIN_DIRECT = 256 * 1024  # below this, staging costs less than an extra request


def _take(pool: BufferPool, keep: Callable[[AlignedBuffer], None]) -> None:
    """Take a staging block from ``pool`` and hand it to ``keep`` with no Ctrl-C in between.

    A KeyboardInterrupt landing after the take but before the caller put the block where its release
    will find it would lose the block, and the bounded pool with it: enough lost blocks and every later
    take waits forever. The wait runs in short held slices, so a Ctrl-C still ends it (nothing taken);
    one noted during the last slice is raised once ``keep`` has run.
    """
    while True:
        with signals_held():
            try:
                block = pool.acquire(timeout=HELD_WAIT)
            except TimeoutError:
                continue
            keep(block)
            return


def _never_taken(fut: Future, exc: BaseException) -> bool:
    """After a submit raised: whether the request is out of the engine's hands. A pending ``fut``
    was never taken: it is completed with ``exc`` here (its callbacks give the buffer back). A
    running one is the engine's, which completes it (False); a done one was completed already."""
    if fut.running():
        return False
    if not fut.done():
        fut.set_exception(exc)
    return True


def _expect(fut: Future, nbytes: int, f: OpenFile, offset: int) -> Future:
    """Wrap a read future so that a short read (file too small) raises, naming file and offset."""
    out: Future = Future()

    def done(inner: Future) -> None:
        got, error = _outcome(inner)
        _complete(out, got, error or _short(got, nbytes, f, offset))

    fut.add_done_callback(done)
    return out


def _after_release(fut: Future, pool: BufferPool, block: AlignedBuffer) -> Future:
    """A future with ``fut``'s outcome, completed after ``block`` went back to ``pool``: whoever waits
    for it finds the block back (set before the submit, so however ``fut`` ends the block goes back once)."""
    out: Future = Future()

    def done(inner: Future) -> None:
        pool.release(block)
        _complete(out, *_outcome(inner))

    fut.add_done_callback(done)
    return out


def _outcome(fut: Future) -> tuple[int, BaseException | None]:
    """(bytes moved, the error) of a finished request.

    Nothing is raised in the done-callbacks that use it: an exception raised there would keep, through
    its traceback, the frames that reference the caller's buffers alive until the cyclic collector runs
    (an arena the caller wants to reuse, or free, would still look in use).
    """
    if fut.cancelled():
        return 0, CancelledError()
    error = fut.exception()
    return (0, error) if error is not None else (fut.result(), None)


def _short(got: int, need: int, f: OpenFile, offset: int) -> AioError | None:
    """The error of a read from ``offset`` that got fewer than the ``need`` bytes it wanted (the file ends first)."""
    return AioError(errno.ENODATA, f.path, offset + got, f"file ends before {offset + need}") if got < need else None


def _complete(fut: Future, got: int, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(got)
    else:
        fut.set_exception(error)


def _destination(path: str | os.PathLike[str], offset: int, dest: Bytes) -> tuple[int, memoryview]:
    """Check one read request up front, naming the file and offset: the kernel's EINVAL would not."""
    offset = operator.index(offset)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset} (reading {os.fspath(path)!r})")
    try:
        view = as_bytes_view(dest)
    except ValueError as exc:
        raise ValueError(f"destination for {os.fspath(path)!r} at offset {offset}: {exc}") from None
    if view.readonly:
        raise ValueError(f"destination for {os.fspath(path)!r} at offset {offset} is read-only")
    return offset, view


def _wait_done(fut: Future) -> BaseException | None:
    """Block until ``fut`` is done, through a Ctrl-C (the device may still use the memory it names);
    the interrupt that came meanwhile, if any, for the caller to raise once it is safe."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait([fut])
            return interrupted
        except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt while waiting: wait on
            interrupted = interrupted or exc


def _settle(futures: Iterable[Future]) -> None:
    """Wait for all futures, ignoring their errors (for callers that give up: raise another, or abort);
    a Ctrl-C that came while waiting is raised once all are done."""
    interrupted: BaseException | None = None
    for fut in list(futures):
        interrupted = _wait_done(fut) or interrupted
    if interrupted is not None:
        raise interrupted


def _wait_all(futures: Iterable[Future]) -> None:
    """Wait for all futures; raise the first error (or a Ctrl-C that came meanwhile) after all have settled."""
    first: BaseException | None = None
    fut: Future | None = None
    for fut in list(futures):
        first = _wait_done(fut) or first
        if first is None and not fut.cancelled() and fut.exception() is not None:
            first = fut.exception()
        elif first is None and fut.cancelled():
            first = CancelledError()
    del fut, futures  # not referenced from the traceback of the error raised below
    if first is not None:
        try:
            raise first
        finally:
            first = None


_shared: dict[tuple[int, AioConfig], AioHandle] = {}
_shared_lock = threading.Lock()


def shared_handle(config: AioConfig | None = None) -> AioHandle:
    """One long-lived handle per configuration and process.

    Starting an engine and faulting in its staging pool costs ~0.3 s; a checkpoint
    library that saves every few minutes should pay it once, not per save. Keyed by
    process id too, so a forked child never inherits its parent's engine threads.
    Closed at interpreter exit.
    """
    key = (os.getpid(), config or AioConfig())
    with _shared_lock:
        handle = _shared.get(key)
        if handle is None or handle.closed:  # someone closed it: start a new one rather than fail
            if not _shared:
                atexit.register(_close_shared)
            handle = _shared[key] = AioHandle(key[1])
        return handle


def _close_shared() -> None:
    with _shared_lock:
        handles = [h for (pid, _), h in _shared.items() if pid == os.getpid()]
        _shared.clear()
    for h in handles:
        h.close()
