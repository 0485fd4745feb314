"""Every ``FP8REF_*`` environment variable fp8ref reads, declared once and read through ``get``.

One rule for all of them: **unset, or set to nothing but blanks, means the default; any other
value must be one the variable accepts, or ``get`` raises ``EnvVarError`` (a ``ValueError``)
naming the variable, the value and what it accepts.** No value is silently ignored or silently
narrowed: ``FP8REF_NATIVE=maybe`` and ``FP8REF_CANDIDATES=' , ,'`` are errors, not "off" and "the
reference only". The kinds:

- ``flag``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case);
- ``names``: comma-separated backend names, at least one (blanks around names are dropped);
- ``name``: one backend name;
- ``choice``: one of the variable's listed values;
- ``seconds``: a finite number of seconds, greater than 0 and at most the variable's maximum
  (``inf`` or a huge value would be a wait without end, which the variable exists to prevent);
- ``path``: a directory or file; ``~`` and ``~user`` are expanded (one that does not expand is an
  error, never a folder named ``~``).

``get`` keeps the parsed value with the raw string it came from and re-parses only when the raw
string changes: a read costs one ``os.environ`` look-up and one comparison, so code that must see
a changed variable (a test's ``monkeypatch.setenv``) may call it on every use. An error is raised
again on every read while the bad value stays.

``python -m fp8ref env`` prints docs/environment.md from these declarations (``--write``
rewrites the file); tests/test_env.py checks the file matches.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["Variable", "VARIABLES", "EnvVarError", "get", "markdown", "document", "FLAG_TRUE", "FLAG_FALSE"]

FLAG_TRUE = ("1", "true", "yes", "on")
FLAG_FALSE = ("0", "false", "no", "off")


class EnvVarError(ValueError):
    """An ``FP8REF_*`` variable is set to a value it does not accept (``name`` says which)."""

    def __init__(self, name: str, raw: str, accepts: str):
        self.name, self.raw = name, raw
        super().__init__(f"{name}={raw!r} is not accepted: {name} must be {accepts} (or unset for the default)")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its kind (module docstring), default, and what it does."""

    name: str
    kind: str
    default: Any
    summary: str
    #: ``choice``: the accepted values; ``seconds``: ``(maximum,)``.
    choices: tuple = ()
    #: The module that acts on it.
    used_in: str = ""

    def accepts(self) -> str:
        if self.kind == "flag":
            return f"one of {'/'.join(FLAG_TRUE)} or {'/'.join(FLAG_FALSE)}"
        if self.kind == "names":
            return "comma-separated backend names (at least one)"
        if self.kind == "name":
            return "a backend name"
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "seconds":
            return f"a finite number of seconds > 0 and <= {self.choices[0]:g}"
        return "a path (~ is expanded)"


VARIABLES: tuple[Variable, ...] = (
    Variable("FP8REF_BACKEND", "name", None,
             "Force this backend wherever `backend=\"auto\"` (`auto` means unset); a backend that cannot run "
             "the case raises, never falls back.", used_in="fp8ref.select.selector"),
    Variable("FP8REF_CANDIDATES", "names", None,
             "Restrict `auto` to these backends (the reference is always added).", used_in="fp8ref.select.selector"),
    Variable("FP8REF_ALLOW_BACKENDS", "names", frozenset(),
             "Entry-point (installed plug-in) backends `auto` may consider without `candidates=`; `*` allows all.",
             used_in="fp8ref.registry"),
    Variable("FP8REF_CACHE_DIR", "path", None,
             "Directory of the selection cache and downloaded audit models (default `~/.cache/fp8ref`); "
             "refused (memory only, one warning) when another user owns it or others can write it.",
             used_in="fp8ref.select.cache"),
    Variable("FP8REF_CACHE_LOCK_TIMEOUT", "seconds", 10.0,
             "Seconds a cache write waits for the cache's lock before it goes on without the disk cache.",
             choices=(3600.0,), used_in="fp8ref.select.cache"),
    Variable("FP8REF_WEIGHT_CHECK", "choice", "sample",
             "How a cached weight's in-place change is noticed when `weight_check=None`.",
             choices=("sample", "version", "content"), used_in="fp8ref.weightcheck"),
    Variable("FP8REF_NATIVE", "flag", True,
             "Off: the optional native fast paths of cpu-bf16, cpu-fp32 and the quantizer are not used.",
             used_in="fp8ref.kernels.native"),
    Variable("FP8REF_CPU_FP8", "flag", False,
             "On: build the C++ extension at the first availability check of a CPU backend (minutes).",
             used_in="fp8ref.kernels.native"),
    Variable("FP8REF_CPU_PACK", "flag", True,
             "Off: cpu-bf16/cpu-fp32 weights are not packed for oneDNN.", used_in="fp8ref.kernels.cpu"),
    Variable("FP8REF_CPU_BF16_DOT", "flag", False,
             "On: cpu-bf16's GEMM runs with bf16 dot products (`bf16_dot_products`).",
             used_in="fp8ref.kernels.cpu"),
    Variable("FP8REF_COMPILE", "flag", False,
             "On: the CPU backends use their torch.compile'd paths.", used_in="fp8ref.kernels.cpu"),
    Variable("FP8REF_PROGRESS", "flag", None,
             "On: progress bars on any stream; off: none. Unset: a bar on a terminal, a line every 30 s otherwise.",
             used_in="fp8ref._progress"),
    Variable("FP8REF_HYPOTHESIS_PROFILE", "choice", "ci",
             "The conformance profile (Hypothesis settings) used when none is given.",
             choices=("dev", "ci", "thorough", "limits"), used_in="fp8ref.conformance.profiles"),
    Variable("FP8REF_KNOWN_FAILURES", "path", None,
             "A known-failures ledger module for the conformance properties (default `properties/known_failures.py`).",
             used_in="properties/conftest.py"),
)
_BY_NAME = {v.name: v for v in VARIABLES}

#: name -> (raw string, parsed value) of the last successful read.
_SEEN: dict[str, tuple[str | None, Any]] = {}


def get(name: str) -> Any:
    """The value of ``FP8REF_...`` variable ``name``, parsed (its default when unset or blank).

    Raises
    ------
    EnvVarError
        The variable is set to a value it does not accept.
    KeyError
        ``name`` is not a declared variable (a typo in fp8ref's own code).

    Examples
    --------
    >>> import os
    >>> from fp8ref import _env
    >>> os.environ["FP8REF_CANDIDATES"] = " cpu-bf16, reference "
    >>> _env.get("FP8REF_CANDIDATES")
    ('cpu-bf16', 'reference')
    >>> del os.environ["FP8REF_CANDIDATES"]
    >>> _env.get("FP8REF_CANDIDATES") is None
    True
    """
    raw = os.environ.get(name)
    seen = _SEEN.get(name)
    if seen is not None and seen[0] == raw:
        return seen[1]
    value = _parse(_BY_NAME[name], raw)
    _SEEN[name] = (raw, value)
    return value


def _parse(var: Variable, raw: str | None) -> Any:
    text = "" if raw is None else raw.strip()
    if not text:
        return var.default
    if var.kind == "flag":
        low = text.lower()
        if low in FLAG_TRUE:
            return True
        if low in FLAG_FALSE:
            return False
    elif var.kind == "names":
        names = tuple(n.strip() for n in text.split(","))
        if all(names):
            return frozenset(names) if isinstance(var.default, frozenset) else names
    elif var.kind == "name":
        if "," not in text:
            return None if text == "auto" else text
    elif var.kind == "choice":
        if text in var.choices:
            return text
    elif var.kind == "seconds":
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and 0 < value <= var.choices[0]:
            return value
    else:
        path = os.path.expanduser(text)
        if not path.startswith("~"):
            return path
    raise EnvVarError(var.name, raw or "", var.accepts())


def markdown() -> str:
    """The table of every variable, as docs/environment.md holds it."""
    lines = ["| variable | accepts | default | what it does | read in |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        default = {None: "unset", True: "on", False: "off", frozenset(): "none"}.get(v.default, v.default) \
            if not isinstance(v.default, float) else f"{v.default:g}"
        lines.append(f"| `{v.name}` | {v.accepts()} | {default} | {v.summary} | `{v.used_in}` |")
    return "\n".join(lines) + "\n"


_DOC_HEAD = """# Environment variables

Generated by `python -m fp8ref env --write` from the declarations in `fp8ref/_env.py`
(tests/test_env.py checks this file matches them); edit those, not this file.

**The rule.** Unset, or set to nothing but blanks, means the default. Any other value must be one the
variable accepts; otherwise its first use raises `fp8ref._env.EnvVarError` (a `ValueError`) naming the
variable, the value and what it accepts. Nothing is silently ignored or narrowed. Flags take
`1/true/yes/on` or `0/false/no/off` (any case); names are comma-separated and each must be non-blank;
paths have `~` expanded; seconds are finite, above 0 and at most the stated maximum.

fp8ref keeps each parsed value with the text it came from and parses again only when the text
changes, so a variable changed in a running process takes effect at its next read.

"""


def document() -> str:
    """docs/environment.md's text."""
    return _DOC_HEAD + markdown()
