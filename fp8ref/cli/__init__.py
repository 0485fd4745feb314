"""The ``fp8ref`` command line: one module per subcommand, each providing ``add_parser(subparsers)``.

This file only lists them, so features stay independent. The CLI is the top of the import
graph: its modules import the rest of fp8ref (most of it lazily, when a subcommand runs), and
nothing in fp8ref imports them except ``fp8ref.gpu_check``, which shares the bench's option parsers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: (module, description) of every subcommand module; each registers one or more subcommands.
SUBCOMMAND_MODULES = (
    "fp8ref.cli.spec",
    "fp8ref.cli.select",
    "fp8ref.cli.bench",
    "fp8ref.cli.conformance",
    "fp8ref.cli.audit",
    "fp8ref.cli.certify",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8ref", description="FP8 W8A8 reference and referee")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in SUBCOMMAND_MODULES:
        importlib.import_module(mod).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
