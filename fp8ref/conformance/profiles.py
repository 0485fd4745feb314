"""Conformance profiles: how hard the suite searches (examples per contract, largest shapes).

Three profiles, chosen with the environment variable ``FP8REF_HYPOTHESIS_PROFILE`` or explicitly
(``check(backend, profile="thorough")``); the default everywhere is ``ci``:

========  ========  ========  =====  ==========  ===========  =====================================
profile   examples  max M, N  max K  max elems   budget/contr  use
========  ========  ========  =====  ==========  ===========  =====================================
dev       6         33        160    2048        2 s           editing a kernel: seconds per backend
ci        16        64        272    16384       none          every push: one backend in < 60 s
thorough  200       256       4097   unlimited   300 s         nightly: K = 4097, 1-element groups
========  ========  ========  =====  ==========  ===========  ==============================
Each profile is also registered as a Hypothesis settings profile named ``fp8ref-<name>``
(no example database, so parallel workers share no state; no deadline, because a reference
GEMM's time depends on the shape drawn).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, Phase, settings

from .. import _env

__all__ = ["Profile", "PROFILES", "ENV_VAR", "get_profile", "default_profile_name", "hypothesis_settings",
           "resolve_seed", "boundary_sizes"]

ENV_VAR = "FP8REF_HYPOTHESIS_PROFILE"


@dataclass(frozen=True)
class Profile:
    """Search budget of one conformance run.

    Attributes
    ----------
    name : str
    max_examples : int
        Hypothesis examples per contract (the exhaustive and probe contracts ignore it).
    max_mn, max_k : int
        Largest M, N and K drawn; the special sizes (1, 3, 15, 17, 127, 129, 4097) above the
        cap are left out.
    max_elems : int
        Largest rows x cols of one operand (interpreted kernels pay per element).
    tiny_blocks : bool
        Also draw scale groups/blocks of 1 and 2 elements (one scale per element: costly for
        kernels launched per group, so only in ``thorough``).
    time_budget_s : float or None
        Soft time budget per contract: once spent, no new example starts (the report gives the
        number of examples that ran). Shrinking a failure is not cut short. ``inf`` (``ci``):
        no budget, so the examples checked never depend on the machine's speed.
    shrink : bool
        Shrink a failing example to a minimal one (off only for the mutant self-test, which
        needs a verdict, not a counterexample).
    derandomize : bool
        Same commit, same examples: the seed defaults to ``fixed_seed`` instead of a random one,
        and Hypothesis tests run under the profile (``fp8ref-<name>``) are derandomized. ``ci``
        is derandomized; ``dev`` and ``thorough`` explore with a fresh seed each run, printed in
        every report so that a failure reproduces.
    fixed_seed : int
        The seed of a derandomized profile.
    thresholds : tuple of int
        Tile sizes t where kernels switch paths: the sweep and the search draw 1, t-1, t, t+1 on
        every axis.
    large_rows : tuple of int
        Row counts (M, N, quantized rows) beyond ``max_mn`` drawn with t-1, t, t+1, the other axes
        kept small (a tall-thin operand).
    long_k : tuple of int
        Reduction lengths beyond ``max_k`` drawn likewise, with a single row or two.
    max_rows : int
        Largest row count of any operand (tall-thin shapes); lowered with ``max_elems`` for
        backends that pay per element (``conformance_max_elems``).
    sweep_stride : int
        The secondary contracts (identities and info: determinism, symmetry, equivariance,
        losslessness on the grid, fused linear = two calls, bit exactness, batch invariance) run
        every ``sweep_stride``-th sweep item; 1 except for backends that pay per element.
    slow_examples : int
        Search examples per contract for a backend that pays per element (the Triton
        interpreter, ``conformance_max_elems``): a count, not a time, so the verdict stays
        independent of the machine's speed.
    huge_sizes : bool
        The ``*.size_limits`` contracts also draw operands past 2**31 elements (element offsets
        that overflow int32): GiBs of memory per example, so only in the ``limits`` profile.
    """

    name: str
    max_examples: int
    max_mn: int
    max_k: int
    max_elems: int = 1 << 30
    tiny_blocks: bool = False
    time_budget_s: float | None = None
    shrink: bool = True
    derandomize: bool = False
    fixed_seed: int = 0
    thresholds: tuple[int, ...] = (8, 16, 32, 64, 128)
    large_rows: tuple[int, ...] = ()
    long_k: tuple[int, ...] = ()
    max_rows: int = 1 << 30
    sweep_stride: int = 1
    slow_examples: int = 4
    huge_sizes: bool = False

    def with_(self, **changes) -> Profile:
        return replace(self, **changes)


PROFILES: dict[str, Profile] = {
    "dev": Profile("dev", max_examples=6, max_mn=33, max_k=160, max_elems=2048, time_budget_s=2.0,
                   thresholds=(8, 16, 64, 128), large_rows=(256,), long_k=(1024,), max_rows=257),
    "ci": Profile("ci", max_examples=16, slow_examples=4, max_mn=64, max_k=272, max_elems=16384, time_budget_s=math.inf,
                  derandomize=True, thresholds=(8, 16, 32, 64, 128, 256), large_rows=(1024,), long_k=(1024, 4096),
                  max_rows=1025),
    "thorough": Profile("thorough", max_examples=200, max_mn=256, max_k=4097, tiny_blocks=True,
                        time_budget_s=300.0, thresholds=(8, 16, 32, 64, 128, 256, 512),
                        large_rows=(1024, 4096), long_k=(4096, 16384), max_rows=4097),
    # The size limits past 2**31 elements (run it with --only <op>.size_limits: GiBs per example).
    "limits": Profile("limits", max_examples=4, max_mn=64, max_k=272, max_elems=16384, time_budget_s=math.inf,
                      derandomize=True, thresholds=(8, 16, 32, 64, 128, 256), large_rows=(1024,), long_k=(1024, 4096),
                      max_rows=1025, huge_sizes=True),
}

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
             HealthCheck.large_base_example, HealthCheck.differing_executors, HealthCheck.nested_given]


def boundary_sizes(profile: Profile, axis: str) -> list[int]:
    """Sizes 1 and t-1, t, t+1 for every threshold t, plus ``large_rows`` (axis "rows": M, N, the
    quantized rows) or ``long_k`` (axis "cols": K), within ``max_rows``/``max_elems``.

    Examples
    --------
    >>> from fp8ref.conformance.profiles import PROFILES, boundary_sizes
    >>> boundary_sizes(PROFILES["dev"], "rows")
    [1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257]
    """
    if axis not in ("rows", "cols"):
        raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}")
    big = profile.large_rows if axis == "rows" else profile.long_k
    cap = profile.max_rows if axis == "rows" else profile.max_elems
    vals = {1} | {t + d for t in (*profile.thresholds, *big) for d in (-1, 0, 1)}
    return sorted(v for v in vals if 1 <= v <= cap)


def default_profile_name() -> str:
    """``$FP8REF_HYPOTHESIS_PROFILE`` if set, else ``ci``: the profile that finds the bugs, and the
    one default of ``check()``, the pytest fixture, ``pytest properties`` and the CLI (``dev`` is
    the quick one for editing a kernel)."""
    name = _env.get(ENV_VAR)
    if name not in PROFILES:
        raise ValueError(f"{ENV_VAR}={name!r} is not a profile; choose one of {sorted(PROFILES)}")
    return name


def get_profile(profile: Profile | str | None = None) -> Profile:
    """A profile by object or name; None gives the one the environment selects."""
    if isinstance(profile, Profile):
        return profile
    if profile is None:
        profile = default_profile_name()
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown conformance profile {profile!r}; choose one of {sorted(PROFILES)}") from None


def resolve_seed(profile: Profile, seed: int | None) -> int:
    """The seed a run uses: ``seed`` if given, else the profile's fixed seed when it is
    derandomized (``ci``), else a fresh random one (to be printed with the results)."""
    if seed is not None:
        return int(seed)
    return profile.fixed_seed if profile.derandomize else random.randrange(2**32)


def hypothesis_settings(profile: Profile, max_examples: int | None = None) -> settings:
    """The Hypothesis settings a contract runs under in ``profile``."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if profile.shrink:
        phases.append(Phase.shrink)
    return settings(max_examples=profile.max_examples if max_examples is None else max_examples,
                    deadline=None, database=None, derandomize=profile.derandomize, print_blob=True,
                    suppress_health_check=_SUPPRESS, phases=phases, report_multiple_bugs=False)


for _p in PROFILES.values():
    settings.register_profile(f"fp8ref-{_p.name}", hypothesis_settings(_p))
