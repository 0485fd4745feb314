"""``audit_model``: run a model in float and in FP8 side by side and measure every ``nn.Linear``.

How one batch is processed (docs/audit.md):

1. **Float pass.** Forward hooks on every audited ``nn.Linear`` keep the exact float input
   ``x_fp`` and output ``y_fp`` and, for every backend audited, compute the layer's FP8 output
   on that exact input: the layer's *own* error, and (on a sample of rows) the worst ratio of
   |error| to the spec's end-to-end bound ``fp8ref.spec.bounds.linear_error_bound``.
2. **One FP8 pass per backend.** The hooks replace each layer's output with the FP8 output
   computed from the input the FP8 model actually produced (``x_q``): the *total* error against
   ``y_fp``, the incoming error ``x_q`` vs ``x_fp``, and the part of the error the float layer
   propagates (``W x_q`` vs ``W x_fp``). The model's outputs give the model metrics.

Statistics are accumulated as sums over batches, so memory holds one batch's activations.
"""

from __future__ import annotations

import fnmatch
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._progress import progress as _progress
from ..spec.schemes import W8A8_FP8, Recipe, get_recipe
from .flags import layer_flags, model_flags
from .outputs import LmAccumulator, batches, call_model, detect_kind, embedding, encoder_metrics, logits, token_ids
from .report import AuditReport, BackendAudit, LayerStats, Thresholds
from .runner import Runner
from .stats import RATIO_BIN_EDGES, ErrorAccumulator, LayerAccumulator, bound_check, sat_flush

__all__ = ["audit_model", "linear_layers", "RATIO_BIN_EDGES", "ErrorAccumulator"]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def linear_layers(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules an audit hooks: every one except those matching ``skip``
    (an exact name, a dotted suffix, or an ``fnmatch`` pattern)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _matches(n, skip)]


class _State:
    """What the hooks share during one forward pass."""

    def __init__(self) -> None:
        self.mode = "off"
        self.runner: Runner | None = None
        self.store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.depth: dict[str, int] = {}
        self.last: tuple | None = None
        self.last_view: tuple | None = None


def audit_model(model: nn.Module, inputs: Any, *, recipe: Recipe | str = W8A8_FP8,
                backends: Sequence[str] = ("reference", "auto"), skip: Sequence[str] = ("lm_head",),
                bound_rows: int = 8, bound_cols: int = 64, bound_batches: int = 1, precision: str = "standard",
                kind: str = "auto",
                thresholds: Thresholds | None = None, model_name: str = "", text_name: str = "",
                progress: bool = False, candidates: Sequence[str] | None = None) -> AuditReport:
    """Audit every ``nn.Linear`` of ``model`` run in FP8 against the float model, per backend.

    Parameters
    ----------
    model : nn.Module
        The float model (left unchanged: the audit only adds hooks, removed on return).
    inputs : torch.Tensor, dict or list
        Token ids ``[B, T]`` (each row is one batch), a dict of model kwargs, or a list of
        either (one forward per item). Encoders take dicts with ``attention_mask``.
    recipe : Recipe or str
        Quantization recipe, default ``W8A8_FP8`` (per-channel weights, per-token activations).
    backends : sequence of str
        Backends to audit: registry names, or ``"auto"`` (what ``fp8ref.linear`` chooses). An
        unavailable named backend, or one that declines a layer's case, raises ``ValueError``
        with its reason.
    skip : sequence of str
        Linear layers left in float (default ``lm_head``, as SGLang's online FP8 does).
    bound_rows, bound_cols, bound_batches : int
        The error is checked against ``fp8ref.spec.bounds.linear_error_bound`` on a sample of
        ``bound_rows`` tokens x ``bound_cols`` output channels of each layer's output, in the
        first ``bound_batches`` batches (the bound costs several float64 GEMMs and an elementwise
        bound on the weight: sampling keeps it a small part of the audit). 0 rows disables it.
    precision : str
        Precision class handed to ``fp8ref.linear`` for ``"auto"``.
    candidates : sequence of str, optional
        The backends ``"auto"`` may choose among (``fp8ref.linear``'s ``candidates``); by default
        every shipped and user-registered backend, and entry-point ones only when
        ``FP8REF_ALLOW_BACKENDS`` names them.
    kind : str
        ``"auto"``, ``"causal_lm"`` or ``"encoder"``.
    thresholds : Thresholds, optional
        When layers and models are flagged.
    model_name, text_name : str
        Recorded in the report.
    progress : bool
        Show a progress bar (tqdm, when installed) over the forward passes.

    Returns
    -------
    AuditReport

    Examples
    --------
    >>> import torch, fp8ref
    >>> from fp8ref.audit import audit_model
    >>> class Tiny(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = torch.nn.Embedding(50, 32)
    ...         self.fc, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 50)
    ...     def forward(self, ids):
    ...         return self.out(torch.relu(self.fc(self.emb(ids))))
    >>> torch.manual_seed(0) and None
    >>> rep = audit_model(Tiny(), torch.randint(0, 50, (2, 16)), backends=("reference",), skip=())
    >>> [lay.name for lay in rep.audits[0].layers]
    ['fc', 'out']
    >>> rep.audits[0].layers[0].bound_ratio_max <= 1.0
    True
    """
    recipe = get_recipe(recipe)
    th = Thresholds() if thresholds is None else thresholds
    if kind not in ("auto", "causal_lm", "encoder"):
        raise ValueError(f"kind must be 'auto', 'causal_lm' or 'encoder', got {kind!r}")
    if isinstance(backends, str):
        backends = (backends,)
    if not backends or len(set(backends)) != len(backends):
        raise ValueError(f"backends must be a non-empty sequence of distinct names, got {backends!r}")
    for nm, v in (("bound_rows", bound_rows), ("bound_cols", bound_cols), ("bound_batches", bound_batches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{nm} must be an int >= 0, got {v!r}")
    layers = linear_layers(model, skip)
    if not layers:
        raise ValueError("the model has no nn.Linear to audit (after skip)")
    todo = batches(inputs)
    runners = [Runner(b, recipe, precision, None if candidates is None else tuple(candidates)) for b in backends]
    accs: list[dict[str, LayerAccumulator]] = [{} for _ in runners]
    st = _State()

    def hook(module: nn.Linear, args, output):
        """Observe (float pass) or compute (FP8 pass, ``output`` is None: the float layer is
        not run) one call of an audited layer."""
        name = module._fp8ref_audit_name
        call = st.calls.get(name, 0)
        st.calls[name] = call + 1
        key = name if call == 0 else f"{name}#{call}"
        x = args[0].detach()
        if st.last_view is not None and st.last_view[0] is x:
            x2 = st.last_view[1]  # one view per input tensor, so layers sharing it share x_fp too
        else:
            x2 = x.reshape(-1, x.shape[-1])
            st.last_view = (x, x2)
        w, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
        od = x.dtype if output is None else output.dtype
        if key not in st.depth:
            st.depth[key] = len(st.depth)
        if st.mode == "fp":
            y_fp = output.detach().reshape(-1, output.shape[-1])
            st.store[key] = (x2, y_fp)
            for i, r in enumerate(runners):
                acc = accs[i].get(key) or accs[i].setdefault(
                    key, LayerAccumulator(key, st.depth[key], w.shape[0], w.shape[1]))
                y, qx, qw, b = r(key, x2, w, bias, od, x)
                acc.own.add(y, y_fp)
                acc.backends.add(b.name)
                if acc.w_stats is None:
                    sat, fl, nz = sat_flush(w, qw)
                    sc = qw.scale.to(torch.float64)
                    acc.w_stats = (sat / max(w.numel(), 1), fl / max(nz, 1), float(sc.min()), float(sc.max()))
                if bound_rows and bound_cols and x2.shape[0] and acc.bound_calls < bound_batches:
                    acc.bound_calls += 1
                    bound_check(acc, x2, w, bias, y, qx=qx(), qw=qw, b=b, od=od, rows=bound_rows, cols=bound_cols)
            return None
        # FP8 pass of the active runner: replace the output.
        i = runners.index(st.runner)
        if key not in st.store:  # a call the float pass did not make (data-dependent control flow)
            y = st.runner(key, x2, w, bias, od, x)[0]
            return y.reshape(*x.shape[:-1], y.shape[-1]).to(od)
        acc = accs[i][key]
        x_fp, y_fp = st.store[key]
        shared = st.last is not None and st.last[0] is x and st.last[1] is x_fp
        if not shared:
            # Statistics of the input, computed once for the layers that share it.
            finite = bool(torch.isfinite(x2).all())
            st.last = (x, x_fp, ErrorAccumulator.sums(x2, x_fp), finite, None)
        _, _, inp_sums, finite, act = st.last
        acc.inp.add_sums(inp_sums)
        if not finite:
            acc.nonfinite_input += 1
            y = torch.full_like(y_fp, float("nan"))
        else:
            y, qx, _, _ = st.runner(key, x2, w, bias, od, x)
            if act is None:
                q = qx()
                sc = q.scale.to(torch.float64)
                act = (*sat_flush(x2, q), float(sc.min()), float(sc.max()))
                st.last = st.last[:4] + (act,)
            sat, fl, nz, smin, smax = act
            acc.a_sat += sat
            acc.a_flushed += fl
            acc.a_nonzero += nz
            acc.a_numel += x2.numel()
            acc.a_smin, acc.a_smax = min(acc.a_smin, smin), max(acc.a_smax, smax)
            acc.prop.add(F.linear(x2, w, bias), y_fp)
        acc.total.add(y, y_fp)
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(od)

    def patched(m: nn.Linear, inner):
        # In the FP8 pass the layer's float output is not needed: skip computing it.
        def forward(x, *args, **kwargs):
            if st.mode == "fp8":
                return hook(m, (x,), None)
            out = inner(x, *args, **kwargs)
            if st.mode == "fp":
                hook(m, (x,), out)
            return out

        return forward

    saved = []
    for name, m in layers:
        m._fp8ref_audit_name = name
        # An instance-level forward (e.g. set by accelerate's hooks) is kept and restored.
        saved.append((m, m.__dict__.get("forward")))
        m.forward = patched(m, m.forward)
    lm_accs = [LmAccumulator() for _ in runners]
    emb_fp: list[torch.Tensor] = []
    emb_q: list[list[torch.Tensor]] = [[] for _ in runners]
    n_tok = 0
    t_start = time.perf_counter()
    bar = None
    if progress:  # a bar on a terminal, a line every half minute in a log (fp8ref._progress)
        bar = _progress(total=len(todo) * (1 + len(runners)), desc="audit passes", unit="pass")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in todo:
                st.mode, st.store, st.calls, st.last, st.last_view = "fp", {}, {}, None, None
                out_fp = call_model(model, batch)
                if kind == "auto":
                    kind = detect_kind(out_fp)
                ids = token_ids(batch)
                n_tok += int(ids.numel()) if ids is not None else 0
                if bar is not None:
                    bar.update(1)
                for i, r in enumerate(runners):
                    st.mode, st.runner, st.calls, st.last, st.last_view = "fp8", r, {}, None, None
                    out_q = call_model(model, batch)
                    if kind == "causal_lm":
                        lm_accs[i].add(logits(out_fp), logits(out_q), ids)
                    else:
                        emb_q[i].append(embedding(out_q, batch))
                    if bar is not None:
                        bar.update(1)
                if kind == "encoder":
                    emb_fp.append(embedding(out_fp, batch))
                st.store, st.last, st.last_view = {}, None, None
    finally:
        st.mode = "off"
        for m, own in saved:
            if own is None:
                del m.forward
            else:
                m.forward = own
        for _, m in layers:
            del m._fp8ref_audit_name
        if bar is not None:
            bar.close()
        model.train(was_training)

    audits = []
    for i, r in enumerate(runners):
        stats = []
        for acc in sorted(accs[i].values(), key=lambda a: a.depth):
            ws = acc.w_stats or (float("nan"),) * 4
            s = LayerStats(
                name=acc.name, depth=acc.depth, out_features=acc.N, in_features=acc.K,
                backend=",".join(sorted(acc.backends)), own=acc.own.stats(), total=acc.total.stats(),
                input_rel_l2=acc.inp.stats().rel_l2, propagated_rel_l2=acc.prop.stats().rel_l2,
                bound_ratio_max=acc.ratio_max if acc.ratio_rows else float("nan"), bound_samples=acc.ratio_rows,
                bound_ratio_hist=list(acc.hist), weight_saturated=ws[0], weight_flushed=ws[1],
                act_saturated=acc.a_sat / acc.a_numel if acc.a_numel else float("nan"),
                act_flushed=acc.a_flushed / acc.a_nonzero if acc.a_nonzero else 0.0,
                weight_scale_min=ws[2], weight_scale_max=ws[3],
                act_scale_min=acc.a_smin if acc.a_numel else float("nan"),
                act_scale_max=acc.a_smax if acc.a_numel else float("nan"))
            s.flags = layer_flags(s, th, acc.nonfinite_input)
            stats.append(s)
        if kind == "causal_lm":
            mm = lm_accs[i].metrics()
        else:
            mm = encoder_metrics(torch.cat(emb_fp), torch.cat(emb_q[i]), n_tok)
        resolved = sorted({b for acc in accs[i].values() for b in acc.backends})
        audits.append(BackendAudit(backend=r.spec, resolved=resolved, note=r.note, layers=stats, model=mm,
                                   flags=model_flags(mm, th, stats), seconds=r.seconds))
    meta = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "batches": len(todo), "tokens": n_tok, "layers_audited": len(layers), "skipped": list(skip),
        "bound_sample": f"{bound_rows} tokens x {bound_cols} channels per layer, first {bound_batches} batch(es)",
        "precision": precision,
        "seconds": round(time.perf_counter() - t_start, 2),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    return AuditReport(model=model_name or type(model).__name__, recipe=recipe.name, text=text_name,
                       audits=audits, meta=meta, thresholds=th)
