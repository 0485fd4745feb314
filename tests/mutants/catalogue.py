"""The catalogue: deliberately broken backends, each modelled on a real upstream bug
(``bugs.py``), and correct-but-different ones (``variants.py``). The conformance suite must reject
every mutant and accept every correct variant (``test_mutants.py``, on 3 seeds of the ci profile);
the calling contract's catalogue (``calling.py``) is held to its own contracts;
``make_report.py`` writes docs/mutants.md.

Every backend starts from ``Fp32Base`` (``base.py``): the reference quantizer and an fp32 scaled
GEMM, conforming to the ``fp32`` declaration; each one changes one thing.
"""

from .base import CLASSES, Fp32Base, fp32_mm, sequential_sum, truncating_sum
from .bugs import *  # noqa: F403 -- the mutant classes, by name
from .bugs import MUTANTS
from .calling import *  # noqa: F403 -- the calling contract's mutants and correct variants, by name
from .calling import CALLING_CLASSES, CALLING_CORRECT, CALLING_MUTANTS
from .variants import *  # noqa: F403 -- the correct variants, by name
from .variants import CORRECT

__all__ = ["CLASSES", "CORRECT", "MUTANTS", "CALLING_CLASSES", "CALLING_CORRECT", "CALLING_MUTANTS", "Fp32Base",
           "fp32_mm", "sequential_sum", "truncating_sum"]
