"""The modules that moved in the layered tree (fp8ref/spec, fp8ref/cli) still import under their
old names, as the new module, with a DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import sys

import pytest

import fp8ref


@pytest.mark.parametrize("old, new", sorted(fp8ref.MOVED_MODULES.items()))
def test_old_module_name_warns_and_is_the_new_module(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    sys.modules.pop(old, None)


def test_unknown_fp8ref_module_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fp8ref.no_such_module")
