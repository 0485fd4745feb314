"""The MoE contracts: certify a MoE backend against the reference layer and its bound (docs/spec.md §7).

``check_moe(backend, profile, seed)`` runs two contracts over the MoE schemes the fused kernels
use (``MOE_SCHEMES``: per-tensor dynamic and static, 128 x 128 blocks with 1 x 128 groups, per
token), each example judged by the checking core's ``check_moe_problem`` (the bound, the inputs
unchanged, a second call bit-identical):

- ``moe.sweep``: a deterministic corner sweep (``moe_sweep``): one token; experts with no token and
  scales apart by 2**4 with outlier rows; a token's top-k repeating one expert; token counts that
  are not multiples of a kernel's block (17); an expert-parallel rank with ids at both edges of
  the global range; a shared expert every token reaches; K and I past one 128-block (partial
  blocks); K and I multiples of 128 (the block kernels' premise); one static scale for all experts
  (what kernels that read one scalar take); the other gate/up order;
- ``moe.search``: a Hypothesis search over the same axes (``moe_specs``), seeded by ``seed``.

A backend whose ``conformance_max_elems`` is set (an interpreter) gets the items whose x and whose
one expert's w13 fit it. The result is a ``Report`` like the dense contracts'.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..check.common import ContractViolation, Declined
from ..check.moe import MoeSpec, build_problem, check_moe_problem
from ..registry import MoeBackend, get_moe_backend
from ..spec.moe import MoeScheme
from ..spec.schemes import QuantScheme
from .profiles import Profile, get_profile, resolve_seed
from .report import FAIL, PASS, UNTESTED, ContractResult, Report

__all__ = ["MOE_SCHEMES", "MOE_CONTRACTS", "moe_sweep", "moe_specs", "check_moe"]

_TENSOR = QuantScheme(granularity="tensor")
_STATIC = QuantScheme(granularity="tensor", dynamic=False)
#: The fused kernels' group quantizer floors amax at eps = 1e-10 (SGLang and vLLM).
_GROUP = QuantScheme(granularity="group", group_size=128, amax_floor=1e-10)

#: The schemes of the FP8 fused-MoE paths: name -> MoeScheme.
MOE_SCHEMES: dict[str, MoeScheme] = {
    "tensor-dynamic": MoeScheme(_TENSOR, _TENSOR, _TENSOR),
    "tensor-static": MoeScheme(_TENSOR, _STATIC, _STATIC),
    "block128": MoeScheme(QuantScheme(granularity="block", block=(128, 128)), _GROUP, _GROUP),
    "token": MoeScheme(QuantScheme(granularity="row"), QuantScheme(granularity="row"), QuantScheme(granularity="row")),
}
MOE_CONTRACTS = ("moe.sweep", "moe.search")


def _fits(s: MoeSpec, max_elems: int | None) -> bool:
    return max_elems is None or (s.tokens * s.hidden <= max_elems and 2 * s.inter * s.hidden <= max_elems)


def moe_sweep(order: str = "gate_up") -> list[MoeSpec]:
    """The corner sweep's items (see the module docstring), for one gate/up order."""
    other = "up_gate" if order == "gate_up" else "gate_up"
    return [
        MoeSpec(1, 40, 24, 3, 1, routing="one", order=order),
        MoeSpec(5, 136, 72, 4, 2, routing="empty", spread=4.0, outlier_rows=True, seed=1, order=order),
        MoeSpec(7, 40, 24, 4, 3, routing="repeat", seed=2, order=order),
        MoeSpec(17, 40, 24, 3, 2, routing="skewed", seed=3, order=order),
        MoeSpec(6, 40, 24, 4, 2, expert_map="ep", seed=4, order=order),
        MoeSpec(6, 40, 24, 4, 3, expert_map="shared", spread=2.0, seed=5, order=order),
        MoeSpec(9, 24, 16, 5, 2, spread=6.0, outlier_rows=True, seed=6, order=order),
        MoeSpec(4, 40, 24, 3, 2, seed=7, order=other),
        MoeSpec(5, 128, 128, 4, 2, routing="empty", spread=4.0, outlier_rows=True, seed=8, order=order),
        MoeSpec(17, 128, 128, 3, 2, routing="skewed", expert_map="ep", seed=9, order=order),
        MoeSpec(6, 128, 128, 4, 3, routing="repeat", expert_map="shared", one_static_scale=True, seed=10, order=order),
        MoeSpec(3, 40, 24, 3, 2, spread=4.0, one_static_scale=True, seed=11, order=order),
    ]


def moe_specs(max_elems: int | None = None, order: str | None = None):
    """A Hypothesis strategy of ``MoeSpec`` (sizes capped by ``max_elems``)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        E = d(st.integers(1, 8))
        k = d(st.integers(1, min(E, 4)))
        T = d(st.sampled_from([1, 2, 3, 5, 8, 15, 16, 17]))
        if d(st.integers(0, 3)) == 0:  # K and I multiples of 128: the block kernels' premise
            K, I = 128, 128
        else:
            K = d(st.sampled_from([8, 16, 24, 40, 127, 128, 136, 256]))
            I = d(st.sampled_from([8, 24, 40, 72, 96, 129]))  # 2I = 144, 192, 258: a partial 128-block
        while max_elems is not None and (T * K > max_elems or 2 * I * K > max_elems):
            K, I = max(8, K // 2), max(8, I // 2)
        return MoeSpec(T, K, I, E, k, routing=d(st.sampled_from(["random", "skewed", "repeat", "one", "empty"])),
                       expert_map=d(st.sampled_from(["none", "ep", "shared"])),
                       spread=d(st.sampled_from([0.0, 2.0, 4.0, 6.0])), outlier_rows=d(st.booleans()),
                       one_static_scale=d(st.integers(0, 3)) == 0,
                       seed=d(st.integers(0, 2**16)),
                       order=order if order is not None else d(st.sampled_from(["gate_up", "up_gate"])))

    return draw()


class _Tally:
    def __init__(self, name: str) -> None:
        self.name, self.examples, self.declined, self.worst = name, 0, 0, None
        self.failure: tuple[str, str] | None = None
        self.n_failed = 0
        self.t0 = time.process_time()

    def run(self, backend: MoeBackend, spec: MoeSpec, scheme_name: str, scheme: MoeScheme) -> None:
        label = f"{scheme_name}:{spec.short_str()}"
        try:
            ratio = check_moe_problem(backend, build_problem(spec, scheme))
        except Declined:
            self.declined += 1
            return
        except ContractViolation as exc:
            self._fail(label, str(exc))
            raise
        except Exception as exc:  # a crash is a failure of the backend on that input
            self._fail(label, f"raised {exc!r}")
            raise ContractViolation(f"raised {exc!r}") from exc
        self.examples += 1
        self.worst = ratio if self.worst is None else max(self.worst, ratio)

    def _fail(self, label: str, message: str) -> None:
        self.examples += 1
        self.n_failed += 1
        if self.failure is None:  # the first failure is the counterexample
            self.failure = (label, message)

    def result(self, reproduce: str) -> ContractResult:
        status = FAIL if self.failure else (PASS if self.examples else UNTESTED)
        return ContractResult(self.name, "bound", status, self.examples, self.declined, self.worst,
                              counterexample=self.failure[0] if self.failure else None,
                              message=self.failure[1] if self.failure else None,
                              reproduce=reproduce if self.failure else None,
                              seconds=time.process_time() - self.t0, op="moe",
                              note=f"{self.n_failed} of {self.examples} examples failed" if self.n_failed else None)


def _schemes(schemes: Sequence[str] | None) -> dict[str, MoeScheme]:
    names = list(MOE_SCHEMES) if schemes is None else list(schemes)
    unknown = [n for n in names if n not in MOE_SCHEMES]
    if unknown:
        raise ValueError(f"unknown MoE schemes {unknown}; choose from {sorted(MOE_SCHEMES)}")
    return {n: MOE_SCHEMES[n] for n in names}


def check_moe(backend: MoeBackend | str, profile: Profile | str | None = None, seed: int | None = None, *,
              schemes: Sequence[str] | None = None, max_examples: int | None = None,
              only: Sequence[str] | None = None, fail_fast: bool = False) -> Report:
    """Certify a MoE backend: the corner sweep, then the Hypothesis search, per scheme it supports.

    Parameters
    ----------
    backend : MoeBackend or str
        An instance or a registered MoE backend's name.
    profile : Profile or str, optional
        The conformance profile (its ``max_examples`` is the search's budget per scheme, its
        ``derandomize`` and ``shrink`` apply); the environment's by default.
    seed : int, optional
        The search's seed (the profile's fixed seed for ``ci``).
    schemes : sequence of str, optional
        Names from ``MOE_SCHEMES`` (all by default).
    max_examples : int, optional
        Fewer search examples per scheme than the profile's.
    only : sequence of str, optional
        Run only these of ``MOE_CONTRACTS``.
    fail_fast : bool
        Stop after the first failing contract.

    Returns
    -------
    Report
        Contracts ``moe.sweep`` and ``moe.search``; ``pass`` only when both ran examples and
        none failed.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    b = get_moe_backend(backend) if isinstance(backend, str) else backend
    prof = get_profile(profile)
    seed = resolve_seed(prof, seed)
    chosen = _schemes(schemes)
    t0 = time.process_time()
    report = Report(b.name, prof.name, seed, precision="", accumulation=b.accuracy.short_str(),
                    claimed="moe: " + ", ".join(chosen))
    reason = b.available()
    if reason:
        report.available, report.reason = False, reason
        return report
    cap = b.conformance_max_elems
    reproduce = (f"python -c \"import fp8ref.conformance.moe as m; print(m.check_moe({b.name!r}, {prof.name!r}, "
                 f"{seed}).to_text())\"")
    contracts = MOE_CONTRACTS if only is None else tuple(only)
    unknown = set(contracts) - set(MOE_CONTRACTS)
    if unknown:
        raise ValueError(f"unknown MoE contracts {sorted(unknown)}; choose from {MOE_CONTRACTS}")
    if "moe.sweep" in contracts:
        sweep = _Tally("moe.sweep")  # every item runs (fail_fast: up to the first failure)
        for name, scheme in chosen.items():
            for spec in moe_sweep(scheme.order):
                if _fits(spec, cap) and not (fail_fast and sweep.failure):
                    try:
                        sweep.run(b, spec, name, scheme)
                    except ContractViolation:
                        pass
        report.results.append(sweep.result(reproduce))
        if fail_fast and report.failures:
            report.seconds = time.process_time() - t0
            return report
    if "moe.search" not in contracts:
        report.seconds = time.process_time() - t0
        return report
    search = _Tally("moe.search")
    n = prof.max_examples if max_examples is None else min(max_examples, prof.max_examples)
    if cap is not None:
        n = min(n, prof.slow_examples)
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if prof.shrink else [])
    # one search per scheme, n examples each: a draw of the scheme would leave some with few
    def search_scheme(name: str, scheme: MoeScheme) -> None:
        @hseed(seed)
        @settings(max_examples=max(1, n), derandomize=False, database=None, deadline=None, phases=phases,
                  suppress_health_check=list(HealthCheck))
        @given(spec=moe_specs(cap))
        def run(spec: MoeSpec) -> None:
            search.run(b, spec, name, scheme)

        run()

    for name, scheme in chosen.items():
        try:
            search_scheme(name, scheme)
        except ContractViolation:
            break
    report.results.append(search.result(reproduce))
    report.seconds = time.process_time() - t0
    return report
