"""``fp8ref certify``: certify the third-party FP8 implementations installed here and write the
certification matrix (``docs/certified.md``).

Examples::

    fp8ref certify                                   # every peer, writes docs/certified.md
    fp8ref certify --peer torchao-float8 --only quantize.codes --seed 0     # reproduce one failure
    fp8ref certify --peer onnxruntime-qdq --peer torchao-float8 --check docs/certified.md
    fp8ref certify --list

Each peer runs in a subprocess of its own (SGLang and vLLM cannot be imported into one process, and
a crashing peer must not take the others down); ``--in-process`` runs them here. Progress: one bar
over all (peer, contract) pairs. Exit status: 0 when the run finished (and, with ``--check``, the
verdicts match the recorded matrix), 1 on a mismatch, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from .._io import unwritable_reason, write_text
from .._progress import oversubscribed

DEFAULT_OUTPUT = os.path.join("docs", "certified.md")


def add_parser(sub) -> None:
    p = sub.add_parser("certify", help="certify third-party FP8 implementations (SGLang, vLLM, onnxruntime, torchao, "
                                       "...) and write the certification matrix")
    p.add_argument("--peer", action="append", metavar="NAME", help="certify only this peer (repeatable)")
    p.add_argument("--only", action="append", metavar="CONTRACT", help="run only this contract (repeatable)")
    p.add_argument("--profile", choices=("dev", "ci", "thorough"), default="ci", help="search budget (default: ci)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: the profile's; ci: 0)")
    p.add_argument("--output", metavar="MD", default=None,
                   help=f"write the matrix here (default: {DEFAULT_OUTPUT} for a full run, nothing otherwise)")
    p.add_argument("--json", metavar="FILE", help="write the certificates as JSON")
    p.add_argument("--check", metavar="MD", help="compare the verdicts with those recorded in this matrix")
    p.add_argument("--merge", metavar="MD", help="put the selected peers' rows into this matrix (replacing theirs, "
                                                 "keeping every other row) and write it back")
    p.add_argument("--known-failures", metavar="PY",
                   help="ledger (default: fp8ref's own, fp8ref.conformance.known_failures)")
    p.add_argument("--in-process", action="store_true", help="run the peers in this process")
    p.add_argument("--no-measure", action="store_true", help="contracts only (skip bit-exactness, schemes, non-finite)")
    p.add_argument("--list", action="store_true", help="list the peers and whether each can run here")
    p.add_argument("--render", metavar="JSON", help="write the matrix from certificates saved with --json "
                                                    "(no recomputation)")
    p.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def _prepare_env() -> None:
    # The Triton kernels run in the interpreter; triton reads this when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _certify_one(name: str, args, known, on_contract=None):
    from ..peers import get_peer
    from ..peers.certify import certify_peer

    return certify_peer(get_peer(name), profile=args.profile, seed=args.seed, contracts=args.only,
                        known_failures=known, on_contract=on_contract, measure=not args.no_measure)


def _worker(args, known) -> int:
    """Certify one peer, announcing each finished contract on stdout, then the certificate."""
    def tick(contract):
        print(json.dumps({"event": "contract", "name": contract}), flush=True)

    cert = _certify_one(args.worker, args, known, tick)
    print(json.dumps({"event": "certificate", "data": cert.to_dict()}, default=str), flush=True)
    return 0


def _via_subprocess(name: str, args, bar):
    from ..peers.certify import Certificate

    cmd = [sys.executable, "-m", "fp8ref", "certify", "--worker", name, "--profile", args.profile]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    for c in args.only or ():
        cmd += ["--only", c]
    if args.known_failures:
        cmd += ["--known-failures", args.known_failures]
    if args.no_measure:
        cmd.append("--no-measure")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        cert = None
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "contract":
                bar.update(1)
            elif msg.get("event") == "certificate":
                cert = Certificate.from_dict(msg["data"])
        proc.wait()
        if cert is None:
            err.seek(0)
            tail = err.read()[-2000:]
            raise RuntimeError(f"certifying {name} crashed (exit {proc.returncode}): {tail}")
    return cert


def _header(args) -> dict:
    import torch

    from .._machine import cpu_kind, cpu_model
    from ..peers._base import dist_version

    cmd = "fp8ref certify" + (f" --profile {args.profile}" if args.profile != "ci" else "")
    return {"command": cmd, "machine": f"{cpu_model()} ({cpu_kind()})",
            "versions": f"torch {torch.__version__}, triton {dist_version('triton') or 'absent'}, "
                        f"Python {sys.version.split()[0]}",
            "profile": args.profile, "seed": 0 if args.seed is None and args.profile == "ci" else args.seed}


def _run(args: argparse.Namespace) -> int:
    _prepare_env()
    try:
        from ..conformance import CONTRACT_NAMES
        from ..conformance.contracts import CALLING_CONTRACT_NAMES
    except ImportError as exc:
        print(f"fp8ref certify needs hypothesis: pip install 'fp8ref[conformance]' ({exc})", file=sys.stderr)
        return 2
    from ..peers import get_peer, peers
    from .conformance import load_known_failures

    known = [e for e in load_known_failures(args.known_failures) if e.get("property")]
    if args.render:
        return _render_saved(args, known)
    if args.worker:
        return _worker(args, known)
    busy = oversubscribed()
    if busy and not args.list:
        print(f"fp8ref certify: {busy}", file=sys.stderr)
    if args.list:
        for p in peers():
            reason = p.available() if args.in_process else None
            state = "" if not args.in_process else f"  {'ok' if reason is None else reason}"
            print(f"{p.name:30} {p.label():28} {', '.join(p.ops):28}{state}")
        return 0
    try:
        selected = [get_peer(n) for n in args.peer] if args.peer else peers()
    except KeyError as exc:
        print(f"fp8ref certify: {exc.args[0]}", file=sys.stderr)
        return 2
    for c in args.only or ():
        if c not in CONTRACT_NAMES:
            print(f"fp8ref certify: no contract {c!r}; contracts: {list(CONTRACT_NAMES)}", file=sys.stderr)
            return 2
    if args.merge and args.only:
        print("fp8ref certify: --merge records whole rows; it cannot take --only", file=sys.stderr)
        return 2
    if args.merge and not os.path.isfile(args.merge):
        print(f"fp8ref certify: --merge: no matrix at {args.merge}", file=sys.stderr)
        return 2
    output = args.output or args.merge or (
        DEFAULT_OUTPUT if not args.peer and not args.only and not args.check else None)
    for opt, path in (("--json", args.json), ("--output", output)):
        reason = path and unwritable_reason(path)
        if reason:
            print(f"fp8ref certify: {opt}: {reason}", file=sys.stderr)
            return 2
    from tqdm import tqdm

    from ..peers.matrix import compare, recorded_verdicts, render

    n_contracts = len(args.only) if args.only else len(CONTRACT_NAMES) - len(CALLING_CONTRACT_NAMES)  # peers skip those
    certs, crashed = [], []
    with tqdm(total=len(selected) * n_contracts, desc="fp8ref certify", unit="contract", file=sys.stderr) as bar:
        for peer in selected:
            bar.set_postfix_str(peer.name)
            before = bar.n
            if args.in_process:
                cert = _certify_one(peer.name, args, known, lambda _c: bar.update(1))
            else:
                try:
                    cert = _via_subprocess(peer.name, args, bar)
                except RuntimeError as exc:  # one peer's crash (its own process) does not stop the others
                    crashed.append(str(exc))
                    print(f"{peer.name}: CRASHED: {exc}", file=sys.stderr, flush=True)
                    bar.update(before + n_contracts - bar.n)
                    continue
            bar.update(before + n_contracts - bar.n)  # an unavailable peer runs no contract
            certs.append(cert)
            print(f"{peer.name}: {_summary(cert)}", file=sys.stderr, flush=True)
    if args.json:
        write_text(args.json, json.dumps([c.to_dict() for c in certs], indent=2, default=str))
    if crashed and not args.merge:
        # a whole matrix without the crashed rows would be silently short: write none
        print(f"fp8ref certify: {len(crashed)} peer(s) crashed; the matrix was not written"
              + (f" (the other certificates are in {args.json})" if args.json else ""), file=sys.stderr)
        return 1
    if args.merge:
        from ..peers import peer_names
        from ..peers.matrix import merge

        with open(args.merge) as f:
            _write_matrix(output, merge(f.read(), certs, _header(args), peer_names()))
    elif output:
        _write_matrix(output, render(certs, _header(args)))
    if args.check:
        with open(args.check) as f:
            diffs = compare(certs, recorded_verdicts(f.read()))
        if diffs:
            print(f"the certification matrix {args.check} is out of date (regenerate it with `fp8ref certify`):",
                  file=sys.stderr)
            for d in diffs:
                print(f"  {d}", file=sys.stderr)
            return 1
        print(f"verdicts match {args.check}", file=sys.stderr)
    if crashed:  # merged without them: their recorded rows were kept
        print(f"fp8ref certify: {len(crashed)} peer(s) crashed; their rows were left as recorded", file=sys.stderr)
        return 1
    return 0


def _write_matrix(path: str, text: str) -> None:
    from .._io import atomic_write

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)
    print(f"wrote {path}", file=sys.stderr)


def _render_saved(args, known: list[dict]) -> int:
    """Render saved certificates, with today's ledger applied (an entry added since the run turns
    its failure into ``xfail``; a listed contract that passed is ``xpass``), nothing recomputed."""
    from ..conformance.report import apply_known_failures
    from ..peers.certify import Certificate
    from ..peers.matrix import render

    with open(args.render) as f:
        certs = [Certificate.from_dict(d) for d in json.load(f)]
    for cert in certs:
        apply_known_failures(cert.report, known)
    if args.merge:
        from ..peers import peer_names
        from ..peers.matrix import merge

        with open(args.merge) as f:
            _write_matrix(args.output or args.merge, merge(f.read(), certs, _header(args), peer_names()))
    else:
        _write_matrix(args.output or DEFAULT_OUTPUT, render(certs, _header(args)))
    return 0


def _summary(cert) -> str:
    rep = cert.report
    if not rep.available:
        return f"not run here ({rep.reason})"
    bad = [f"{r.contract}={r.status}" for r in rep.results if r.status in ("fail", "error", "xpass", "xfail")]
    return ("FAILED: " + ", ".join(bad)) if bad else f"certified ({sum(r.examples for r in rep.results)} examples)"
