"""Weight loaders certified against the Loading rule (docs/spec.md §8) by
``fp8ref.conformance.check_loader``: fp8ref's own loading paths (``own``), vLLM's FP8 checkpoint
loading (``vllm``) and online quantization (``vllm_online``), and SGLang's FP8 loading, offline and
online (``sglang``). ``python -m fp8ref.peers.loaders --write docs/certified-loaders.md`` runs every
row, applies the known-failures ledger (``fp8ref.conformance.known_failures``: a listed failure reads
``xfail`` with its finding, a listed contract that passes ``xpass``) and renders the page;
``--only NAME`` runs one.

Imports flow down: the conformance driver, the checking core and the spec; a third-party package is
imported by its module on first use (``available()`` says what is missing).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...check.loading import WeightLoader
from ...conformance import check_loader
from ...conformance.known_failures import KNOWN_FAILURES
from ...conformance.report import UNTESTED, XFAIL, XPASS, Report, apply_known_failures

__all__ = ["LoaderRow", "rows", "loader_names", "certify_loaders", "render", "main"]


@dataclass
class LoaderRow:
    """One certified loader: its project, version, entry point and report."""

    name: str
    project: str
    version: str
    entry: str
    report: Report | None
    reason: str | None = None
    cpu_seconds: float = 0.0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def rows() -> list[tuple[str, str, str, callable]]:
    """(project, distribution, availability check, loaders factory) per project, in page order."""
    from . import own, sglang, vllm, vllm_online

    return [("fp8ref", "fp8ref", lambda: None, own.loaders), ("vLLM", "vllm", vllm.available, vllm.loaders),
            ("vLLM", "vllm", vllm.available, vllm_online.loaders),
            ("SGLang", "sglang", sglang.available, sglang.loaders)]


def loader_names() -> set[str]:
    """Every loader row's name (the ledger's ``backend`` for loader findings); imports no peer."""
    return {loader.name for *_, make in rows() for loader in make()}


def certify_loaders(only: Sequence[str] | None = None, profile: str = "ci", seed: int = 0,
                    known_failures: Sequence[dict] = KNOWN_FAILURES) -> list[LoaderRow]:
    """Run ``check_loader`` on every loader row (or the named ones), with the ledger applied."""
    out = []
    for project, dist, avail, make in rows():
        wanted = [loader for loader in make() if not only or loader.name in only]
        if not wanted:
            continue
        reason = avail()
        if reason is not None:
            out += [LoaderRow(loader.name, project, _version(dist), _entry(loader), None, reason) for loader in wanted]
            continue
        for loader in wanted:
            t0 = time.process_time()
            rep = apply_known_failures(check_loader(loader, profile, seed=seed), known_failures)
            out.append(LoaderRow(loader.name, project, _version(dist), _entry(loader), rep,
                                 cpu_seconds=time.process_time() - t0))
    return out


def _verdict(rep: Report) -> str:
    """``certified``, ``**FAIL**``, ``**FAIL** (known, ledger)`` (every failure is a ledger entry) or
    ``**UNTESTED**`` (no failure, a contract ran no example)."""
    if rep.verdict != "fail" and any(r.status == XFAIL for r in rep.results):
        return "**FAIL** (known, ledger)"
    return "certified" if rep.verdict == "pass" else f"**{rep.verdict.upper()}**"


def _entry(loader: WeightLoader) -> str:
    return getattr(loader, "entry", None) or (type(loader).__doc__ or "").strip().splitlines()[0]


def _md(s: str | None) -> str:
    return (s or "").replace("|", "\\|").replace("\n", " ")


#: What the rows leave out, and why.
NOT_WRAPPED = ("Not wrapped: SGLang's and vLLM's per-channel online paths (`per_token_group_quant_fp8`, a "
               "Triton kernel whose FP8 cast the CPU interpreter gets wrong, finding 9; vLLM's `fp8_ptpc`), which "
               "the CUDA capability check selects; their weight quantizers alone are certified in docs/certified.md "
               "(`sglang-online-w8a8-cutlass`, `vllm-online-fp8-ptpc`). SGLang's per-tensor checkpoints are wrapped "
               "on both paths: `requantize_with_max_scale` (`-tensor` rows) and CUTLASS's `convert_to_channelwise` "
               "(`-tensor-channelwise` rows). SGLang's per-tensor and online methods "
               "replace the weight by a transposed FP8 `Parameter` without `weight_loader` and do not restore it, "
               "so its weight update (`update_weights_from_disk`) cannot load them again (its reload for them is "
               "`QuantizedRLModelLoader`, model-level, not wrapped): those rows decline `load.reload_idempotent` "
               "and read `untested` where nothing else fails. vLLM's online per-tensor rows run at simulated TP 2-8: "
               "vLLM agrees one scale over the TP group (`all_reduce(MAX)` of the amax, `amax_for_tp_weight_quant`), "
               "answered here with the max of every rank's shard amax, so a rank holds the unsharded weight's "
               "scale, which docs/spec.md §8.2 admits (\"A scale agreed over the TP group\"). Known failures "
               "read `xfail` with their finding (docs/findings.md, `fp8ref/conformance/known_failures.py`).")


def render(certs: Sequence[LoaderRow]) -> str:
    """docs/certified-loaders.md."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    out = ["# Certified loaders: how FP8 weights are loaded, against the Loading rule", "",
           "Generated by `python -m fp8ref.peers.loaders --write docs/certified-loaders.md`; do not edit by hand. "
           f"Machine: {cpu}; torch {torch.__version__}, Python {sys.version.split()[0]}. Profile `ci`, seed 0.", "",
           "Each row drives one real loading path through `fp8ref.conformance.check_loader` (docs/conformance.md, "
           "\"Loader contracts\"): allocate the layer for a layout (fused partitions, TP size and rank, column- or "
           "row-parallel), load every partition's weight (or its checkpoint, the spec's quantization of each full "
           "partition), post-process, and read what the GEMM reads. docs/spec.md §8 says what each element must "
           "dequantize to. Wrappers live in `fp8ref/peers/loaders/`; what they patch to run on a CPU is written "
           "in each module's docstring. Findings have standalone reproductions in `tests/findings/`.", "",
           "| loader | project | version | verdict | failing or untested contracts | examples | CPU s | entry |",
           "|---|---|---|---|---|---|---|---|"]
    for c in certs:
        if c.report is None:
            out.append(f"| `{c.name}` | {c.project} | {c.version} | declined: {_md(c.reason)} | | | | "
                       f"`{_md(c.entry)}` |")
            continue
        rep = c.report
        failing = ", ".join(f"{r.contract} ({r.status})" for r in rep.results
                            if r.failed or r.status in (XFAIL, XPASS, UNTESTED)) or "-"
        verdict = _verdict(rep)
        n = sum(r.examples for r in rep.results)
        out.append(f"| `{c.name}` | {c.project} | {c.version} | {verdict} | {failing} | {n} | {c.cpu_seconds:.1f} | "
                   f"`{_md(c.entry)}` |")
    out += ["", NOT_WRAPPED, "", "## Per loader", ""]
    for c in certs:
        if c.report is None:
            continue
        out += [f"### `{c.name}`", "", "| contract | status | examples | declined | to first failure | worst err/bound "
                "| detail |", "|---|---|---|---|---|---|---|"]
        for r in c.report.results:
            ratio = "" if r.worst_ratio is None else f"{r.worst_ratio:.3g}"
            detail = r.detail("counterexample ", blob=False) if r.failed or r.status == XFAIL else (r.note or "")
            if r.status == XFAIL:
                detail = f"{r.note} -- {detail}"
            declined = r.coverage.get("declined", {}) if r.coverage else {}
            if not r.failed and r.status != XFAIL and declined:
                detail = "declined: " + "; ".join(f"{k} (x{v})" for k, v in list(declined.items())[:2])
            out.append(f"| {r.contract} | {r.status} | {r.examples} | {r.declined} | {r.examples_to_failure or ''} | "
                       f"{ratio} | {_md(detail[:700])} |")
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8ref.peers.loaders", description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="run only this loader (repeatable)")
    ap.add_argument("--write", help="write the rendered page to this path")
    args = ap.parse_args(argv)
    certs = certify_loaders(args.only)
    text = render(certs)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0 if all(c.report is None or c.report.verdict in ("pass", "fail", "untested") for c in certs) else 1
