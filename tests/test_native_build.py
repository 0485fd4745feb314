"""When and where the CPU extension is built (fp8ref.kernels.native), without running a compiler.

The rules: the build directory is keyed to the environment; a build happens only on request
(``python -m fp8ref.kernels.build``, or ``FP8REF_CPU_FP8=1`` at a CPU backend's availability
check), never inside a probe or a timed call, and says so on stderr. ``native._compile`` (the
only place the compiler runs) is replaced here by a recorder, and ``TORCH_EXTENSIONS_DIR`` points
at an empty directory, so every test sees an environment with no build.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import fp8ref
from fp8ref.kernels import build, cpu_fp8, native
from fp8ref.select import cache, compliance, selector, timing

CASE = fp8ref.Case(M=2, N=32, K=64, recipe=fp8ref.W8A8_FP8)


@pytest.fixture()
def unbuilt(tmp_path, monkeypatch):
    """No build in this environment; a recorder instead of the compiler. Yields the event list."""
    events: list[str] = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("FP8REF_CACHE_DIR", str(tmp_path / "select-cache"))
    monkeypatch.delenv(native.ENV_BUILD, raising=False)
    monkeypatch.delenv(native.ENV_NATIVE, raising=False)
    monkeypatch.delenv("FP8REF_BACKEND", raising=False)
    monkeypatch.delenv("FP8REF_CANDIDATES", raising=False)
    monkeypatch.setattr(native, "toolchain_reason", lambda: None)  # as if ninja and c++ were here

    def no_compiler(verbose):
        events.append("build")
        raise RuntimeError("test: no compiler run")

    monkeypatch.setattr(native, "_compile", no_compiler)
    native.reset()
    cache.clear_cache()
    yield events
    monkeypatch.undo()
    native.reset()  # the real build (if any) loads again for the next tests
    cache.clear_cache()
    fp8ref.api.clear_weight_cache()


def _spy(monkeypatch, events):
    """Record every probe and every timing the selector starts."""
    real_probe, real_time = selector.probe, timing.time_backend

    def probe(backend, case, **kw):
        events.append(f"probe {backend.name}")
        return real_probe(backend, case, **kw)

    def time_backend(backend, case, best, timers=None):
        events.append(f"time {backend.name}")
        return real_time(backend, case, best, timers)

    monkeypatch.setattr(selector, "probe", probe)
    monkeypatch.setattr(timing, "time_backend", time_backend)


def test_build_key_separates_environments(monkeypatch):
    base = native.build_key()
    assert base["cflags"] == "-O3 -fopenmp -ffp-contract=off"  # -ffp-contract=off: see test_native.py
    name = native.build_name(base)
    for field, other in [("torch", "0.0.0"), ("python", "CPython-3.0.0"), ("prefix", "/other/venv"),
                         ("torch_dir", "/other/torch"), ("cflags", "-O2"), ("sources", "0" * 64),
                         ("compiler", "/usr/bin/clang++")]:
        assert native.build_name(dict(base, **{field: other})) != name, field
    assert native.build_name(dict(base)) == name  # a pure function of the key
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert native.build_key()["prefix"] == "/some/other/venv"


def test_build_key_ignores_where_the_sources_lie(monkeypatch, tmp_path):
    """tox builds from the checkout (``python -m fp8ref.kernels.build`` in the repository) and
    pytest imports the installed copy: the same sources at another path must name the same build."""
    import shutil

    name = native.build_name()
    copy = tmp_path / "site-packages" / "fp8ref" / "kernels" / "csrc"
    shutil.copytree(native.CSRC, copy)
    monkeypatch.setattr(native, "CSRC", copy)
    native._source_digest.cache_clear()
    try:
        assert native.build_name() == name
        (copy / native.SOURCES[0]).write_text((copy / native.SOURCES[0]).read_text() + "\n// changed\n")
        native._source_digest.cache_clear()
        assert native.build_name() != name  # content still counts
    finally:
        monkeypatch.undo()
        native._source_digest.cache_clear()


def test_build_dir_is_under_torch_extensions_dir(unbuilt, tmp_path):
    assert native.build_dir() == tmp_path / "ext" / native.build_name()
    assert native.library_path().parent == native.build_dir()
    assert not native.is_built()


def test_sources_are_the_files_in_csrc():
    files = {p.name for p in native.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert files == set(native.SOURCES) | set(native.HEADERS)
    assert any("PYBIND11_MODULE" in (native.CSRC / s).read_text() for s in native.SOURCES)


def test_nothing_builds_unless_asked(unbuilt, monkeypatch):
    _spy(monkeypatch, unbuilt)
    reason = cpu_fp8.CpuFp8Backend().available()
    assert "python -m fp8ref.kernels.build" in reason and "FP8REF_CPU_FP8=1" in reason
    assert native.get() is None
    with pytest.raises(RuntimeError, match="not built yet"):
        native.require()
    d = fp8ref.select_backend(CASE, candidates=["cpu-fp8", "cpu-bf16"], refresh=True)
    assert next(r for r in d.rows if r.backend == "cpu-fp8").available == reason
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(32, 64)
    fp8ref.linear(x, w, backend="cpu-bf16")  # the eager path: same bits, no extension
    assert "build" not in unbuilt
    assert "probe cpu-bf16" in unbuilt


def test_fp8ref_cpu_fp8_builds_at_the_availability_check_before_any_probe(unbuilt, monkeypatch, capsys):
    monkeypatch.setenv(native.ENV_BUILD, "1")
    _spy(monkeypatch, unbuilt)
    d = fp8ref.select_backend(CASE, candidates=["cpu-fp8", "cpu-bf16", "cpu-fp32"], refresh=True)
    assert unbuilt[0] == "build" and unbuilt.count("build") == 1  # one try, before any probe or timing
    assert any(e.startswith("probe") for e in unbuilt[1:])
    row = next(r for r in d.rows if r.backend == "cpu-fp8")
    assert row.available == "building the cpu-fp8 kernel failed: RuntimeError('test: no compiler run')"
    err = capsys.readouterr().err
    assert f"building the cpu-fp8 C++ kernel in {native.build_dir()}" in err and "failed" in err


def test_a_named_cpu_backend_builds_before_its_first_call(unbuilt, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD, "1")
    calls = []
    real_linear = fp8ref.get_backend("cpu-bf16").linear

    def linear(*args, **kwargs):
        calls.append(list(unbuilt))
        return real_linear(*args, **kwargs)

    monkeypatch.setattr(fp8ref.get_backend("cpu-bf16"), "linear", linear)
    fp8ref.linear(torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(32, 64), backend="cpu-bf16")
    assert calls == [["build"]]  # the build was tried before the backend ran


def test_probe_and_timing_never_build(unbuilt, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD, "1")
    be = fp8ref.get_backend("cpu-bf16")
    assert compliance.probe(be, CASE).compliant
    timing.time_backend(be, CASE, None)
    assert unbuilt == []  # asked for, but neither path is the availability check


def test_build_says_when_it_starts_and_how_long_it_took(unbuilt, monkeypatch, capsys):
    fake = types.SimpleNamespace(has_bf16_dot=lambda: False, gemm_isa=lambda: 1,
                                 amx_status=lambda: "this CPU lacks amx")
    monkeypatch.setattr(native, "_compile", lambda verbose: unbuilt.append("build") or fake)
    assert build.main([]) == 0
    out, err = capsys.readouterr()
    assert unbuilt == ["build"]
    assert "fp8ref: building the cpu-fp8 C++ kernel in" in err
    assert "fp8ref: built the cpu-fp8 C++ kernel in" in err and err.rstrip().endswith(" s")
    assert str(native.library_path()) in out and "cpu-fp8 runs its avx2 kernel" in out
    assert "AMX tiles (cpu-fp8-amx): no, this CPU lacks amx" in out
    assert native.require() is fake and build.main([]) == 0 and unbuilt == ["build"]  # built once


def test_python_m_build_reports_the_amx_self_test_where_tiles_exist(unbuilt, monkeypatch, capsys):
    """On a CPU with AMX tiles the report carries the self-test's verdict and whether the chip
    computes the emulation's bits (the first AMX machine answers that question in its build log)."""
    from fp8ref.kernels import cpu_fp8_amx

    fake = types.SimpleNamespace(has_bf16_dot=lambda: True, gemm_isa=lambda: 2, amx_status=lambda: "")
    monkeypatch.setattr(native, "_compile", lambda verbose: fake)
    monkeypatch.setattr(cpu_fp8_amx, "_result", {"reason": None, "matches_emulation": False, "checks": 33})
    assert build.main([]) == 0
    out = capsys.readouterr().out
    assert "AMX tiles (cpu-fp8-amx): yes: self-test passed; the real tiles' bits differ from the emulation's" in out


def test_python_m_build_as_a_script_registers_nothing(unbuilt, monkeypatch, capsys):
    """``python -m`` runs build.py as ``__main__``, a second copy of the module; the report it prints
    comes from the package's backends. When the command lived in cpu_fp8.py, its script copy and
    the package's both registered 'cpu-fp8' on an AMX CPU: "already registered" (the first AMX
    machine, 2026-12-02)."""
    from fp8ref.kernels import cpu_fp8_amx

    fake = types.SimpleNamespace(has_bf16_dot=lambda: True, gemm_isa=lambda: 2, amx_status=lambda: "")
    monkeypatch.setattr(native, "_compile", lambda verbose: fake)
    monkeypatch.setattr(cpu_fp8_amx, "_result", {"reason": None, "matches_emulation": True, "checks": 33})
    monkeypatch.setattr(sys, "argv", [build.__file__])
    before = fp8ref.get_backend("cpu-fp8"), fp8ref.get_backend("cpu-fp8-amx")
    script = compile(Path(build.__file__).read_text(), build.__file__, "exec")  # what runpy does
    with pytest.raises(SystemExit) as exc:
        exec(script, {"__name__": "__main__", "__package__": "fp8ref.kernels", "__file__": build.__file__})
    assert exc.value.code == 0
    assert "AMX tiles (cpu-fp8-amx): yes: self-test passed; the real tiles' bits equal the emulation's" in \
        capsys.readouterr().out
    assert (fp8ref.get_backend("cpu-fp8"), fp8ref.get_backend("cpu-fp8-amx")) == before


def test_the_former_build_command_says_where_it_went():
    """``python -m fp8ref.kernels.cpu_fp8`` (the command before issue 33) fails with a pointer instead
    of registering a second copy of the backend or exiting 0 having built nothing."""
    script = compile(Path(cpu_fp8.__file__).read_text(), cpu_fp8.__file__, "exec")
    with pytest.raises(SystemExit) as exc:
        exec(script, {"__name__": "__main__", "__package__": "fp8ref.kernels", "__file__": cpu_fp8.__file__})
    assert exc.value.code == "fp8ref: the build command is `python -m fp8ref.kernels.build` now"


def test_python_m_build_reports_a_failed_build(unbuilt, capsys):
    assert build.main([]) == 1
    assert "the cpu-fp8 kernel is unavailable: building the cpu-fp8 kernel failed" in capsys.readouterr().err


def test_a_broken_build_is_reported_not_loaded(unbuilt):
    native.library_path().parent.mkdir(parents=True)
    native.library_path().write_bytes(b"not a shared object")
    assert native.is_built() and native.get() is None
    reason = cpu_fp8.CpuFp8Backend().available()
    assert reason.startswith(f"loading the cpu-fp8 kernel from {native.library_path()} failed")
    assert "python -m fp8ref.kernels.build" in reason
    assert unbuilt == []  # a broken build is rebuilt only on request (`python -m ...`)
    assert build.main([]) == 1 and unbuilt == ["build"]


def test_no_toolchain_is_the_reason(unbuilt, monkeypatch):
    monkeypatch.setenv(native.ENV_BUILD, "1")
    needs = "the cpu-fp8 kernel needs ninja to build (pip install ninja)"
    monkeypatch.setattr(native, "toolchain_reason", lambda: needs)
    assert "needs ninja" in cpu_fp8.CpuFp8Backend().available()
    assert unbuilt == []
