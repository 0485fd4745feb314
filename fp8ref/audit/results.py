"""The seed's accuracy table for SmolLM2-135M and MiniLM: ``python -m fp8ref.audit.results``.

Rows: the float model; ``fp8ref.quantize_model`` with each recipe (W8A8 per-channel/per-token,
per-tensor, block) on each backend asked for; and the FP8_DYNAMIC path (quantize, save with
``fp8ref.save_fp8_dynamic``, load the file into a fresh copy with ``fp8ref.load_fp8_dynamic``).
Columns: perplexity on GSM8K Q+A and on Hamlet (``--tokens`` tokens each, in windows of
``--seq-len``), mean KL(fp || fp8) per token, top-1 agreement over all tokens and over the first
256; MiniLM: mean/min embedding cosine and nearest-neighbour agreement over GSM8K questions.
Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from .material import encoder_batches, encoder_sentences, lm_batches, load_model, load_text
from .outputs import LmAccumulator, embedding

__all__ = ["lm_rows", "encoder_rows", "main"]

RECIPES = (("w8a8_fp8", "W8A8 per-channel / per-token"), ("fp8", "per-tensor FP8"),
           ("fp8_block", "block FP8 (128x128 / 1x128)"))


def _quantized(model, recipe: str, backend: str):
    import fp8ref

    q = copy.deepcopy(model)
    fp8ref.quantize_model(q, recipe=recipe, backend=backend)
    return q


def _dynamic_roundtrip(model, backend: str):
    import fp8ref

    q = _quantized(model, "fp8_dynamic", backend)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model-fp8-dynamic.safetensors"
        fp8ref.save_fp8_dynamic(q, path)
        fresh = copy.deepcopy(model)
        loaded = fp8ref.load_fp8_dynamic(fresh, path, backend=backend)
    return fresh, len(loaded)


def _lm_metrics(model, q, batches, logits_fp) -> dict:
    acc, acc256 = LmAccumulator(), LmAccumulator()
    seen = 0
    with torch.no_grad():
        for b, lf in zip(batches, logits_fp, strict=True):
            lq = q(b).logits
            acc.add(lf, lq, b)
            if seen < 256:
                n = min(256 - seen, b.shape[1])
                acc256.add(lf[:, :n], lq[:, :n], None)
                seen += n
    m = acc.metrics()
    return {"ppl": m.ppl_fp8, "ppl_fp": m.ppl_fp, "kl": m.kl_mean, "top1": m.top1_agreement,
            "top1_256": acc256.metrics().top1_agreement, "tokens": m.n_tokens}


def lm_rows(backends: list[str], tokens: int, seq_len: int, texts=("gsm8k", "hamlet"), log=print,
            reference_recipes: tuple[str, ...] = ()) -> dict:
    """Rows of the SmolLM2 table (a dict: name -> text -> metrics)."""
    model, tok, _, name = load_model("smollm2")
    data = {t: lm_batches(tok, load_text(t), tokens, seq_len) for t in texts}
    with torch.no_grad():
        ref = {t: [model(b).logits for b in bs] for t, bs in data.items()}
    rows: dict = {"float (fp32)": {}}
    for t, bs in data.items():
        acc = LmAccumulator()
        for b, lf in zip(bs, ref[t], strict=True):
            acc.add(lf, lf, b)
        m = acc.metrics()
        rows["float (fp32)"][t] = {"ppl": m.ppl_fp, "ppl_fp": m.ppl_fp, "kl": 0.0, "top1": 1.0, "top1_256": 1.0,
                                   "tokens": m.n_tokens}
    variants = []
    for backend in backends:
        variants += [(f"{label} [{backend}]", lambda r=recipe, b=backend: (_quantized(model, r, b), None))
                     for recipe, label in RECIPES]
        variants.append((f"FP8_DYNAMIC save + reload [{backend}]", lambda b=backend: _dynamic_roundtrip(model, b)))
    # The exact reference is slow (float64 GEMMs): only the recipes asked for.
    variants += [(f"{label} [reference]", lambda r=recipe: (_quantized(model, r, "reference"), None))
                 for recipe, label in RECIPES if recipe in reference_recipes]
    for label, make in variants:
        t0 = time.perf_counter()
        try:
            q, _ = make()
            rows[label] = {t: _lm_metrics(model, q, bs, ref[t]) for t, bs in data.items()}
        except Exception as exc:  # a backend that declines a recipe: say so in the table
            rows[label] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{label}: {time.perf_counter() - t0:.1f} s {json.dumps(rows[label])[:300]}")
    return {"model": name, "tokens": tokens, "seq_len": seq_len, "rows": rows}


def encoder_rows(backends: list[str], sentences: int, log=print) -> dict:
    """Rows of the MiniLM table: embedding cosine and NN agreement per recipe and backend."""
    from .core import _encoder_metrics

    model, tok, _, name = load_model("minilm")
    batches = encoder_batches(tok, encoder_sentences("gsm8k", sentences))
    with torch.no_grad():
        ef = torch.cat([embedding(model(**b), b) for b in batches])
    rows = {}
    for backend in backends:
        for recipe, label in RECIPES:
            key = f"{label} [{backend}]"
            try:
                q = _quantized(model, recipe, backend)
                with torch.no_grad():
                    eq = torch.cat([embedding(q(**b), b) for b in batches])
                m = _encoder_metrics(ef, eq, 0)
                rows[key] = {"cosine_mean": m.embedding_cosine_mean, "cosine_min": m.embedding_cosine_min,
                             "nn_agreement": m.nn_agreement}
            except Exception as exc:
                rows[key] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{key}: {rows[key]}")
    return {"model": name, "sentences": len(ef), "rows": rows}


def _fmt(v, spec):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def to_markdown(lm: dict, enc: dict) -> str:
    texts = [t for t in ("gsm8k", "hamlet") if any(t in r for r in lm["rows"].values())]
    notes: list[str] = []
    out = [f"### {lm['model']}: {lm['tokens']} tokens per text in windows of {lm['seq_len']}", "",
           "| model | " + " | ".join(f"ppl {t}" for t in texts) + " | " +
           " | ".join(f"KL {t}" for t in texts) + " | " + " | ".join(f"top-1 {t} (first 256)" for t in texts) + " |",
           "|---|" + "---:|" * (3 * len(texts))]
    for label, r in lm["rows"].items():
        if "error" in r:
            out.append(f"| {label} | " + " | ".join(["declined"] * (3 * len(texts))) + " |")
            notes.append(f"- {label}: {r['error']}")
            continue
        out.append(f"| {label} | " + " | ".join(_fmt(r[t]["ppl"], ".3f") for t in texts) + " | "
                   + " | ".join(_fmt(r[t]["kl"], ".4f") for t in texts) + " | "
                   + " | ".join(f"{_fmt(r[t]['top1'], '.3f')} ({_fmt(r[t]['top1_256'], '.3f')})" for t in texts)
                   + " |")
    out += ["", f"### {enc['model']}: {enc['sentences']} GSM8K questions, mean-pooled embeddings", "",
            "| model | cosine mean | cosine min | NN agreement |", "|---|---:|---:|---:|"]
    for label, r in enc["rows"].items():
        if "error" in r:
            out.append(f"| {label} | declined | | |")
            notes.append(f"- MiniLM {label}: {r['error']}")
            continue
        out.append(f"| {label} | {r['cosine_mean']:.5f} | {r['cosine_min']:.5f} | {r['nn_agreement']:.4f} |")
    if notes:
        out += ["", "Declined:"] + notes
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8ref.audit.results", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", dest="backends", help="repeatable; default auto")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--reference-recipe", action="append", default=[], dest="reference_recipes",
                   help="also run this recipe on the (slow, exact) reference backend; repeatable")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    backends = args.backends or ["auto"]
    lm = lm_rows(backends, args.tokens, args.seq_len, reference_recipes=tuple(args.reference_recipes))
    enc = encoder_rows(backends, args.sentences)
    meta = {"seconds": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    (out / "results.json").write_text(json.dumps({"lm": lm, "encoder": enc, "meta": meta}, indent=1))
    (out / "results.md").write_text(to_markdown(lm, enc) + f"\n{meta}\n")
    print(to_markdown(lm, enc))
    print(meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
