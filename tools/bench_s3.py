"""Save and load a state on an S3 endpoint: UCP vs torch.distributed.checkpoint, beside the server's ceiling.

    flock /tmp/bench.lock .venv/bin/python tools/bench_s3.py              # 1 GiB, one round
    .venv/bin/python tools/bench_s3.py --gib 0.125                         # a quick smoke run

One run against one loopback S3 server (moto's, ``tools/s3_server.py``; every client reaches it
through ``AWS_ENDPOINT_URL`` and the AWS credential variables, as it would reach AWS S3 or MinIO):

* **ceiling**: the server's own limit for these bytes, with obstore (the client that measured
  fastest here: docs/object-stores.md), two ways: the same number of bytes as one object written
  as a parallel multipart upload (``--part-size``, ``--concurrency``) and read back by parallel
  ranged GETs (``--read-size``) into one preallocated buffer (the ceiling the ratios are to: what a
  client moving these bytes in parallel gets); and, for comparison, as one PUT and one GET (moto
  copies a whole object per request and serializes the requests on one object, so there a single
  request is fastest, unlike on S3, where one connection is the bottleneck);
* **ucp**: ``ucp.save(state, "s3://...")`` and ``ucp.load(url, into=state_like)``;
* **dcp-s3fs**: ``torch.distributed.checkpoint.save`` / ``load`` with its ``FsspecWriter`` /
  ``FsspecReader`` on s3fs (``--dcp-threads`` writer threads);
* **dcp-s3torchconnector**: the DCP writer/reader of ``s3torchconnector``, pointed at the endpoint
  (its writer takes no endpoint, so its file system's client is replaced by one made with
  ``endpoint=``); when it cannot run, the table says why.

The state is ``--tensors`` fp32 tensors totalling ``--gib`` GiB. Every load is checked bit-exact
against the saved state (outside the timing); objects are deleted between methods so the server
holds one copy at a time. Prints a markdown table (GB/s = 10^9 bytes/s) labelled with the date,
commit, CPU and command.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.s3_server import REGION, S3Server, start_server  # noqa: E402

Result = dict[str, Any]


def make_state(gib: float, tensors: int) -> dict[str, Any]:
    import torch

    n = int(gib * (1 << 30)) // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:03d}": torch.randn(n, generator=g) for i in range(tensors)}


def like(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.empty_like(v) for k, v in state.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def clear(server: S3Server, bucket: str) -> None:
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def ceiling(bucket: str, nbytes: int, part: int, concurrency: int, read: int) -> Result:
    """Raw parallel multipart PUT (``part`` bytes a part) and ranged GETs (``read`` bytes each) of
    ``nbytes`` as one object, with obstore: async GETs gathered on one loop, as ucp's reads run."""
    import numpy as np
    import obstore

    from ucp.store.s3 import S3Options, make_store

    store = make_store(bucket, S3Options(part_size=part, concurrency=concurrency))
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    view = data.data
    chunks = [view[i : i + part] for i in range(0, nbytes, part)]
    put_s, _ = timed(lambda: obstore.put(store, "ceiling", iter(chunks), chunk_size=part, max_concurrency=concurrency))
    out = np.empty(nbytes, dtype=np.uint8)
    dest = out.data

    async def get(i: int, limit: asyncio.Semaphore) -> None:
        async with limit:
            got = await obstore.get_range_async(store, "ceiling", start=i, length=min(read, nbytes - i))
        dest[i : i + len(got)] = memoryview(got)

    async def get_all() -> None:
        limit = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(get(i, limit) for i in range(0, nbytes, read)))

    get_s, _ = timed(lambda: asyncio.run(get_all()))
    return {"save_s": put_s, "load_s": get_s, "ok": bool((out == data).all())}


def ceiling_single(bucket: str, nbytes: int) -> Result:
    """Raw single-request PUT and GET of ``nbytes`` as one object (moto copies a whole object per request
    and serializes requests on one object, so there this can beat the parallel variant)."""
    import numpy as np
    import obstore

    from ucp.store.s3 import S3Options, make_store

    store = make_store(bucket, S3Options())
    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    put_s, _ = timed(lambda: obstore.put(store, "ceiling1", data.data, use_multipart=False))
    get_s, got = timed(lambda: obstore.get(store, "ceiling1").bytes())
    return {"save_s": put_s, "load_s": get_s, "ok": bytes(memoryview(got)) == data.tobytes()}


def ucp_method(bucket: str, state: dict[str, Any], part: int, concurrency: int, read: int) -> Result:
    import ucp

    opts = {"part_size": part, "concurrency": concurrency, "read_size": read}
    url = f"s3://{bucket}/ucp/ck"
    save_s, _ = timed(lambda: ucp.save(state, url, storage_options=opts))
    target = like(state)
    load_s, _ = timed(lambda: ucp.load(url, into=target, storage_options=opts))
    return {"save_s": save_s, "load_s": load_s, "ok": same(state, target)}


def dcp_s3fs(bucket: str, state: dict[str, Any], threads: int) -> Result:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url = f"s3://{bucket}/dcp/ck"
    writer = FsspecWriter(url, thread_count=threads, sync_files=False)
    save_s, _ = timed(lambda: dcp.save(state, storage_writer=writer))
    target = like(state)
    load_s, _ = timed(lambda: dcp.load(target, storage_reader=FsspecReader(url)))
    return {"save_s": save_s, "load_s": load_s, "ok": same(state, target)}


def dcp_s3torchconnector(bucket: str, state: dict[str, Any], endpoint: str, threads: int) -> Result:
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    url = f"s3://{bucket}/s3tc/ck"
    config = S3ClientConfig(force_path_style=True)

    def fs() -> Any:
        return S3FileSystem(REGION, s3_client=S3Client(REGION, endpoint=endpoint, s3client_config=config))

    writer = S3StorageWriter(REGION, url, s3client_config=config, thread_count=threads)
    writer.fs = fs()  # its constructor takes no endpoint
    save_s, _ = timed(lambda: dcp.save(state, storage_writer=writer))
    reader = S3StorageReader(REGION, url, s3client_config=config)
    reader.fs = fs()
    target = like(state)
    load_s, _ = timed(lambda: dcp.load(target, storage_reader=reader))
    return {"save_s": save_s, "load_s": load_s, "ok": same(state, target)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--part-size", type=int, default=16 << 20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--read-size",
        type=int,
        default=128 << 20,
        help="bytes per ranged GET for ucp and the ceiling (moto reads a whole object per ranged GET: fewer is faster)",
    )
    ap.add_argument(
        "--dcp-threads",
        type=int,
        action="append",
        default=None,
        help="DCP writer threads (repeatable; default 1, its own default, and 8). Each thread writes a file of its own",
    )
    ap.add_argument("--skip", action="append", default=[], help="a method not to run (repeatable)")
    args = ap.parse_args()
    args.dcp_threads = args.dcp_threads or [1, 8]

    server = start_server()
    os.environ.update(server.env())
    bucket = server.make_bucket("bench")
    state = make_state(args.gib, args.tensors)
    nbytes = sum(v.numel() * 4 for v in state.values())
    methods: list[tuple[str, Callable[[], Result]]] = [
        (
            "ceiling: raw parallel multipart PUT / ranged GETs",
            lambda: ceiling(bucket, nbytes, args.part_size, args.concurrency, args.read_size),
        ),
        ("ceiling: raw single PUT / GET", lambda: ceiling_single(bucket, nbytes)),
        ("ucp", lambda: ucp_method(bucket, state, args.part_size, args.concurrency, args.read_size)),
    ]
    for t in args.dcp_threads:
        methods.append((f"dcp-s3fs, {t} thread(s)", lambda t=t: dcp_s3fs(bucket, state, t)))  # type: ignore[misc]
    for t in args.dcp_threads:
        methods.append(
            (f"dcp-s3torchconnector, {t} thread(s)", lambda t=t: dcp_s3torchconnector(bucket, state, server.url, t))  # type: ignore[misc]
        )
    from ucp.bench.report import cpu_model, source_commit

    print(
        f"{datetime.now(timezone.utc):%Y-%m-%d}, commit {source_commit() or '?'}, {cpu_model()}, "
        f"load at start {os.getloadavg()[0]:.1f}: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}` "
        f"({nbytes / 2**30:.2f} GiB in {args.tensors} fp32 tensors, part {args.part_size >> 20} MiB, "
        f"read {args.read_size >> 20} MiB, concurrency {args.concurrency}; the ceiling is the parallel one, "
        f"DCP-s3fs its first row)\n",
        flush=True,
    )
    print(
        "| method | save GB/s | load GB/s | save vs ceiling | load vs ceiling | save vs DCP-s3fs | load vs DCP-s3fs "
        "| bit-exact |\n|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    results: dict[str, Result] = {}
    ceiling_name, dcp_name = methods[0][0], f"dcp-s3fs, {args.dcp_threads[0]} thread(s)"
    for name, fn in methods:  # each row printed as soon as it is measured: a peer that crashes loses only itself
        if any(s in name for s in args.skip):
            continue
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            traceback.print_exc(limit=3)
            results[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"}
        clear(server, bucket)
        print(f"# {name}: {results[name]}", file=sys.stderr, flush=True)
        print(row(name, results[name], results.get(ceiling_name, {}), results.get(dcp_name, {}), nbytes), flush=True)
    server.stop()
    print(f"\nload at end {os.getloadavg()[0]:.1f}")


def row(name: str, r: Result, ceil: Result, dcp: Result, nbytes: int) -> str:
    """One markdown row: GB/s each way and the ratios to the ceiling and to DCP on s3fs."""
    if "error" in r:
        return f"| {name} | — | — | — | — | — | — | could not run: {r['error']} |"
    save, load = nbytes / r["save_s"] / 1e9, nbytes / r["load_s"] / 1e9

    def ratio(ref: Result, key: str) -> str:
        return f"{ref[key] / r[key]:.2f}x" if ref and "error" not in ref else "—"

    return (
        f"| {name} | {save:.3f} | {load:.3f} | {ratio(ceil, 'save_s')} | {ratio(ceil, 'load_s')} | "
        f"{ratio(dcp, 'save_s')} | {ratio(dcp, 'load_s')} | {'yes' if r['ok'] else 'NO'} |"
    )


if __name__ == "__main__":
    main()
