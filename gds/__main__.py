"""``python -m gds [--json]``: print what this machine offers for tensor I/O, and why."""

from __future__ import annotations

import argparse

from .capability import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gds", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report(as_json=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
