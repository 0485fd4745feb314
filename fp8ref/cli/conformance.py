"""``fp8ref conformance``: certify backends against the contract table, print/save the reports.

Examples::

    fp8ref conformance --backend torch --profile ci --json torch.json
    fp8ref conformance --all --markdown conformance.md
    fp8ref conformance --merge host1.json host2.json --markdown fleet.md
    fp8ref conformance --replay '{"type": "QuantizeProblem", ...}' --write-script repro.py

Each report lists the contracts (status, examples run -- of which from the corner sweep --,
declined, worst error/bound), then a coverage table: per contract, the ranges of M, N, K, the
formats, granularities, static/dynamic scales, dtypes and biases of the examples that ran, and
what the backend declined with its reasons. ``--json`` and ``--markdown`` keep all of it.

Exit status: 0 when every certified backend passed (known failures listed in the ledger count
as expected); 1 when any contract failed, when a backend is "untested" (a claimed contract ran no
example: nothing is certified), or when a backend named with ``--backend`` is unavailable here
(with ``--all``, unavailable backends are listed and skipped); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from .._io import unwritable_reason, write_text


def add_parser(sub) -> None:
    p = sub.add_parser("conformance", help="certify FP8 backends against the spec's contracts (property-based)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--backend", action="append", metavar="NAME", help="backend to certify (repeatable)")
    who.add_argument("--all", action="store_true", help="every registered backend (the default)")
    who.add_argument("--merge", nargs="+", metavar="JSON", help="merge JSON reports of earlier runs into one table")
    p.add_argument("--profile", choices=("dev", "ci", "thorough", "limits"), default=None,
                   help="search budget: ci (derandomized, finds the bugs), dev (quick), thorough (nightly), limits "
                        "(the size limits past 2**31 elements, with --only OP.size_limits); "
                        "default: $FP8REF_HYPOTHESIS_PROFILE, else ci")
    p.add_argument("--seed", type=int, default=None,
                   help="Hypothesis seed (default: the profile's: fixed at 0 for ci, random and printed otherwise)")
    p.add_argument("--only", action="append", metavar="CONTRACT", help="run only this contract (repeatable)")
    p.add_argument("--ops", action="append", metavar="OP", choices=("quantize", "scaled_mm", "linear"),
                   help="certify only this of the backend's declared ops (repeatable; default: all it declares)")
    p.add_argument("--known-failures", metavar="PY",
                   help="ledger of known upstream failures (default: fp8ref's own, fp8ref.conformance.known_failures)")
    p.add_argument("--json", metavar="FILE", help="write the report(s) as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the report(s) as markdown")
    p.add_argument("--list", action="store_true", help="print the contract table and exit")
    p.add_argument("--replay", metavar="JSON",
                   help="rebuild a printed counterexample (the JSON of a report's replay: line, or a file holding "
                        "it): its exact tensors, the reference and the bound, then exit")
    p.add_argument("--write-script", metavar="PY",
                   help="with --replay: write a standalone script (torch only, no fp8ref) holding those tensors")
    p.set_defaults(func=_run)


def _replay(args: argparse.Namespace) -> int:
    """``--replay``: print the counterexample's tensors and bound; ``--write-script`` writes them out."""
    from ..conformance import replay

    text = args.replay
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        r = replay(text)
    except (ValueError, TypeError) as exc:
        print(f"fp8ref conformance: --replay: {exc}", file=sys.stderr)
        return 2
    print(f"counterexample: {r.problem!r}")
    for name, t in {**r.inputs, **{f"spec {k}": v for k, v in r.spec.items()}}.items():
        print(f"  {name:14} {tuple(t.shape)} {t.dtype}")
    print(f"  reference      {tuple(r.reference.shape)} float64; bound {tuple(r.bound.shape)} float64 "
          f"(fp32 accumulation, one output rounding)")
    if args.write_script:
        reason = unwritable_reason(args.write_script)
        if reason:
            print(f"fp8ref conformance: --write-script: {reason}", file=sys.stderr)
            return 2
        r.write_script(args.write_script)
        print(f"wrote {args.write_script} (python {args.write_script}; needs torch only)")
    return 0


def load_known_failures(path: str | None) -> list[dict]:
    """Entries of a known-failures ledger module (``KNOWN_FAILURES``, a list of dicts); ``path=None``:
    fp8ref's own ledger (``fp8ref.conformance.known_failures``)."""
    if path is None:
        from ..conformance.known_failures import KNOWN_FAILURES

        return list(KNOWN_FAILURES)
    spec = importlib.util.spec_from_file_location("_fp8ref_known_failures", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load known failures from {path!r}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    entries = getattr(mod, "KNOWN_FAILURES", None)
    if entries is None:
        raise ValueError(f"{path} defines no KNOWN_FAILURES list")
    return list(entries)


def _contract_table() -> str:
    from ..conformance.contracts import CONTRACTS

    lines = [f"{'contract':30} {'kind':8} {'bound':26} statement"]
    lines += [f"{c.name:30} {c.kind:8} {c.bound:26} {c.statement}" for c in CONTRACTS]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    try:
        from ..conformance import check, load_report, merge_reports
    except ImportError as exc:
        print(f"fp8ref conformance needs hypothesis: pip install 'fp8ref[conformance]' ({exc})", file=sys.stderr)
        return 2
    from ..registry import backends

    if args.list:
        print(_contract_table())
        return 0
    if args.replay:
        return _replay(args)
    if args.write_script:
        print("fp8ref conformance: --write-script needs --replay", file=sys.stderr)
        return 2
    for opt, path in (("--json", args.json), ("--markdown", args.markdown)):
        reason = path and unwritable_reason(path)
        if reason:
            print(f"fp8ref conformance: {opt}: {reason}", file=sys.stderr)
            return 2
    if args.merge:
        reports = [r for path in args.merge for r in load_report(path)]
        table = merge_reports(reports)
        print(table)
        _write(args, reports, table)
        return 1 if any(r.verdict in ("fail", "untested") for r in reports) else 0
    names = args.backend or [b.name for b in backends()]
    known = load_known_failures(args.known_failures)
    reports = []
    for name in names:
        try:
            report = check(name, profile=args.profile, seed=args.seed, contracts=args.only, known_failures=known,
                           ops=args.ops)
        except KeyError as exc:
            print(f"fp8ref conformance: {exc.args[0]}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"fp8ref conformance: {exc}", file=sys.stderr)
            return 2
        print(report.to_text(), flush=True)
        reports.append(report)
    if len(reports) > 1:
        print(merge_reports(reports))
    _write(args, reports, "\n".join(r.to_markdown() for r in reports))
    failed = [r.backend for r in reports if r.verdict == "fail"]
    untested = [r.backend for r in reports if r.verdict == "untested"]
    missing = [r.backend for r in reports if r.verdict == "unavailable" and args.backend]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    if untested:
        print(f"UNTESTED (not certified: a claimed contract ran no example): {', '.join(untested)}", file=sys.stderr)
    if missing:
        print(f"UNAVAILABLE here (not certified): {', '.join(missing)}", file=sys.stderr)
    return 1 if failed or untested or missing else 0


def _write(args: argparse.Namespace, reports, markdown: str) -> None:
    if args.json:
        write_text(args.json, json.dumps([r.to_dict() for r in reports], indent=2, default=str))
    if args.markdown:
        write_text(args.markdown, markdown)
