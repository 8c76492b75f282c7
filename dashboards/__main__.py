"""`python -m dashboards [--check] [--root DIR]`: regenerate, or check, the committed files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dashboards.generate import ROOT, stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dashboards",
        description="Render the Grafana dashboards and Prometheus rules into the repository.",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a committed file is stale"
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="repository root (default: this one)"
    )
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale(args.root)
        for path in outdated:
            print(f"stale: {path}", file=sys.stderr)
        if outdated:
            print(
                "Generated files are out of date: run `python -m dashboards` and commit.",
                file=sys.stderr,
            )
            return 1
        print("dashboards and rules are up to date")
        return 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
