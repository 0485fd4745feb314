"""``python -m fp8ref.kernels.build [-v]``: build this environment's C++ extension (or find it built).

The command sits above the two backends whose state it reports, ``cpu_fp8`` (which kernel path this
CPU runs) and ``cpu_fp8_amx`` (the real tiles' self-test), and imports both; neither imports this
module, so the backends and their build command form no import cycle at any level (when the command
lived in ``cpu_fp8.py`` its lazy import of ``cpu_fp8_amx`` closed one). Run as a script, this file is
``__main__`` and registers nothing: the backends it reports are the package's own. tox's
``commands_pre`` runs it; ``fp8ref.kernels.native`` does the building.
"""

from __future__ import annotations

import sys

from .._machine import cpu_model
from . import native
from .cpu_fp8 import gemm_path
from .cpu_fp8_amx import self_test_summary


def main(argv: list[str] | None = None) -> int:
    """Build the extension and say what this CPU runs; 0 when the kernel is ready, 1 when not.

    Parameters
    ----------
    argv : list of str, optional
        The command's arguments (default ``sys.argv[1:]``); ``-v`` shows the compiler's output.
    """
    args = sys.argv[1:] if argv is None else argv
    try:
        mod = native.build(verbose="-v" in args)
    except RuntimeError as exc:
        print(f"fp8ref: the cpu-fp8 kernel is unavailable: {exc}", file=sys.stderr)
        return 1
    amx = mod.amx_status()
    if not amx:
        amx = f"yes: {self_test_summary()}"
    else:
        amx = f"no, {amx}"
    print(f"cpu-fp8 kernel ready: {native.library_path()}\n"
          f"  this CPU ({cpu_model()}): cpu-fp8 runs its {gemm_path()} kernel; AMX tiles (cpu-fp8-amx): {amx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
