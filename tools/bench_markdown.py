#!/usr/bin/env python
"""Run ``ucp bench io`` or ``ucp bench save`` and print its result as markdown for docs/benchmarks.md.

    .venv/bin/python tools/bench_markdown.py io --size-gib 2 --rounds 3
    .venv/bin/python tools/bench_markdown.py save --size-gib 2 --rounds 3

Every option after the bench's name goes to the command line unchanged (``ucp bench io --help``),
so the options are defined once, in the CLI. The published figures are cold reads of a whole quiet
machine, so ``--drop-caches`` (drop the system's page cache; needs root) is passed unless the
command line says ``--no-drop-caches``. Progress goes to stderr; the markdown table, the notes
and the exact command to stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ucp.bench.report import BenchReport, to_markdown


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("io", "save"):
        print(__doc__, file=sys.stderr)
        return 2
    bench, rest = argv[0], argv[1:]
    if "--no-drop-caches" not in rest and "--drop-caches" not in rest:
        rest = [*rest, "--drop-caches"]
    proc = subprocess.run(
        [sys.executable, "-m", "ucp.cli", "bench", bench, *rest, "--json"], stdout=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        return proc.returncode
    print(to_markdown(BenchReport.model_validate(json.loads(proc.stdout)["report"])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
