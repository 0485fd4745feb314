"""What every peer adapter shares: the ``Peer`` backend class, lazy imports with exact reasons, and
the helpers that turn a peer's tensors into ``Quantized`` without changing a value.

An adapter adapts *conventions* (multiply or divide by the scale, scale layouts, argument order)
and never the peer's numerics: the codes and scales it returns are the bytes the peer produced.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import replace
from typing import Any

import torch

from ..conformance.problems import GemmProblem, LinearProblem, QuantizeProblem
from ..registry import Backend, Case
from ..spec import layouts, quant
from ..spec.quant import Quantized
from ..spec.schemes import Granularity, QuantScheme, Recipe

__all__ = ["Peer", "dist_version", "import_reason", "as_scheme_scale", "spec_or_given_scale", "interpreting",
           "model_dtype_scales", "ModelDtypeScalesPeer"]


def dist_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_reason(*modules: str) -> str | None:
    """None if every module imports, else which one fails and why (the peer's exact missing piece)."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # ImportError, or a package that raises anything while importing
            return f"import {mod} failed: {type(exc).__name__}: {exc}"
    return None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def spec_or_given_scale(x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None,
                        dtype: torch.dtype) -> torch.Tensor:
    """The scale a peer quantizes ``x`` [rows, cols] with, in ``dtype``: the caller's (static) laid out
    as ``scheme.scale_shape``, else the spec's dynamic scale (for peers whose scale is not the code
    under test)."""
    rows, cols = x.shape
    s = quant.compute_scale(x, scheme) if scale is None else scale.reshape(scheme.scale_shape(rows, cols))
    return s.to(dtype)


def as_scheme_scale(s: torch.Tensor, scheme: QuantScheme, rows: int, cols: int) -> torch.Tensor:
    """The peer's scale tensor in the scheme's shape and dtype; raises if that would change a value
    (a peer whose stored scales cannot be the scheme's declines the scheme in ``supports``)."""
    want = scheme.scale_shape(rows, cols)
    if s.dtype == torch.float8_e8m0fnu:  # E8M0 bytes (torchao's scale_dtype): the reference decoder
        s = layouts.e8m0_decode(s)
    s = s.reshape(want) if s.numel() == want[0] * want[1] else s
    if tuple(s.shape) != want:
        raise ValueError(f"peer returned scales of shape {tuple(s.shape)}, the scheme needs {want}")
    out = s.to(scheme.scale_dtype)
    same = torch.equal(out.to(torch.float64), s.to(torch.float64))
    nan_same = bool(torch.isnan(s).any()) and torch.equal(torch.isnan(out), torch.isnan(s))
    if not same and not nan_same:
        raise ValueError(f"peer scales ({s.dtype}) are not values of the scheme's scale_dtype {scheme.scale_dtype}")
    return out.contiguous()


class Peer(Backend):
    """A third-party FP8 implementation wrapped as an fp8ref backend (not registered: certified by
    ``fp8ref certify``, never selected by ``fp8ref.linear``).

    Attributes
    ----------
    project : str
        Who ships the code (``"SGLang"``).
    distribution : str
        The PyPI distribution whose version is reported.
    entry : str
        The function(s) called, fully qualified.
    notes : str
        The peer's numerics as read from its source (what the declaration rests on).
    modules : tuple of str
        Modules imported on first use; ``available()`` names the first that fails.
    version : str or None
        The installed version of ``distribution`` (None: not installed).
    recipes : tuple of Recipe or None
        The recipes its certificate claims (``fp8ref.conformance.check``'s ``schemes``), for a layer
        that computes one recipe only: the contracts draw only these. None (default): every recipe.
    """

    project: str = ""
    distribution: str = ""
    entry: str = ""
    notes: str = ""
    modules: tuple[str, ...] = ()
    recipes: tuple[Recipe, ...] | None = None

    @property
    def version(self) -> str | None:  # type: ignore[override]
        return dist_version(self.distribution)

    def label(self) -> str:
        return f"{self.project} {self.version or '(not installed)'}"

    def prepare(self) -> str | None:
        """Environment the peer needs before its first import (None, or the reason it cannot)."""
        return None

    def available(self) -> str | None:
        if self.version is None:
            return f"{self.distribution} is not installed (pip install 'fp8ref[peers]'; see docs/certified.md)"
        reason = self.prepare()
        if reason is not None:
            return reason
        return import_reason(*self.modules)

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        """The scheme this peer computes when asked for ``scheme`` on ``x_dtype`` input: the
        legitimate conventions it follows (docs/spec.md §3.1) filled in. Defects are never mapped."""
        return scheme

    def map_problem(self, problem: Any) -> Any:
        """A conformance problem with its schemes rewritten by ``conventions`` (certify draws these)."""
        if isinstance(problem, QuantizeProblem):
            return replace(problem, scheme=self.conventions(problem.scheme, problem.x_dtype))
        if isinstance(problem, (GemmProblem, LinearProblem)):
            r = problem.recipe
            # a GEMM problem has no input dtype (its operands come quantized): conventions that depend
            # on it are taken for bf16 input
            x_dtype = problem.x_dtype if isinstance(problem, LinearProblem) else torch.bfloat16
            recipe = Recipe(r.name, self.conventions(r.weight, x_dtype), self.conventions(r.activation, x_dtype))
            return replace(problem, recipe=recipe)
        return problem

    # -- helpers for subclasses ------------------------------------------------------------------

    @staticmethod
    def _quantized(data: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> Quantized:
        rows, cols = data.shape
        if data.dtype != scheme.format.torch_dtype:
            if data.dtype == torch.uint8:
                data = data.view(scheme.format.torch_dtype)
            else:
                raise TypeError(f"peer returned {data.dtype} codes, the scheme needs {scheme.format.torch_dtype}")
        return Quantized(data.contiguous(), as_scheme_scale(scale, scheme, rows, cols), scheme)

    @staticmethod
    def _case_scheme(case: Case) -> QuantScheme:
        return case.recipe.activation


def model_dtype_scales(scheme: QuantScheme, x_dtype: torch.dtype, *, eps_for_zero: bool = False) -> QuantScheme:
    """``scheme`` with the scale computed and stored in the model's dtype (bf16/fp16 input; fp32
    otherwise), no amax floor, subnormal scales kept -- compressed-tensors' and quanto's conventions;
    ``eps_for_zero``: a zero block's scale is that dtype's eps (compressed-tensors)."""
    dt = x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.float32
    zero = float(torch.finfo(dt).eps) if eps_for_zero else scheme.zero_scale
    return scheme.with_(amax_floor=0.0, scale_dtype=dt, scale_compute_dtype=dt, subnormal_scales=True,
                        zero_scale=zero)


class ModelDtypeScalesPeer(Peer):
    """A quantizer that computes and stores its E4M3 scales in the model's dtype (``model_dtype_scales``)."""

    eps_for_zero = False

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        if scheme.format.name == "e4m3fn" and scheme.qmax == scheme.format.max and not scheme.pow2_scale:
            return model_dtype_scales(scheme, x_dtype, eps_for_zero=self.eps_for_zero)
        return scheme


def plain_fp32_scales(s: QuantScheme) -> str | None:
    """The decline of a kernel whose scale is the plain fp32 quotient (no power-of-two rounding, no
    other declared scale convention); None when ``s`` asks for exactly that."""
    if s.scale_dtype != torch.float32 or s.pow2_scale or not s.standard_scale_rule:
        return "plain fp32 scales"
    return None


class FixedAmaxFloor:
    """Mixin for a peer whose source fixes its amax floor (``eps``) for one granularity: any positive
    floor the suite asks for at that granularity is the same convention at the source's value."""

    granularity = Granularity.ROW
    eps = 0.0

    def conventions(self, scheme: QuantScheme, x_dtype: torch.dtype) -> QuantScheme:
        # the source fixes its amax floor; any positive floor is the same convention at another value
        if scheme.amax_floor > 0 and scheme.granularity is self.granularity:
            return scheme.with_(amax_floor=self.eps)
        return scheme

    def _load_time_reason(self, s: QuantScheme, case: Case) -> str | None:
        """Why a load-time weight quantizer with this fixed floor declines ``s`` beyond its
        granularity and format (None when it takes it)."""
        if s.amax_floor != self.eps:
            return f"amax floor {self.eps:g} is fixed in the source"
        if (why := plain_fp32_scales(s)) is not None:
            return why
        if case.x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"weight dtype {case.x_dtype}"
        return None


def group_width(scheme: QuantScheme, cols: int) -> int | None:
    """The 1 x G group width a per-token-group kernel runs for ``scheme`` (row = one group of
    ``cols``), or None for other granularities."""
    if scheme.granularity is Granularity.ROW:
        return cols
    if scheme.granularity is Granularity.GROUP:
        return scheme.group_size
    return None
