"""The GPU run's targets (stated for an H200) and their evaluation as pass / fail / no data."""

from __future__ import annotations

from collections.abc import Sequence

from ..spec.bounds import PrecisionClass

__all__ = ["TARGETS", "ACT_QUANTS", "evaluate_targets", "overall"]

#: The targets of the GPU run (issue 6), stated for an H200.
TARGETS = {
    #: FP8 GEMM (activations already quantized) over bf16 F.linear (cuBLAS) at M >= fp8_gemm_min_m.
    "fp8_gemm_speedup_min": 1.6,
    "fp8_gemm_min_m": 1024,
    #: Activation quantization GB/s over the device-to-device copy GB/s.
    "act_quant_frac_of_copy_min": 0.70,
    #: auto's time over the fastest compliant backend's, per shape.
    "auto_over_fastest_max": 1.05,
}

#: The activation quantizations the copy-bandwidth target is evaluated on.
ACT_QUANTS = ("per-token", "per-group128", "per-tensor")


def _target(name: str, case: str, value: float | None, op: str, threshold: float, detail: str) -> dict:
    if value is None:
        passed = None
    elif op == ">=":
        passed = value >= threshold
    else:
        passed = value <= threshold
    return {"target": name, "case": case, "value": value, "op": op, "threshold": threshold, "passed": passed,
            "detail": detail}


def evaluate_targets(res: dict, compliant: Sequence[str] | None = None, targets: dict | None = None) -> list[dict]:
    """Pass/fail of every target on the figures in ``res`` (the dict ``fp8ref.bench.run`` returns).

    Parameters
    ----------
    res : dict
        Needs ``linear`` and ``quant`` rows as ``fp8ref.bench`` writes them; missing ones give
        targets with ``passed=None`` ("no data"), never a pass.
    compliant : sequence of str, optional
        Backends that passed conformance; only they count. None: every measured backend counts.
        For the ``auto`` target, a backend must also be of a precision class that ``auto``
        admits (the rows' ``precision`` fields, when recorded): ``auto`` at ``standard`` is
        not compared with a ``fast`` backend it may not pick.
    targets : dict, optional
        Thresholds; ``TARGETS`` by default.

    Returns
    -------
    list of dict
        One per (target, case): ``target, case, value, op, threshold, passed, detail``.

    Examples
    --------
    >>> from fp8ref.gpu_check import evaluate_targets
    >>> row = {"K": 8, "N": 8, "M": 1024, "bf16_s": 2.0,
    ...        "backends": {"torch": {"seconds": 1.0, "speedup_vs_bf16": 2.0, "gemm_speedup_vs_bf16": 2.5}}}
    >>> [(t["target"], t["passed"]) for t in evaluate_targets({"linear": [row], "quant": []})][:2]
    [('fp8_gemm_vs_bf16', True), ('act_quant_vs_copy', None)]
    """
    tg = dict(TARGETS if targets is None else targets)
    ok = (lambda b: b != "auto") if compliant is None else (lambda b: b in compliant)
    out = []
    linear = res.get("linear") or []
    big = [r for r in linear if r["M"] >= tg["fp8_gemm_min_m"]]
    if not big:
        out.append(_target("fp8_gemm_vs_bf16", f"M >= {tg['fp8_gemm_min_m']}", None, ">=", tg["fp8_gemm_speedup_min"],
                           "no data: no linear row at this M"))
    for r in big:
        cands = {}
        for b, e in r["backends"].items():
            if not ok(b):
                continue
            if "gemm_speedup_vs_bf16" in e:
                cands[b] = (e["gemm_speedup_vs_bf16"], "GEMM alone")
            elif "speedup_vs_bf16" in e:
                cands[b] = (e["speedup_vs_bf16"], "linear incl. activation quantization")
        case = f"K={r['K']} N={r['N']} M={r['M']}"
        if cands:
            best = max(cands, key=lambda b: cands[b][0])
            out.append(_target("fp8_gemm_vs_bf16", case, cands[best][0], ">=", tg["fp8_gemm_speedup_min"],
                               f"best: {best} ({cands[best][1]})"))
        else:
            out.append(_target("fp8_gemm_vs_bf16", case, None, ">=", tg["fp8_gemm_speedup_min"],
                               "no data: no compliant backend measured"))
    quant_rows = res.get("quant") or []
    for qname in ACT_QUANTS:
        cands = {r["backend"]: r["frac_of_copy"] for r in quant_rows
                 if r.get("quant") == qname and "frac_of_copy" in r and ok(r["backend"])}
        if cands:
            best = max(cands, key=cands.get)
            out.append(_target("act_quant_vs_copy", qname, cands[best], ">=", tg["act_quant_frac_of_copy_min"],
                               f"best: {best}"))
        else:
            out.append(_target("act_quant_vs_copy", qname, None, ">=", tg["act_quant_frac_of_copy_min"],
                               "no data: no compliant backend measured with a copy bandwidth"))
    autos = [r for r in linear if "seconds" in r["backends"].get("auto", {})]
    for r in autos:
        need = r["backends"]["auto"].get("precision")
        times = {b: e["seconds"] for b, e in r["backends"].items()
                 if b != "auto" and "seconds" in e and ok(b) and _admits(need, e.get("precision"))}
        case = f"K={r['K']} N={r['N']} M={r['M']}"
        if not times:
            out.append(_target("auto_vs_fastest", case, None, "<=", tg["auto_over_fastest_max"],
                               "no data: no compliant backend measured"))
            continue
        best = min(times, key=times.get)
        sel = r["backends"]["auto"].get("selected")
        note = f"fastest: {best}" + (f"; auto picked {sel}" if sel else "")
        # auto timed back to back with the fastest backends on the same weight, where the bench did
        # (bench.linear._auto_beside_the_fastest); else the quotient of two medians taken apart
        beside = {b: v for b, v in r.get("auto_beside", {}).items() if b in times}
        if best in beside:
            value = max(beside.values())
            note += "; timed beside auto: " + ", ".join(f"{b} {v:.3f}" for b, v in beside.items())
        else:
            value = r["backends"]["auto"]["seconds"] / times[best]
        out.append(_target("auto_vs_fastest", case, value, "<=", tg["auto_over_fastest_max"], note))
    if not autos:
        out.append(_target("auto_vs_fastest", "all shapes", None, "<=", tg["auto_over_fastest_max"],
                           "no data: auto was not measured"))
    return out


def _admits(required: str | None, declared: str | None) -> bool:
    """Whether auto, requiring class ``required``, may pick a backend of class ``declared``
    (True when either is unknown: then every backend counts)."""
    if required is None or declared is None:
        return True
    return PrecisionClass(required).admits(PrecisionClass(declared))


def overall(targets: list[dict]) -> bool | None:
    """True if every target passed, False if one failed, None if none failed but some lack data."""
    if any(t["passed"] is False for t in targets):
        return False
    if not targets or any(t["passed"] is None for t in targets):
        return None
    return True
