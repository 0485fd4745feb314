"""The calling contract's checks (docs/spec.md, "The calling contract"): what an entry point
promises its caller beyond its values, checked the way the reference BLAS test programs check
every routine (xBLAT2/xBLAT3: arguments with leading dimensions larger than the matrix, every
input compared with a snapshot after every call, the error exits exercised).

Each dimension is a check per op (``quantize``, ``scaled_mm`` with ``prepare_weight``, the
``linear`` hook): the arguments of the op's problem are named tensors (``_Op.args``), the call
takes them and returns named outputs, and a dimension varies the arguments or the calls:

* ``layout``: every argument as a view (transposed storage, offset storage with a leading
  dimension larger than the row, row or column stride 2, stride 0); the result equals the
  contiguous call's bits or lies within the op's bound of the spec, or the call refuses the view
  with a ``ValueError``/``TypeError``;
* ``untouched``: no argument (nor the prepared weight) changes in a call, and no output shares
  storage with an argument;
* ``lifetime``: arguments updated in place between calls (``copy_``, ``mul_``, item assignment,
  ``.data =``, a write through a numpy view that bumps no version counter) give what a fresh
  call on the new values gives;
* ``threads``: calls from several threads at once, each on its own values, give the bits each
  gives alone;
* ``non_finite``: NaN/Inf in each kind of input, and finite results past the output dtype's
  range: what the backend declares (``Backend.non_finite``) and never a finite stand-in;
* ``degenerate``: M, N or K = 0 or 1;
* ``size_limits``: rows past 65535 (GPU grid limits), K past 2**16, and (profile ``limits``)
  element offsets past 2**31.

Imports flow down: the registry, the spec, the conformance modules below and the per-op checks.
"""

from __future__ import annotations

import math
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st

from ...registry import PROPAGATE, RAISE, Backend, Case, decline_reason
from ...spec import gemm, quant
from ...spec.bounds import gemm_error_bound, linear_error_bound, quantization_error_bound, scale_error_bound
from ...spec.quant import Quantized
from .. import strategies as fst
from ..profiles import Profile
from .common import (
    ContractViolation,
    Declined,
    _bits,
    _check_within,
    _first_diff,
    _ref_quantize,
    _require,
    _same_bits,
    backend_threads,
    poison_allocator,
)
from .linear import _backend_linear
from .linear import check_linear_bound as _linear_bound
from .quantize import check_quantize_codes as _quantize_codes
from .quantize import check_quantize_scale as _quantize_scale
from .scaled_mm import check_scaled_mm_bound as _gemm_bound

__all__ = ["VIEW_KINDS", "UPDATES", "SIZE_KINDS", "SizeProblem", "size_problems", "size_sweep", "as_view",
           "storage_overlaps"]

#: The layouts every tensor argument is passed in (``as_view``).
VIEW_KINDS = ("transposed", "offset", "row_stride", "col_stride", "stride0")
#: The ways a caller updates a tensor in place between two calls (``_update``).
UPDATES = ("copy_", "mul_", "setitem", "data", "numpy")
#: Threads that call the backend at once, and the calls each makes.
THREADS, THREAD_CALLS = 4, 8
#: The interpreter's thread switch interval while the threads run (``sys.setswitchinterval``).
SWITCH_INTERVAL_S = 1e-6
#: Rows past the CUDA grid's y/z limit (65535), and K past 2**16.
BIG_ROWS, BIG_K = 65537, 65537
#: Elements of an operand whose last offsets lie past 2**31 (profile ``limits``).
BIG_OFFSET = 2**31 + 2**14


# --------------------------------------------------------------------------------------------
# backends that pay per element


def _light(backend: Backend) -> bool:
    """Whether the backend pays per element (an interpreter: the driver's ``conformance_max_elems``
    hint, read as the driver reads it): each example then takes two view kinds, two updates and two
    rounds of threads instead of all of them, chosen by the problem so the sweep still covers all."""
    hint = getattr(backend, "conformance_max_elems", None)
    return isinstance(hint, int) and hint > 0


def _pick(options: tuple, p, backend: Backend, n: int = 2) -> tuple:
    """All of ``options``, or (a backend that pays per element) ``n`` of them chosen by the problem."""
    if not _light(backend):
        return options
    i = zlib.crc32(repr(p).encode())
    return tuple(options[(i + j) % len(options)] for j in range(n))


# --------------------------------------------------------------------------------------------
# tensors: views, snapshots, storage, updates


def _poison(dtype: torch.dtype) -> torch.Tensor:
    """The value around a view: NaN (the NaN code for FP8 formats), so that an element read from
    the wrong place shows in the result."""
    return torch.tensor(float("nan")).to(dtype)


def as_view(t: torch.Tensor, kind: str) -> torch.Tensor | None:
    """``t`` passed as a view of kind ``kind`` (``VIEW_KINDS``), or None where the kind does not apply.

    The storage around the view holds NaN. ``stride0`` changes the values: rows (or, for one row,
    columns) repeat the first one, through a stride of 0.

    Examples
    --------
    >>> import torch
    >>> from fp8ref.conformance.contracts.calling import as_view
    >>> v = as_view(torch.arange(6.0).reshape(2, 3), "offset")
    >>> v.tolist(), v.stride(), v.storage_offset()
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], (6, 1), 9)
    """
    if t.dim() not in (1, 2) or t.numel() == 0:
        return None
    p = _poison(t.dtype)

    def big(*shape):
        return p.expand(*shape).clone()

    if t.dim() == 1:
        (n,) = t.shape
        if kind == "offset":
            b = big(n + 5)
            b[5:] = t
            return b[5:]
        if kind == "row_stride":
            b = big(2 * n)
            b[::2] = t
            return b[::2]
        if kind == "stride0" and n > 1:
            return t[:1].expand(n)
        return None
    R, C = t.shape
    if kind == "transposed":
        return t.t().contiguous().t() if R > 1 and C > 1 else None
    if kind == "offset":
        b = big(R + 1, C + 3)
        b[1:, 3:] = t
        return b[1:, 3:]
    if kind == "row_stride":
        b = big(2 * R, C)
        b[::2] = t
        return b[::2]
    if kind == "col_stride":
        b = big(R, 2 * C)
        b[:, ::2] = t
        return b[:, ::2]
    if kind == "stride0":
        if R > 1:
            return t[:1].expand(R, C)
        return t[:, :1].expand(R, C) if C > 1 else None
    raise ValueError(f"unknown view kind {kind!r}; kinds: {VIEW_KINDS}")


def _tensors_in(obj: Any, name: str, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` (a prepared weight is any object a backend returns):
    tensors, Quantized fields, sequences, mappings and the attributes of other objects, two levels deep."""
    if isinstance(obj, torch.Tensor):
        return [(name, obj)]
    if depth > 2 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype)):
        return []
    if isinstance(obj, Quantized):
        return [(f"{name}.data", obj.data), (f"{name}.scale", obj.scale)]
    if isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return []
    out = []
    for k, v in items:
        out += _tensors_in(v, f"{name}.{k}" if not isinstance(k, int) else f"{name}[{k}]", depth + 1)
    return out


def _snapshot(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    return [(n, t, _bits(t).clone()) for n, t in named]


def _check_unchanged(snap, when: str, rule: str = "an input must never be written") -> None:
    for name, t, before in snap:
        now = _bits(t)
        if now.shape != before.shape or not torch.equal(now, before):
            diff = (now != before).nonzero() if now.shape == before.shape else None
            where = f" (first at {tuple(int(i) for i in diff[0])}, {len(diff)} elements)" if diff is not None else ""
            raise ContractViolation(f"{when} modified {name}{where}: {rule}")


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte range of ``t``'s storage (None for an empty one)."""
    s = t.untyped_storage()
    return None if s.nbytes() == 0 else (s.data_ptr(), s.data_ptr() + s.nbytes())


def storage_overlaps(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``u`` and ``v`` share storage (any overlap of the two storages' byte ranges)."""
    su, sv = _span(u), _span(v)
    return su is not None and sv is not None and u.device == v.device and su[0] < sv[1] and sv[0] < su[1]


def _check_fresh(outs: dict[str, torch.Tensor], named_inputs: list[tuple[str, torch.Tensor]], when: str) -> None:
    for on, o in outs.items():
        for n, t in named_inputs:
            if storage_overlaps(o, t):
                raise ContractViolation(f"{when}: output {on} shares storage with the argument {n}; an output "
                                        f"must be fresh memory (the caller may update or free its arguments)")


def _altered(t: torch.Tensor, name: str) -> torch.Tensor:
    """New values for ``t`` of the same shape and dtype, still valid for its role: scales doubled
    (positive, exact), values and codes negated and rolled by one along the last dimension."""
    if name.endswith("scale"):
        return t * 2
    v = -(t.to(torch.float32))  # through float: FNUZ formats have no -0 to flip a sign bit into
    if t.dim() >= 1 and t.shape[-1] > 1:
        v = v.roll(1, dims=-1)
    return v.to(t.dtype)


def _update(t: torch.Tensor, name: str, how: str) -> None:
    """Update ``t`` in place, as a caller does between calls (``UPDATES``)."""
    new = _altered(t, name)
    if how == "copy_":
        t.copy_(new)
    elif how == "mul_":
        with torch.no_grad():
            if t.is_floating_point() and t.element_size() > 1:
                t.mul_(2)
            else:  # FP8 codes have no in-place arithmetic: a caller copies
                t.copy_(new)
    elif how == "setitem":
        with torch.no_grad():
            t[...] = new
    elif how == "data":
        t.data = new  # same tensor object, new storage
    elif how == "numpy":  # a write through a numpy view: the version counter does not move
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        t.view(ints).numpy()[...] = new.view(ints).numpy()
    else:
        raise ValueError(f"unknown update {how!r}; updates: {UPDATES}")


# --------------------------------------------------------------------------------------------
# the ops, as named arguments -> named outputs


@dataclass(frozen=True)
class _Op:
    """One entry point with its problem: ``args()`` builds the named argument tensors, ``call``
    runs the backend on them (returning named outputs and the prepared weight, if any), ``spec``
    judges an output against the spec on the given argument values (ratio or ContractViolation)."""

    name: str
    problem: Any

    def args(self) -> dict[str, torch.Tensor]:
        p = self.problem
        if self.name == "quantize":
            x = p.build()
            s = p.scale(x)
            return {"x": x} if s is None else {"x": x, "scale": s}
        if self.name == "scaled_mm":
            a, b, bias = p.build()
            out = {"a.data": a.data, "a.scale": a.scale, "b.data": b.data, "b.scale": b.scale}
            return out if bias is None else {**out, "bias": bias}
        x, w, bias = p.build()
        qw = _ref_quantize(w, p.recipe.weight)
        out = {"x": x, "w.data": qw.data, "w.scale": qw.scale}
        if bias is not None:
            out["bias"] = bias
        s = p.act_scale(x)
        return out if s is None else {**out, "scale": s}

    def weight(self, args) -> Quantized | None:
        """The weight operand (the one ``prepare_weight`` takes), None for quantize."""
        if self.name == "scaled_mm":
            return Quantized(args["b.data"], args["b.scale"], self.problem.recipe.weight)
        if self.name == "linear":
            return Quantized(args["w.data"], args["w.scale"], self.problem.recipe.weight)
        return None

    def call(self, backend: Backend, args, weight: Quantized | None = None,
             prepared_hook: Callable[[Any], None] | None = None) -> dict[str, torch.Tensor]:
        """Run the entry point on ``args`` (the weight object ``weight`` if given, so that a caller
        can hand the same object again); ``prepared_hook(prepared)`` sees the prepared weight."""
        p = self.problem
        if self.name == "quantize":
            q = backend.quantize(args["x"], p.scheme) if "scale" not in args else backend.quantize(
                args["x"], p.scheme, scale=args["scale"])
            if not isinstance(q, Quantized):
                raise ContractViolation(f"quantize returned {type(q).__name__}, not an fp8ref.Quantized")
            return {"data": q.data, "scale": q.scale}
        w = weight if weight is not None else self.weight(args)
        prepared = backend.prepare_weight(w)
        if prepared_hook is not None:
            prepared_hook(prepared)
        if self.name == "scaled_mm":
            a = Quantized(args["a.data"], args["a.scale"], p.recipe.activation)
            y = backend.scaled_mm(a, prepared, args.get("bias"), p.out_dtype)
        else:
            y = _backend_linear(backend, args["x"], prepared, args.get("bias"), p.out_dtype, p.recipe.activation,
                                args.get("scale"))
        if not isinstance(y, torch.Tensor):
            raise ContractViolation(f"{self.name} returned {type(y).__name__}, not a tensor")
        return {"y": y}

    def out_shape_ok(self, args, outs) -> str | None:
        p = self.problem
        if self.name == "quantize":
            x = args["x"]
            if tuple(outs["data"].shape) != tuple(x.shape):
                return f"quantize returned data of shape {tuple(outs['data'].shape)} for x {tuple(x.shape)}"
            return None
        M = args["a.data" if self.name == "scaled_mm" else "x"].shape[0]
        N = args["b.data" if self.name == "scaled_mm" else "w.data"].shape[0]
        y = outs["y"]
        if tuple(y.shape) != (M, N) or y.dtype != p.out_dtype:
            return f"{self.name} returned {tuple(y.shape)} {y.dtype}, expected ({M}, {N}) {p.out_dtype}"
        return None

    def spec(self, backend: Backend, args, outs) -> float:
        """The output judged against the spec on these argument values (contiguous copies)."""
        p = self.problem
        c = {k: v.contiguous() for k, v in args.items()}
        if self.name == "quantize":
            x, s = c["x"], c.get("scale")
            ref = _ref_quantize(x, p.scheme, s)
            q = Quantized(outs["data"], outs["scale"], p.scheme)
            # quantize.scale's rule: the caller's scale bit for bit, a dynamic one within scale_error_bound
            _check_within("scale", q.scale, ref.scale, scale_error_bound(ref.scale, p.scheme),
                          dtype=ref.scale.dtype if s is not None else None)
            deq = quant.dequantize(q, torch.float64)
            return _check_within("dequantized value vs x (quantization_error_bound)", deq, x.to(torch.float64),
                                 quantization_error_bound(x, q))
        if self.name == "scaled_mm":
            a = Quantized(c["a.data"], c["a.scale"], p.recipe.activation)
            b = Quantized(c["b.data"], c["b.scale"], p.recipe.weight)
            y64 = gemm.scaled_mm(a, b, c.get("bias"), out_dtype=torch.float64)
            bound = gemm_error_bound(a, b, c.get("bias"), out_dtype=p.out_dtype, accumulation=backend.accumulation,
                                     output_roundings=backend.output_roundings, y_ref=y64)
            return _check_within("scaled_mm vs reference (gemm_error_bound)", outs["y"], y64, bound)
        x, bias, s = c["x"], c.get("bias"), c.get("scale")
        qw = Quantized(c["w.data"], c["w.scale"], p.recipe.weight)
        qx = _ref_quantize(x, p.recipe.activation, s)
        w = quant.dequantize(qw, torch.float64)  # the unquantized weight is the one these codes are exact for
        y_true = x.to(torch.float64) @ w.T + (0 if bias is None else bias.to(torch.float64))
        bound = linear_error_bound(x, w, qx, qw, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                                   output_roundings=backend.output_roundings)
        return _check_within("linear vs float64 linear (linear_error_bound)", outs["y"], y_true, bound)


def _op_of(p) -> _Op:
    if isinstance(p, fst.QuantizeProblem):
        return _Op("quantize", p)
    if isinstance(p, fst.GemmProblem):
        return _Op("scaled_mm", p)
    return _Op("linear", p)


def _premise(backend: Backend, op: _Op) -> dict[str, torch.Tensor]:
    """The problem's arguments, after the backend's ``supports`` and the spec's own refusals (an
    input the spec rejects is never the backend's fault)."""
    _require(backend, op.problem.case())
    args = op.args()
    p = op.problem
    if op.name == "quantize":
        _ref_quantize(args["x"], p.scheme, args.get("scale"))
    elif op.name == "linear":
        _ref_quantize(args["x"], p.recipe.activation, args.get("scale"))
        limit = torch.finfo(p.out_dtype).max / 4
        y = quant.dequantize(op.weight(args), torch.float64)
        if bool(((args["x"].to(torch.float64) @ y.T).abs() > limit).any()):
            raise Declined(f"premise: the exact result overflows {p.out_dtype}")
    else:
        a = Quantized(args["a.data"], args["a.scale"], p.recipe.activation)
        y64 = gemm.scaled_mm(a, op.weight(args), args.get("bias"), out_dtype=torch.float64)
        if not bool(torch.isfinite(y64).all()) or bool((y64.abs() > torch.finfo(p.out_dtype).max / 2).any()):
            raise Declined(f"premise: the exact result overflows {p.out_dtype}")
    return args


def _run(backend: Backend, op: _Op, args, **kw) -> dict[str, torch.Tensor]:
    if op.name != "quantize":
        poison_allocator((args["a.data" if op.name == "scaled_mm" else "x"].shape[0],
                          args["b.data" if op.name == "scaled_mm" else "w.data"].shape[0]))
    with backend_threads():
        outs = op.call(backend, args, **kw)
    bad = op.out_shape_ok(args, outs)
    if bad is not None:
        raise ContractViolation(bad)
    return outs


def _same(o1: dict, o2: dict) -> str | None:
    """None if the two calls' outputs have the same bits, else where they differ."""
    for k in o1:
        if not _same_bits(o1[k], o2[k]):
            return f"{k}: {_first_diff(o1[k], o2[k])}"
    return None


def _clones(args: dict) -> dict:
    return {k: v.clone() for k, v in args.items()}


# --------------------------------------------------------------------------------------------
# layout


def check_layout(backend: Backend, p) -> float:
    """Every argument as a view of each kind in ``VIEW_KINDS`` at once: the contiguous call's bits,
    or within the op's bound of the spec on the same values, or a ValueError/TypeError refusal."""
    op = _op_of(p)
    args = _premise(backend, op)
    base = _run(backend, op, _clones(args))
    worst, refused = 0.0, []
    for kind in _pick(VIEW_KINDS, p, backend):
        views = {k: as_view(v, kind) for k, v in args.items()}
        if all(v is None for v in views.values()):
            continue
        views = {k: args[k] if v is None else v for k, v in views.items()}
        want = base
        if kind == "stride0":  # new values: their own contiguous call
            try:
                _premise_values(op, views)
            except Declined:
                continue
            want = _run(backend, op, {k: v.contiguous() for k, v in views.items()})
        try:
            got = _run(backend, op, views)
        except (ValueError, TypeError) as exc:
            refused.append(f"{kind}: {type(exc).__name__}: {exc}")
            continue
        if _same(got, want) is None:
            continue
        try:
            worst = max(worst, op.spec(backend, views, got))
        except ContractViolation as exc:
            raise ContractViolation(f"arguments as {kind} views ({_describe(views)}): {exc} -- the contiguous call "
                                    f"differs: {_same(got, want)}") from None
    return worst  # a clean refusal of every view meets the contract too (a contiguous-only kernel)


def _premise_values(op: _Op, args) -> None:
    """The spec's refusals of changed argument values (a stride-0 view repeats a row)."""
    p = op.problem
    if op.name == "quantize":
        _ref_quantize(args["x"].contiguous(), p.scheme, None if "scale" not in args else args["scale"].contiguous())
    elif op.name == "linear":
        _ref_quantize(args["x"].contiguous(), p.recipe.activation,
                      None if "scale" not in args else args["scale"].contiguous())


def _describe(views) -> str:
    return ", ".join(f"{k} stride {tuple(v.stride())} offset {v.storage_offset()}" for k, v in views.items())


# --------------------------------------------------------------------------------------------
# inputs untouched, outputs fresh


def check_untouched(backend: Backend, p) -> None:
    """Two calls, the second on other values (the first's, altered); after each, every argument and
    the prepared weight have their bits of before the call, no output shares storage with any of
    them, and the second call leaves the first call's outputs as they were (no workspace handed
    out as a result)."""
    op = _op_of(p)
    first = _premise(backend, op)
    second = {k: _altered(v, k) for k, v in first.items()}
    try:
        _premise_values(op, second)
        calls = (first, second)
    except Declined:
        calls = (first, _clones(first))
    earlier = None
    for i, args in enumerate(calls, 1):
        named = list(args.items())
        snap = _snapshot(named)
        prepared: list = []

        def hook(obj, snap=snap, prepared=prepared):
            _check_unchanged(snap, "prepare_weight")
            prepared.extend(_tensors_in(obj, "prepared"))
            snap.extend(_snapshot(prepared))

        outs = _run(backend, op, args, weight=op.weight(args), prepared_hook=hook)
        _check_unchanged(snap, f"{op.name} (call {i})")
        _check_fresh(outs, named + prepared, f"{op.name} (call {i})")
        if earlier is not None:  # an output belongs to the caller: a later call must not write it
            _check_unchanged(earlier, f"{op.name} (call {i})", "a call must not write an earlier call's output")
        earlier = _snapshot([(f"output {k} of call {i}", v) for k, v in outs.items()])
    return None


# --------------------------------------------------------------------------------------------
# lifetime


def check_lifetime(backend: Backend, p) -> None:
    """After a call, the arguments (the weight object included) are updated in place by each way
    in ``UPDATES`` in turn; each next call, with the weight prepared again from the same object,
    gives the bits of a fresh call on fresh copies of the new values."""
    op = _op_of(p)
    args = _premise(backend, op)
    weight = op.weight(args)
    _run(backend, op, args, weight=weight)
    for how in _pick(UPDATES, p, backend):
        for k, t in args.items():
            _update(t, k, how)
        try:
            _premise_values(op, args)
            fresh = _run(backend, op, _clones(args))
        except (Declined, ValueError):
            return None  # the new values leave the spec's domain (or the backend's): nothing to compare
        got = _run(backend, op, args, weight=weight)
        diff = _same(got, fresh)
        if diff is not None:
            raise ContractViolation(f"after the arguments were updated in place ({how}), the call on them differs "
                                    f"from a fresh call on the same values -- a stale internal copy: {diff}")
    return None


# --------------------------------------------------------------------------------------------
# threads


def check_threads(backend: Backend, p) -> None:
    """``THREADS`` threads make ``THREAD_CALLS`` rounds of calls, every round started together (a
    barrier), each thread on values of its own (the problem's, altered ``i`` times); each result
    must have the bits of that call made alone."""
    op = _op_of(p)
    args = _premise(backend, op)
    variants = [args]
    for _ in range(THREADS - 1):
        variants.append({k: _altered(v, k) for k, v in variants[-1].items()})
    alone = []
    for v in variants:
        try:
            _premise_values(op, v)
            alone.append(_run(backend, op, _clones(v)))
        except (Declined, ValueError):
            alone.append(None)
    if all(a is None for a in alone):
        raise Declined("premise: no variant of the problem runs alone")
    barrier = threading.Barrier(sum(a is not None for a in alone))
    results: dict[int, list] = {i: [] for i in range(THREADS)}

    rounds = 2 if _light(backend) else THREAD_CALLS

    def work(i):
        mine = [_clones(variants[i]) for _ in range(rounds)]
        for r in range(rounds):
            try:
                barrier.wait(timeout=60)  # every round starts together: the calls overlap
                results[i].append(op.call(backend, mine[r]))
            except threading.BrokenBarrierError:
                return
            except BaseException as exc:  # noqa: BLE001 -- reported below, in the calling thread
                results[i].append(exc)
                barrier.abort()
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS) if alone[i] is not None]
    # The interpreter hands the GIL over every few microseconds instead of every 5 ms, so that
    # Python-level steps of the threads interleave finely (a race shows in a few calls).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with backend_threads():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
    for i in range(THREADS):
        for j, r in enumerate(results[i]):
            if isinstance(r, BaseException):
                raise ContractViolation(f"thread {i} (of {len(threads)} calling at once), call {j + 1}: "
                                        f"{type(r).__name__}: {r} (the same call alone succeeds)")
            diff = _same(r, alone[i])
            if diff is not None:
                raise ContractViolation(f"thread {i} (of {len(threads)} calling at once), call {j + 1} differs from "
                                        f"the same call made alone: {diff} -- state shared between calls")
    return None


# --------------------------------------------------------------------------------------------
# special values


def _nonfinite_values(dtype: torch.dtype) -> tuple[tuple[str, int | float], ...]:
    """``(label, value)`` pairs of NaN and the infinities a tensor of ``dtype`` can hold; for FP8 the
    value is the code's byte (every format has a NaN code; E5M2 also has +-Inf)."""
    if dtype.itemsize != 1:
        return (("nan", math.nan), ("+inf", math.inf), ("-inf", -math.inf))
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    out = []
    for label, hit in (("nan", torch.isnan(vals)), ("+inf", vals == math.inf), ("-inf", vals == -math.inf)):
        if bool(hit.any()):
            out.append((label, int(hit.nonzero()[0])))
    return tuple(out)


def _kind(arg: str) -> str:
    """The ``NonFinite`` field that governs argument ``arg``."""
    if arg == "x" or arg == "bias":
        return arg
    if arg == "scale":
        return "static_scale"
    return "codes" if arg.endswith(".data") else "scales"


def _affected(op: _Op, args, arg: str, idx: tuple[int, ...]) -> torch.Tensor:
    """Where the outputs must be non-finite when ``args[arg][idx]`` is (the mask of the output
    quantize: dequantized values; others: y)."""
    p = op.problem
    if op.name == "quantize":
        x = args["x"]
        mask = torch.zeros(x.shape, dtype=torch.bool)
        if arg == "x":
            mask[idx] = True
        else:  # a static scale's block
            r, c = p.scheme.block_shape(*x.shape)
            mask[idx[0] * r:(idx[0] + 1) * r, idx[1] * c:(idx[1] + 1) * c] = True
        return mask
    a_rows = args["a.data" if op.name == "scaled_mm" else "x"].shape[0]
    w_key = "b" if op.name == "scaled_mm" else "w"
    n_rows = args[f"{w_key}.data"].shape[0]
    mask = torch.zeros(a_rows, n_rows, dtype=torch.bool)
    a_scheme = p.recipe.activation
    w_scheme = p.recipe.weight
    K = args[f"{w_key}.data"].shape[1]
    if arg in ("a.data", "x"):
        mask[idx[0]] = True
    elif arg in ("a.scale", "scale"):
        r, _ = a_scheme.block_shape(a_rows, K)
        mask[idx[0] * r:(idx[0] + 1) * r] = True
    elif arg == f"{w_key}.data":
        mask[:, idx[0]] = True
    elif arg == f"{w_key}.scale":
        r, _ = w_scheme.block_shape(n_rows, K)
        mask[:, idx[0] * r:(idx[0] + 1) * r] = True
    elif arg == "bias":
        mask[:, idx[0]] = True
    return mask


def _site(t: torch.Tensor) -> tuple[int, ...]:
    """Where the non-finite value goes: the last row and column, so a kernel that skips the tail of
    a tile or the last block is seen (the sweep's other contracts cover the first ones)."""
    return tuple(s - 1 for s in t.shape)


def _spoiled(t: torch.Tensor, idx, v: int | float) -> torch.Tensor:
    t = t.clone()
    if t.element_size() == 1:  # FP8: the code's byte (a cast would saturate an Inf)
        t.view(torch.uint8)[idx] = v
    else:
        t[idx] = v
    return t


def check_non_finite(backend: Backend, p) -> float | None:
    """NaN and +-Inf in each argument in turn (FP8 operands: the format's NaN/Inf codes); what the
    backend declares (``Backend.non_finite``): a ValueError, or non-finite values wherever the
    output depends on the spoiled element. scaled_mm and linear also get finite operands whose
    exact result passes the output dtype's range: +-Inf there (round to nearest), never a finite
    stand-in."""
    op = _op_of(p)
    args = _premise(backend, op)
    declared = backend.non_finite
    for arg, t in args.items():
        if t.numel() == 0 or (op.name == "linear" and arg.startswith("w.")):
            continue  # linear's weight reaches the backend through prepare_weight: scaled_mm's contract
        policy = getattr(declared, _kind(arg))
        for label, v in _nonfinite_values(t.dtype):
            idx = _site(t)
            spoiled = {**_clones(args), arg: _spoiled(t, idx, v)}
            what = f"{arg}[{', '.join(map(str, idx))}] = {label} (declared non_finite.{_kind(arg)} = {policy!r})"
            try:
                outs = _run(backend, op, spoiled)
            except ValueError:
                if policy == RAISE:
                    continue
                raise ContractViolation(f"{what}: raised ValueError") from None
            if policy == RAISE:
                raise ContractViolation(f"{what}: returned instead of raising ValueError")
            assert policy == PROPAGATE
            mask = _affected(op, spoiled, arg, idx)
            if op.name == "quantize":
                o = quant.dequantize(Quantized(outs["data"], outs["scale"], p.scheme), torch.float64)
            else:
                o = outs["y"].to(torch.float64)
            finite = torch.isfinite(o) & mask
            if bool(finite.any()):
                at = tuple(int(i) for i in finite.nonzero()[0])
                raise ContractViolation(f"{what}: {int(finite.sum())} of {int(mask.sum())} outputs computed from it "
                                        f"are finite (first at {at}: {o[at].item()!r}): a finite value stands in "
                                        f"for a non-finite one")
    if op.name != "quantize":
        return _check_overflow(backend, op, args)
    return None


def _abs(q: Quantized) -> Quantized:
    return Quantized(q.data.to(torch.float32).abs().to(q.data.dtype), q.scale.abs(), q.scheme)


def _check_overflow(backend: Backend, op: _Op, args) -> float | None:
    """Both operands' scales multiplied by powers of two so that the exact result's largest
    magnitude is 8x the output dtype's maximum: where |y| - bound exceeds the
    rounding threshold the output is +-Inf with y's sign; where |y| + bound stays below the maximum,
    finite and within the bound."""
    p = op.problem
    if op.name == "linear":
        return None  # linear's activation scale is the backend's own: the GEMM's operands are scaled_mm's
    a = Quantized(args["a.data"], args["a.scale"], p.recipe.activation)
    b = op.weight(args)
    y64 = gemm.scaled_mm(a, b, None, out_dtype=torch.float64)
    big = float(y64.abs().max()) if y64.numel() else 0.0
    oi = torch.finfo(p.out_dtype)
    if big == 0.0:
        return None
    k = math.ceil(math.log2(8 * oi.max / big))
    # Half of k on each operand's scales: an fp32 kernel's (acc * sa) * sb then overflows only
    # where the result itself does.
    room_a = math.floor(math.log2(torch.finfo(a.scale.dtype).max / float(a.scale.abs().max()))) - 1
    room_b = math.floor(math.log2(torch.finfo(b.scale.dtype).max / float(b.scale.abs().max()))) - 1
    ka = min(k - k // 2, room_a)
    kb = k - ka
    if kb > room_b:
        return None  # the scale dtypes cannot reach past the output's range
    a2 = Quantized(a.data, a.scale * 2.0**ka, a.scheme)
    b2 = Quantized(b.data, b.scale * 2.0**kb, b.scheme)
    bias = args.get("bias")
    y64 = gemm.scaled_mm(a2, b2, bias, out_dtype=torch.float64)
    bound = gemm_error_bound(a2, b2, bias, out_dtype=p.out_dtype, accumulation=backend.accumulation,
                             output_roundings=backend.output_roundings, y_ref=y64)
    over = oi.max + 2.0 ** (math.frexp(oi.max)[1] - 1) * oi.eps / 2  # max + ulp(max)/2: rounds to Inf
    new = {**_clones(args), "a.scale": a2.scale, "b.scale": b2.scale}
    y = _run(backend, op, new)["y"].to(torch.float64)
    must_inf = (y64.abs() - bound) > over
    # Where the terms' absolute sum passes fp32's range, an fp32 accumulator's partial sums can
    # reach +Inf and -Inf: NaN is non-finite too, and allowed there.
    mass = gemm.scaled_mm(_abs(a2), _abs(b2), None, out_dtype=torch.float64)
    nan_ok = mass > torch.finfo(torch.float32).max
    wrong = must_inf & (y != torch.sign(y64) * math.inf) & ~(nan_ok & torch.isnan(y))
    if bool(wrong.any()):
        at = tuple(int(i) for i in wrong.nonzero()[0])
        raise ContractViolation(f"exact result {y64[at].item():.6g} lies past {p.out_dtype}'s range (max {oi.max:g}) "
                                f"by more than the bound, got {y[at].item()!r} at {at}: must be "
                                f"{'+' if y64[at] > 0 else '-'}Inf (round to nearest; NaN only where the terms' "
                                f"absolute sum passes fp32's range), never a finite stand-in")
    inside = (y64.abs() + bound) < oi.max
    if bool(inside.any()):
        return _check_within(f"scaled_mm with results near {p.out_dtype}'s maximum", torch.where(inside, y, 0.0),
                             torch.where(inside, y64, 0.0), torch.where(inside, bound, 0.0))
    return None


# --------------------------------------------------------------------------------------------
# degenerate shapes


def _empty_args(op: _Op, args, axis: str) -> dict[str, torch.Tensor]:
    """``args`` cut to 0 along ``axis`` (M: activation rows, N: weight rows, K: columns), the
    scales cut to the scheme's scale shape of the new size."""
    p = op.problem
    out = {}
    for k, t in args.items():
        if op.name == "quantize":
            scheme = p.scheme
        else:
            scheme = p.recipe.weight if k.startswith(("b.", "w.")) else p.recipe.activation
        is_w = k.startswith(("b.", "w.")) or k == "bias"
        if k == "bias":
            out[k] = t[:0] if axis == "N" else t
            continue
        rows_cut = (axis == "M" and not is_w) or (axis == "N" and is_w)
        data_key = k.replace("scale", "data") if "." in k else "x"
        R, C = args[data_key].shape
        R2, C2 = (0 if rows_cut else R), (0 if axis == "K" else C)
        if k.endswith("scale") or k == "scale":
            sr, sc = scheme.scale_shape(R2, C2)
            out[k] = t[:sr, :sc] if t.dim() == 2 else t
        else:
            out[k] = t[:R2, :C2]
    return out


def check_degenerate(backend: Backend, p) -> float:
    """M, N, K = 1 (and all three): within the op's bound; M or N = 0: an empty result of the
    right shape and dtype; K = 0: a ValueError or TypeError, as the spec raises (not a crash,
    not a result). A case the backend declines in ``supports`` is skipped."""
    op = _op_of(p)
    worst, ran = 0.0, 0
    ones = ([dict(rows=1), dict(cols=1), dict(rows=1, cols=1)] if op.name == "quantize"
            else [dict(M=1), dict(N=1), dict(K=1), dict(M=1, N=1, K=1)])
    primary = {"quantize": (_quantize_codes, _quantize_scale), "scaled_mm": (_gemm_bound,),
               "linear": (_linear_bound,)}[op.name]
    for kw in ones:
        q = replace(p, **kw)
        for check in primary:
            try:
                r = check(backend, q)
                ran += 1
                worst = max(worst, r or 0.0)
            except Declined:
                continue
            except ContractViolation as exc:
                raise ContractViolation(f"at {', '.join(f'{k}={v}' for k, v in kw.items())}: {exc}") from None
    args = _premise(backend, op)
    for axis in (("M", "K") if op.name == "quantize" else ("M", "N", "K")):
        e = _empty_args(op, args, axis)
        rows = e["x" if op.name != "scaled_mm" else "a.data"].shape[0]
        cols = e["x" if op.name != "scaled_mm" else "a.data"].shape[1]
        n = 0 if op.name == "quantize" else e["b.data" if op.name == "scaled_mm" else "w.data"].shape[0]
        case = replace(p.case(), M=rows, N=n if op.name != "quantize" else rows, K=cols)
        if decline_reason(backend, case) is not None:
            continue
        try:
            _run(backend, op, e)
        except (ValueError, TypeError):
            if axis == "K":
                ran += 1
                continue
            raise
        ran += 1
        if axis == "K":
            raise ContractViolation(f"{op.name} with K = 0 returned a result: the spec raises ValueError (the "
                                    f"reduction dim must be at least 1)")
    if ran == 0:
        raise Declined("supports declines every degenerate shape")
    return worst


# --------------------------------------------------------------------------------------------
# size limits


@dataclass(frozen=True)
class SizeProblem:
    """An op problem at a size past a hardware limit: ``kind`` ``rows`` (M past 65535; quantize:
    rows), ``n`` (N past 65535), ``k`` (K past 2**16) or ``offset`` (an operand past 2**31
    elements: profile ``limits``); the other sizes of ``base`` are kept small."""

    base: Any
    kind: str

    def resized(self):
        p, k = self.base, self.kind
        if isinstance(p, fst.QuantizeProblem):
            sizes = {"rows": dict(rows=BIG_ROWS, cols=min(p.cols, 16)), "k": dict(rows=min(p.rows, 2), cols=BIG_K),
                     "offset": dict(rows=BIG_OFFSET // 16384 + 1, cols=16384)}[k]
        else:
            sizes = {"rows": dict(M=BIG_ROWS, N=min(p.N, 8), K=min(p.K, 32)),
                     "n": dict(M=min(p.M, 4), N=BIG_ROWS, K=min(p.K, 32)),
                     "k": dict(M=min(p.M, 2), N=min(p.N, 2), K=BIG_K),
                     "offset": dict(M=BIG_OFFSET // 16384 + 1, N=min(p.N, 4), K=16384)}[k]
        return replace(p, **sizes)

    def case(self) -> Case:
        return self.resized().case()

    def facets(self) -> dict:
        return {**self.resized().facets(), "size limit": {self.kind}}

    def __repr__(self) -> str:
        return f"{self.resized()!r} (size limit: {self.kind})"


#: The size limits every profile checks (from the sweep), per op.
SIZE_KINDS = {"quantize": ("rows", "k"), "scaled_mm": ("rows", "n", "k"), "linear": ("rows", "k")}


def _blocked(p) -> bool:
    """Whether a problem's scheme has groups or blocks (a program per group in a Triton kernel)."""
    schemes = (p.scheme,) if isinstance(p, fst.QuantizeProblem) else (p.recipe.activation, p.recipe.weight)
    return any(s.granularity.value in ("group", "block") for s in schemes)


def size_sweep(op: str) -> Callable[[list], list]:
    """The sweep adapter of ``<op>.size_limits``: each limit of ``SIZE_KINDS`` on two of the sweep's
    problems (the first with a per-row or per-tensor scale, the first with blocks or groups)."""
    def adapt(problems: list) -> list:
        bases = [q for q in (next((p for p in problems if not _blocked(p)), None),
                             next((p for p in problems if _blocked(p)), None)) if q is not None]
        # Past 65535 rows the reference's per-row work dominates (seconds): one problem, plain values.
        tall = [SizeProblem(_plain(bases[0]), k) for k in SIZE_KINDS[op] if k in ("rows", "n")][:len(bases)]
        return tall + [SizeProblem(b, "k") for b in bases]
    return adapt


def _plain(p):
    """``p`` with normally distributed values (the cheapest family to build and check at 65537 rows)."""
    if isinstance(p, fst.GemmProblem):
        return p
    return replace(p, x=fst.TensorSpec("normal", p.x.exp, p.x.seed))


def size_problems(op_strategy, op: str):
    """``strategy(profile, scope)`` of the search of ``<op>.size_limits``: operands past 2**31
    elements in a profile with ``huge_sizes`` (``limits``), nothing otherwise (the sweep holds
    the cheap limits)."""
    def strategy(prof: Profile, scope=None):
        if not prof.huge_sizes:
            return st.nothing()
        small = prof.with_(max_mn=min(prof.max_mn, 16), max_k=min(prof.max_k, 64))
        return st.builds(SizeProblem, op_strategy(small, scope), st.just("offset"))
    return strategy


def check_size_limits(backend: Backend, sp: SizeProblem) -> float:
    """The op's primary bound at the resized problem (the backend may decline the size in
    ``supports``). A backend that pays per element (an interpreter: ``conformance_max_elems``)
    runs only the long K of a per-row or per-tensor scheme here (a program or two): 65537 row
    programs, or 513 group programs, are the device's to run."""
    if _light(backend) and (sp.kind != "k" or _blocked(sp.base)):
        raise Declined("the backend pays per program (conformance_max_elems): 65537 rows or 513 groups run on "
                       "the device; K past 2**16 in one program runs here")
    p = sp.resized()
    _require(backend, p.case())
    primary = {fst.QuantizeProblem: (_quantize_codes, _quantize_scale), fst.GemmProblem: (_gemm_bound,),
               fst.LinearProblem: (_linear_bound,)}[type(p)]
    worst = 0.0
    for check in primary:
        worst = max(worst, check(backend, p) or 0.0)
    return worst
