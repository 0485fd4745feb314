"""Certify naive-fp8 against fp8ref's contracts: one test per contract, so a failure names it.

Run with ``pytest`` (profile ``ci``: derandomized, the same verdict on every run) or
``pytest --fp8ref-profile dev`` for a quick look while editing the kernel.
"""

import pytest

from fp8ref.conformance import CONTRACT_NAMES


@pytest.mark.parametrize("contract", CONTRACT_NAMES)
def test_fp8ref_contract(fp8ref_certify, backend, contract):
    fp8ref_certify(backend, contract)
