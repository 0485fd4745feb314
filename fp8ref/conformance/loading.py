"""The loader contracts and their driver: ``check_loader(loader)`` certifies how a serving stack
loads one fused FP8 linear weight -- partitions, tensor-parallel shards, reloads, source dtypes,
poisoned allocations -- against the spec's Loading rule (docs/spec.md §8, docs/conformance.md
"Loader contracts").

Each contract runs a deterministic sweep of corner layouts first (partitions that are not
multiples of the block, partitions of one row, blocks split by a shard boundary, square scale
grids, all-zero partitions, fp16 values past E4M3's range), then a Hypothesis search that draws
partition lists, sizes, TP size and rank and values, and shrinks a failure to the smallest
partition list. The run's seed enters every problem's values, so seeds differ in what they draw
even in the derandomized ``ci`` profile. Results are ``ContractResult`` rows of a ``Report``, as
``check()`` returns.

Imports flow down: the checking core (``fp8ref.check.loading``), the spec, and ``profiles`` and
``report`` of this package.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hypothesis import Verbosity, given, reject, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from ..check.common import ContractViolation, Declined
from ..check.loading import (
    LOAD_FAMILIES,
    FunctionLoader,
    LoadProblem,
    WeightLoader,
    check_load_poison,
    check_load_reload,
    check_load_values,
)
from ..spec.loading import LoadLayout
from .coverage import Coverage
from .profiles import Profile, get_profile, hypothesis_settings, resolve_seed
from .report import ERROR, FAIL, PASS, UNTESTED, ContractResult, Report

__all__ = ["LoadContract", "LOAD_CONTRACTS", "LOAD_CONTRACT_NAMES", "check_loader", "load_sweep"]

#: Local partition sizes the search draws from: below, at and past a 128-row block, one row.
_SIZES = (1, 2, 3, 16, 64, 100, 127, 128, 129, 192, 256)
_KS = (16, 64, 100, 128, 130, 256)
_LOCAL_KS = (16, 64, 80, 128, 192)
#: Elements of the full weight an example may build (the reference quantizes every partition).
_MAX_ELEMS = 1 << 19


@dataclass(frozen=True)
class LoadContract:
    """One row of the loader contract table: its check, its corner sweep and its strategy."""

    name: str
    check: Callable[[WeightLoader, LoadProblem], float]
    doc: str
    sweep: Callable[[WeightLoader], list[dict]]
    strategy: Callable[[WeightLoader], st.SearchStrategy]


def _problem(loader: WeightLoader, seed: int, *, parts, k, tp=1, rank=0, parallel="column", dtype=torch.float32,
             families=None, exponents=None, reloads=1) -> LoadProblem:
    parts = tuple(parts)
    if tp == 1 and parallel not in loader.parallel:  # at TP 1 column and row parallel hold the same weight
        parallel = loader.parallel[0]
    fam = tuple(families) if families is not None else ("normal",) * len(parts)
    exps = tuple(exponents) if exponents is not None else tuple((3 * i) % 7 - 3 for i in range(len(parts)))
    lay = LoadLayout(parts, k, loader.scheme, tp_size=tp, tp_rank=rank, parallel=parallel, offline=loader.offline)
    return LoadProblem(lay, dtype, fam, exps, seed=seed, reloads=reloads)


# --------------------------------------------------------------------------------------------
# corner sweeps (keyword sets of _problem)

_PARTITIONS = [
    dict(parts=(64, 64, 64), k=128),                    # three partitions inside one block
    dict(parts=(192, 64, 64), k=256),                   # q not a block multiple: k and v straddle
    dict(parts=(1,), k=16), dict(parts=(1, 1, 1), k=16, exponents=(4, -2, 0)),
    dict(parts=(128, 128), k=256),                      # a square 2x2 grid of blocks
    dict(parts=(100, 28, 200), k=130),
    dict(parts=(64, 64, 64, 64), k=64),                 # GQA-like four small partitions
    dict(parts=(576,), k=128),                          # an MLA width: 4.5 blocks
    dict(parts=(256, 64), k=128, exponents=(-3, 3)),
    dict(parts=(256, 128, 128), k=256, exponents=(0, -3, 2)),  # an aligned GQA QKV
]
_TP = [
    dict(parts=(256, 128), k=128, tp=2, rank=1),
    dict(parts=(192, 64), k=128, tp=4, rank=3),          # 48 + 16 rows: a checkpoint block split by ranks
    dict(parts=(64, 64), k=64, tp=8, rank=7),
    dict(parts=(128,), k=256, tp=2, rank=1, parallel="row"),
    dict(parts=(64, 64), k=320, tp=4, rank=2, parallel="row"),  # 80 columns: K blocks split by ranks
    dict(parts=(128,), k=1024, tp=8, rank=5, parallel="row"),
    dict(parts=(256, 128), k=128, tp=2, rank=0),
    dict(parts=(512, 256, 256), k=128, tp=2, rank=1),    # an aligned QKV at TP 2
]
_RELOAD = [
    dict(parts=(64, 64, 64), k=128, exponents=(3, -2, 0)),
    dict(parts=(256,), k=256),
    dict(parts=(128, 128), k=256, tp=2, rank=1, parallel="row"),
    dict(parts=(100, 28), k=130, exponents=(-1, 2)),
    dict(parts=(256, 128, 128), k=128, exponents=(1, -2, 3)),
]
_DTYPES = [
    dict(parts=(64, 64), k=128, dtype=torch.float16),                       # sglang#4434: fp16 source
    dict(parts=(64, 64), k=128, dtype=torch.float16, families=("wide", "normal")),
    dict(parts=(64, 64), k=128, dtype=torch.bfloat16, families=("normal", "wide")),
    dict(parts=(64, 64, 64), k=128, dtype=torch.float32, families=("normal", "zero", "normal")),
    dict(parts=(130,), k=64, dtype=torch.float16, families=("tiny",)),
    dict(parts=(16, 16), k=16, dtype=torch.bfloat16, families=("zero", "zero")),
    dict(parts=(64, 100), k=128, dtype=torch.float16, families=("outlier", "wide")),
    dict(parts=(256, 128, 128), k=128, dtype=torch.float16, families=("normal", "wide", "zero")),
    dict(parts=(96, 32, 32), k=128, dtype=torch.float16, families=("tiny", "normal", "normal")),
    dict(parts=(32,), k=100, dtype=torch.bfloat16, families=("tiny",)),  # weights near 1e-7
]
_POISON = [
    dict(parts=(64, 64, 64), k=256),
    dict(parts=(100, 28), k=130),
    dict(parts=(130,), k=130),
    dict(parts=(64, 64), k=256, tp=2, rank=1, parallel="row"),
    dict(parts=(256, 128, 128), k=128),
]


# --------------------------------------------------------------------------------------------
# strategies


@st.composite
def _layouts(draw, loader: WeightLoader, *, tp_sizes=(1,), parallel=("column",), dtypes=(torch.float32,),
             families=("normal",)):
    seed = draw(st.integers(0, 2**16))
    local = draw(st.lists(st.sampled_from(_SIZES), min_size=1, max_size=4))
    par = draw(st.sampled_from([p for p in parallel if p in loader.parallel] or list(parallel)))
    tps = [t for t in tp_sizes if t in loader.tp_sizes] or [1]
    tp = draw(st.sampled_from(tps))
    if par == "column":
        k = draw(st.sampled_from(_KS))
        parts = [n * tp for n in local]
    else:
        k = draw(st.sampled_from(_LOCAL_KS)) * tp
        parts = list(local)
    if sum(parts) * k > _MAX_ELEMS:
        reject()
    rank = draw(st.integers(0, tp - 1))
    fam = tuple(draw(st.sampled_from(families)) for _ in parts)
    exps = tuple(draw(st.integers(-6, 6)) for _ in parts)
    dtype = draw(st.sampled_from(dtypes))
    return dict(parts=parts, k=k, tp=tp, rank=rank, parallel=par, dtype=dtype, families=fam, exponents=exps,
                _seed=seed)


def _strategy(**kw):
    return lambda loader: _layouts(loader, **kw)


_ALL_TP = (1, 2, 4, 8)
_ANY = dict(tp_sizes=_ALL_TP, parallel=("column", "row"))

LOAD_CONTRACTS: tuple[LoadContract, ...] = (
    LoadContract("load.partitions", check_load_values,
                 "every partition's rows read their own scales (or a correctly requantized shared max), "
                 "including partitions that are not block multiples and partitions of one row",
                 lambda loader: _PARTITIONS, _strategy(families=("normal", "outlier"))),
    LoadContract("load.tp_shards", check_load_values,
                 "column- and row-parallel shards at TP 1/2/4/8, blocks split by a shard boundary, K-group "
                 "scales sharded with the weight", lambda loader: _TP, _strategy(**_ANY)),
    LoadContract("load.reload_idempotent", check_load_reload,
                 "load and post-process twice on one layer: the same codes and scales as once",
                 lambda loader: _RELOAD, _strategy(**_ANY)),
    LoadContract("load.source_dtypes", check_load_values,
                 "fp16/bf16/fp32 sources, fp16 values past E4M3's range, all-zero partitions",
                 lambda loader: _DTYPES,
                 _strategy(dtypes=(torch.float16, torch.bfloat16, torch.float32), families=LOAD_FAMILIES)),
    LoadContract("load.no_uninitialised", check_load_poison,
                 "allocations poisoned (NaN, then 0.5): no element keeps the allocation's contents",
                 lambda loader: _POISON, _strategy(**_ANY)),
)
LOAD_CONTRACT_NAMES = tuple(c.name for c in LOAD_CONTRACTS)


def load_sweep(contract: LoadContract, loader: WeightLoader, seed: int) -> list[LoadProblem]:
    """The contract's corner problems for ``loader`` (the seed enters their values)."""
    out = []
    for kw in contract.sweep(loader):
        try:
            out.append(_problem(loader, seed, **kw))
        except ValueError:  # a corner this loader's layout cannot express (e.g. its TP sizes)
            continue
    return out


def _from_draw(loader: WeightLoader, d: dict, seed: int) -> LoadProblem:
    d = dict(d)
    s = d.pop("_seed")
    return _problem(loader, seed * 65537 + s, **d)


def _crash(exc: BaseException) -> str:
    """A loader's own exception (an assertion of its code too: not a verdict of the rule), with
    where it was raised."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" (raised at {tb.tb_frame.f_code.co_filename.split('site-packages/')[-1]}:{tb.tb_lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _run_contract(loader: WeightLoader, c: LoadContract, prof: Profile, seed: int, sweep: bool) -> ContractResult:
    t0 = time.perf_counter()
    res = ContractResult(c.name, "bound", PASS, op="load")
    cov = Coverage()
    state = {"n": 0, "worst": None, "fail": None, "first": None}

    def run(p: LoadProblem) -> None:
        try:
            ratio = c.check(loader, p)
        except Declined as exc:
            cov.decline(str(exc))
            raise
        except Exception as exc:
            state["n"] += 1
            cov.add(p.facets())
            if state["first"] is None:
                state["first"] = state["n"]
            state["fail"] = (p, exc)
            raise
        state["n"] += 1
        cov.add(p.facets())
        if ratio is not None and (state["worst"] is None or ratio > state["worst"]):
            state["worst"] = ratio

    for p in load_sweep(c, loader, seed) if sweep else []:
        try:
            run(p)
        except Declined:
            continue
        except Exception:  # noqa: BLE001 -- a violation or a crash of the loader, reported
            break
    res.sweep = state["n"]
    if state["fail"] is None:
        @settings(hypothesis_settings(prof, prof.max_examples), verbosity=Verbosity.quiet)
        @hseed(seed)
        @given(c.strategy(loader))
        def search(d):
            try:
                run(_from_draw(loader, d, seed))
            except Declined:
                reject()

        try:
            search()
        except BaseException as exc:  # noqa: B036 -- Hypothesis raises ExceptionGroups / Flaky here too
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if state["fail"] is None and type(exc).__name__ != "Unsatisfiable":
                state["fail"] = (None, exc)
    if state["fail"] is not None:
        p, exc = state["fail"]
        res.status, res.message = (FAIL, str(exc)) if isinstance(exc, ContractViolation) else (ERROR, _crash(exc))
        res.counterexample = repr(p) if p is not None else None
        res.examples_to_failure = state["first"]
        res.reproduce = (f"fp8ref.conformance.check_loader(<{loader.name}>, profile={prof.name!r}, seed={seed}, "
                         f"contracts=[{c.name!r}])")
    res.examples = state["n"]
    worst = state["worst"]
    if state["fail"] is not None and isinstance(state["fail"][1], ContractViolation):
        r = state["fail"][1].ratio
        worst = float("inf") if r is None else max(worst or 0.0, r)
    res.worst_ratio = worst
    res.declined = sum(cov.declined.values())
    res.coverage = cov.to_dict()
    if res.status == PASS and res.examples == 0:
        res.status = UNTESTED
        res.note = "no example ran (not certified): " + (
            "; ".join(f"{r} (x{n})" for r, n in cov.declined.most_common(2)) or "nothing was drawn")
    res.seconds = time.perf_counter() - t0
    return res


def check_loader(loader: WeightLoader | Callable, profile: Profile | str | None = "ci", seed: int | None = None, *,
                 contracts: Sequence[str] | None = None, scheme=None, offline: bool = False,
                 fail_fast: bool = False, sweep: bool = True) -> Report:
    """Certify a weight loader against the loader contracts (``LOAD_CONTRACTS``).

    Parameters
    ----------
    loader : WeightLoader or callable
        A ``fp8ref.check.loading.WeightLoader``, or a callable ``fn(source, layout) -> Loaded``
        (then ``scheme`` names the weight scheme it produces and ``offline`` whether it reads a
        checkpoint).
    profile : Profile or str or None
        ``ci`` (default), ``dev`` or ``thorough``: the search's example count.
    seed : int, optional
        Enters every problem's values and the search (default: the profile's fixed seed).
    contracts : sequence of str, optional
        Only these contracts.
    fail_fast : bool
        Stop at the first failing contract.
    sweep : bool
        Run each contract's corner layouts before the search (default); False measures the search
        alone.

    Returns
    -------
    Report
        As ``check()`` returns: verdict, per-contract results with the counterexample (the shrunk
        partition list), examples to the first failure, seconds.

    Examples
    --------
    >>> import fp8ref
    >>> from fp8ref.spec.loading import Loaded, source_slices
    >>> scheme = fp8ref.QuantScheme(granularity="row")
    >>> def per_partition(source, layout):
    ...     qs = [fp8ref.quantize(w, scheme) for w in source_slices(layout, source.weights)]
    ...     return Loaded(torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]))
    >>> import torch
    >>> rep = check_loader(per_partition, scheme=scheme, contracts=["load.partitions"])
    >>> rep.verdict
    'pass'
    """
    if not isinstance(loader, WeightLoader):
        if not callable(loader):
            raise TypeError(f"loader must be a WeightLoader or a callable, got {type(loader).__name__}")
        if scheme is None:
            raise ValueError("a callable loader needs scheme= (the weight scheme it produces)")
        loader = FunctionLoader(loader, scheme, offline=offline)
    prof = get_profile(profile)
    seed = resolve_seed(prof, seed)
    known = {c.name: c for c in LOAD_CONTRACTS}
    if contracts is not None:
        bad = [c for c in contracts if c not in known]
        if bad:
            raise ValueError(f"unknown loader contracts {bad}; known: {list(known)}")
    selected = LOAD_CONTRACTS if contracts is None else tuple(known[c] for c in contracts)
    rep = Report(loader.name, prof.name, seed, claimed=f"load: {loader.scheme.short_str()}"
                 f"{' offline' if loader.offline else ' online'}")
    t0 = time.perf_counter()
    for c in selected:
        r = _run_contract(loader, c, prof, seed, sweep)
        rep.results.append(r)
        if fail_fast and r.failed:
            break
    rep.seconds = time.perf_counter() - t0
    return rep

