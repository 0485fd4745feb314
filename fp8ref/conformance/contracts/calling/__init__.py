"""The calling contract's checks (docs/spec.md, "The calling contract"): what an entry point
promises its caller beyond its values, checked the way the reference BLAS test programs check
every routine (xBLAT2/xBLAT3: arguments with leading dimensions larger than the matrix, every
input compared with a snapshot after every call, the error exits exercised).

Each dimension is a check per op (``quantize``, ``scaled_mm`` with ``prepare_weight``, the
``linear`` hook): the arguments of the op's problem are named tensors (``_Op.args``), the call
takes them and returns named outputs, and a dimension varies the arguments or the calls:

* ``layout``: every argument as a view (transposed storage, offset storage with a leading
  dimension larger than the row, row or column stride 2, stride 0); the result equals the
  contiguous call's bits or lies within the op's bound of the spec, or the call refuses the view
  with a ``ValueError``/``TypeError``;
* ``untouched``: no argument (nor the prepared weight) changes in a call, and no output shares
  storage with an argument;
* ``lifetime``: arguments updated in place between calls (``copy_``, ``mul_``, item assignment,
  ``.data =``, a write through a numpy view that bumps no version counter) give what a fresh
  call on the new values gives;
* ``threads``: calls from several threads at once, each on its own values, give the bits each
  gives alone;
* ``non_finite``: NaN/Inf in each kind of input, and finite results past the output dtype's
  range: what the backend declares (``Backend.non_finite``) and never a finite stand-in;
* ``degenerate``: M, N or K = 0 or 1;
* ``size_limits``: rows past 65535 (GPU grid limits), K past 2**16, and (profile ``limits``)
  element offsets past 2**31.

Imports flow down: the registry, the spec, the conformance modules below and the per-op checks.

The package, from the bottom up (each module imports only the ones before it): ``tensors``
(views, snapshots, storage, updates), ``entry`` (the entry points as named arguments and outputs,
the premises), then a module per group of dimensions: ``memory`` (layout, untouched, lifetime),
``threads``, ``special`` (non-finite values, overflow), ``shapes`` (degenerate shapes, size limits).
"""

from .memory import check_layout, check_lifetime, check_untouched
from .shapes import (
    BIG_K,
    BIG_OFFSET,
    BIG_ROWS,
    SIZE_KINDS,
    SizeProblem,
    check_degenerate,
    check_size_limits,
    size_problems,
    size_sweep,
)
from .special import check_non_finite
from .tensors import UPDATES, VIEW_KINDS, as_view, storage_overlaps
from .threads import THREAD_CALLS, THREADS, check_threads

__all__ = ["VIEW_KINDS", "UPDATES", "THREADS", "THREAD_CALLS", "BIG_ROWS", "BIG_K", "BIG_OFFSET", "SIZE_KINDS",
           "SizeProblem", "as_view", "storage_overlaps", "size_problems", "size_sweep", "check_layout",
           "check_untouched", "check_lifetime", "check_threads", "check_non_finite", "check_degenerate",
           "check_size_limits"]
