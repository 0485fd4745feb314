"""fp8ref's C++ extension for the CPU backends: its sources, its build, and whether it is loaded.

The extension holds cpu-fp8's and cpu-fp8-amx's E4M3FN GEMMs and the fused quantizer and scale epilogue
that cpu-bf16 and cpu-fp32 use when it is there. Its sources are real files in
``fp8ref/kernels/csrc/`` (one per job, shipped as package data), compiled with
``torch.utils.cpp_extension.load`` (a C++ compiler, ninja, OpenMP): about a minute on two cores.

**Where.** ``$TORCH_EXTENSIONS_DIR/<build_name()>`` (default ``~/.cache/torch_extensions``). The
name holds a hash of everything that makes a build differ (``build_key``): the sources and
headers (by content, not by path: a checkout and its installed copy share a build), the flags,
the compiler, the torch version and install, the Python version and the environment's prefix.
Two environments therefore never share (and never rebuild over) one build directory, and a
change of any source gets a new one.

**When.** A build happens only on an explicit request, and never inside a timed or probed call:

- ``python -m fp8ref.kernels.build`` (tox's ``commands_pre`` runs it), which calls ``build``;
- with ``FP8REF_CPU_FP8=1``, the first availability check of cpu-fp8, cpu-bf16 or cpu-fp32
  (``prepare``). The selector, ``fp8ref.linear`` with a named backend, ``fp8ref backends``, the
  bench and the conformance suite all ask a backend's ``available()`` before they probe, time
  or call it.

Building says so on stderr when it starts and how long it took. ``get()``, which the hot paths
call, and ``require()``, which cpu-fp8 calls, never build: they load an existing build (a
``dlopen``, milliseconds). Where ``get()`` returns None its callers run eager torch code that
computes the same bits. ``FP8REF_NATIVE=0`` turns those optional fast paths off (cpu-fp8 itself
still uses the extension).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import threading
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from .. import _env

__all__ = ["CSRC", "SOURCES", "HEADERS", "CFLAGS", "LDFLAGS", "ENV_BUILD", "ENV_NATIVE", "build_key",
           "build_name", "build_dir", "library_path", "is_built", "toolchain_reason", "build", "prepare",
           "get", "loaded", "require", "reset"]

#: The extension's source directory (package data).
CSRC = Path(__file__).resolve().with_name("csrc")
#: Translation units, one per job; bindings.cpp is the Python module.
SOURCES = ("gemm.cpp", "gemm_packed.cpp", "gemm_amx.cpp", "quant.cpp", "epilogue.cpp", "linear.cpp", "bindings.cpp")
HEADERS = ("fp8ref_cpu.h", "decode.h", "amx_tiles.h")
#: Compiler flags. -fopenmp makes ``at::parallel_for`` run on torch's intra-op threads (without it
#: the loops run on one thread: ATen's OpenMP backend is header-only). -ffp-contract=off: GCC would
#: otherwise fuse ``v * sb + bias`` into one FMA (one rounding instead of two), and the epilogue
#: would no longer be bit-identical to the eager torch one (tests/test_native.py caught it).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
#: ``1`` builds the extension at the first availability check of a CPU backend.
ENV_BUILD = "FP8REF_CPU_FP8"
#: ``0`` turns the optional fast paths of cpu-bf16, cpu-fp32 and ``fast_quantize`` off.
ENV_NATIVE = "FP8REF_NATIVE"

_NOT_BUILT = ("the cpu-fp8 C++ kernel is not built yet: run `python -m fp8ref.kernels.build` once "
              "(about a minute), or set FP8REF_CPU_FP8=1 to build it on first use")

_lock = threading.RLock()
# A lock another thread held at a fork stays held for ever in the child: the child gets fresh ones.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.RLock()))
_module: ModuleType | None = None
#: Why loading or building failed in this process (then nothing is tried again until ``reset``).
_error: str | None = None
#: ``get()``'s answer: None (not asked yet), False (no module) or the module.
_native_state: ModuleType | bool | None = None


def _flag(name: str) -> bool:
    return _env.get(name)


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx) or cxx


@cache
def _source_digest() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    return h.hexdigest()


def source_version() -> str:
    """A short digest of the extension's sources: backends built on it name it in their ``version``,
    so that a selector decision timed on other C++ code is not reused (``fp8ref.select.keys``)."""
    return _source_digest()[:12]


def build_key() -> dict[str, str]:
    """Everything that makes one build of the extension differ from another.

    Examples
    --------
    >>> from fp8ref.kernels import native
    >>> sorted(native.build_key())
    ['cflags', 'compiler', 'ldflags', 'prefix', 'python', 'sources', 'torch', 'torch_dir']

    The sources count by content, never by path: tox builds the extension with ``python -m
    fp8ref.kernels.build`` run from the repository (fp8ref imported from the checkout) while
    pytest imports the installed copy from site-packages; both must find the same build.
    """
    return {
        "sources": _source_digest(),
        "cflags": " ".join(CFLAGS),
        "ldflags": " ".join(LDFLAGS),
        "compiler": _compiler(),
        "torch": torch.__version__,
        "torch_dir": os.path.dirname(os.path.abspath(torch.__file__)),
        "python": f"{platform.python_implementation()}-{platform.python_version()}",
        "prefix": sys.prefix,
    }


def build_name(key: dict[str, str] | None = None) -> str:
    """``fp8ref_cpu_fp8_<hash of build_key()>``: the module's name and its build directory's."""
    key = build_key() if key is None else key
    return "fp8ref_cpu_fp8_" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@cache
def _name() -> str:
    return build_name()  # once per process (``reset`` forgets it): the key hashes seven files


def build_dir() -> Path:
    """The build directory: ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) / the name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                  "torch_extensions")
    return Path(root) / _name()


def library_path() -> Path:
    """The compiled module inside ``build_dir()``."""
    return build_dir() / (_name() + (".pyd" if sys.platform == "win32" else ".so"))


def is_built() -> bool:
    """Whether this environment's build exists (nothing is loaded or compiled)."""
    return library_path().is_file()


def toolchain_reason() -> str | None:
    """Why the extension cannot be compiled here (no ninja, no C++ compiler), or None."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            return "the cpu-fp8 kernel needs ninja to build (pip install ninja)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "the cpu-fp8 kernel needs a C++ compiler (c++ or $CXX)"
    return None


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(verbose: bool) -> ModuleType:
    """Run the compiler (the only place that does)."""
    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    return load(_name(), sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS), build_directory=str(where), verbose=verbose)


def _load_existing() -> ModuleType | None:
    """The module from an existing build (loaded once per process), or None; sets ``_error`` when
    a build exists but does not load."""
    global _module, _error
    with _lock:
        if _module is None and _error is None and is_built():
            try:
                _module = _import(library_path())
            except Exception as exc:  # a truncated or foreign file: say which, and how to redo it
                _error = (f"loading the cpu-fp8 kernel from {library_path()} failed ({exc!r}); "
                          "run `python -m fp8ref.kernels.build` to build it again")
        return _module


def build(verbose: bool = False) -> ModuleType:
    """Load this environment's build of the extension, compiling it first if there is none.

    Says on stderr when a compilation starts and how long it took. Raises ``RuntimeError`` with
    the reason when the toolchain is missing or the compiler fails (the reason is kept: the CPU
    backends then report it as unavailable).
    """
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if is_built():
            _error = None
            if _load_existing() is not None:
                return _module
        reason = toolchain_reason()
        if reason is not None:
            _error = reason
            raise RuntimeError(reason)
        where = build_dir()
        print(f"fp8ref: building the cpu-fp8 C++ kernel in {where} (once per environment, about a minute)...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            _module = _compile(verbose)
        except Exception as exc:  # a failed build makes the backends unavailable, with the reason
            _error = f"building the cpu-fp8 kernel failed: {exc!r}"
            print(f"fp8ref: {_error}", file=sys.stderr, flush=True)
            raise RuntimeError(_error) from exc
        _error = None
        print(f"fp8ref: built the cpu-fp8 C++ kernel in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        return _module


def prepare() -> str | None:
    """Why the extension cannot be used here, or None; builds it first when ``FP8REF_CPU_FP8=1``
    asks for that and there is no build yet.

    The availability check of the CPU backends: the one place a build happens implicitly, before
    any probe, timing or call of a backend.
    """
    with _lock:
        if _module is not None or _load_existing() is not None:
            return None
        if _error is not None:
            return _error
        reason = toolchain_reason()
        if not _flag(ENV_BUILD):
            return reason or _NOT_BUILT
        if reason is not None:
            return reason
        try:
            build()
        except RuntimeError as exc:
            return str(exc)
        return None


def get() -> ModuleType | None:
    """The extension for an optional fast path: loaded on first call if it is built, else None;
    ``FP8REF_NATIVE=0`` gives None.

    Never compiles (see ``prepare``). Besides the cpu-fp8 GEMMs, the module holds the fused
    quantizer (``quant_blocks``) and the scale epilogue (``scale_epilogue``) that
    ``fast_quantize``, ``cpu-bf16`` and ``cpu-fp32`` use when it is there: same expressions in the
    same order as the spec, bit-identical results (tests/test_native.py), one pass over the data
    instead of five or six.
    """
    global _native_state
    if _native_state is not None:
        return _native_state or None
    if not _flag(ENV_NATIVE):
        return None
    mod = _load_existing()
    _native_state = mod if mod is not None else False
    return mod


def loaded() -> ModuleType | None:
    """The extension if this process has loaded it already (loads and builds nothing)."""
    return _module


def require() -> ModuleType:
    """The extension for a backend that cannot run without it (cpu-fp8); never compiles.

    Raises ``RuntimeError`` with the reason when it is not built or does not load.
    """
    mod = _module if _module is not None else _load_existing()
    if mod is None:
        raise RuntimeError(_error or _NOT_BUILT)
    return mod


def reset() -> None:
    """Forget what this process knows (the loaded module stays importable); tests switch
    ``FP8REF_NATIVE``, ``FP8REF_CPU_FP8`` or ``TORCH_EXTENSIONS_DIR`` and call this."""
    global _module, _error, _native_state
    with _lock:
        _module, _error, _native_state = None, None, None
        _source_digest.cache_clear()
        _name.cache_clear()
