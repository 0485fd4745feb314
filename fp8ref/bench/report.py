"""The tables ``fp8ref bench`` prints: every figure as a ratio to its ceiling or baseline."""

from __future__ import annotations

from .gemv import format_gemv
from .load import unreliable_reason

__all__ = ["format_report", "QUANT_TARGET"]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


#: The quantization target (issue 16): every scheme at least this fraction of the copy bandwidth.
QUANT_TARGET = 0.40


def _cpu_tag(meta: dict) -> str:
    """`` [on <CPU model>, kind <kind>]``: every table says which CPU it was measured on."""
    if "cpu_model" not in meta:
        return ""
    return f" [on {meta['cpu_model']}, kind {meta.get('cpu_kind', '?')}]"


def _quant_summary(rows: list[dict]) -> list[str]:
    """Per backend: its slowest scheme against the target."""
    out = []
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for b in backends:
        measured = [r for r in rows if r["backend"] == b and r.get("frac_of_copy") is not None]
        if not measured:
            continue
        worst = min(measured, key=lambda r: r["frac_of_copy"])
        met = all(r["frac_of_copy"] >= QUANT_TARGET for r in measured)
        line = (f"  {b:12} slowest {worst['quant']} {100 * worst['frac_of_copy']:.1f} % of copy: every measured "
                f"scheme >= {100 * QUANT_TARGET:.0f} %: {'yes' if met else 'no'}")
        pair = [r for r in measured if r.get("frac_of_copy_paired") is not None]
        if len(pair) == len(measured):
            pw = min(pair, key=lambda r: r["frac_of_copy_paired"])
            pmet = all(r["frac_of_copy_paired"] >= QUANT_TARGET for r in pair)
            line += (f"; paired with a copy: slowest {pw['quant']} {100 * pw['frac_of_copy_paired']:.1f} %, "
                     f"{'yes' if pmet else 'no'}")
        out.append(line)
    return out


def format_report(res: dict) -> str:
    """The tables ``fp8ref bench`` prints: every figure as a ratio to its ceiling or baseline.

    Examples
    --------
    >>> from fp8ref.bench import format_report
    >>> print(format_report({"meta": {"device": "cpu"}, "copy": {"gbps": 10.0},
    ...                      "bf16_peak": {"gflops": 100.0, "n": 2048}}).splitlines()[-1])
    ceilings: memory copy 10.00 GB/s (read + write); bf16 GEMM peak 100.0 GFLOP/s (n=2048)
    """
    out = []
    meta = res.get("meta", {})
    tag = _cpu_tag(meta)
    out.append(f"fp8ref bench on {meta.get('gpu', meta.get('device'))} (torch {meta.get('torch')}, "
               f"{meta.get('cpu_count')} CPUs, {meta.get('torch_threads')} threads, {meta.get('date_utc')}"
               f"{', quick' if meta.get('quick') else ''})")
    if "cpu_model" in meta:
        design = (f"{meta['cpu_vendor']} family {meta.get('cpu_family')} model {meta.get('cpu_model_number')}; "
                  if "cpu_vendor" in meta else "")
        out.append(f"CPU: {meta['cpu_model']} (kind {meta.get('cpu_kind')}; {design}kernel flags: "
                   f"{' '.join(meta.get('cpu_flags', [])) or 'none'})")
    if meta.get("kernel_paths"):
        out.append("kernel paths: " + "; ".join(f"{k}: {v}" for k, v in meta["kernel_paths"].items()))
    if "loadavg_start" in meta:
        out.append(f"load average at start {meta['loadavg_start'][0]:.2f}"
                   + (f", at end {meta['loadavg_end'][0]:.2f}" if "loadavg_end" in meta else ""))
    why = unreliable_reason(meta)
    if why:
        out.append(f"UNRELIABLE ({why}): read every ratio below as a sketch, not a result")
    if res.get("backends_skipped"):
        out.append("backends not run: " + "; ".join(f"{k} ({v})" for k, v in res["backends_skipped"].items()))
    if "copy" in res:
        out.append(f"\nceilings: memory copy {res['copy']['gbps']:.2f} GB/s (read + write); "
                   f"bf16 GEMM peak {res['bf16_peak']['gflops']:.1f} GFLOP/s (n={res['bf16_peak']['n']}){tag}")
    if res.get("gemv"):
        out.append("\n" + format_gemv(res["gemv"]))
        if res.get("gemv_uniform"):
            out.append(format_gemv(res["gemv_uniform"]))
    if res.get("quant"):
        out.append(f"\nquantization (GB/s = input read + codes and scales written; % of memory copy){tag}")
        out.append("  (% paired: against a copy timed in back-to-back rounds with it, immune to bandwidth drift)")
        out.append(f"  {'backend':12} {'quant':13} {'shape':>11} {'GB/s':>9} {'% copy':>7} {'% paired':>8}")
        for r in res["quant"]:
            shape = "x".join(map(str, r["shape"]))
            if "gbps" in r:
                frac, fp = r.get("frac_of_copy"), r.get("frac_of_copy_paired")
                out.append(f"  {r['backend']:12} {r['quant']:13} {shape:>11} {r['gbps']:9.3f} "
                           f"{_fmt(None if frac is None else 100 * frac, '6.1f'):>7} "
                           f"{_fmt(None if fp is None else 100 * fp, '6.1f'):>8}")
            else:
                out.append(f"  {r['backend']:12} {r['quant']:13} {shape:>11}  skipped: {r['skipped'][:60]}")
        out.extend(_quant_summary(res["quant"]))
    if res.get("linear"):
        cols = []
        for r in res["linear"]:
            for b in r["backends"]:
                if b not in cols:
                    cols.append(b)
        out.append("\nlinear (W8A8 per-channel/per-token, bf16 out): speed-up over bf16 F.linear "
                   f"(> 1 = faster) / % of bf16 GEMM peak{tag}")
        out.append(f"  {'K':>5} {'N':>5} {'M':>4} {'bf16 ms':>9} {'bf16 %pk':>8} "
                   + " ".join(f"{c:>15}" for c in cols) + "  auto/fastest")
        for r in res["linear"]:
            cells = []
            for c in cols:
                e = r["backends"].get(c, {})
                if "speedup_vs_bf16" in e:
                    pk = e.get("frac_of_peak")
                    cells.append(f"{e['speedup_vs_bf16']:7.3f}/{_fmt(None if pk is None else 100 * pk, '5.1f'):>5}%"
                                 .rjust(15))
                else:
                    cells.append(("err" if "error" in e else "skip").rjust(15))
            bpk = r.get("bf16_frac_of_peak")
            vs = r.get("fastest_beside", r.get("fastest", "-"))  # the backend auto_over_fastest is against
            out.append(f"  {r['K']:5} {r['N']:5} {r['M']:4} {r['bf16_s'] * 1e3:9.3f} "
                       f"{_fmt(None if bpk is None else 100 * bpk, '7.1f'):>8} " + " ".join(cells)
                       + f"  {_fmt(r.get('auto_over_fastest'), '.3f')} ({vs})")
        gem = [(r, b, e) for r in res["linear"] for b, e in r["backends"].items() if "gemm_speedup_vs_bf16" in e]
        if gem:
            out.append("  FP8 GEMM alone (activations pre-quantized), speed-up over bf16 F.linear:")
            for r, b, e in gem:
                out.append(f"    K={r['K']} N={r['N']} M={r['M']} {b}: {e['gemm_speedup_vs_bf16']:.3f}")
    if "reference" in res:
        ref = res["reference"]
        sm = ref["scaled_mm"]
        out.append(f"\nreference{tag}: exact scaled_mm M={sm['M']} K={sm['K']} N={sm['N']} takes "
                   f"{ref['scaled_mm_over_fp32_linear']:.2f} x fp32 F.linear (target <= "
                   f"{ref['target_scaled_mm_over_fp32_linear']:g}); quantize {ref['quantize']['shape'][0]}x"
                   f"{ref['quantize']['shape'][1]} bf16: {ref['quantize']['gbps']:.3f} GB/s"
                   + (f" = {100 * ref['quantize']['gbps'] / res['copy']['gbps']:.1f} % of copy"
                      if "copy" in res else ""))
    if "selector" in res:
        s = res["selector"]
        if "skipped" in s:
            out.append(f"\nselector: skipped ({s['skipped']})")
        else:
            ov = s.get("dispatch_overhead_s")
            om, ok_, on = s.get("overhead_shape", (s["M"], s["K"], s["N"]))
            out.append(f"\nselector{tag}: first selection (probe + timing) at M={s['M']} K={s['K']} N={s['N']}: "
                       f"{s['first_selection_s'] * 1e3:.1f} ms; from the disk cache {s['disk_lookup_s'] * 1e3:.2f} ms"
                       + (f" (picks {s['selected_at_first_shape']})" if s.get("selected_at_first_shape") else ""))
            out.append(f"  dispatch overhead at M={om} K={ok_} N={on}: "
                       f"{_fmt(None if ov is None else ov * 1e6, '.1f')} us per call "
                       f"({_fmt(None if ov is None else 100 * ov / s['auto_min_s'], '.1f')} % of the auto call"
                       + ("; below the timing noise" if ov is not None and ov < 0 else "") + ")"
                       + (f"; picks {s['selected']}" if s.get("selected") else ""))
    if res.get("conformance"):
        out.append(f"\nconformance throughput{tag}:")
        for c in res["conformance"]:
            if "skipped" in c or "error" in c:
                out.append(f"  {c['backend']:12} {c.get('skipped') or c.get('error')}")
            else:
                out.append(f"  {c['backend']:12} {c['profile']}: {_fmt(c['examples_per_s'], '.1f')} examples/s "
                           f"({c['examples']} in {c['seconds']:.2f} s, passed={c['passed']})")
    if "elapsed_s" in meta:
        out.append(f"\nelapsed {meta['elapsed_s']:.1f} s")
    return "\n".join(out)
