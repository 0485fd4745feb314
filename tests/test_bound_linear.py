"""A plan's bound call (``Backend.bind_linear``; cpu-fp8's, cpu-bf16's and cpu-fp32's one call into
the extension, csrc/linear.cpp) returns what the backend's ``linear`` returns, bit for bit, hands
back (None) every call that ``linear`` would not take on its fast path, and is what a warm
``Fp8Linear`` runs (issue 42)."""

from __future__ import annotations

import pytest
import torch

import fp8ref
from fp8ref.kernels.cpu_fp8 import PACKED_ROWS, PATH_FLAGS, CpuFp8Backend

RECIPES = [fp8ref.W8A8_FP8, fp8ref.FP8_PER_TENSOR]


def _backend(path: str | None = None) -> CpuFp8Backend:
    from fp8ref._machine import cpu_flags, cpu_model

    be = CpuFp8Backend()
    reason = be.available()
    if reason:
        pytest.skip(f"cpu-fp8: {reason}")
    if path is not None:
        missing = [f for f in PATH_FLAGS[path] if f not in cpu_flags()]
        if missing:
            pytest.skip(f"this CPU ({cpu_model()}) lacks {', '.join(missing)}: the {path} path cannot run here")
        be.isa = path
    return be


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _weight(be, N, K, recipe, seed=0):
    g = torch.Generator().manual_seed(seed)
    return be.prepare_weight(fp8ref.quantize(torch.randn(N, K, generator=g), recipe.weight))


@pytest.mark.parametrize("path", ["packed", "avx512", "avx2", "scalar"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_bound_call_is_linear_bit_for_bit(path, recipe):
    be = _backend(path)
    N, K = 40, 72
    w = _weight(be, N, K, recipe)
    g = torch.Generator().manual_seed(1)
    Ms = [1, 3, 17] + ([PACKED_ROWS + 5] if path == "packed" else [])  # the packed path's row chunks
    _check_bit_for_bit(be, w, recipe.activation, (torch.bfloat16, torch.float32, torch.float16), Ms, g)


def _check_bit_for_bit(be, w, scheme, out_dtypes, Ms, g):
    """The bound call of every output dtype against ``linear``: every x dtype, each M, x of more
    than two dimensions, with and without a bias; the same shape, dtype and bits."""
    N, K = w.data.shape
    for out_dtype in out_dtypes:
        fn = be.bind_linear(w, scheme, out_dtype)
        assert fn is not None
        for x_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for M in Ms:
                x = (torch.randn(M, K, generator=g) * 3).to(x_dtype)
                nd = fn(x.reshape(1, M, 1, K), None)  # rows are every dimension but the last
                assert nd is not None and nd.shape == (1, M, 1, N)
                assert torch.equal(_bits(nd.reshape(M, N)), _bits(fn(x, None)))
                for bias in (None, torch.randn(N, generator=g).to(x_dtype)):
                    got = fn(x, bias)
                    want = be.linear(x, w, bias, out_dtype, scheme)
                    assert got is not None and got.dtype == want.dtype == out_dtype and got.shape == (M, N)
                    assert torch.equal(_bits(got), _bits(want)), (be.name, x_dtype, out_dtype, M, bias)


def _check_hands_back(be, w, scheme):
    """NaN/Inf in x or the bias, a bias of another shape or dtype, K or M of 0, an x dtype the
    fused path does not take: the bound call returns None, so that the caller runs ``linear``,
    which raises (or computes) in the spec's words."""
    N, K = w.data.shape
    fn = be.bind_linear(w, scheme, torch.bfloat16)
    x = torch.randn(4, K)
    bad_x = x.clone()
    bad_x[2, 5] = float("nan")
    inf_x = x.clone()
    inf_x[0, 0] = float("inf")
    nan_bias = torch.randn(N)
    nan_bias[3] = float("nan")
    cases = [(bad_x, None), (inf_x, None), (x, nan_bias), (x, torch.randn(N + 1)),
             (x, torch.randn(N, dtype=torch.float64)), (x, torch.randn(1, N)), (torch.randn(0, K), None),
             (x.to(torch.float64), None), (torch.randn(4, K + 1), None), (torch.randn(2, 0, K), None)]
    for xx, bias in cases:
        assert fn(xx, bias) is None, (xx.shape, xx.dtype, None if bias is None else (bias.shape, bias.dtype))
    with pytest.raises(ValueError):
        be.linear(bad_x, w, None, torch.bfloat16, scheme)
    with pytest.raises(ValueError):
        be.linear(x, w, nan_bias, torch.bfloat16, scheme)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_bound_call_hands_back_what_linear_handles_otherwise(recipe):
    be = _backend()
    _check_hands_back(be, _weight(be, 24, 40, recipe), recipe.activation)


def test_bind_declines_what_it_does_not_compute():
    be = _backend()
    w = _weight(be, 16, 32, fp8ref.W8A8_FP8)
    unprepared = fp8ref.quantize(torch.randn(16, 32), fp8ref.W8A8_FP8.weight)
    assert be.bind_linear(unprepared, fp8ref.W8A8_FP8.activation, torch.bfloat16) is None
    assert be.bind_linear(w, fp8ref.W8A8_FP8.activation, torch.float64) is None
    assert be.bind_linear(w, fp8ref.FP8_BLOCK.activation, torch.bfloat16) is None  # group scales


def test_bound_call_follows_a_forced_path():
    """A path forced after binding (tests do it on the shared instance) hands calls back."""
    be = _backend()
    w = _weight(be, 16, 32, fp8ref.W8A8_FP8)
    fn = be.bind_linear(w, fp8ref.W8A8_FP8.activation, torch.bfloat16)
    x = torch.randn(2, 32)
    assert fn(x, None) is not None
    be.isa = "scalar"
    assert fn(x, None) is None


@pytest.mark.parametrize("bias", [False, True])
def test_warm_fp8linear_runs_the_bound_call(bias, monkeypatch, tmp_path):
    """The plan of a warm ``Fp8Linear`` call on cpu-fp8 holds the bound call, and the layer's
    output is ``linear``'s, bit for bit."""
    from fp8ref import select as sel

    _backend()
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    sel.clear_cache()
    try:
        lin = torch.nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16)
        q = fp8ref.Fp8Linear.from_linear(lin, backend="cpu-fp8")
        x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
        with torch.no_grad():
            y = q(x)
            p = q.plan(x)
            assert p is not None and p.fast is not None and p.watched is not None
            calls = []
            watched = p.watched
            object.__setattr__(p, "watched", lambda *a: calls.append(1) or watched(*a))
            y2 = q(x)
            assert calls == [1]
            want = p.backend.linear(x.reshape(-1, 64), p.prepared, q.bias, p.out_dtype, p.scheme).reshape(3, 5, 48)
        assert torch.equal(_bits(y), _bits(want)) and torch.equal(_bits(y2), _bits(want))
    finally:
        sel.clear_cache()


def test_fused_entry_point_guards_its_operands():
    """``fp8_linear`` checks what it reads through raw pointers (RuntimeError, never a crash)."""
    from fp8ref.kernels import _common, native

    be = _backend()
    mod = native.loaded()
    w = _weight(be, 16, 32, fp8ref.W8A8_FP8)
    codes, sb = w.extra["codes"], w.extra["sb"]
    pb, special = w.extra["packed"] if w.extra.get("packed") is not None else (codes, codes)
    isa = -1 if w.extra.get("packed") is not None else 1
    s = fp8ref.W8A8_FP8.activation
    head = (False, s.qmax, s.amax_floor, *_common.native_format_args(s), False)
    x = torch.randn(2, 32)

    def call(*, x=x, codes=codes, pb=pb, special=special, sb=sb, bias=sb, has_bias=False, isa=isa, rows=256, out=1):
        return mod.fp8_linear(x, *head, codes, pb, special, sb, bias, has_bias, isa, rows, out)

    assert call() is not None
    bad = [{"codes": codes.view(torch.int8)}, {"codes": codes.t()}, {"sb": torch.ones(15)},
           {"sb": torch.ones(16, dtype=torch.float64)}, {"out": 3}, {"rows": 0}, {"isa": 7}, {"isa": -4}]
    if isa < 0:  # the packed weight's shape must fit the codes'
        bad += [{"pb": pb[:, :-1]}, {"special": special[:, :-1]}]
    for kw in bad:
        with pytest.raises(RuntimeError):
            call(**kw)


class _BoundDoubleRounding(CpuFp8Backend):
    """A bound call that rounds the fp32 result to fp16 before out_dtype: a second rounding that
    ``linear`` does not make (what a hand-written fast path gets wrong)."""

    name = "mutant-bound-double-rounding"

    def bind_linear(self, w, scheme, out_dtype):
        fn = super().bind_linear(w, scheme, torch.float32)
        if fn is None:
            return None
        return lambda x, bias: (lambda y: None if y is None else y.to(torch.float16).to(out_dtype))(fn(x, bias))


class _WatchIgnored(CpuFp8Backend):
    """A watched call that checks nothing: the bound call whatever the weight (what a fast path
    that caches its operands gets wrong)."""

    name = "mutant-watch-ignored"

    def bind_watched_linear(self, w, scheme, out_dtype, watch):
        fn = self.bind_linear(w, scheme, out_dtype)
        return None if fn is None else (lambda x, bias, weight, scale: fn(x, bias))


class _WatchRowsOnly(CpuFp8Backend):
    """A watched call that checks x's rows but not the weight (a stale packed copy after a write)."""

    name = "mutant-watch-rows-only"

    def bind_watched_linear(self, w, scheme, out_dtype, watch):
        fn = self.bind_linear(w, scheme, out_dtype)
        if fn is None:
            return None
        return lambda x, bias, weight, scale: fn(x, bias) if watch.m_lo <= x.numel() // x.shape[-1] <= watch.m_hi \
            else None


def test_linear_matches_two_calls_checks_the_watched_call():
    from fp8ref.conformance import check

    _backend()
    for mutant, says in ((_WatchIgnored, "rows; it watches"), (_WatchRowsOnly, "sampled weight byte changed")):
        rep = check(mutant(), "ci", seed=0, contracts=["linear.matches_two_calls"])
        assert not rep.passed and "watched call" in rep.to_text() and says in rep.to_text(), rep.to_text()


def test_linear_matches_two_calls_checks_the_bound_call():
    from fp8ref.conformance import check

    _backend()
    rep = check(CpuFp8Backend(), "ci", seed=0, contracts=["linear.matches_two_calls"])
    assert rep.passed, rep.to_text()
    rep = check(_BoundDoubleRounding(), "ci", seed=0, contracts=["linear.matches_two_calls"])
    assert not rep.passed and "bound call" in rep.to_text(), rep.to_text()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_amx_bound_call_is_linear_bit_for_bit(recipe, monkeypatch):
    """cpu-fp8-amx binds the AMX kernel (not cpu-fp8's packed one it inherits from): on the emulated
    tiles here, rows in chunks of AMX_ROWS (8 for the test) as its ``linear`` takes them."""
    from fp8ref.kernels import cpu_fp8_amx

    monkeypatch.setattr(cpu_fp8_amx, "AMX_ROWS", 8)
    be = cpu_fp8_amx.CpuFp8AmxBackend()
    be.emulate = True
    reason = be.available()
    if reason:
        pytest.skip(f"cpu-fp8-amx (emulated): {reason}")
    N, K = 40, 72
    w = _weight(be, N, K, recipe)
    g = torch.Generator().manual_seed(2)
    for out_dtype in (torch.bfloat16, torch.float32):
        fn = be.bind_linear(w, recipe.activation, out_dtype)
        assert fn is not None
        for M in (1, 5, 19):
            x = torch.randn(M, K, generator=g, dtype=torch.bfloat16)
            bias = torch.randn(N, generator=g)
            got, want = fn(x, bias), be.linear(x, w, bias, out_dtype, recipe.activation)
            assert got is not None and torch.equal(_bits(got), _bits(want)), (out_dtype, M)
    be.emulate = False  # the kernel the binding chose is no longer the one linear runs: hand back
    assert fn(torch.randn(2, K), None) is None


WATCHED = ["cpu-fp8", "cpu-bf16"]  # backends whose plans bind a watched call


def _watched_layer(weight_check="sample", bias=False, N=48, K=64, backend="cpu-fp8"):
    _backend()  # the extension is built and loaded
    reason = fp8ref.get_backend(backend).available()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    lin = torch.nn.Linear(K, N, bias=bias, dtype=torch.bfloat16)
    return fp8ref.Fp8Linear.from_linear(lin, backend=backend, weight_check=weight_check)


def _spy(q, x):
    """The plan of x's case, its watched call counting the calls that it computes."""
    p = q.plan(x)
    assert p is not None and p.watched is not None
    computed = []
    watched = p.watched

    def spy(*a):
        y = watched(*a)
        if y is not None:
            computed.append(1)
        return y

    object.__setattr__(p, "watched", spy)
    return computed


@pytest.mark.parametrize("backend", WATCHED)
@pytest.mark.parametrize("weight_check", ["sample", "version"])
def test_watched_call_sees_what_the_plan_check_sees(weight_check, backend, isolated_selection):
    """The warm ``Fp8Linear`` call is the watched call alone; it hands back (the layer then plans
    again, as ``Plan.current`` decides) after each change the weight check sees, and the layer's
    output is then the changed layer's, bit for bit."""
    q = _watched_layer(weight_check, backend=backend)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
        computed = _spy(q, x)
        q(x)
        assert computed == [1]
        changes = [lambda: q.weight_scale.mul_(2),  # a version bump
                   lambda: setattr(q, "weight_scale", q.weight_scale.clone())]  # another tensor
        if weight_check == "sample":  # writes torch does not count: the sample sees them
            changes += [lambda: q.weight_scale.data.mul_(0.5),
                        lambda: q.weight.data.view(torch.uint8).numpy().__setitem__((0, 0), 0x38)]
        for i, change in enumerate(changes):
            change()
            y = q(x)
            qw = q.quantized_weight()
            fresh = fp8ref.Quantized(qw.data.clone(), qw.scale.clone(), qw.scheme)
            want = fp8ref.linear(x, fresh, None, recipe=q.recipe, backend=backend)
            assert torch.equal(_bits(y), _bits(want)), f"change {i}"
            computed = _spy(q, x)  # the new plan is watched again
            q(x)
            assert computed == [1], f"change {i}"


@pytest.mark.parametrize("weight_check", ["sample", "version"])
def test_native_watch_sees_what_the_plan_check_sees(weight_check, isolated_selection):
    """A backend without a watched call (torch) keeps the Python path, whose weight check is the
    extension's ``WeightWatch`` (``LayerPlans._current``): after each change the weight check sees,
    the layer's output is the changed layer's, bit for bit."""
    _backend()
    if fp8ref.get_backend("torch").available():
        pytest.skip("the torch backend is unavailable here")
    lin = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    q = fp8ref.Fp8Linear.from_linear(lin, backend="torch", weight_check=weight_check)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
        assert q.plan(x).watched is None and q._plans.watch is not None
        changes = [lambda: q.weight_scale.mul_(2), lambda: setattr(q, "weight_scale", q.weight_scale.clone())]
        if weight_check == "sample":
            changes += [lambda: q.weight_scale.data.mul_(0.5),
                        lambda: q.weight.data.view(torch.uint8).numpy().__setitem__((0, 0), 0x38)]
        for i, change in enumerate(changes):
            entry = q._plans.entry
            change()
            y = q(x)
            assert q._plans.entry is not entry, f"change {i} not seen"  # the weight was checked again
            qw = q.quantized_weight()
            fresh = fp8ref.Quantized(qw.data.clone(), qw.scale.clone(), qw.scheme)
            want = fp8ref.linear(x, fresh, None, recipe=q.recipe, backend="torch")
            assert torch.equal(_bits(y), _bits(want)), f"change {i}"
            assert q._plans.watch is not None and q._plans.watch[0] is q._plans.entry, f"change {i}"


@pytest.mark.parametrize("backend", WATCHED)
def test_watched_call_hands_back_other_cases(backend, isolated_selection):
    """x of another dtype or M bucket, grad mode with an input that requires grad, and a change
    of the backend's kernel settings: the watched call computes nothing."""
    q = _watched_layer(bias=True, backend=backend)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        q(x)
    p = q.plan(x)
    w, s = q.weight, q.weight_scale
    with torch.no_grad():
        assert p.watched(x, q.bias, w, s) is not None
        assert p.watched(torch.randn(3, 64, dtype=torch.bfloat16), q.bias, w, s) is None  # bucket 4
        assert p.watched(torch.randn(1, 64, dtype=torch.bfloat16), q.bias, w, s) is None  # bucket 1
        assert p.watched(x.float(), q.bias, w, s) is None
        assert p.watched(x.reshape(1, 2, 64), q.bias, w, s) is not None  # rows are all but the last dim
    assert p.watched(x.requires_grad_(), q.bias, w, s) is None
    with torch.no_grad():
        x = x.detach()
        be = p.backend
        name = type(be)._KERNEL_SETTINGS[0]
        missing = object()
        old = be.__dict__.get(name, missing)
        setattr(be, name, getattr(be, name))  # the same value: still a change of setting, so the call hands back
        try:
            assert p.watched(x, q.bias, w, s) is None
        finally:
            if old is missing:
                delattr(be, name)
            else:
                setattr(be, name, old)


def test_watched_call_guards_its_construction():
    """``BoundLinear`` checks what it keeps (RuntimeError, never a crash)."""
    from fp8ref.kernels import native

    be = _backend()
    mod = native.loaded()
    w = _weight(be, 16, 32, fp8ref.W8A8_FP8)
    fast_args = be._bound_args(w, fp8ref.W8A8_FP8.activation, torch.bfloat16)
    assert fast_args is not None
    _, args, tail = fast_args
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    i64 = torch.zeros(0, dtype=torch.int64)
    good = dict(epoch=torch.zeros(1, dtype=torch.int64), watched=[codes], versions=[0], addr=i64, lens=i64,
                expected=torch.zeros(0, dtype=torch.uint8))

    def make(**kw):
        a = {**good, **kw}
        return mod.BoundLinear(*args, *tail, 1, 1, 1, a["epoch"], a["watched"], a["versions"], a["addr"], a["lens"],
                               a["expected"])

    assert make() is not None
    assert make(addr=torch.tensor([codes.data_ptr() + 500]), lens=torch.tensor([12]),
                expected=codes.reshape(-1)[500:].clone()).current([codes])
    for kw in [{"epoch": torch.zeros(2, dtype=torch.int64)}, {"epoch": torch.zeros(1)}, {"versions": []},
               {"addr": torch.zeros(1, dtype=torch.int64)}, {"lens": torch.ones(1, dtype=torch.int64),
                                                            "addr": torch.zeros(1, dtype=torch.int64)},
               {"expected": torch.zeros(3, dtype=torch.uint8)},
               {"addr": torch.tensor([codes.data_ptr() + 500]), "lens": torch.tensor([13]),  # past the storage
                "expected": torch.zeros(13, dtype=torch.uint8)},
               {"addr": torch.tensor([8]), "lens": torch.tensor([1]), "expected": torch.zeros(1, dtype=torch.uint8)}]:
        with pytest.raises(RuntimeError):
            make(**kw)


# --- cpu-bf16 and cpu-fp32: the fused linear (wide_linear) and its watched call (BoundWideLinear) ---

WIDE = {"cpu-bf16": (torch.bfloat16,), "cpu-fp32": (torch.bfloat16, torch.float32)}  # outputs bound
#: What the wide backends fuse: per-row dynamic activations, one weight scale along K (per row or
#: per tensor), every FP8 format the quantizer takes.
WIDE_RECIPES = [fp8ref.W8A8_FP8, fp8ref.W8A8_FP8_ROCM,
                fp8ref.Recipe("tensor-weight", fp8ref.FP8_PER_TENSOR.weight, fp8ref.W8A8_FP8.activation),
                fp8ref.Recipe("e5m2-rows", fp8ref.QuantScheme(format="e5m2", granularity="row"),
                              fp8ref.QuantScheme(format="e5m2", granularity="row"))]


def _wide(name: str):
    _backend()  # the extension is built and loaded
    be = fp8ref.get_backend(name)
    reason = be.available()
    if reason:
        pytest.skip(f"{name}: {reason}")
    return be


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("name", list(WIDE))
@pytest.mark.parametrize("recipe", WIDE_RECIPES, ids=lambda r: r.name)
def test_wide_bound_call_is_linear_bit_for_bit(name, recipe, packed):
    """Every x dtype, bound output, row count and bias; oneDNN's packed weight and the plain one."""
    from fp8ref.kernels import cpu

    be = _wide(name)
    if packed and cpu.pack_reason(be.wide):
        pytest.skip(f"{name}: weights are not packed here ({cpu.pack_reason(be.wide)})")
    N, K = 40, 72
    g = torch.Generator().manual_seed(3)
    qw = fp8ref.quantize(torch.randn(N, K, generator=g), recipe.weight)
    w = be.prepare_weight(qw)
    if not packed:  # the plain weight prepare_weight keeps where oneDNN packs nothing
        w = type(w).wrap(qw, be.name, wide=qw.data.to(be.wide).contiguous())
    assert ("packed" in w.extra) == packed
    _check_bit_for_bit(be, w, recipe.activation, WIDE[name], (1, 3, 17, 70), g)


@pytest.mark.parametrize("name", list(WIDE))
def test_wide_bound_call_hands_back_what_linear_handles_otherwise(name):
    be = _wide(name)
    _check_hands_back(be, be.prepare_weight(fp8ref.quantize(torch.randn(24, 40), fp8ref.W8A8_FP8.weight)),
                      fp8ref.W8A8_FP8.activation)


@pytest.mark.parametrize("name", list(WIDE))
def test_wide_bind_declines_what_it_does_not_compute(name):
    be = _wide(name)
    qw = fp8ref.quantize(torch.randn(16, 32), fp8ref.W8A8_FP8.weight)
    w = be.prepare_weight(qw)
    act = fp8ref.W8A8_FP8.activation
    assert be.bind_linear(w, act, torch.bfloat16) is not None
    assert be.bind_linear(qw, act, torch.bfloat16) is None  # not prepared here
    assert be.bind_linear(w, act, torch.float64) is None
    assert be.bind_linear(w, act, torch.float16) is None  # the extension's epilogue writes bf16 or fp32
    blocked = be.prepare_weight(fp8ref.quantize(torch.randn(16, 256), fp8ref.FP8_BLOCK.weight))
    assert be.bind_linear(blocked, fp8ref.FP8_BLOCK.activation, torch.bfloat16) is None  # K segments
    assert be.bind_linear(w, fp8ref.FP8_PER_TENSOR.activation, torch.bfloat16) is None  # one scale for x
    assert be.bind_linear(w, fp8ref.MXFP8.activation, torch.bfloat16) is None  # groups, power-of-two scales


def test_wide_bound_call_follows_the_precision_switch():
    """cpu-fp32's bf16 dot products, switched on after binding, hand calls back (``linear`` then
    runs its GEMM under the switch); bound while on, nothing binds."""
    be = _wide("cpu-fp32")
    w = be.prepare_weight(fp8ref.quantize(torch.randn(16, 32), fp8ref.W8A8_FP8.weight))
    act = fp8ref.W8A8_FP8.activation
    fn = be.bind_linear(w, act, torch.float32)
    x = torch.randn(2, 32)
    assert fn(x, None) is not None
    old = be.__dict__["bf16_dot_products"]
    be.bf16_dot_products = True
    try:
        assert fn(x, None) is None
        assert be.bind_linear(w, act, torch.float32) is None
    finally:
        be.bf16_dot_products = old
    assert fn(x, None) is not None


def test_wide_entry_point_guards_its_operands():
    """``wide_linear`` and ``BoundWideLinear`` check what they read (RuntimeError, never a crash)."""
    from fp8ref.kernels import native

    be = _wide("cpu-bf16")
    mod = native.loaded()
    w = be.prepare_weight(fp8ref.quantize(torch.randn(16, 32), fp8ref.W8A8_FP8.weight))
    _, args, tail = be._bound_args(w, fp8ref.W8A8_FP8.activation, torch.bfloat16)
    head, weight, packed, sb = args[:-3], args[-3], args[-2], args[-1]
    plain = torch.randn(16, 32).to(torch.bfloat16)
    x = torch.randn(2, 32)

    def call(*, weight=weight, packed=packed, sb=sb, mode=1, out_bf16=True):
        return mod.wide_linear(x, *head, weight, packed, sb, sb, False, mode, out_bf16)

    assert call() is not None and call(weight=plain, packed=False) is not None
    bad = [{"weight": plain, "packed": True}, {"weight": plain.float(), "packed": False},
           {"weight": plain[:, None], "packed": False}, {"weight": plain, "packed": False, "sb": torch.ones(15)},
           {"weight": plain, "packed": False, "sb": torch.ones(16, dtype=torch.float64)},
           {"weight": plain, "packed": False, "mode": 3}, {"weight": plain, "packed": False, "out_bf16": False}]
    if packed:
        bad.append({"packed": False})  # oneDNN's opaque layout read as a plain tensor
    for kw in bad:
        with pytest.raises(RuntimeError):
            call(**kw)
    i64 = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        mod.BoundWideLinear(*head, weight, packed, torch.ones(15), *tail, 1, 1, 1, torch.zeros(1, dtype=torch.int64),
                            [plain], [0], i64, i64, torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(RuntimeError):
        mod.BoundWideLinear(*args, *tail, 5, 1, 1, torch.zeros(1, dtype=torch.int64), [plain], [0], i64, i64,
                            torch.zeros(0, dtype=torch.uint8))  # x_code 5


def _wide_mutants():
    from fp8ref.kernels.cpu import CpuWideBackend

    class WideWatchIgnored(CpuWideBackend):
        """cpu-bf16 with a watched call that checks nothing (a fast path that caches its operands)."""

        def bind_watched_linear(self, w, scheme, out_dtype, watch):
            fn = self.bind_linear(w, scheme, out_dtype)
            return None if fn is None else (lambda x, bias, weight, scale: fn(x, bias))

    class WideBoundRoundsTwice(CpuWideBackend):
        """cpu-fp32 with a bound call that rounds to bf16 on the way to an fp32 output."""

        def bind_linear(self, w, scheme, out_dtype):
            fn = super().bind_linear(w, scheme, out_dtype)
            if fn is None:
                return None
            return lambda x, bias: (lambda y: None if y is None else y.to(torch.bfloat16).to(y.dtype))(fn(x, bias))

    return ((WideWatchIgnored("mutant-wide-watch-ignored", torch.bfloat16), "watched call"),
            (WideBoundRoundsTwice("mutant-wide-bound-rounds-twice", torch.float32), "bound call"))


def test_wide_linear_matches_two_calls_checks_the_bound_and_watched_calls():
    """The conformance contract runs cpu-bf16's and cpu-fp32's bound and watched calls: the correct
    ones pass, and a watched call that ignores the watch or a bound call that rounds twice fail."""
    from fp8ref.conformance import check
    from fp8ref.kernels.cpu import CpuWideBackend

    for name in WIDE:
        be = _wide(name)
        rep = check(CpuWideBackend(be.name, be.wide), "ci", seed=0, contracts=["linear.matches_two_calls"])
        assert rep.passed, rep.to_text()
    for mutant, says in _wide_mutants():
        rep = check(mutant, "ci", seed=0, contracts=["linear.matches_two_calls"])
        assert not rep.passed and says in rep.to_text(), rep.to_text()
