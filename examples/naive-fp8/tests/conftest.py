"""The backend under test, shared by the test files. The ``fp8ref_certify`` fixture itself comes
from fp8ref's pytest plug-in, which pytest loads automatically once fp8ref is installed."""

import pytest

from naive_fp8 import NaiveFp8Backend


@pytest.fixture(scope="session")
def backend():
    return NaiveFp8Backend()
