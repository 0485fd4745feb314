"""``fp8ref audit``: precision-drift audit of a real model (or a checkpoint's weights) in FP8.

Writes ``audit.json``, ``audit.md`` and two PNG plots to ``--out``; exits 1 when two audited
backends drift apart, when the audit drifts from ``--baseline``, or when a layer or the model
is flagged (unless ``--ignore-flags``); 0 otherwise. See docs/audit.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from .._progress import oversubscribed
from ..spec.schemes import RECIPES
from .bench import _names, _positive_int, unknown_backends

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="precision-drift audit of a real model in FP8 against float, per layer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="smollm2, minilm, a transformers folder, or a .safetensors file "
                                                   "/ index (weights-only audit when no config.json is beside it)")
    p.add_argument("--text", default="hamlet", help="gsm8k, hamlet or a text file (default hamlet)")
    p.add_argument("--recipe", default="w8a8_fp8", choices=sorted(RECIPES), help="quantization recipe")
    p.add_argument("--backend", action="extend", type=_names, dest="backends", metavar="NAME",
                   help="backend to audit, repeatable or NAME1,NAME2 (default: reference and auto)")
    p.add_argument("--candidates", type=_names, metavar="NAMES",
                   help="comma-separated backends 'auto' may choose among (the reference is added); entry-point "
                        "backends take part only when named here or in FP8REF_ALLOW_BACKENDS")
    p.add_argument("--skip", action="append", metavar="PATTERN",
                   help="linear layers left in float: name, dotted suffix or fnmatch pattern; repeatable "
                        "(default lm_head; --skip none audits every nn.Linear)")
    p.add_argument("--baseline", metavar="JSON", help="a stored audit.json to check for drift against")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text for a causal LM (default 2048)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per forward pass (default 512)")
    p.add_argument("--sentences", type=int, default=256, help="sentences for an encoder (default 256)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="dtype of the float model")
    p.add_argument("--bound-rows", type=int, default=8, help="tokens per layer checked against the bound")
    p.add_argument("--bound-cols", type=int, default=64, help="output channels per layer checked against the bound")
    p.add_argument("--bound-batches", type=int, default=1, help="batches in which the bound is checked")
    p.add_argument("--weights-only", action="store_true", help="stream the checkpoint's weights, no model run")
    p.add_argument("--ignore-flags", action="store_true", help="exit 0 despite flagged layers (drift still fails)")
    p.add_argument("--drift-sqnr-db", type=float, help="layer SQNR drop counted as drift (dB)")
    p.add_argument("--drift-ppl-rel", type=float, help="relative perplexity rise counted as drift")
    p.add_argument("--drift-kl", type=float, help="mean KL rise counted as drift (nats)")
    p.add_argument("--drift-top1", type=float, help="top-1 agreement drop counted as drift")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="torch CPU threads (default: torch's own choice); on a loaded machine 1 thread avoids "
                        "waiting at parallel barriers for descheduled threads (docs/audit.md)")
    p.set_defaults(func=_audit)


def _thresholds(args: argparse.Namespace):
    from ..audit import Thresholds

    changes = {k: getattr(args, k) for k in ("drift_sqnr_db", "drift_ppl_rel", "drift_kl", "drift_top1")
               if getattr(args, k) is not None}
    return dataclasses.replace(Thresholds(), **changes)


def _weights_only(args: argparse.Namespace, out: Path) -> int:
    from ..audit import audit_safetensors

    wa = audit_safetensors(args.model, args.recipe, progress=not args.no_progress)
    wa.save(out / "weights.json")
    (out / "weights.md").write_text(wa.to_markdown())
    q = [t for t in wa.tensors if t.kind == "quantized"]
    print(f"{len(wa.tensors)} tensors ({len(q)} quantized); {len(wa.flagged)} flagged; peak RSS "
          f"{wa.meta['peak_rss_mb']} MB, largest tensor {wa.meta['largest_tensor_mb']} MB")
    for t in wa.flagged:
        print(f"  FLAG {t.name}: {'; '.join(t.flags)}")
    print(f"wrote {out / 'weights.json'}, {out / 'weights.md'}")
    return 1 if wa.flagged and not args.ignore_flags else 0


def _audit(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _audit_run(args)
    finally:  # main() called in a process that goes on (a test, a notebook) keeps its thread count
        torch.set_num_threads(threads)


def _audit_run(args: argparse.Namespace) -> int:
    from ..audit import AuditReport, audit_model, compare_audits, compare_reports
    from ..audit.material import encoder_batches, encoder_sentences, lm_batches, load_model, load_text

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = Path(args.model)
    if args.model not in ("smollm2", "minilm") and (
            args.weights_only or (p.is_file() and not (p.parent / "config.json").is_file())):
        return _weights_only(args, out)
    th = _thresholds(args)
    backends = tuple(args.backends or ("reference", "auto"))
    reason = unknown_backends(backends, extra=("auto",))
    if reason:  # before the model loads
        print(f"fp8ref audit: --backend: {reason}", file=sys.stderr)
        return 2
    busy = oversubscribed()
    if busy:
        print(f"fp8ref audit: {busy}", file=sys.stderr)
    print(f"loading {args.model} ...", flush=True)
    model, tok, kind, name = load_model(args.model, _DTYPES[args.dtype])
    if kind == "causal_lm":
        inputs = lm_batches(tok, load_text(args.text), args.tokens, args.seq_len)
    else:
        inputs = encoder_batches(tok, encoder_sentences(args.text, args.sentences))
    skip = tuple(s for s in (args.skip or ["lm_head"]) if s != "none")
    rep = audit_model(model, inputs, recipe=args.recipe, backends=backends, skip=skip, bound_rows=args.bound_rows,
                      bound_cols=args.bound_cols, bound_batches=args.bound_batches, kind=kind, thresholds=th,
                      model_name=name, text_name=args.text, progress=not args.no_progress,
                      candidates=args.candidates)
    drifts = []
    for a in rep.audits[1:]:
        drifts.append(compare_audits(rep.audits[0], a, th))
    if args.baseline:
        drifts += compare_reports(AuditReport.load(args.baseline), rep, thresholds=th)
    rep.save(out / "audit.json")
    md = rep.to_markdown() + "".join("\n" + d.to_markdown() for d in drifts)
    (out / "audit.md").write_text(md)
    plots = []
    try:
        from ..audit.plots import write_plots

        plots = write_plots(rep, out)
    except ImportError as exc:
        print(f"no plots: {exc}", file=sys.stderr)
    for a in rep.audits:
        m = a.model
        if m.kind == "causal_lm":
            print(f"{a.backend:10} [{', '.join(a.resolved)}] ppl {m.ppl_fp:.4f} -> {m.ppl_fp8:.4f}, "
                  f"KL {m.kl_mean:.4g}, "
                  f"top-1 {m.top1_agreement:.4f}; {len(a.flagged_layers)}/{len(a.layers)} layers flagged")
        else:
            print(f"{a.backend:10} [{', '.join(a.resolved)}] embedding cosine {m.embedding_cosine_mean:.5f} "
                  f"(min {m.embedding_cosine_min:.5f}), NN agreement {m.nn_agreement:.4f}; "
                  f"{len(a.flagged_layers)}/{len(a.layers)} layers flagged")
        for f in a.flags:
            print(f"  FLAG model: {f}")
        for lay in a.flagged_layers[:5]:
            print(f"  FLAG {lay.name}: {'; '.join(lay.flags)}")
        if len(a.flagged_layers) > 5:
            print(f"  ... {len(a.flagged_layers) - 5} more flagged layers in audit.md")
    for d in drifts:
        status = f"DRIFT in {len(d.layers)} layer(s), {len(d.items)} metric(s)" if d.drifted else "no drift"
        print(f"{d.before} -> {d.after}: {status}")
        for item in d.items[:10]:
            print(f"  {item}")
    print(f"wrote {', '.join(str(x) for x in [out / 'audit.json', out / 'audit.md', *plots])} "
          f"({rep.meta['seconds']} s)")
    if any(d.drifted for d in drifts):
        return 1
    return 1 if rep.flagged and not args.ignore_flags else 0
