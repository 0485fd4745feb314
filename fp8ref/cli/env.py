"""``fp8ref env [--write]``: docs/environment.md, generated from ``fp8ref._env``'s declarations of
every ``FP8REF_*`` variable (printed, or written over the file with ``--write``)."""

from __future__ import annotations

import sys
from pathlib import Path

#: The generated page, in a source checkout.
DOC = Path(__file__).resolve().parents[2] / "docs" / "environment.md"


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="list every FP8REF_* environment variable, what it accepts and its default "
                                   "(the text of docs/environment.md)")
    p.add_argument("--write", action="store_true", help="write the text over docs/environment.md")
    p.set_defaults(func=_env)


def _env(args) -> int:
    from .._env import document
    from .._io import write_text

    if args.write:
        write_text(DOC, document())
        print(f"wrote {DOC}")
    else:
        sys.stdout.write(document())
    return 0
