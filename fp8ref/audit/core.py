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
import math
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Backend, Case, decline_reason, get_backend
from ..spec import bounds
from ..spec.quant import Quantized, expand_scale, saturation_threshold
from ..spec.schemes import W8A8_FP8, Granularity, Recipe, get_recipe
from .report import AuditReport, BackendAudit, ErrorStats, LayerStats, ModelMetrics, Thresholds

__all__ = ["audit_model", "linear_layers", "RATIO_BIN_EDGES", "ErrorAccumulator"]

#: log10 edges of the error/bound histogram kept per layer: 10**-8 .. 10**2 in quarter decades
#: (ratios outside are counted in the first/last bin).
RATIO_BIN_EDGES = tuple(-8.0 + 0.25 * k for k in range(41))


class ErrorAccumulator:
    """Sums that give rel. L2 error, SQNR, cosine and max |error| of ``y`` against ``r``."""

    def __init__(self) -> None:
        self.err2 = self.ref2 = self.out2 = self.dot = 0.0
        self.max_abs = 0.0
        self.n = 0

    @staticmethod
    def sums(y: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float, float, float, int]:
        """(sum (y-r)^2, sum r^2, sum y^2, sum y r, max |y-r|, n) of one call.

        Computed in fp32 (float64 for float64 inputs) with BLAS dot products: these are
        statistics of an FP8 error of ~2**-5 relative, for which fp32 sums (relative error
        ~ sqrt(n) 2**-24 in practice) are ample, and one pass each keeps the audit cheap.
        """
        wide = torch.float64 if torch.float64 in (y.dtype, r.dtype) else torch.float32
        y = y.detach().reshape(-1).to(wide)
        r = r.detach().reshape(-1).to(wide)
        d = y - r
        if not d.numel():
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0
        return (float(torch.dot(d, d)), float(torch.dot(r, r)), float(torch.dot(y, y)), float(torch.dot(y, r)),
                float(d.abs().max()), d.numel())

    def add(self, y: torch.Tensor, r: torch.Tensor) -> None:
        self.add_sums(self.sums(y, r))

    def add_sums(self, s: tuple[float, float, float, float, float, int]) -> None:
        self.err2 += s[0]
        self.ref2 += s[1]
        self.out2 += s[2]
        self.dot += s[3]
        self.max_abs = s[4] if math.isnan(s[4]) else max(self.max_abs, s[4])
        self.n += s[5]

    def stats(self) -> ErrorStats:
        if self.n == 0:
            return ErrorStats()
        nan = float("nan")
        if math.isnan(self.err2):
            return ErrorStats(nan, nan, nan, nan)
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else (0.0 if self.err2 == 0 else math.inf)
        if self.err2 == 0:
            sqnr = math.inf
        elif self.ref2 == 0:
            sqnr = -math.inf
        else:
            sqnr = 10.0 * math.log10(self.ref2 / self.err2)
        denom = math.sqrt(self.ref2 * self.out2)
        cos = self.dot / denom if denom > 0 else nan
        return ErrorStats(rel, self.max_abs, sqnr, cos)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def linear_layers(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules an audit hooks: every one except those matching ``skip``
    (an exact name, a dotted suffix, or an ``fnmatch`` pattern)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _matches(n, skip)]


def _take_rows(q: Quantized, idx: torch.Tensor) -> tuple[Quantized, torch.Tensor]:
    """Rows ``idx`` of a quantized activation tensor, with their own scales (exact: every
    activation scheme but 2-D blocks keeps a row's scales separate). For block scales the
    first block of rows is taken whole; the returned ``idx`` says which rows were used."""
    g = q.scheme.granularity
    if g is Granularity.TENSOR:
        return Quantized(q.data[idx], q.scale, q.scheme), idx
    if g in (Granularity.ROW, Granularity.GROUP):
        return Quantized(q.data[idx], q.scale[idx], q.scheme), idx
    r = q.scheme.block[0]
    idx = torch.arange(min(q.data.shape[0], r), device=q.data.device)
    return Quantized(q.data[idx], q.scale[:1], q.scheme), idx


def _sat_flush(x: torch.Tensor, q: Quantized) -> tuple[int, int, int]:
    """(saturated, flushed-to-zero, non-zero) element counts of ``x`` quantized as ``q``.

    Saturated: |x / s| beyond qmax + ulp(qmax)/2 with the scales ``q`` holds (the clamp moved
    it); counted elementwise only in the blocks whose amax can reach that, since a dynamic
    scale almost never lets any element saturate. Flushed: x != 0 but its code is +-0.
    """
    rows, cols = x.shape
    thr = saturation_threshold(q.scheme.format, q.scheme.qmax)
    sat = 0
    if q.n_saturated is not None:
        sat = q.n_saturated
    elif x.numel():
        amax = x.abs().amax().to(torch.float32)
        if float(amax / q.scale.to(torch.float32).min()) > thr:
            s = expand_scale(q.scale.to(torch.float32), q.scheme, rows, cols)
            sat = int((x.to(torch.float32) / s).abs().gt(thr).sum())
    nz = x != 0
    zero_code = (q.data.view(torch.uint8) & 0x7F) == 0  # +0 and -0 (0x80 is NaN in FNUZ formats: never produced)
    return sat, int((nz & zero_code).sum()), int(nz.sum())


@dataclass
class _LayerAcc:
    name: str
    depth: int
    N: int
    K: int
    own: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    total: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    inp: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    prop: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    ratio_max: float = float("-inf")
    ratio_rows: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * (len(RATIO_BIN_EDGES) - 1))
    w_stats: tuple[float, float, float, float] | None = None  # saturated, flushed, scale min, max
    a_sat: int = 0
    a_flushed: int = 0
    a_nonzero: int = 0
    a_numel: int = 0
    a_smin: float = float("inf")
    a_smax: float = float("-inf")
    backends: set[str] = field(default_factory=set)
    nonfinite_input: int = 0
    bound_calls: int = 0


def _sample(n: int, k: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, min(k, n)).round().long().unique()


def _bound_check(acc: _LayerAcc, x2, w, bias, y, qx: Quantized, qw: Quantized, b: Backend, od,
                 rows: int, cols: int) -> None:
    """Worst |y - y_true| / linear_error_bound on a rows x cols sample of the output.

    The bound of element (m, n) depends only on row m of x and row n of w (and their scales),
    so it is computed on the sampled rows of both operands, each kept with its own scales
    (``_take_rows``): exact for every element sampled, at a fraction of the cost of the full
    [M, N] bound (which needs several float64 GEMMs and an elementwise bound on all of w).
    """
    qxs, ix = _take_rows(qx, _sample(x2.shape[0], rows))
    qws, iw = _take_rows(qw, _sample(w.shape[0], cols))
    xs, ws = x2[ix], w[iw]
    bs = None if bias is None else bias[iw]
    bnd = bounds.linear_error_bound(xs, ws, qxs, qws, bs, out_dtype=od, accumulation=b.accumulation,
                                    output_roundings=b.output_roundings)
    y_true = xs.to(torch.float64) @ ws.to(torch.float64).T
    if bs is not None:
        y_true = y_true + bs.to(torch.float64)
    ratio = (y[ix][:, iw].to(torch.float64) - y_true).abs() / bnd
    worst = float(ratio.max())
    acc.ratio_max = worst if math.isnan(worst) else max(acc.ratio_max, worst)
    acc.ratio_rows += ratio.numel()
    _ratio_hist(ratio, acc.hist)


class _Runner:
    """Computes one linear the FP8 way for one requested backend name (or ``"auto"``)."""

    def __init__(self, spec: str, recipe: Recipe, precision: str) -> None:
        import fp8ref

        self.spec, self.recipe, self.precision = spec, recipe, precision
        self.note = ""
        self.seconds = 0.0
        self._weights: dict[str, tuple[Quantized, Any]] = {}
        self._last_x: tuple[object, str, Quantized] | None = None
        self.linear = getattr(fp8ref, "linear", None) if spec == "auto" else None
        if spec == "auto" and not callable(self.linear):
            self.linear = None
            self.note = "fp8ref.linear is not available in this build: 'auto' ran the reference backend"
        self.backend: Backend | None = None
        if self.linear is None:
            self.backend = get_backend("reference" if spec == "auto" else spec)
            reason = self.backend.available()
            if reason is not None:
                raise ValueError(f"backend {spec!r} is not available here: {reason}")

    def _case(self, x2: torch.Tensor, w: torch.Tensor, bias, od: torch.dtype) -> Case:
        return Case(M=x2.shape[0], N=w.shape[0], K=w.shape[1], recipe=self.recipe, x_dtype=x2.dtype, out_dtype=od,
                    device=str(x2.device), has_bias=bias is not None)

    def _quantize_x(self, b: Backend, x2: torch.Tensor, src: object) -> Quantized:
        # q_proj/k_proj/v_proj (and gate/up) receive the very same input tensor: quantize once.
        if self._last_x is not None and self._last_x[0] is src and self._last_x[1] == b.name:
            return self._last_x[2]
        qx = b.quantize(x2, self.recipe.activation)
        self._last_x = (src, b.name, qx)
        return qx

    def __call__(self, key: str, x2: torch.Tensor, w: torch.Tensor, bias, od: torch.dtype, src: object = None
                 ) -> tuple[torch.Tensor, Callable[[], Quantized], Quantized, Backend]:
        """(y, a function giving the quantized activations, quantized weight, backend used).

        Under "auto" the activations are quantized inside ``fp8ref.linear``; the statistics
        need them too, so they are quantized again with the chosen backend, but only when asked.
        """
        t0 = time.perf_counter()
        try:
            if self.linear is not None:
                from ..api import quantize_weight
                from ..select import resolve

                b, _ = resolve(self._case(x2, w, bias, od), "auto", self.precision)
                y = self.linear(x2, w, bias, recipe=self.recipe, backend="auto", precision=self.precision,
                                out_dtype=od)
                if key not in self._weights:
                    # fp8ref.linear quantizes weights with the reference quantizer, so the
                    # statistics and the bound use that same Quantized.
                    self._weights[key] = (quantize_weight(w, self.recipe), None)
                qw = self._weights[key][0]
                return y, lambda: self._quantize_x(b, x2, x2 if src is None else src), qw, b
            b = self.backend
            reason = decline_reason(b, self._case(x2, w, bias, od))
            if reason is not None:
                raise ValueError(f"backend {b.name!r} does not take layer {key!r} "
                                 f"(M={x2.shape[0]}, N={w.shape[0]}, K={w.shape[1]}, {x2.dtype}): {reason}")
            if key not in self._weights:
                qw = b.quantize(w, self.recipe.weight)
                self._weights[key] = (qw, b.prepare_weight(qw))
            qw, prepared = self._weights[key]
            qx = self._quantize_x(b, x2, x2 if src is None else src)
            return b.scaled_mm(qx, prepared, bias, od), lambda: qx, qw, b
        finally:
            self.seconds += time.perf_counter() - t0


class _State:
    def __init__(self) -> None:
        self.mode = "off"
        self.runner: _Runner | None = None
        self.store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.depth: dict[str, int] = {}
        self.last: tuple | None = None
        self.last_view: tuple | None = None


def _batches(inputs: Any) -> list[Any]:
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 1:
            inputs = inputs.unsqueeze(0)
        return [inputs[i:i + 1] for i in range(inputs.shape[0])]
    if isinstance(inputs, dict):
        return [inputs]
    if isinstance(inputs, Iterable):
        out = list(inputs)
        if not out:
            raise ValueError("inputs is empty: give at least one batch")
        for b in out:
            if not isinstance(b, (torch.Tensor, dict)):
                raise TypeError(f"each batch must be a tensor of token ids or a dict of model kwargs, "
                                f"got {type(b).__name__}")
        return out
    raise TypeError(f"inputs must be a tensor [B, T], a dict of model kwargs or a list of those, "
                    f"got {type(inputs).__name__}")


def _call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, dict):
        return batch.get("input_ids")
    return batch if not batch.is_floating_point() else None


def _detect_kind(out: Any) -> str:
    if hasattr(out, "logits"):
        return "causal_lm"
    if hasattr(out, "last_hidden_state"):
        return "encoder"
    if isinstance(out, torch.Tensor) and out.dim() == 3:
        return "causal_lm"
    raise ValueError(f"cannot tell the model kind from its output ({type(out).__name__}); pass kind="
                     "'causal_lm' (output .logits or a [B, T, V] tensor) or 'encoder' (.last_hidden_state)")


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _embedding(out: Any, batch: Any) -> torch.Tensor:
    """Mean-pooled (over the attention mask), L2-normalized sentence embeddings, float64."""
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    h = h.to(torch.float64)
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is None:
        e = h.mean(dim=1)
    else:
        m = mask.to(torch.float64).unsqueeze(-1)
        e = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return F.normalize(e, dim=-1)


class _LmAcc:
    def __init__(self) -> None:
        self.nll_fp = self.nll_q = self.kl = 0.0
        self.kl_max = 0.0
        self.n_pred = self.n_pos = self.agree = 0
        self.n_seq = 0
        self.tok_nll: list[float] = []
        self.tok_kl: list[float] = []
        self.tok_top1: list[int] = []

    def add(self, lf: torch.Tensor, lq: torch.Tensor, ids: torch.Tensor | None) -> None:
        lf, lq = lf.to(torch.float64), lq.to(torch.float64)
        pf, pq = F.log_softmax(lf, dim=-1), F.log_softmax(lq, dim=-1)
        kl = (pf.exp() * (pf - pq)).sum(-1)
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max())) if not math.isnan(float(kl.max())) else math.nan
        self.n_pos += kl.numel()
        same = lf.argmax(-1) == lq.argmax(-1)
        self.agree += int(same.sum())
        self.tok_kl += [round(v, 7) for v in kl.reshape(-1).tolist()]
        self.tok_top1 += same.reshape(-1).int().tolist()
        self.n_seq += lf.shape[0]
        if ids is not None and ids.shape[-1] > 1:
            tgt = ids[:, 1:].unsqueeze(-1)
            self.nll_fp -= float(pf[:, :-1].gather(-1, tgt).sum())
            nq = -pq[:, :-1].gather(-1, tgt)
            self.nll_q += float(nq.sum())
            self.tok_nll += [round(v, 7) for v in nq.reshape(-1).tolist()]
            self.n_pred += tgt.numel()

    def metrics(self) -> ModelMetrics:
        nan = float("nan")

        def ppl(s: float) -> float:
            return math.exp(s / self.n_pred) if self.n_pred else nan

        return ModelMetrics(kind="causal_lm", n_tokens=self.n_pos, n_sequences=self.n_seq,
                            ppl_fp=ppl(self.nll_fp), ppl_fp8=ppl(self.nll_q),
                            kl_mean=self.kl / self.n_pos if self.n_pos else nan, kl_max=self.kl_max,
                            top1_agreement=self.agree / self.n_pos if self.n_pos else nan,
                            token_nll=self.tok_nll, token_kl=self.tok_kl, token_top1=self.tok_top1)


def _encoder_metrics(ef: torch.Tensor, eq: torch.Tensor, n_tokens: int) -> ModelMetrics:
    cos = (ef * F.normalize(eq, dim=-1)).sum(-1)
    nn_agree = float("nan")
    if ef.shape[0] > 1:
        def nearest(e):
            sim = e @ e.T
            sim.fill_diagonal_(-math.inf)
            return sim.argmax(-1)
        nn_agree = float((nearest(ef) == nearest(F.normalize(eq, dim=-1))).double().mean())
    return ModelMetrics(kind="encoder", n_tokens=n_tokens, n_sequences=ef.shape[0],
                        embedding_cosine_mean=float(cos.mean()), embedding_cosine_min=float(cos.min()),
                        nn_agreement=nn_agree)


def _layer_flags(s: LayerStats, th: Thresholds, nonfinite: int) -> list[str]:
    flags = []
    if not (s.own.sqnr_db >= th.min_sqnr_db):
        flags.append(f"own SQNR {s.own.sqnr_db:.1f} dB < {th.min_sqnr_db:g}")
    if s.bound_ratio_max > th.max_bound_ratio or math.isnan(s.bound_ratio_max) and s.bound_samples:
        flags.append(f"error/bound {s.bound_ratio_max:.3g} > {th.max_bound_ratio:g}: outside the spec's bound")
    if s.weight_flushed > th.max_flushed:
        flags.append(f"{s.weight_flushed:.0%} of non-zero weights flushed to 0")
    if s.act_flushed > th.max_flushed:
        flags.append(f"{s.act_flushed:.0%} of non-zero activations flushed to 0")
    if nonfinite:
        flags.append(f"non-finite input in the FP8 model ({nonfinite} call(s))")
    return flags


def _model_flags(m: ModelMetrics, th: Thresholds, layers: list[LayerStats]) -> list[str]:
    flags = []
    if m.kind == "causal_lm":
        if not (m.top1_agreement >= th.min_top1):
            flags.append(f"top-1 agreement {m.top1_agreement:.3f} < {th.min_top1:g}")
        if not (m.kl_mean <= th.max_kl):
            flags.append(f"mean KL {m.kl_mean:.3g} > {th.max_kl:g}")
        if m.n_tokens and m.ppl_fp == m.ppl_fp and not (m.ppl_fp8 <= th.max_ppl_ratio * m.ppl_fp):
            flags.append(f"perplexity {m.ppl_fp8:.4g} > {th.max_ppl_ratio:g} x float {m.ppl_fp:.4g}")
    else:
        if not (m.embedding_cosine_mean >= th.min_embedding_cosine):
            flags.append(f"embedding cosine {m.embedding_cosine_mean:.4f} < {th.min_embedding_cosine:g}")
    if layers and all(lay.flags for lay in layers):
        flags.append(f"every one of the {len(layers)} layers is flagged")
    return flags


def _ratio_hist(ratio: torch.Tensor, hist: list[int]) -> None:
    r = ratio[torch.isfinite(ratio)].clamp(min=1e-300)
    lg = torch.log10(r)
    lo, step, nb = RATIO_BIN_EDGES[0], RATIO_BIN_EDGES[1] - RATIO_BIN_EDGES[0], len(hist)
    idx = ((lg - lo) / step).floor().clamp(0, nb - 1).to(torch.int64)
    for i, c in enumerate(torch.bincount(idx, minlength=nb).tolist()):
        hist[i] += c


def audit_model(model: nn.Module, inputs: Any, *, recipe: Recipe | str = W8A8_FP8,
                backends: Sequence[str] = ("reference", "auto"), skip: Sequence[str] = ("lm_head",),
                bound_rows: int = 8, bound_cols: int = 64, bound_batches: int = 1, precision: str = "standard",
                kind: str = "auto",
                thresholds: Thresholds | None = None, model_name: str = "", text_name: str = "",
                progress: bool = False) -> AuditReport:
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
        Backends to audit: registry names, or ``"auto"`` (what ``fp8ref.linear`` chooses; the
        reference when ``fp8ref.linear`` is absent, said in the audit's ``note``). An unavailable
        named backend, or one that declines a layer's case, raises ``ValueError`` with its reason.
    skip : sequence of str
        Linear layers left in float (default ``lm_head``, as SGLang's online FP8 does).
    bound_rows, bound_cols, bound_batches : int
        The error is checked against ``fp8ref.spec.bounds.linear_error_bound`` on a sample of
        ``bound_rows`` tokens x ``bound_cols`` output channels of each layer's output, in the
        first ``bound_batches`` batches (the bound costs several float64 GEMMs and an elementwise
        bound on the weight: sampling keeps it a small part of the audit). 0 rows disables it.
    precision : str
        Precision class handed to ``fp8ref.linear`` for ``"auto"``.
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
    batches = _batches(inputs)
    runners = [_Runner(b, recipe, precision) for b in backends]
    accs: list[dict[str, _LayerAcc]] = [{} for _ in runners]
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
                    key, _LayerAcc(key, st.depth[key], w.shape[0], w.shape[1]))
                y, qx, qw, b = r(key, x2, w, bias, od, x)
                acc.own.add(y, y_fp)
                acc.backends.add(b.name)
                if acc.w_stats is None:
                    sat, fl, nz = _sat_flush(w, qw)
                    sc = qw.scale.to(torch.float64)
                    acc.w_stats = (sat / max(w.numel(), 1), fl / max(nz, 1), float(sc.min()), float(sc.max()))
                if bound_rows and bound_cols and x2.shape[0] and acc.bound_calls < bound_batches:
                    acc.bound_calls += 1
                    _bound_check(acc, x2, w, bias, y, qx(), qw, b, od, bound_rows, bound_cols)
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
                act = (*_sat_flush(x2, q), float(sc.min()), float(sc.max()))
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
    lm_accs = [_LmAcc() for _ in runners]
    emb_fp: list[torch.Tensor] = []
    emb_q: list[list[torch.Tensor]] = [[] for _ in runners]
    n_tok = 0
    t_start = time.perf_counter()
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batches) * (1 + len(runners)), desc="audit passes", unit="pass")
        except ImportError:
            bar = None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                st.mode, st.store, st.calls, st.last, st.last_view = "fp", {}, {}, None, None
                out_fp = _call(model, batch)
                if kind == "auto":
                    kind = _detect_kind(out_fp)
                ids = _ids(batch)
                n_tok += int(ids.numel()) if ids is not None else 0
                if bar is not None:
                    bar.update(1)
                for i, r in enumerate(runners):
                    st.mode, st.runner, st.calls, st.last, st.last_view = "fp8", r, {}, None, None
                    out_q = _call(model, batch)
                    if kind == "causal_lm":
                        lm_accs[i].add(_logits(out_fp), _logits(out_q), ids)
                    else:
                        emb_q[i].append(_embedding(out_q, batch))
                    if bar is not None:
                        bar.update(1)
                if kind == "encoder":
                    emb_fp.append(_embedding(out_fp, batch))
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
            s.flags = _layer_flags(s, th, acc.nonfinite_input)
            stats.append(s)
        if kind == "causal_lm":
            mm = lm_accs[i].metrics()
        else:
            mm = _encoder_metrics(torch.cat(emb_fp), torch.cat(emb_q[i]), n_tok)
        resolved = sorted({b for acc in accs[i].values() for b in acc.backends})
        audits.append(BackendAudit(backend=r.spec, resolved=resolved, note=r.note, layers=stats, model=mm,
                                   flags=_model_flags(mm, th, stats), seconds=r.seconds))
    meta = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "batches": len(batches), "tokens": n_tok, "layers_audited": len(layers), "skipped": list(skip),
        "bound_sample": f"{bound_rows} tokens x {bound_cols} channels per layer, first {bound_batches} batch(es)",
        "precision": precision,
        "seconds": round(time.perf_counter() - t_start, 2),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    return AuditReport(model=model_name or type(model).__name__, recipe=recipe.name, text=text_name,
                       audits=audits, meta=meta, thresholds=th)
