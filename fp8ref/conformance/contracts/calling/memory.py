"""How a backend treats the caller's memory: arguments as views (``check_layout``), arguments never
written and outputs of their own (``check_untouched``), nothing kept stale across calls
(``check_lifetime``).
"""

from __future__ import annotations

from ....registry import Backend
from ..common import (
    ContractViolation,
    Declined,
)
from .entry import _clones, _op_of, _premise, _premise_values, _run, _same
from .tensors import (
    UPDATES,
    VIEW_KINDS,
    _altered,
    _check_fresh,
    _check_unchanged,
    _pick,
    _snapshot,
    _tensors_in,
    _update,
    as_view,
)


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


def _describe(views) -> str:
    return ", ".join(f"{k} stride {tuple(v.stride())} offset {v.storage_offset()}" for k, v in views.items())


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
        except (Declined, ValueError):
            return None  # the new values leave the spec's domain: nothing to compare
        # The call on the updated arguments comes right after the update, as a caller makes it: a
        # fresh call first would let a memo keyed on storage be overwritten by the copies' call, and
        # whether the stale entry was hit would then hang on the allocator reusing an address.
        try:
            got, refused = _run(backend, op, args, weight=weight), None
        except (Declined, ValueError) as exc:
            got, refused = None, exc
        try:
            fresh = _run(backend, op, _clones(args))
        except (Declined, ValueError):
            return None  # the new values leave the backend's domain: nothing to compare
        if refused is not None:
            raise ContractViolation(f"after the arguments were updated in place ({how}), the call on them raised "
                                    f"{type(refused).__name__}: {refused}; a fresh call on the same values did not")
        diff = _same(got, fresh)
        if diff is not None:
            raise ContractViolation(f"after the arguments were updated in place ({how}), the call on them differs "
                                    f"from a fresh call on the same values -- a stale internal copy: {diff}")
    return None
