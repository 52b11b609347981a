"""A fault-injecting HTTP/1.1 proxy for tests: sits between a client and a loopback server and, per
request, forwards it, answers 503 SlowDown, drops the connection, or forwards it slowly.

It understands just enough HTTP for an S3 client and server: a request or response is a head
ending in a blank line and a body of ``Content-Length`` bytes (or chunked, for requests). Faults
are chosen by :attr:`FaultProxy.plan` (a function of the request's method, target and sequence
number returning ``None`` to forward, ``"503"``, ``"drop"``, ``"drop-mid"`` (half the body read,
then the connection closed) or ``"slow"``), so a test says exactly which requests fail.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

Plan = Callable[[str, str, int], "str | None"]

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def _read_until(sock: socket.socket, buf: bytearray, sep: bytes) -> bytes | None:
    """The bytes before the next ``sep`` (consumed from ``buf``, topped up from ``sock``); None at EOF."""
    while sep not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(sep)
    buf[:] = rest
    return head


def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    return _read_until(sock, buf, b"\r\n\r\n")


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        out[k.strip().lower()] = v.strip()
    return out


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes | None:
    while len(buf) < n:
        data = sock.recv(max(65536, n - len(buf)))
        if not data:
            return None
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_chunked(sock: socket.socket, buf: bytearray) -> bytes | None:
    out = bytearray()
    while True:
        line = _read_until(sock, buf, b"\r\n")
        if line is None:
            return None
        size = int(line.split(b";")[0], 16)
        chunk = _read_exact(sock, buf, size + 2)
        if chunk is None:
            return None
        out += chunk[:size]
        if size == 0:
            return bytes(out)


class FaultProxy:
    """``FaultProxy(upstream_port).start()``; point the client at :attr:`url`. Bounded: it serves only
    loopback and stops with :meth:`stop`."""

    def __init__(self, upstream_port: int, plan: Plan | None = None, slow_seconds: float = 0.3) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.plan: Plan = plan or (lambda method, target, n: None)
        self.slow_seconds = slow_seconds
        self.count = 0
        self.faults: list[tuple[str, str, str]] = []  # (fault, method, target)
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = False

    def start(self) -> "FaultProxy":
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()
        return self

    def stop(self) -> None:
        self._stop = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        buf = bytearray()
        upstream: socket.socket | None = None
        up_buf = bytearray()
        try:
            while not self._stop:
                head = _read_head(client, buf)
                if head is None:
                    return
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, target = request_line.split(" ")[:2]
                hdrs = _headers(head)
                with self._lock:
                    n = self.count
                    self.count += 1
                fault = self.plan(method, target, n)
                if fault is not None:
                    with self._lock:
                        self.faults.append((fault, method, target))
                if hdrs.get("transfer-encoding", "").lower() == "chunked":
                    body = _read_chunked(client, buf)
                    if body is None:
                        return
                    head = b"\r\n".join(
                        line for line in head.split(b"\r\n") if not line.lower().startswith(b"transfer-encoding")
                    )
                    head += b"\r\ncontent-length: " + str(len(body)).encode()
                else:
                    length = int(hdrs.get("content-length", "0") or 0)
                    if fault == "drop-mid" and length > 1:
                        _read_exact(client, buf, length // 2)
                        return
                    body = _read_exact(client, buf, length) if length else b""
                    if body is None:
                        return
                if fault in ("drop", "drop-mid"):
                    return
                if fault == "503":
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                        + str(len(SLOW_DOWN)).encode()
                        + b"\r\n\r\n"
                        + SLOW_DOWN
                    )
                    continue
                if fault == "slow":
                    time.sleep(self.slow_seconds)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    up_buf = bytearray()
                upstream.sendall(head + b"\r\n\r\n" + body)
                resp_head = _read_head(upstream, up_buf)
                if resp_head is None:
                    return
                rh = _headers(resp_head)
                status = int(resp_head.split(b" ", 2)[1])
                if method == "HEAD" or status in (204, 304):
                    resp_body = b""
                elif "content-length" in rh:
                    resp_body = _read_exact(upstream, up_buf, int(rh["content-length"])) or b""
                elif rh.get("transfer-encoding", "").lower() == "chunked":
                    resp_body = _read_chunked(upstream, up_buf) or b""
                    resp_head = b"\r\n".join(
                        line for line in resp_head.split(b"\r\n") if not line.lower().startswith(b"transfer-encoding")
                    )
                    resp_head += b"\r\ncontent-length: " + str(len(resp_body)).encode()
                else:
                    resp_body = b""
                client.sendall(resp_head + b"\r\n\r\n" + resp_body)
        except OSError:
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()
