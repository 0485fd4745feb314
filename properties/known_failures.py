"""Ledger of known failures of third-party code that fp8ref's backends run on.

Each entry names the backend, what goes wrong, the upstream link and why fp8ref is (or is not)
affected. Tests that reproduce an entry are marked ``xfail(strict=True)`` through ``xfail(id)``,
so an upstream fix makes them XPASS -> fail, which forces the entry's removal. The conformance
suite reads ``KNOWN_FAILURES`` to report these next to its own results.

Fields: ``id`` (stable key), ``backend`` (registry name, or a peer of ``fp8ref.peers``), ``applies``
(when it bites), ``what`` (the failing property), ``link`` (upstream issue/PR, or None if none was
found), ``reason`` (the cause, and the workaround fp8ref uses), ``test`` (the test that reproduces it).
Entries for peers also name the conformance ``property`` (contract) they turn into a strict xfail in
``fp8ref certify`` and its ``upstream`` link; their ``test`` is a standalone reproduction in
``tests/findings/`` (docs/findings.md).
"""

from __future__ import annotations

__all__ = ["KNOWN_FAILURES", "known_failure", "xfail"]

KNOWN_FAILURES: list[dict] = [
    {
        "id": "triton-interp-fp8-cast",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "x.to(tl.float8e4nv) on fp32 is not round-to-nearest-even: ties round away from zero "
                "and carries out of the mantissa are lost (about 1% of uniform inputs in [-448, 448])",
        "link": "https://github.com/triton-lang/triton/issues/8322",
        "reason": "the interpreter's _convert_float downcast (fix proposed in triton PR #11897); the triton "
                  "backend rounds with integer ops on the fp32 bits instead, so its codes are exact",
        "test": "tests/test_kernel_triton_interpreter.py::test_interpreter_fp8_cast_is_rne",
    },
    {
        "id": "triton-interp-bf16-store",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "fp32 -> tl.bfloat16 conversion truncates the low 16 bits instead of rounding to nearest even",
        "link": None,
        "reason": "no upstream report found (related: triton PR #10945 on bf16 arithmetic in the interpreter); "
                  "the triton backend stores its GEMM result as fp32 and torch rounds it to out_dtype",
        "test": "tests/test_kernel_triton_interpreter.py::test_interpreter_bf16_store_is_rne",
    },
    {
        "id": "torch-cpu-scaled-mm-fnuz",
        "backend": "torch",
        "applies": "torch 2.13.0+cpu; by CPU kind (fp8ref._machine.cpu_kind): amx (Intel Xeon Sapphire Rapids) "
                   "every shape; avx512_bf16 (AMD EPYC with AVX-512) M = N = 1 only; avx2 (AMD EPYC Zen 3) never",
        "cpu_kinds": {"amx": "every shape", "avx512_bf16": "M = N = 1", "avx2": "never"},
        "what": "torch._scaled_mm raises RuntimeError 'itensor_view_from_dense expects float/bfloat16/half/int8/fp8 "
                "tensor inputFloat8_e4m3fnuz' for E4M3FNUZ operands (E4M3FN and E5M2 work)",
        "link": None,
        "reason": "no upstream report found (searched pytorch issues for itensor_view_from_dense and e4m3fnuz "
                  "_scaled_mm CPU); the torch and torch-fast backends run a trial call per (device, operand "
                  "class) and decline with torch's message, so fp8ref never crashes on it",
        "test": "tests/test_torch_trial.py::test_upstream_fnuz_behaviour_on_this_cpu",
    },
    {
        "id": "triton-interp-bf16-arith",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "+ - * / on two bf16 tensors operate on their uint16 bit patterns (c = acc.to(bf16); c += bias "
                "gives ~1e38)",
        "link": "https://github.com/triton-lang/triton/issues/10919",
        "reason": "the interpreter stores bf16 as uint16 and binary_op runs numpy on the storage (fix PR #10945 closed "
                  "unmerged); fp8ref's triton backend does no bf16 arithmetic, and third-party kernels are certified "
                  "under fp8ref.peers.triton_interpreter.correct_downcasts()",
        "test": "tests/test_peers_triton_interpreter.py::test_unpatched_bf16_arithmetic_still_wrong",
    },
    {
        "id": "triton-interp-bf16-dot",
        "backend": "triton",
        "applies": "TRITON_INTERPRET=1 (triton 3.9)",
        "what": "tl.dot on bfloat16 operands multiplies the uint16 bit patterns (results ~1e10)",
        "link": "https://github.com/triton-lang/triton/issues/11584",
        "reason": "the interpreter stores bf16 as uint16 and create_dot converts only 8-bit floats; the triton "
                  "backend only calls tl.dot on FP8 operands, which the interpreter converts correctly",
        "test": "tests/test_kernel_triton_interpreter.py::test_interpreter_bf16_dot",
    },
]


def known_failure(id: str) -> dict:
    """The ledger entry called ``id`` (KeyError listing the ids otherwise)."""
    for entry in KNOWN_FAILURES:
        if entry["id"] == id:
            return entry
    raise KeyError(f"no known failure {id!r}; ids: {[e['id'] for e in KNOWN_FAILURES]}")


def xfail(id: str):
    """``pytest.mark.xfail(strict=True)`` for ledger entry ``id``, with its link in the reason."""
    import pytest

    entry = known_failure(id)
    return pytest.mark.xfail(strict=True, reason=f"{entry['what']} ({entry['link'] or 'no upstream link'})")
