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
    "fp8ref.cli.env",
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written (paragraphs), and every option's help ending with its default
    unless the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in text and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


def _finish(parser: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """Give every (sub)command page a description (its one-line help unless it has its own), the
    formatter above, and help texts without reST markup (docstrings use ``literal``)."""
    parser.formatter_class = HelpFormatter
    if not parser.description and help_text:
        parser.description = help_text[0].upper() + help_text[1:] + "."
    if parser.description:
        parser.description = parser.description.replace("``", "")
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = action.help.replace("``", "")
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                _finish(sub, helps.get(name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8ref", description="FP8 W8A8 reference and referee")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in SUBCOMMAND_MODULES:
        importlib.import_module(mod).add_parser(sub)
    _finish(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
