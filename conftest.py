"""Repository-wide pytest setting: benchmarks are off unless asked for (``--benchmark-enable``,
``tox -e bench``).

Set here rather than as ``--benchmark-disable`` in pyproject's ``addopts``: without pytest-benchmark
installed that option is unknown and every pytest run in the repository fails before collecting
(``pip install fp8ref[conformance]``, then ``pytest properties``).
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if hasattr(config.option, "benchmark_disable") and not config.getoption("benchmark_enable"):
        config.option.benchmark_disable = True
