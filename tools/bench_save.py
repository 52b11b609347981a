#!/usr/bin/env python
"""Run the checkpoint bench (the library behind ``ucp bench save``) and print it for docs/benchmarks.md.

    .venv/bin/python tools/bench_save.py --size-gib 2 --rounds 3 --markdown

``--markdown`` prints a markdown table, the notes and the exact command line;
``--json`` prints the full result; otherwise the rich tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from aio import AioConfig
from aio.tune import config_from_json
from ucp.bench.io import BenchError
from ucp.bench.save import METHOD_CHOICES, BenchSaveOptions, print_table, run_bench_save, to_markdown


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", default="1,2", help="comma list of world sizes")
    p.add_argument("--dir", type=Path, default=None, help="default: a temp dir under the current directory")
    p.add_argument("--methods", default=",".join(METHOD_CHOICES), help="comma list of " + ", ".join(METHOD_CHOICES))
    p.add_argument("--raw", choices=["auto", "fio", "dd", "none"], default="auto")
    p.add_argument("--fio-iomem", default="malloc", help="fio --iomem, e.g. shmhuge (needs reserved huge pages)")
    p.add_argument("--aio-config", type=Path, default=None, help="JSON aio config (ucp tune --output, DeepSpeed)")
    p.add_argument("--no-drop-caches", action="store_true")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--markdown", action="store_true", help="markdown table + command, for docs/benchmarks.md")
    out.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    options = BenchSaveOptions(
        size_gib=args.size_gib,
        rounds=args.rounds,
        ranks=[int(x) for x in args.ranks.split(",") if x.strip()],
        directory=args.dir,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        raw=args.raw,
        fio_iomem=args.fio_iomem,
        aio=config_from_json(json.loads(args.aio_config.read_text())) if args.aio_config else AioConfig(),
        drop_caches=not args.no_drop_caches,
    )
    command = shlex.join([sys.executable if not sys.executable.startswith(os.getcwd()) else os.path.relpath(sys.executable),
                          os.path.relpath(__file__), *argv])  # fmt: skip
    try:
        result = run_bench_save(options, command=command, progress=_progress if sys.stderr.isatty() else None)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.json:
        print(result.model_dump_json(indent=2))
    elif args.markdown:
        print(to_markdown(result), end="")
    else:
        print_table(result)
    return 0


def _progress(done: int, total: int, what: str) -> None:
    print(f"\r[{done}/{total}] {what:<70}", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
