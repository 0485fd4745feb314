"""The catalogue: deliberately broken backends, each modelled on a real upstream bug
(``bugs.py``; scale soundness in ``scales.py``), and correct-but-different ones (``variants.py``,
``scales.FusedLinear``). The conformance suite must reject every mutant and accept every correct
variant (``test_mutants.py``, on 3 seeds of the ci profile); the calling contract's catalogue
(``calling.py``) is held to its own contracts; ``third_party.py`` holds correct kernels that
declare nothing beyond accumulation and output roundings (``test_third_party.py``);
``make_report.py`` writes docs/mutants.md.

Every backend starts from ``Fp32Base`` (``base.py``): the reference quantizer and an fp32 scaled
GEMM, conforming to the ``fp32`` declaration; each one changes one thing.
"""

from .base import CLASSES, Fp32Base, fp32_mm, sequential_sum, truncating_sum
from .bugs import *  # noqa: F403 -- the mutant classes, by name
from .bugs import MUTANTS as _BUGS
from .calling import *  # noqa: F403 -- the calling contract's mutants and correct variants, by name
from .calling import CALLING_CLASSES, CALLING_CORRECT, CALLING_MUTANTS
from .layouts import *  # noqa: F403 -- backends holding scales in a declared storage layout, by name
from .layouts import LAYOUT_CORRECT, LAYOUT_MUTANTS
from .scales import *  # noqa: F403 -- the scale-soundness mutants and their correct twin, by name
from .scales import SCALE_CORRECT, SCALE_MUTANTS
from .third_party import THIRD_PARTY
from .variants import *  # noqa: F403 -- the correct variants, by name
from .variants import CORRECT as _VARIANTS

MUTANTS = _BUGS + SCALE_MUTANTS + LAYOUT_MUTANTS
CORRECT = _VARIANTS + SCALE_CORRECT + LAYOUT_CORRECT


def claim_of(cls) -> tuple | None:
    """The recipes a narrow backend of the catalogue is certified for (``check(..., schemes=)``):
    its ``claim``, None (every scheme the suite draws) for the others."""
    return getattr(cls, "claim", None)


__all__ = ["CLASSES", "CORRECT", "MUTANTS", "claim_of",
           "CALLING_CLASSES", "CALLING_CORRECT", "CALLING_MUTANTS", "THIRD_PARTY", "Fp32Base",
           "fp32_mm", "sequential_sum", "truncating_sum"]
