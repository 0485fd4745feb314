"""What this CPU is and can do, read at run time (never assumed from the build machine).

The machines fp8ref is built, tested and benchmarked on change from run to run (an AMD EPYC with
AVX2 only, one with AVX-512 BF16, an Intel Xeon with AMX), and third-party kernels behave
differently on each, so figures, cache keys and known failures name the CPU kind. The kind
alone does not pin upstream behaviour down: two AMD EPYCs of kind ``avx512_bf16`` (Zen 4, family
25; Zen 5, family 26) run torch._scaled_mm on E4M3FNUZ differently, so records of a third party's
behaviour on a CPU match its ``cpu_signature`` (vendor, family, model) as well.
"""

from __future__ import annotations

import platform
from functools import cache

__all__ = ["cpu_model", "cpu_flags", "cpu_kind", "cpu_signature"]


@cache
def _cpuinfo_fields() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (``avx2``, ``avx512_bf16``, ``amx_bf16``...);
    empty where ``/proc/cpuinfo`` is not readable."""
    return frozenset(_cpuinfo_fields().get("flags", "").split())


def cpu_kind() -> str:
    """A short name for the feature level that decides kernel paths: ``amx``, ``avx512_bf16``,
    ``avx512``, ``avx2`` or ``other``."""
    flags = cpu_flags()
    if "amx_bf16" in flags and "amx_tile" in flags:
        return "amx"
    if {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


def cpu_signature() -> dict[str, object]:
    """What identifies this CPU's design: ``vendor`` (``/proc/cpuinfo``'s vendor_id, e.g.
    ``AuthenticAMD``), ``family`` and ``model`` (ints, None where unreadable) and ``kind``.

    AMD's families name its generations (25: Zen 3 and Zen 4, 26: Zen 5); Intel's server parts
    are all family 6 and the model tells them apart (106: Ice Lake, 143: Sapphire Rapids).

    Examples
    --------
    >>> from fp8ref._machine import cpu_signature
    >>> sorted(cpu_signature())
    ['family', 'kind', 'model', 'vendor']
    """
    fields = _cpuinfo_fields()

    def number(key: str) -> int | None:
        try:
            return int(fields[key])
        except (KeyError, ValueError):
            return None

    return {"vendor": fields.get("vendor_id") or platform.machine(), "family": number("cpu family"),
            "model": number("model"), "kind": cpu_kind()}
