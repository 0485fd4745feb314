"""Certify the selected backends, one test per (backend, contract).

    pytest properties --fp8ref-backend torch --fp8ref-profile ci
    pytest properties -n auto                      # every registered backend, xdist workers
"""


def test_contract(fp8ref_certify, backend_name, contract_name):
    fp8ref_certify(backend_name, contract_name)
