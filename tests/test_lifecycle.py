"""Process lifecycle (issue 40): a child forked while another thread holds a selection or registry
lock selects on its own; an interrupt during the registry's first load leaves it loadable."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fp8ref
from fp8ref import registry
from fp8ref import select as sel
from fp8ref.kernels import cpu, native, torch_mm, triton_kernels
from fp8ref.select import selector

ROOT = Path(__file__).resolve().parents[1]
#: Seconds the forked child gets; it selects with the reference only (no probe, no timing).
CHILD_TIMEOUT_S = 60
#: The module-level locks of fp8ref (besides the per-key selection locks), by module and name.
MODULE_LOCKS = [(registry, "_LOAD_LOCK"), (cpu, "_pack_lock"), (cpu, "_precision_lock"), (torch_mm, "_TRIALS_LOCK"),
                (triton_kernels, "_INTERPRETER_LOCK"), (native, "_lock")]


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit status, or None after killing it when it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_child_forked_while_a_thread_holds_the_selection_lock_selects(tmp_path, monkeypatch):
    monkeypatch.setenv(sel.ENV_CACHE_DIR, str(tmp_path))
    sel.clear_cache()
    case = fp8ref.Case(M=4, N=32, K=64, recipe=fp8ref.W8A8_FP8)
    key = sel.selection_key(case, "standard", selector._candidates(["reference"]))
    held, release = threading.Event(), threading.Event()

    def hold():  # a thread in the middle of a selection (and of the registry's load, ...) at the fork
        with contextlib.ExitStack() as stack:
            stack.enter_context(selector._key_lock(key))
            for mod, name in MODULE_LOCKS:
                stack.enter_context(getattr(mod, name))
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(CHILD_TIMEOUT_S)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if both locks are usable and the selection answers
            code = 1
            try:
                code = 3 if not all(getattr(m, n).acquire(timeout=CHILD_TIMEOUT_S / 4) for m, n in MODULE_LOCKS) \
                    else 0 if sel.select(case, candidates=["reference"]).chosen == "reference" else 2
            finally:
                os._exit(code)
        status = _wait(pid, CHILD_TIMEOUT_S)
    finally:
        release.set()
        t.join()
    assert status == 0, f"the forked child {'hung' if status is None else f'exited {status}'}"


_INTERRUPTED_LOAD = """
import sys
import fp8ref.registry as r
real, fired = r.register_backend, []

def interrupted(backend, **kw):
    if backend.name == "torch-fast" and not fired:  # after 'torch', inside the same module
        fired.append(1)
        raise KeyboardInterrupt
    return real(backend, **kw)

r.register_backend = interrupted
try:
    r.get_backend("reference")
    sys.exit("the interrupt was not raised")
except KeyboardInterrupt:
    pass
names = {b.name for b in r.backends()}
assert {"reference", "torch", "torch-fast", "cpu-bf16"} <= names, names
print("loaded", len(names))
"""


def test_an_interrupt_during_the_first_registry_load_leaves_it_loadable():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _INTERRUPTED_LOAD], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]


#: Module-level locks left out of the fork reset, each with its reason.
NOT_RESET = {("fp8ref.peers.triton_interpreter", "_LOCK"):
             "guards a patch of Triton's interpreter with a depth count: a fresh lock in a child forked mid-patch "
             "would not restore the patch; certification runs are not forked"}


def test_every_module_level_lock_is_reset_after_fork():
    import re

    found = set()
    for path in (ROOT / "fp8ref").rglob("*.py"):
        for name in re.findall(r"^(\w+) = threading\.R?Lock\(\)", path.read_text(), re.M):
            found.add((".".join(path.relative_to(ROOT).with_suffix("").parts), name))
    reset = {(m.__name__, n) for m, n in MODULE_LOCKS} | {("fp8ref.select.selector", "_KEY_LOCKS_GUARD")}
    assert found - reset == set(NOT_RESET), "a module-level lock without a fork reset: add it to MODULE_LOCKS"
