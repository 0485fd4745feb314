"""The linear contracts' checks, from the checking core (``fp8ref.check.linear``), with the api path
filled in: for a registered backend, ``linear.bound`` calls ``fp8ref.linear(..., backend=name)``
itself, so a certificate covers what users call (argument checks, dispatch, the weight cache), not
only the backend's hook. The core cannot make that call (it sits below the api, and the
selector's probe runs it while ``fp8ref.linear`` is selecting); this layer, above the package face,
can. Imports flow down: the checking core and the registry (``fp8ref`` itself lazily, in the
hook)."""

from __future__ import annotations

from typing import Any

from ...check import linear as _core
from ...check.linear import LinearArgs, backend_linear
from ...check.linear import check_linear_matches_two_calls as check_linear_matches_two_calls
from ...check.problems import LinearProblem
from ...registry import Backend, get_backend

__all__ = ["api_linear", "check_linear_bound", "check_linear_matches_two_calls"]

# ``calling`` reaches the hook call of the core through here.
_backend_linear = _core._backend_linear


def _registered(backend: Backend) -> bool:
    try:
        return get_backend(backend.name) is backend
    except KeyError:
        return False


def api_linear(backend: Backend, args: LinearArgs) -> Any:
    """The backend's linear as its callers run it: a registered backend through ``fp8ref.linear(...,
    backend=name)`` (static activation schemes, which ``fp8ref.linear`` does not take, through its
    ``Backend.linear`` hook); any other through ``prepare_weight`` and ``linear``
    (``fp8ref.check.linear.backend_linear``)."""
    if not _registered(backend) or args.scale is not None:
        return backend_linear(backend, args)
    import fp8ref

    from ...kernels import reference  # noqa: F401 -- fp8ref.linear needs the registry loaded

    with _core.backend_threads():
        return fp8ref.linear(args.x, args.w, args.bias, recipe=args.recipe, backend=backend.name, precision="fast",
                             out_dtype=args.out_dtype)


def check_linear_bound(backend: Backend, p: LinearProblem) -> float:
    """``fp8ref.check.linear.check_linear_bound`` through ``api_linear``: the backend's linear against
    the float64 linear of the unquantized inputs, within ``linear_error_bound`` of the spec's own
    quantization of x and w."""
    return _core.check_linear_bound(backend, p, call_linear=api_linear)
