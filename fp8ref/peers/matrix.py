"""Render certificates as ``docs/certified.md`` and read its verdicts back (``fp8ref certify --check``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ..conformance.report import ERROR, FAIL, NA, NOT_CLAIMED, XFAIL, XPASS
from .certify import Certificate, fmt_pct

__all__ = ["render", "merge", "verdicts", "recorded_verdicts", "compare"]

_MARK = "fp8ref-certify-verdicts"

INSTALL = """## Installing the peers

Everything below runs on a CPU with torch held at `constraints.txt` (a CPU build):

```
pip install -c constraints.txt -e ".[peers]"     # onnxruntime, onnx, torchao, compressed-tensors,
                                                 # jax[cpu], optimum-quanto, nvidia-modelopt, triton,
                                                 # flax, tinygrad, openvino, keras
pip install -c constraints.txt --no-deps "sglang==0.5.23" "vllm==0.33.0" "amd-quark==0.13" "onnxslim==0.1.98" \\
    "lmdeploy==0.18.0" "mmengine-lite==0.10.7" addict termcolor yapf platformdirs
pip install -c constraints.txt omegaconf "pulp<4.0"         # nvidia-modelopt's imports
pip install -c constraints.txt orjson pyzmq pybase64 starlette msgspec IPython aiohttp \\
    pydantic pillow regex requests packaging tqdm transformers
```

LMDeploy 0.18.0 declares torch <= 2.12.1 and triton <= 3.7.1 (hence `--no-deps`); its Triton
kernels and online weight quantization import only the small packages on that line. SGLang and
vLLM declare a CUDA torch and ~50 serving packages each; `--no-deps` plus the small packages on the
last line (the minimal set their FP8 kernel modules import, found by importing them
in a fresh virtual environment) is enough for their Triton kernels. The online weight-quantization
rows (`sglang-online-*`, `vllm-online-*`, `vllm-quantfp8-native`) import SGLang's and vLLM's model
and config packages, which reach much more: they ran in a separate environment where
`pip install -c constraints.txt vllm` (the resolver, holding torch, picks vllm 0.32.0 and its
dependencies), then `pip install --no-deps sglang==0.5.23 vllm==0.33.0`, then `pip uninstall
torchvision torchaudio torchcodec flashinfer-python` (built for another torch, or CUDA-only: their
imports fail or crash on a CPU). SGLang's configs import torchvision at module level; where it does
not import, the adapter puts in a stand-in that refuses every call (`fp8ref/peers/sglang.py`).
tinygrad runs on its `PYTHON` device (its `CPU` device needs clang). OpenVINO (a 59 MB wheel that
depends on numpy, packaging and openvino-telemetry only, not on torch) runs on its CPU plugin with
`INFERENCE_PRECISION_HINT=f32` pinned by the adapters (the default is bf16 on CPUs with AVX512-BF16
or AMX). jax 0.10.2 is the newest
release for Python 3.11. Peers whose package is missing are listed as *not run here* with the exact
missing piece.
SGLang's loader rows (docs/certified-loaders.md) also need `pip install -c constraints.txt --no-deps
sentencepiece` (its parameters' weight loaders import its model-loader package, which reaches a
tokenizer config).

Regenerate this page with `fp8ref certify` (about 20 minutes on 2 cores: the Triton kernels run in
the interpreter, tinygrad in its Python emulator); `fp8ref certify --peer NAME --only CONTRACT`
reproduces one result; `fp8ref certify --peer NAME --merge docs/certified.md` recomputes one row and
keeps the others (the page then says which rows were merged, where); `tests/test_peers.py`
recomputes the onnxruntime, onnx-reference, torchao and torchao-float8-training rows in CI and fails
when their verdicts no longer match this page."""

_FAILING = (FAIL, ERROR, XPASS)
#: Contracts that did not run for the peer: an op it does not declare, an info contract with no example.
_NOT_RUN = (NA, NOT_CLAIMED)


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def verdicts(cert: Certificate) -> dict[str, str]:
    """contract -> status (``unavailable`` for a peer that cannot run here)."""
    if not cert.report.available:
        return {"*": "unavailable"}
    return {r.contract: r.status for r in cert.report.results}


def _verdict(cert: Certificate) -> str:
    rep = cert.report
    if not rep.available:
        return "not run here"
    ran = sum(r.examples for r in rep.results if r.status not in _NOT_RUN)
    if ran == 0:
        return "**no examples ran** (not certified)"
    if any(r.status in _FAILING for r in rep.results):
        return "**FAILED**"
    if any(r.status == XFAIL for r in rep.results):
        return "**FAILED** (known, ledger)"
    return "certified"


def _failing(cert: Certificate) -> str:
    bad = [r for r in cert.report.results if r.status in _FAILING + (XFAIL,)]
    return ", ".join(f"{r.contract} ({r.status})" for r in bad) or "-"


def _exact(cert: Certificate) -> str:
    if cert.exact_label == "outputs":
        return f"outputs {fmt_pct(cert.exact_outputs)} %"
    if cert.exact_label:
        return f"codes {fmt_pct(cert.exact_codes)} %, scales {fmt_pct(cert.exact_scales)} %"
    return ""


def _coverage(cert: Certificate) -> str:
    res = cert.report.results
    run = [r for r in res if r.status not in _NOT_RUN]
    return f"{len(run)}/{len(res)} contracts, {sum(r.examples for r in res)} examples" if res else ""


#: Where the loader rows are (a page of their own: ``python -m fp8ref.peers.loaders``).
LOADERS_NOTE = ("How weights are *loaded* -- fused partitions, tensor-parallel shards, reloads, source dtypes "
                "(docs/spec.md §8) -- is certified separately by `fp8ref.conformance.check_loader`: "
                "docs/certified-loaders.md (fp8ref's own loading paths, vLLM's FP8 checkpoint loading and online "
                "quantization, SGLang's FP8 loading, offline and online).")
#: Where the mixture-of-experts rows are (a page of their own: ``python -m fp8ref.peers.moe_certify``).
MOE_NOTE = ("FP8 mixture-of-experts layers (docs/spec.md §7) are certified by `fp8ref.conformance.moe.check_moe`: "
            "docs/certified-moe.md (SGLang's and vLLM's Triton `fused_moe` FP8 paths).")


def render(certs: Sequence[Certificate], header: dict) -> str:
    """The whole ``docs/certified.md``."""
    out = [
        "# Certified: third-party FP8 implementations against the fp8ref spec",
        "",
        "Generated by `" + header["command"] + "`; do not edit by hand. Machine: " + header["machine"] + "; "
        + header["versions"] + ". Profile `" + header["profile"] + "`, seed " + str(header["seed"]) + ".",
        "",
        "Each row is one real implementation, called through a thin adapter in `fp8ref/peers/` that adapts "
        "conventions (scale layout, multiply vs divide, argument order) and never the numerics. Each is checked "
        "against the conformance contracts (`docs/conformance.md`) on the schemes it computes: its legitimate "
        "scale conventions are filled in (docs/spec.md §3.1: scale computed in the input's dtype, a zero "
        "block's scale, E8M0 scales, subnormal scales, a scale written 1/(qmax/amax), codes x*m, a stored "
        "multiplier); its defects are not. Declarations (accumulation, output "
        "roundings) are read from each peer's source; the bounds follow from them. Triton kernels run under "
        "`TRITON_INTERPRET=1` with fp8ref's interpreter patch (`fp8ref/peers/triton_interpreter.py`: correctly "
        "rounding downcasts and bf16 arithmetic) so that Triton's own interpreter bugs are not blamed on them. "
        "Known failures (`fp8ref/conformance/known_failures.py`) read `xfail` with their upstream link; "
        "`docs/findings.md` has a standalone reproduction of each.",
        "",
        "Columns: *bit-exact* compares codes and scales (quantizers) or outputs (GEMMs) with the reference's "
        "bits on a fixed corpus of the schemes the peer takes; *accumulator* is the probe's reading in bits "
        "(`fp8ref.conformance.accumulator_bits`); *non-finite* is what a NaN/Inf input does (the spec raises).",
        "",
        LOADERS_NOTE,
        "",
        MOE_NOTE,
        "",
        "| implementation | version | entry | ops | verdict | failing contracts | expresses | bit-exact | "
        "declares | accumulator bits | batch-invariant | non-finite input | coverage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in certs:
        rep = c.report
        if not rep.available:
            out.append(f"| `{c.peer}` ({_md(c.project)}) | {c.version or 'not installed'} | `{_md(c.entry)}` | "
                       f"{', '.join(c.ops)} | not run here: {_md(rep.reason)} | | | | {_md(c.declaration)} | | | | |")
            continue
        bits = "n/a" if rep.accumulator_bits is None else (f">={rep.accumulator_bits}" if rep.accumulator_bits >= 35
                                                             else str(rep.accumulator_bits))
        out.append(f"| `{c.peer}` ({_md(c.project)}) | {c.version} | `{_md(c.entry)}` | {', '.join(c.ops)} | "
                   f"{_verdict(c)} | {_md(_failing(c))} | {_md(c.expressible)} | {_exact(c)} | {_md(c.declaration)} | "
                   f"{bits} | {rep.batch_invariant or 'n/a'} | {_md(c.non_finite)} | {_coverage(c)} |")
    out += ["", INSTALL, "", "## Per implementation", ""]
    for c in certs:
        rep = c.report
        out.append(f"### `{c.peer}`: {c.project} {c.version or '(not installed)'}")
        out.append("")
        out.append(f"`{c.entry}`. Numerics read from the source: {c.notes}. Declares {c.declaration}.")
        out.append("")
        if not rep.available:
            out += [f"Not run here: {rep.reason}", ""]
            continue
        out.append(f"{_verdict(c)} in {c.seconds:.0f} s ({rep.profile} profile, seed {rep.seed}). Expresses: "
                   f"{c.expressible}. Bit-exact: {_exact(c)} of {c.exact_samples} elements. Non-finite input: "
                   f"{c.non_finite}.")
        out += ["", "| contract | status | examples | declined | worst err/bound | detail |",
                "|---|---|---|---|---|---|"]
        for r in rep.results:
            detail = r.detail("minimal counterexample ", blob=False)
            if r.status in ("xfail", "xpass") and r.note:
                detail = f"{r.note}. {detail}"
            ratio = "" if r.worst_ratio is None else f"{r.worst_ratio:.3g}"
            out.append(f"| {r.contract} | {r.status} | {r.examples} | {r.declined} | {ratio} | {_md(detail[:700])} |")
        out.append("")
    data = {c.peer: verdicts(c) for c in certs}
    out.append(f"<!-- {_MARK} {json.dumps(data, sort_keys=True)} -->")
    return "\n".join(out) + "\n"


_ROW = re.compile(r"^\| `([^`]+)` \(")
_SECTION = re.compile(r"^### `([^`]+)`: ")
_MERGED = "Rows merged by `fp8ref certify --merge`"


def _split(text: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """A rendered matrix as (preamble lines before the table, row per peer, section per peer)."""
    lines = text.splitlines()
    pre: list[str] = []
    rows: dict[str, str] = {}
    secs: dict[str, list[str]] = {}
    current = None
    in_table = False
    for line in lines:
        if line.startswith("| implementation |"):
            in_table = True
            continue
        if not in_table:
            pre.append(line)
            continue
        m = _ROW.match(line)
        if m and current is None:
            rows[m.group(1)] = line
            continue
        m = _SECTION.match(line)
        if m:
            current = m.group(1)
            secs[current] = [line]
            continue
        if line.startswith(f"<!-- {_MARK} "):
            current = None
            continue
        if current is not None:
            secs[current].append(line)
    while pre and not pre[-1].strip():
        pre.pop()
    return pre, rows, {k: "\n".join(v).rstrip("\n") for k, v in secs.items()}


def _superseded(line: str, merged: set[str]) -> str | None:
    """``line``, or for an earlier merge note the note without the rows recomputed now (None when
    it names none that are left)."""
    if not line.startswith(_MERGED):
        return line
    head, _, names = line.rpartition(": ")
    left = [n for n in re.findall(r"`([^`]+)`", names) if n not in merged]
    return f"{head}: " + ", ".join(f"`{n}`" for n in left) + "." if left else None


def merge(text: str, certs: Sequence[Certificate], header: dict, order: Sequence[str]) -> str:
    """``text`` (a rendered ``docs/certified.md``) with the rows, sections and verdicts of ``certs``
    put in -- replacing those peers' old ones -- and every other peer's kept as recorded; rows follow
    ``order`` (the peers' matrix order). A line under the header names the merged rows and the
    machine and versions they were computed with, so that a page whose rows come from two runs says so."""
    fresh = render(certs, header)
    pre, rows, secs = _split(text)
    _, new_rows, new_secs = _split(fresh)
    rows.update(new_rows)
    secs.update(new_secs)
    names = [n for n in order if n in rows] + [n for n in rows if n not in order]
    data = recorded_verdicts(text)
    data.update({c.peer: verdicts(c) for c in certs})
    note = (f"{_MERGED} (profile `{header['profile']}`, seed {header['seed']}) on {header['machine']}; "
            f"{header['versions']}: " + ", ".join(f"`{c.peer}`" for c in certs) + ".")
    merged = {c.peer for c in certs}
    pre = [kept for line in pre if (kept := _superseded(line, merged)) is not None]
    while pre and not pre[-1].strip():
        pre.pop()
    table = fresh.splitlines()
    head = [table.index(line) for line in table if line.startswith("| implementation |")][0]
    out = pre + ["", note, ""] + table[head:head + 2] + [rows[n] for n in names]
    out += ["", INSTALL, "", "## Per implementation", ""]
    for n in names:
        if n in secs:
            out += [secs[n], ""]
    out.append(f"<!-- {_MARK} {json.dumps(data, sort_keys=True)} -->")
    return "\n".join(out) + "\n"


def recorded_verdicts(text: str) -> dict[str, dict[str, str]]:
    """The verdicts a rendered ``docs/certified.md`` records (empty if none)."""
    m = re.search(rf"<!-- {_MARK} (.*?) -->", text, re.S)
    return json.loads(m.group(1)) if m else {}


def _detail(cert: Certificate, contract: str) -> str:
    """What the fresh run said about ``contract``: its message, counterexample and reproduction."""
    for r in cert.report.results:
        if r.contract == contract:
            parts = [r.message or r.note or "", f"counterexample {r.counterexample}" if r.counterexample else "",
                     f"reproduce: {r.reproduce}" if r.reproduce else ""]
            return "; ".join(p for p in parts if p)
    return ""


def compare(certs: Sequence[Certificate], recorded: dict[str, dict[str, str]]) -> list[str]:
    """Differences between fresh certificates and recorded verdicts (empty: the matrix is current)."""
    diffs = []
    for c in certs:
        want = recorded.get(c.peer)
        got = verdicts(c)
        if want is None:
            diffs.append(f"{c.peer}: not in the recorded matrix")
            continue
        for contract in sorted(set(want) | set(got)):
            if want.get(contract) != got.get(contract):
                line = f"{c.peer} {contract}: recorded {want.get(contract)}, now {got.get(contract)}"
                why = _detail(c, contract)
                diffs.append(f"{line} ({why})" if why else line)
    return diffs
