"""Write docs/mutants.md: how the conformance suite rejects each mutant (which contract, after how
many examples, in how many seconds), that it accepts every correct variant, how close each
accumulation class comes to its bound, and the peers' tolerance checks on the same backends.

    python -m tests.mutants.make_report [--seeds 3] [--trials 24] [--out docs/mutants.md]

Ours: ``fp8ref.conformance.check(mutant, "ci", seed=s, fail_fast=True)`` for each seed (seed 0 with
shrinking, for the counterexample and the time to detection; the others without). *Search alone*
repeats seed 0 with the sweep off (``sweep=False``). Peers: each peer's rtol/atol
(fp8ref/conformance/peers.py) applied end to end -- the mutant's linear (quantize + scaled_mm, or
its fused hook) on randn inputs of peer-typical shapes, against the fp32 matmul of the
reference-dequantized operands -- over ``--trials`` problems; the rate is the fraction of problems
on which the peer's check fails. The last sections hold the other catalogues to the same report:
the third-party kernels (``third_party.py``, issue 39: every one must pass on every seed, here
``--seeds`` of them), the loader catalogue (``loaders.py``, ``check_loader``) and the MoE catalogue
(``moe.py``, ``check_moe``), each on seed 0 for the mutants (``fail_fast``) and the correct
variants. Times are CPU seconds of this process (``time.process_time``), less sensitive than wall
time to the other jobs of a shared machine.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from fp8ref._machine import cpu_kind, cpu_model
from fp8ref.conformance import check, get_profile
from fp8ref.conformance.contracts import CALLING_CONTRACT_NAMES
from fp8ref.conformance.peers import PEER_CHECKS, peer_accepts
from fp8ref.spec import quant
from fp8ref.spec.schemes import RECIPES

from .base import CLASSES
from .catalogue import CALLING_CLASSES, CALLING_CORRECT, CALLING_MUTANTS, CORRECT, MUTANTS, claim_of
from .ladder import LADDER, swamp_ratio
from .loaders import LOAD_CORRECT, LOAD_MUTANTS
from .moe import MOE_CORRECT, MOE_MUTANTS
from .third_party import THIRD_PARTY

_SHAPES = [(1, 16, 16), (17, 64, 128), (33, 16, 144), (64, 64, 272), (5, 32, 160), (128, 16, 256)]


def peer_rates(backend, trials: int) -> dict[str, float]:
    """Fraction of ``trials`` problems on which each peer check rejects ``backend``."""
    fails = {p.name: 0 for p in PEER_CHECKS}
    recipes = [RECIPES["w8a8_fp8"], RECIPES["fp8"], RECIPES["fp8_block"]]
    for t in range(trials):
        g = torch.Generator().manual_seed(t)
        M, N, K = _SHAPES[t % len(_SHAPES)]
        recipe = recipes[t % len(recipes)]
        dtype = (torch.bfloat16, torch.float16)[t % 2]
        x = torch.randn(M, K, generator=g).to(dtype)
        w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
        bias = torch.randn(N, generator=g).to(dtype) if t % 3 == 0 else None
        try:
            qw = backend.prepare_weight(backend.quantize(w, recipe.weight))
            y = backend.linear(x, qw, bias, dtype, recipe.activation)  # the layer path a serving stack runs
        except Exception:
            for p in PEER_CHECKS:
                fails[p.name] += 1
            continue
        rx, rw = quant.quantize(x, recipe.activation), quant.quantize(w, recipe.weight)
        for p in PEER_CHECKS:
            fails[p.name] += not peer_accepts(p, y, rx, rw, bias)
    return {k: v / trials for k, v in fails.items()}


def _timed(fn):
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def calling_section(seeds: int) -> list[str]:
    """The calling contract's catalogue (``calling.py``) as a markdown section: per mutant, the calling
    contract that caught it first (all calling contracts, seed 0, ``fail_fast``), the examples and CPU
    seconds until then, and the detection rate of its own dimension's contracts over ``seeds`` seeds
    (what ``test_calling_contract_rejects_mutant`` asserts); per correct variant, the pass rate."""
    fast = get_profile("ci").with_(shrink=False)
    t_all = time.process_time()
    out = ["## The calling contract (docs/spec.md §3.4): its own catalogue", "",
           "Mutants that compute the right values and break the calling contract (`tests/mutants/calling.py`): "
           "*caught by* is the first failing contract of `check(mutant, \"ci\", seed=0, fail_fast=True, "
           "contracts=CALLING_CONTRACT_NAMES)` (shrinking off), with the examples run until then and the CPU "
           f"seconds; *detected* is the fraction of seeds 0..{seeds - 1} on which the contracts of the mutant's own "
           "dimension alone reject it (`tests/mutants/test_mutants.py` asserts 100 % on seeds 0, 1, 2). On fresh, "
           "contiguous, finite operands called from one thread their values are the base's.", "",
           "| dimension | mutant | bug | caught by | examples | CPU s | detected |", "|---|---|---|---|---|---|---|"]
    for cls in CALLING_MUTANTS:
        first, dt = _timed(lambda c=cls: check(c(), fast, seed=0, fail_fast=True, contracts=CALLING_CONTRACT_NAMES))
        dim = CALLING_CLASSES[cls.klass]
        names = [n for n in CALLING_CONTRACT_NAMES if n.split(".", 1)[1] == dim]
        hits = [not check(cls(), fast, seed=s, fail_fast=True, contracts=names).passed for s in range(seeds)]
        f = first.failures[0] if first.failures else None
        out.append(f"| {dim} | `{cls.name}` | {cls.bug} | {f.contract if f else 'not detected'} | "
                   f"{first.examples_to_detection or '-'} | {dt:.1f} | {sum(hits) / len(hits):.0%} |")
        print(cls.name, f.contract if f else None, f"{dt:.1f}s", sum(hits), flush=True)
    out += ["", "Correct variants (every calling contract of the ops they change, seeds "
            f"0..{seeds - 1}):", "", "| variant | what it does | passed |", "|---|---|---|"]
    for cls in CALLING_CORRECT:
        ok = [check(cls(), fast, seed=s, contracts=CALLING_CONTRACT_NAMES, ops=cls.changes).passed
              for s in range(seeds)]
        out.append(f"| `{cls.name}` | {cls.bug} | {sum(ok) / len(ok):.0%} |")
        print(cls.name, sum(ok), flush=True)
    out += ["", f"This section took {time.process_time() - t_all:.0f} CPU s.", ""]
    return out


def third_party_section(seeds: int) -> list[str]:
    """The third-party kernels (``third_party.py``): per kernel, the seeds of ``ci`` it passes (every
    contract of every op; ``test_third_party.py`` asserts all of seeds 0-7) and the CPU seconds."""
    fast = get_profile("ci").with_(shrink=False)
    out = ["## Correct kernels written as a third party writes them: must be accepted", "",
           "`tests/mutants/third_party.py` (issue 39): correct kernels declaring nothing beyond accumulation and "
           "output roundings; `check(kernel, \"ci\", seed=s)` on every contract, seeds "
           f"0..{seeds - 1}. A rejection is a false alarm of the suite (docs/conformance.md, \"Defects, and what a "
           "declaration changes\").", "",
           "| kernel | declares | what it does | passed | CPU s |", "|---|---|---|---|---|"]
    for cls in THIRD_PARTY:
        ok, dt = _timed(lambda c=cls: [check(c(), fast, seed=s).passed for s in range(seeds)])
        out.append(f"| `{cls.name}` | {cls.accumulation.name}, {cls.output_roundings} rounding(s) | {cls.bug} | "
                   f"{sum(ok) / len(ok):.0%} | {dt:.1f} |")
        print(cls.name, sum(ok), flush=True)
    return out + [""]


def _catalogue_rows(mutants, correct, run, label) -> list[str]:
    """Rows of a mutant table (the first failing contract on seed 0 with ``fail_fast``, examples and
    CPU seconds until then) and of a correct-variant table (passed on seed 0)."""
    out = ["| mutant | modelled on | bug | caught by | examples | CPU s |", "|---|---|---|---|---|---|"]
    for make in mutants:
        cls = getattr(make, "cls", make)
        report, dt = _timed(lambda m=make: run(m(), True))
        f = report.failures[0] if report.failures else None
        out.append(f"| `{make.name}` | {cls.upstream} | {cls.bug} | {f.contract if f else '**not detected**'} | "
                   f"{report.examples_to_detection or '-'} | {dt:.1f} |")
        print(make.name, f.contract if f else None, flush=True)
    out += ["", f"Correct {label} (seed 0, every contract):", "", "| variant | passed | CPU s |", "|---|---|---|"]
    for make in correct:
        report, dt = _timed(lambda m=make: run(m(), False))
        out.append(f"| `{make.name}` | {'yes' if report.passed else '**no**'} | {dt:.1f} |")
        print(make.name, report.passed, flush=True)
    return out + [""]


def loader_moe_sections() -> list[str]:
    from fp8ref.conformance import check_loader
    from fp8ref.conformance.moe import check_moe

    fast = get_profile("ci").with_(shrink=False)
    out = ["## Weight loaders (docs/spec.md, loading): `check_loader`", "",
           "`tests/mutants/loaders.py`: `check_loader(mutant, \"ci\", seed=0, fail_fast=True)` "
           "(`tests/mutants/test_loaders.py` asserts seeds 0-7).", ""]
    out += _catalogue_rows(LOAD_MUTANTS, LOAD_CORRECT,
                           lambda b, ff: check_loader(b, "ci", seed=0, fail_fast=ff), "loaders")
    out += ["## MoE (docs/spec.md §7): `check_moe`", "",
            "`tests/mutants/moe.py`: `check_moe(mutant, \"ci\", seed=0, fail_fast=True)` "
            "(`tests/mutants/test_moe_mutants.py` asserts the search alone on seeds 0-7 too).", ""]
    out += _catalogue_rows(MOE_MUTANTS, MOE_CORRECT,
                           lambda b, ff: check_moe(b, fast, seed=0, fail_fast=ff), "MoE backends")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--out", default="docs/mutants.md")
    ap.add_argument("--calling-only", action="store_true",
                    help="print only the calling contract's section (to stdout)")
    args = ap.parse_args(argv)
    if args.calling_only:
        print("\n".join(calling_section(args.seeds)))
        return 0
    ci = get_profile("ci")
    fast = ci.with_(shrink=False)
    rows, correct_rows = [], []
    t_all = time.process_time()
    for cls in MUTANTS:
        first, dt = _timed(lambda c=cls: check(c(), ci, seed=0, fail_fast=True, schemes=claim_of(c)))
        detected = [not first.passed] + [not check(cls(), fast, seed=s, fail_fast=True, schemes=claim_of(cls)).passed
                                         for s in range(1, args.seeds)]
        search, dt_search = _timed(lambda c=cls: check(c(), ci, seed=0, fail_fast=True, sweep=False,
                                                          schemes=claim_of(c)))
        f = first.failures[0] if first.failures else None
        fs = search.failures[0] if search.failures else None
        rows.append((cls, dt, sum(detected) / len(detected), f, first.examples_to_detection,
                     peer_rates(cls(), args.trials), not search.passed, dt_search, fs))
        print(cls.name, f"{dt:.1f}s", sum(detected), not search.passed, flush=True)
    for cls in CORRECT:
        reports, dt = _timed(lambda c=cls: [check(c(), fast, seed=s, ops=c.changes, schemes=claim_of(c))
                                            for s in range(args.seeds)])
        worst = max((r.result("scaled_mm.bound").worst_ratio or 0.0) for r in reports)
        correct_rows.append((cls, dt, sum(r.passed for r in reports) / len(reports), worst,
                             peer_rates(cls(), args.trials)))
        print(cls.name, sum(r.passed for r in reports), flush=True)
    ladder = [(c, b, swamp_ratio(c(), b), w, wb, swamp_ratio(w(), wb) if w is not None else None)
              for c, b, w, wb in LADDER]
    total = time.process_time() - t_all

    peers = " | ".join(f"{p.name} (rtol {p.rtol:g}, atol {p.atol:g})" for p in PEER_CHECKS)
    out = [
        "# The conformance suite against a catalogue of real bugs",
        "",
        "Generated by `python -m tests.mutants.make_report "
        f"--seeds {args.seeds} --trials {args.trials}` (fp8ref/conformance, tests/mutants/) on {cpu_model()} "
        f"({cpu_kind()}, {platform.machine()}, torch {torch.__version__}), a shared 2-core machine; times are CPU "
        f"seconds of the process. Total {total:.0f} s.",
        "",
        "Each mutant is the correct fp32 base backend (`tests/mutants/base.py`) with one real bug put back "
        "(`bugs.py`). **Ours**: `check(mutant, \"ci\", seed=0, fail_fast=True)`: the first contract that failed, "
        "the examples run until then (over all contracts, in table order, the failing one included) and the CPU "
        f"seconds; *detected* is the fraction of seeds 0..{args.seeds - 1} on which the ci profile rejects the "
        "mutant (`tests/mutants/test_mutants.py` asserts 100 % on seeds 0, 1, 2). *Search alone* repeats seed 0 "
        "with the corner sweep off (`check(..., sweep=False)`): what Hypothesis finds without being pointed at "
        "the bug class. **Peers**: each peer's tolerance (`fp8ref/conformance/peers.py`) applied end to end to "
        f"the mutant's `linear` on {args.trials} randn problems of peer-typical shapes (fp16 and bf16 inputs, "
        "3 recipes), against the fp32 matmul of the reference-dequantized operands; the rate is the fraction of "
        "problems the peer's check fails.",
        "",
        "## Per class: the mutant, the contract that caught it, examples needed, seconds",
        "",
        "| class | mutant | modelled on | caught by | examples | CPU s | detected | search alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for klass in CLASSES:
        for cls, dt, rate, f, n, _pr, found, _ds, _fs in rows:
            if cls.klass == klass:
                out.append(f"| {klass} | `{cls.name}` | {cls.upstream} | {f.contract if f else '**not detected**'} | "
                           f"{n if n is not None else '-'} | {dt:.1f} | {rate:.0%} | {'yes' if found else 'no'} |")
    out += ["", "## Peers' tolerances on the same mutants (fraction of problems rejected)", "",
            f"| mutant | {peers} |", "|---|" + "---|" * len(PEER_CHECKS)]
    for cls, *_x, pr, _f2, _d2, _fs in rows:
        out.append(f"| `{cls.name}` | " + " | ".join(f"{pr[p.name]:.0%}" for p in PEER_CHECKS) + " |")
    out += ["", "## Correct but different: must be accepted", "",
            f"| backend | declares | what differs | ours: accepted | worst err/bound (scaled_mm.bound) | "
            f"CPU s for {args.seeds} ci runs | " + " | ".join(f"{p.name} false alarms" for p in PEER_CHECKS) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(PEER_CHECKS)]
    for cls, dt, rate, worst, pr in correct_rows:
        decl = f"{cls.accumulation.name}, {cls.output_roundings} rounding(s)"
        out.append(f"| `{cls.name}` | {decl} | {cls.bug} | {rate:.0%} | {worst:.3g} | {dt:.1f} | "
                   + " | ".join(f"{pr[p.name]:.0%} " for p in PEER_CHECKS) + " |")
    out += ["", "## Precision of declarations: every accumulation class is tight", "",
            "On the sweep's swamped dot products (`[L, d, ..., d]`, products d*d = L*L*2**-t, fp32 output), a "
            "correct implementation of each class reaches at least half of its bound at the widths t where its "
            "accumulator drops the small products; the next weaker implementation, declaring the same class, is "
            "outside the bound (`test_each_accumulation_class_is_tight`).", "",
            "| class (correct implementation) | widths t | worst err/bound | next weaker, declaring it | widths t | "
            "worst err/bound |", "|---|---|---|---|---|---|"]
    for c, b, r, w, wb, rw in ladder:
        weak = f"`{w.name}`" if w is not None else "-"
        rws = "-" if rw is None else ("violation" if rw == float("inf") else f"{rw:.3g}")
        out.append(f"| {c.accumulation.name} (`{c.name}`) | {', '.join(map(str, b))} | {r:.3g} | {weak} | "
                   f"{', '.join(map(str, wb)) or '-'} | {rws} |")
    out += ["", "## Counterexamples (seed 0, ci profile)", "",
            "*First* is the first failure of the default run (pinned examples, then the corner sweep, then the "
            "search; sweep items are reported as generated, search failures shrunk); *search* is the first failure "
            "with the sweep off, shrunk by Hypothesis.", ""]
    for cls, _dt, _rate, f, _n, _pr, _found, _ds, fs in rows:
        out += [f"### `{cls.name}` ({cls.klass}): {cls.bug}", "", f"- upstream: {cls.upstream}"]
        for label, r in (("first", f), ("search", fs)):
            if r is None:
                out.append(f"- {label}: not detected")
                continue
            out += [f"- {label}: `{r.contract}` on `{r.counterexample}`", f"  - {r.message}",
                    f"  - reproduce: `{(r.reproduce or '').split('  # or in a test')[0]}`"
                    + ("" if label == "first" else " with sweep=False")]
        out.append("")
    out += calling_section(args.seeds)
    out += third_party_section(args.seeds)
    out += loader_moe_sections()
    with open(args.out, "w") as fh:
        fh.write("\n".join(out))
    print(f"wrote {args.out} in {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
