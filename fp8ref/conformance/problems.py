"""Conformance problems (``QuantizeProblem``, ``GemmProblem``, ``LinearProblem``), re-exported from the
checking core, ``fp8ref.check.problems``, where they live so that the selector's probe builds the
same problems; this name stays for reports, replays and third-party code. Imports flow down: the
checking core only."""

from __future__ import annotations

from ..check.problems import (
    BIAS_MODES,
    CODE_FAMILIES,
    EXHAUSTIVE_FAMILIES,
    GRID_FAMILIES,
    MAGNITUDES,
    PLACES,
    STATIC_KINDS,
    VALUE_FAMILIES,
    CodeSpec,
    GemmProblem,
    LinearProblem,
    QuantizeProblem,
    TensorSpec,
    anchor_blocks,
    exhaustive_shape,
    make_codes,
    make_tensor,
    place_index,
    problem_from_dict,
    problem_to_dict,
    static_scale,
    swamp_ok,
)

__all__ = ["VALUE_FAMILIES", "GRID_FAMILIES", "EXHAUSTIVE_FAMILIES", "MAGNITUDES", "exhaustive_shape",
           "CODE_FAMILIES", "PLACES", "STATIC_KINDS", "BIAS_MODES", "TensorSpec", "CodeSpec", "QuantizeProblem",
           "GemmProblem", "LinearProblem", "make_tensor", "make_codes", "anchor_blocks", "static_scale",
           "place_index", "swamp_ok", "problem_to_dict", "problem_from_dict"]
