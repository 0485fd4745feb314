"""The Examples sections of the spec's public docstrings run and print what they say."""

import doctest
import importlib

import pytest

SPEC_MODULES = ["fp8ref.formats", "fp8ref.schemes", "fp8ref.quant", "fp8ref.gemm", "fp8ref.bounds", "fp8ref.linear"]


@pytest.mark.parametrize("name", SPEC_MODULES)
def test_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
