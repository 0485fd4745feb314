"""The tensors a conformance problem is built from (``TensorSpec``, ``CodeSpec``, ``make_tensor``,
``make_codes``, ``static_scale``), re-exported from the checking core, ``fp8ref.check.values``;
this name stays for third-party code. Imports flow down: the checking core only."""

from __future__ import annotations

from ..check.values import (
    BIAS_MODES,
    CODE_FAMILIES,
    EXHAUSTIVE_FAMILIES,
    GRID_FAMILIES,
    MAGNITUDES,
    PLACES,
    STATIC_KINDS,
    VALUE_FAMILIES,
    CodeSpec,
    TensorSpec,
    anchor_blocks,
    dname,
    exhaustive_shape,
    make_codes,
    make_tensor,
    place_index,
    static_scale,
    swamp_ok,
)

__all__ = ["VALUE_FAMILIES", "EXHAUSTIVE_FAMILIES", "MAGNITUDES", "exhaustive_shape", "GRID_FAMILIES",
           "CODE_FAMILIES", "PLACES", "STATIC_KINDS", "BIAS_MODES", "TensorSpec", "CodeSpec", "make_tensor",
           "make_codes", "anchor_blocks", "static_scale", "place_index", "swamp_ok", "dname"]
