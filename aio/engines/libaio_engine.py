"""Linux kernel AIO (io_submit / io_getevents) through PyPI ``libaio``.

One kernel AIO context per engine. Callers submit from any thread; a reaper
thread waits in ``io_getevents`` (a ctypes call, so the GIL is released) and
completes the futures. Short transfers are resubmitted for the remainder; a
read that returns 0 has reached the end of the file.

A closed engine refuses new requests: its context id is destroyed, and the kernel hands the same
id to the next ``io_setup``, so a late submit would land in another engine's context.
"""

from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import Future
from ctypes import addressof, byref, pointer
from dataclasses import dataclass, field
from typing import Sequence

from aio.errors import AioError
from aio.files import OpenFile

from .base import HELD_WAIT, IOV_MAX, Engine, rest_of, signals_held

log = logging.getLogger(__name__)

try:  # the import loads libaio.so.1 (Debian's libaio1 / libaio1t64)
    import libaio as _pylibaio
    from libaio import libaio as _raw

    LIBAIO_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the machine
    _pylibaio = None
    _raw = None
    LIBAIO_ERROR = f"{type(exc).__name__}: {exc}"


@dataclass
class _Request:
    f: OpenFile
    offset: int
    buffers: list[memoryview]  # filled (or written) in order from ``offset``: one iovec each
    write: bool
    future: "Future[int]"
    done: int = 0
    block: object = field(default=None, repr=False)
    in_kernel: bool = False  # io_submit accepted it: only its completion may give its slot back
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = sum(b.nbytes for b in self.buffers)


class LibaioEngine(Engine):
    name = "libaio"
    max_segments = IOV_MAX

    def __init__(self, queue_depth: int = 32, *, single_submit: bool = False) -> None:
        if _pylibaio is None:
            raise RuntimeError(f"libaio is unavailable: {LIBAIO_ERROR}")
        self.queue_depth = queue_depth
        self.single_submit = single_submit
        self._max_events = max(queue_depth * 4, 64)
        self._ctx = _raw.io_context_t()
        _raw.io_setup(self._max_events, byref(self._ctx))
        self._slots = threading.BoundedSemaphore(queue_depth)  # requests in flight, as configured
        self._inflight: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._reaper_done = False  # the reaper has stopped (set by it, under the lock)
        self._completing = False  # the reaper is completing requests it took off _inflight (under the lock)
        self._reaper_destroys = False  # close() left the context to the reaper (see close)
        self._broken: OSError | None = None
        self._reaper = threading.Thread(target=self._reap, name="ucp-libaio-reaper", daemon=True)
        self._reaper.start()

    # -- submission ---------------------------------------------------------------
    def submit_read(
        self, f: OpenFile, offset: int, buf: memoryview, future: "Future[int] | None" = None
    ) -> "Future[int]":
        return self._start(_Request(f, offset, [buf], False, future or Future()))

    def submit_readv(
        self, f: OpenFile, offset: int, buffers: Sequence[memoryview], future: "Future[int] | None" = None
    ) -> "Future[int]":
        return self._start(_Request(f, offset, list(buffers), False, future or Future()))

    def submit_write(
        self, f: OpenFile, offset: int, buf: memoryview, future: "Future[int] | None" = None
    ) -> "Future[int]":
        return self._start(_Request(f, offset, [buf], True, future or Future()))

    def _start(self, req: _Request) -> "Future[int]":
        self._check_usable(req)
        if req.nbytes == 0:
            req.future.set_result(0)
            return req.future
        while True:  # each wait for a slot is a short held slice: a Ctrl-C ends the wait, never leaks a slot
            with signals_held():  # taken, then owned by the request (or given back), with no Ctrl-C between
                if not self._slots.acquire(timeout=HELD_WAIT):
                    continue
                try:
                    self._submit(req, new=True)
                except BaseException:
                    if not req.in_kernel:  # a Ctrl-C after io_submit took it: the reaper releases the slot
                        self._slots.release()
                    raise
                return req.future

    def _submit(self, req: _Request, *, new: bool = False) -> None:
        """(Re)submit what is left of ``req``; holds one slot.

        A ``new`` request is checked and registered under the lock that ``close`` and ``_fail_all``
        take: either they see it in flight (the reaper completes or fails it before the context
        is destroyed) or it sees the engine closed or broken and is refused.
        """
        mode = _pylibaio.AIOBLOCK_MODE_WRITE if req.write else _pylibaio.AIOBLOCK_MODE_READ
        block = _pylibaio.AIOBlock(
            mode, target_file=req.f.fd, buffer_list=rest_of(req.buffers, req.done), offset=req.offset + req.done
        )
        req.block = block
        key = addressof(block._iocb)  # noqa: SLF001 - the iocb is what the kernel hands back
        iocbs = (_raw.iocb_p * 1)(pointer(block._iocb))  # noqa: SLF001
        with signals_held():  # a Ctrl-C must not fall between "registered" and "submitted"
            with self._lock:
                if new:
                    self._check_usable(req)
                    # Running before io_submit: the kernel may complete it before io_submit returns.
                    req.future.set_running_or_notify_cancel()
                self._inflight[key] = req
            while True:
                try:
                    _raw.io_submit(self._ctx, 1, iocbs)
                    req.in_kernel = True
                    return
                except OSError as exc:
                    if exc.errno == errno.EAGAIN:
                        continue
                    with self._lock:
                        ours = self._inflight.pop(key, None) is not None
                    err = AioError(exc.errno or errno.EIO, req.f.path, req.offset + req.done, "io_submit")
                    if not ours:  # _fail_all took it meanwhile: it released the slot and failed the future
                        req.in_kernel = True  # (so that _start does not release the slot again)
                    elif new:  # running already: complete it, so that nobody waits for it
                        req.future.set_exception(err)
                    raise err from exc

    def _check_usable(self, req: _Request) -> None:
        """Refuse a new request to a closed or broken engine, naming its file and offset."""
        if self._closing:
            raise ValueError(
                f"I/O on a closed LibaioEngine ({'writing' if req.write else 'reading'} "
                f"{req.f.path!r} at offset {req.offset})"
            )
        if self._broken is not None:
            raise AioError(self._broken.errno or errno.EIO, req.f.path, req.offset, "libaio context failed earlier")

    # -- completion -----------------------------------------------------------------
    def _reap(self) -> None:
        """The reaper thread: complete requests until closed; if it dies, fail what is in flight."""
        try:
            self._reap_events()
        except BaseException as exc:  # noqa: BLE001 - nobody else would ever complete the waiting futures
            log.error("libaio reaper failed; failing all in-flight requests", exc_info=True)
            self._fail_all(exc, "libaio reaper failed")
        finally:
            with self._lock:
                self._reaper_done = True
                destroy = self._reaper_destroys
            if destroy:  # close() returned at once: the context is ours to destroy, after our last io_getevents
                _raw.io_destroy(self._ctx)

    def _reap_events(self) -> None:
        events = (_raw.io_event * self._max_events)()
        timeout = _raw.timespec(0, 50_000_000)
        while True:
            with self._lock:
                idle = not self._inflight
            if idle and self._closing:
                return
            try:
                n = _raw.io_getevents(self._ctx, 1, self._max_events, events, byref(timeout))
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self._fail_all(exc, "io_getevents")
                return
            if n > 0:
                with self._lock:  # close() must wait for these: they are off _inflight but not yet done
                    self._completing = True
            try:
                for i in range(n):
                    ev = events[i]
                    key = addressof(ev.obj.contents)
                    with self._lock:
                        req = self._inflight.pop(key, None)
                    if req is None:  # not ours (a request submitted into a reused context id): skip it
                        log.warning("libaio: ignoring a completion for an unknown request (iocb at %#x)", key)
                        continue
                    try:
                        self._complete(req, int(ev.res))
                    except BaseException as exc:  # popped already: _fail_all would not see it
                        with self._lock:  # broken first: a caller woken below must not submit to a dead reaper
                            self._broken = self._broken or OSError(errno.EIO, f"libaio reaper failed: {exc}")
                        if not req.future.done():
                            req.future.set_exception(exc)
                        raise
            finally:
                with self._lock:
                    self._completing = False
            req = None  # don't pin the last request's buffer while idle

    def _complete(self, req: _Request, res: int) -> None:
        where = req.offset + req.done
        if res < 0:
            self._finish(req, AioError(-res, req.f.path, where, "write" if req.write else "read"))
            return
        req.done += res
        if req.done < req.nbytes:
            if res == 0:
                if req.write:
                    self._finish(req, AioError(errno.EIO, req.f.path, where, "write made no progress"))
                else:
                    self._finish(req, None)  # end of file
                return
            try:
                self._submit(req)  # keeps its slot
            except BaseException as exc:
                self._finish(req, exc)
            return
        self._finish(req, None)

    def _finish(self, req: _Request, exc: BaseException | None) -> None:
        req.block = None
        self._slots.release()
        if exc is None:
            req.future.set_result(req.done)
        else:
            req.future.set_exception(exc)

    def _fail_all(self, exc: BaseException, what: str) -> None:
        """The context is unusable: fail every in-flight request and refuse new ones."""
        err = getattr(exc, "errno", None) or errno.EIO
        with self._lock:
            self._broken = exc if isinstance(exc, OSError) else OSError(err, str(exc))
            pending, self._inflight = list(self._inflight.values()), {}
        for req in pending:
            if not req.future.done():
                self._finish(req, AioError(err, req.f.path, req.offset + req.done, f"{what}: {exc}"))

    def close(self) -> None:
        """Refuse new requests, wait for those in flight, destroy the kernel context.

        With nothing in flight it returns at once: the reaper, which may sit in ``io_getevents`` for up
        to its 50 ms poll, destroys the context itself when it wakes (a one-shot command's exit would
        otherwise wait for that poll; the context cannot outlive the reaper's last call to it).
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._reaper_destroys = not self._inflight and not self._completing and not self._reaper_done
        if self._reaper_destroys:
            return
        self._reaper.join()
        _raw.io_destroy(self._ctx)
