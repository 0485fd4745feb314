"""The catalogue's backends are Python-level stand-ins for kernels: they run on one thread.

Their results do not depend on the thread count, and on a shared 2-core machine waking a second
OpenMP/MKL thread for each of their many tiny matmuls cost 5-20x the CPU time of the test (the
self-test measures the referee's power, not the stand-ins' threading). Real backends are certified
with the process's thread count (``properties/``).
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
