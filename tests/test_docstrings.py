"""The Examples sections of the spec's public docstrings run and print what they say."""

import doctest
import importlib

import pytest

SPEC_MODULES = ["fp8ref.spec.formats", "fp8ref.spec.schemes", "fp8ref.spec.quant", "fp8ref.spec.gemm",
                "fp8ref.spec.bounds", "fp8ref.api", "fp8ref.ops",
                "fp8ref.select.choose"]


@pytest.mark.parametrize("name", SPEC_MODULES)
def test_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
