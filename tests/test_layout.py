"""The house rules of the source tree, checked by parsing it (nothing is imported or run).

- The spec (``fp8ref/spec/``) imports nothing else from fp8ref, not even inside a function.
- Imports between fp8ref modules form no cycle, neither at import time nor counting the imports
  inside functions (a lazy import that closes a cycle still ties the two modules into one), and
  each module imports at module level only from its own area or from areas below it in ``LAYERS`` (the map in
  ``fp8ref/__init__``'s docstring, which must name every area).
- No ``.py`` file under ``fp8ref/`` carries C++ in a string: native code lives in real source
  files (``fp8ref/kernels/csrc/``).
- No function takes more than ``MAX_POSITIONAL`` positional parameters (a method's receiver and a
  Triton kernel's launch arguments aside): beyond that a call site is a row of unnamed values.
- Docstrings and comments (the C++ sources' too) hold no lab notebook: no CPU model (``CPU_NAME``) and no speed figure
  (``SPEED_FIGURE``); measurements of one machine go to docs/performance.md ("Figures behind the
  code"), and the code keeps the reason for its choice. ``NOTEBOOK_ALLOWED`` lists the few
  phrases that are facts, not measurements, each with its reason.
- No module is longer than ``MAX_LINES`` unless its docstring says why, in a paragraph starting
  with ``LONG_MARKER``.
- Every package has a docstring whose first paragraph says what lives there and which mentions
  how its imports flow.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fp8ref"

#: Longest module without a stated reason.
MAX_LINES = 500
#: A longer module's docstring holds a paragraph starting with this, followed by the reason.
LONG_MARKER = "Why this module is long:"
#: Modules other engineers own while this rule lands; the owner splits the module or states its
#: reason with LONG_MARKER, and removes the entry.
LONG_PENDING: dict[str, str] = {}
#: Package docstrings that do not yet say how their imports flow, for the same reason.
DOC_PENDING: dict[str, str] = {}

#: Most positional parameters a function may take; more go keyword-only or into a named structure.
MAX_POSITIONAL = 8

#: CPU models and machine descriptions ("a 2-vCPU ..."): in a docstring or a comment they mark a
#: measurement of one machine.
CPU_NAME = re.compile(r"\b(?:Zen ?\d|EPYC|Xeon|Sapphire Rapids|Emerald Rapids|Granite Rapids|Ice ?Lake|"
                      r"Cascade ?Lake|Cooper ?Lake|Skylake|Genoa|Milan|Turin|Ryzen|Graviton|Neoverse|Opteron)\b"
                      r"|\b\d+-(?:v?CPUs?|cores?)\b")
#: Speed figures: a number (or a range) with a unit of time below the second or of throughput, a
#: decimal speed ratio ("1.45x", "0.91-0.99x") or a ratio said to be faster or slower. Integer
#: multiples that are not speeds ("up to 2x saturation", "32x too small") are left alone.
SPEED_FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s*(?:-\s*\d+(?:\.\d+)?\s*)?(?:ns|us|µs|ms|[GMT]i?B/s|[GMT]FLOP/s|G codes/s|cycles)"
    r"(?![\w/])"
    r"|(?<![\w.])\d+\.\d+(?:\s*-\s*\d+\.\d+)?x\b"
    r"|(?<![\w.])\d+(?:\.\d+)?x (?:faster|slower|as long|the time|the CPU)\b")
#: (module, phrase) -> why it stays: a figure or CPU name inside the phrase is not a measurement.
NOTEBOOK_ALLOWED = {
    ("fp8ref/kernels/cpu_fp8_amx.py", "Intel Xeon Sapphire Rapids and later"):
        "which CPUs have the AMX instructions: a fact of the hardware",
    ("fp8ref/bench/timing.py", "Default 1 ms on CUDA, 5 ms on CPU"): "a parameter's documented default",
    ("fp8ref/bench/report.py", "memory copy 10.00 GB/s (read + write); bf16 GEMM peak 100.0 GFLOP/s"):
        "a doctest's output on made-up input",
}
#: Modules whose job is to identify CPUs: they may name them (never with a figure).
CPU_NAMES_ALLOWED = {"fp8ref/_machine.py": "says which vendor, family and model numbers name which design",
                     "fp8ref/conformance/known_failures.py": "the ledger records on which machines a failure was seen"}

#: The areas of fp8ref from the bottom up: at module level an area imports only from itself and
#: from areas of a lower rank. ``fp8ref`` is the face (``fp8ref/__init__.py``) alone.
LAYERS = [
    ("fp8ref.spec", "fp8ref._machine", "fp8ref._io", "fp8ref._progress", "fp8ref._version", "fp8ref._env",
     "fp8ref._safetensors_reader"),
    # the weight check (the sample, the watch a bound call checks) reads the spec only: below the
    # registry, whose hooks take a Watch, and the checking core, which hands one to a backend
    ("fp8ref.weightcheck",),
    ("fp8ref.registry",),
    ("fp8ref.check",),
    ("fp8ref.kernels",),
    ("fp8ref.select",),
    ("fp8ref.api",),
    ("fp8ref.ops",),
    ("fp8ref.nn",),
    ("fp8ref.surgery",),
    ("fp8ref.checkpoint",),
    ("fp8ref",),
    ("fp8ref.conformance",),
    ("fp8ref.peers",),
    ("fp8ref.audit",),
    ("fp8ref.bench",),
    ("fp8ref.cli",),
    ("fp8ref.gpu_check",),
    ("fp8ref.pytest_plugin", "fp8ref.__main__"),
]
RANK = {area: i for i, areas in enumerate(LAYERS) for area in areas}

#: What C++ in a Python string looks like.
CPP = re.compile(r"#\s*include\s*[<\"]|PYBIND11_MODULE|TORCH_LIBRARY")


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(PKG.rglob("*.py"))}


@cache
def _tree(name: str) -> ast.Module:
    return ast.parse(_modules()[name].read_text(), filename=str(_modules()[name]))


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _absolute(module: str, level: int, target: str | None) -> str:
    """``from <level dots><target> import ...`` inside ``module``, as an absolute name."""
    if level == 0:
        return target or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(name: str) -> list[tuple[str, bool, int]]:
    """``(imported fp8ref module, at module level, line)`` for every import in module ``name``.

    ``from pkg import x`` counts as importing ``pkg.x`` when that is a module, else ``pkg``.
    Function bodies run later (lazy imports); class bodies and module-level ``if``/``try`` run at
    import time; ``if TYPE_CHECKING:`` never runs.
    """
    mods = _modules()
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, top, child.lineno) for a in child.names if a.name.split(".")[0] == "fp8ref")
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(name, child.level, child.module)
                if base.split(".")[0] == "fp8ref":
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        out.append((sub if sub in mods else base, top, child.lineno))
            if _type_checking(child):
                continue
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(_tree(name), True)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _import_time_edges(lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the fp8ref modules its import runs (importing ``a.b.c`` from outside ``a.b`` runs
    ``a.b``'s ``__init__`` first; one's own enclosing packages are already running); with ``lazy``,
    also those its functions import when called."""
    edges: dict[str, set[str]] = {}
    for name in _modules():
        deps = edges.setdefault(name, set())
        own = set(_ancestors(name)) | ({name} if _is_package(name) else set())
        for target, top, _ in _imports(name):
            if not (top or lazy):
                continue
            for t in [*_ancestors(target), target]:
                if t in _modules() and t not in own:
                    deps.add(t)
    return edges


def _area(name: str) -> str:
    parts = name.split(".")
    return name if len(parts) == 1 else ".".join(parts[:2])


def test_the_tree_is_found():
    mods = _modules()
    assert {"fp8ref", "fp8ref.spec", "fp8ref.kernels", "fp8ref.select", "fp8ref.conformance", "fp8ref.audit",
            "fp8ref.cli", "fp8ref.bench", "fp8ref.gpu_check"} <= set(mods)
    assert len(mods) > 50


@pytest.mark.parametrize("name", [n for n in _modules() if n == "fp8ref.spec" or n.startswith("fp8ref.spec.")])
def test_the_spec_imports_nothing_else_from_fp8ref(name):
    outside = [(t, line) for t, _, line in _imports(name) if t != "fp8ref.spec" and not t.startswith("fp8ref.spec.")]
    assert not outside, f"{_modules()[name]} imports {outside}: the spec is a leaf"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def dfs(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt, path)
        path.pop()
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            dfs(name, [])
    return cycles


def test_no_import_cycle_at_import_time():
    cycles = _cycles(_import_time_edges())
    assert not cycles, "import cycles at import time:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_at_any_level():
    """Imports inside functions count too: a lazy import that closes a cycle hides a dependency
    that goes both ways (the build command in cpu_fp8.py importing cpu_fp8_amx, which imports
    cpu_fp8, was one); move the code that needs both sides above them instead."""
    cycles = _cycles(_import_time_edges(lazy=True))
    assert not cycles, "import cycles through imports inside functions:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    """The checker itself: a made-up pair of modules importing each other is reported."""
    fake = {"fp8ref.x": "from . import y\n", "fp8ref.y": "from .x import f\n", "fp8ref": ""}
    trees = {n: ast.parse(src) for n, src in fake.items()}
    paths = {"fp8ref": PKG / "__init__.py", "fp8ref.x": PKG / "x.py", "fp8ref.y": PKG / "y.py"}
    monkeypatch.setitem(globals(), "_modules", lambda: paths)
    monkeypatch.setitem(globals(), "_tree", lambda n: trees[n])
    assert _import_time_edges() == {"fp8ref": set(), "fp8ref.x": {"fp8ref.y"}, "fp8ref.y": {"fp8ref.x"}}
    with pytest.raises(AssertionError, match="fp8ref.x -> fp8ref.y -> fp8ref.x"):
        test_no_import_cycle_at_import_time()


def test_the_cycle_check_sees_a_cycle_through_a_lazy_import(monkeypatch):
    """A cycle closed only by an import inside a function is invisible at import time but not
    at any level."""
    fake = {"fp8ref.x": "from . import y\n", "fp8ref.y": "def f():\n    from .x import g\n", "fp8ref": ""}
    trees = {n: ast.parse(src) for n, src in fake.items()}
    paths = {"fp8ref": PKG / "__init__.py", "fp8ref.x": PKG / "x.py", "fp8ref.y": PKG / "y.py"}
    monkeypatch.setitem(globals(), "_modules", lambda: paths)
    monkeypatch.setitem(globals(), "_tree", lambda n: trees[n])
    test_no_import_cycle_at_import_time()
    with pytest.raises(AssertionError, match="fp8ref.x -> fp8ref.y -> fp8ref.x"):
        test_no_import_cycle_at_any_level()


def test_every_area_is_on_the_map():
    areas = {_area(n) for n in _modules()}
    unplaced = sorted(areas - set(RANK))
    assert not unplaced, (f"new area(s) {unplaced}: place them in LAYERS (tests/test_layout.py) and in the map "
                          "of fp8ref/__init__.py's docstring")
    doc = ast.get_docstring(_tree("fp8ref"))
    missing = [a for a in areas if a != "fp8ref" and f"``{a}``" not in doc and f"``{a.split('.')[1]}``" not in doc]
    assert not missing, f"fp8ref/__init__.py's docstring does not say where {missing} live"


def test_imports_flow_up_the_layers():
    upward = []
    for name in _modules():
        for target, top, line in _imports(name):
            src, dst = _area(name), _area(target)
            if top and src != dst and src in RANK and dst in RANK and RANK[dst] >= RANK[src]:
                where = f"{_modules()[name].relative_to(ROOT)}:{line}"
                upward.append(f"{where} imports {target} ({dst} is not below {src})")
    assert not upward, "module-level imports that go up (or sideways) the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_cpp_in_python_strings(name):
    found = [(node.lineno, CPP.search(node.value).group()) for node in ast.walk(_tree(name))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and CPP.search(node.value)]
    assert not found, f"{_modules()[name]} holds C++ in strings at {found}: move it to fp8ref/kernels/csrc/"


def test_cpp_sources_are_shipped():
    """Every C++ file under fp8ref/ is matched by pyproject's package data (sdist and wheel)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    native = [p for p in PKG.rglob("*") if p.suffix in (".cpp", ".h", ".cu")]
    assert native
    for p in native:
        owner = p.parent
        while not (owner / "__init__.py").exists():
            owner = owner.parent
        globs = data.get(_name(owner / "__init__.py"), [])
        assert any(p.relative_to(owner).match(g) for g in globs), f"{p.relative_to(ROOT)} is not package data"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_long_modules_say_why(name):
    path = _modules()[name]
    rel = str(path.relative_to(ROOT))
    n = len(path.read_text().splitlines())
    if n <= MAX_LINES or rel in LONG_PENDING:
        return
    doc = ast.get_docstring(_tree(name)) or ""
    reason = next((p[len(LONG_MARKER):].strip() for p in doc.split("\n\n") if p.startswith(LONG_MARKER)), "")
    assert len(reason) >= 40, (f"{rel} has {n} lines (> {MAX_LINES}): split it into modules named for their jobs, "
                               f"or say why in its docstring, in a paragraph starting with {LONG_MARKER!r}")


def test_pending_exceptions_are_still_needed():
    for rel in LONG_PENDING:
        assert len((ROOT / rel).read_text().splitlines()) > MAX_LINES, f"{rel} is short now: drop it from LONG_PENDING"


@pytest.mark.parametrize("name", sorted(n for n in _modules() if _is_package(n)))
def test_every_package_says_what_lives_there(name):
    doc = ast.get_docstring(_tree(name))
    assert doc, f"{_modules()[name]} has no docstring"
    first = doc.split("\n\n")[0]
    assert len(first) >= 60, f"{name}: the first paragraph should say what lives in the package: {first!r}"
    if name not in DOC_PENDING:
        assert "import" in doc, f"{name}: the docstring should say which way the package's imports flow"


def test_every_source_directory_is_a_package():
    """A directory of .py files without __init__.py would hide its modules from the checks above."""
    loose = [p for p in PKG.rglob("*.py") if not (p.parent / "__init__.py").exists()]
    assert not loose, f"modules outside any package: {loose}"


def _decorator_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _positional_counts(tree: ast.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, positional parameters, line)`` of every function and lambda in ``tree``.

    The receiver of a method (the first parameter of a function in a class body that is not a
    ``staticmethod``) is not counted: the caller never writes it. A ``triton.jit`` kernel is
    skipped: its parameters are the compiled kernel's argument list (pointers, strides and
    constexprs, each specialised by Triton at launch): the GPU kernel's interface, not a Python API.
    """
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                name = f"{prefix}{getattr(child, 'name', '<lambda>')}"
                decorators = set() if isinstance(child, ast.Lambda) else _decorator_names(child)
                n = len(child.args.posonlyargs) + len(child.args.args)
                if in_class and not isinstance(child, ast.Lambda) and "staticmethod" not in decorators:
                    n -= 1
                if "jit" not in decorators:
                    out.append((name, n, child.lineno))
                visit(child, f"{name}.", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", True)
            else:
                visit(child, prefix, in_class and not isinstance(child, ast.ClassDef))

    visit(tree, "", False)
    return out


def test_no_function_takes_too_many_positional_parameters():
    over = []
    for name, path in _modules().items():
        rel = path.relative_to(ROOT).as_posix()
        for fn, n, line in _positional_counts(_tree(name)):
            if n > MAX_POSITIONAL:
                over.append(f"{rel}:{line} {fn} takes {n} positional parameters")
    assert not over, (f"more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only, "
                      "or pass a named structure):\n" + "\n".join(over))


def test_the_positional_count_sees_what_a_caller_writes():
    tree = ast.parse(
        "def f(a, b, /, c, *args, d, e=1, **kw): pass\n"
        "class C:\n"
        "    def m(self, a, b): pass\n"
        "    @staticmethod\n"
        "    def s(a, b): pass\n"
        "    def outer(self, a):\n"
        "        def inner(x, y, z): pass\n"
        "@triton.jit\n"
        "def kernel(a, b, c, d, e, f, g, h, i, j): pass\n"
        "g = lambda a, b: a\n")
    assert {(f, n) for f, n, _ in _positional_counts(tree)} == {
        ("f", 3), ("C.m", 2), ("C.s", 2), ("C.outer", 1), ("C.outer.inner", 3), ("<lambda>", 2)}


def _prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every docstring (a string standing as a statement, ``#:`` attribute
    docs' neighbours included) and every block of consecutive comment lines in ``path``, with
    the whitespace collapsed so that a figure wrapped over two lines is still one figure."""
    src = path.read_text()
    out = [(node.lineno, " ".join(node.value.value.split())) for node in ast.walk(ast.parse(src))
           if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    block: list[str] = []
    start = last = -1
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if block and line != last + 1:
            out.append((start, " ".join(block)))
            block = []
        if not block:
            start = line
        block.append(" ".join(tok.string.lstrip("#:").split()))
        last = line
    if block:
        out.append((start, " ".join(block)))
    return out


def _notebook_entries(rel: str, text: str) -> list[str]:
    """The CPU names and speed figures in ``text`` that no allowed phrase of module ``rel`` covers."""
    spans = []
    for (where, phrase), _ in NOTEBOOK_ALLOWED.items():
        if where == rel:
            spans += [(m.start(), m.end()) for m in re.finditer(re.escape(phrase), text)]
    found = [m for m in SPEED_FIGURE.finditer(text)]
    if rel not in CPU_NAMES_ALLOWED:
        found += CPU_NAME.finditer(text)
    return [m.group() for m in found if not any(a <= m.start() and m.end() <= b for a, b in spans)]


def _cpp_prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every block of consecutive ``//`` comment lines of a C++ file."""
    out: list[tuple[int, str]] = []
    block: list[str] = []
    start = 0
    for i, line in enumerate([*path.read_text().splitlines(), ""], 1):
        if "//" in line:
            start = start if block else i
            block.append(" ".join(line.split("//", 1)[1].split()))
        elif block:
            out.append((start, " ".join(block)))
            block = []
    return out


def _sources() -> list[Path]:
    return sorted([*PKG.rglob("*.py"), *(p for p in PKG.rglob("*") if p.suffix in (".cpp", ".h", ".cu"))])


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.relative_to(PKG).as_posix())
def test_docstrings_and_comments_hold_no_lab_notebook(path):
    rel = path.relative_to(ROOT).as_posix()
    prose = _prose(path) if path.suffix == ".py" else _cpp_prose(path)
    found = [f"{rel}:{line}: {hits}" for line, text in prose if (hits := _notebook_entries(rel, text))]
    assert not found, ("machine-specific measurements in docstrings or comments; move them to docs/performance.md "
                       "(\"Figures behind the code\": the figure, the CPU, the date) and keep the reason for the "
                       "choice here:\n" + "\n".join(found))


def test_notebook_allowances_are_still_needed():
    for (rel, phrase), reason in NOTEBOOK_ALLOWED.items():
        texts = [t for _, t in _prose(ROOT / rel) if phrase in t]
        assert texts, f"{rel} no longer says {phrase!r}: drop it from NOTEBOOK_ALLOWED"
        assert SPEED_FIGURE.search(phrase) or CPU_NAME.search(phrase), f"{phrase!r} needs no allowance"
        assert reason
    for rel in CPU_NAMES_ALLOWED:
        assert any(CPU_NAME.search(t) for _, t in _prose(ROOT / rel)), f"{rel} names no CPU: drop its allowance"


@pytest.mark.parametrize("text, hits", [
    ("on a 2-vCPU Xeon with AMX it ran 1.45-1.8x bf16 F.linear", ["1.45-1.8x", "Xeon", "2-vCPU"]),
    ("24.5-25.2 -> 23.7-24.0 ms at M = 1024", ["23.7-24.0 ms"]),
    ("0.76 ns per code; 0.2 GB/s; 11 us against 96-180 us; 1.4 µs", ["0.76 ns", "0.2 GB/s", "11 us", "96-180 us",
                                                                    "1.4 µs"]),
    ("ran 4x slower per row; a ci run took 8x the CPU time; on the Zen 4 EPYC", ["4x slower", "8x the CPU", "Zen 4",
                                                                                 "EPYC"]),
    ("up to 2x saturation; 32x too small; 100-1000x larger; K = 4096; 1 << 20; 2**-9; 448", []),
    ("quantization in GB/s as a fraction of the copy; ms per call; a 2-core machine", ["2-core"]),
])
def test_the_notebook_check_sees_figures_not_constants(text, hits):
    assert sorted(_notebook_entries("fp8ref/x.py", text)) == sorted(hits)


def _backend_class() -> ast.ClassDef:
    return next(n for n in _tree("fp8ref.registry").body if isinstance(n, ast.ClassDef) and n.name == "Backend")


def _declared_backend_attributes() -> tuple[set[str], set[str]]:
    """(attributes, methods) that ``fp8ref.registry.Backend`` declares; a property is an attribute."""
    attrs, methods = set(), set()
    for node in _backend_class().body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attrs.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            is_property = any(ast.unparse(d) == "property" for d in node.decorator_list)
            (attrs if is_property else methods).add(node.name)
    return attrs, methods


def test_backend_declares_what_is_read_from_it():
    """What the driver, selector, peers, bench and reports read from a backend is declared on ``Backend``
    with a default and an entry in its docstring, and read directly: ``getattr(x, "<declared name>",
    default)`` would hide a renamed attribute behind the default."""
    attrs, methods = _declared_backend_attributes()
    assert {"conformance_max_elems", "conformance_max_examples", "time_budget_s", "bench_skip_reason",
            "version"} <= attrs
    doc = ast.get_docstring(_backend_class()) or ""
    undocumented = sorted(n for n in attrs if not any(line.strip().startswith(f"{n} :") for line in doc.splitlines()))
    assert not undocumented, f"Backend attributes without an entry in its docstring: {undocumented}"
    guessed = []
    for name in _modules():
        for node in ast.walk(_tree(name)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in attrs | methods):
                guessed.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not guessed, f"getattr/hasattr of attributes Backend declares: {guessed}"


#: The argument checks of the calling contract, which live in ``fp8ref/spec/checks.py`` alone (issue 33).
ARG_CHECKS = {"check_dense", "check_x", "check_weight", "check_call", "check_values", "check_linear_args",
              "check_finite", "check_codes", "BIAS_NON_FINITE", "check_bias", "check_out_dtype"}


def test_argument_checks_have_one_home():
    """Defined in ``fp8ref/spec/checks.py`` only, and imported from it directly: never re-defined,
    and never reached through ``fp8ref.api`` or ``fp8ref.kernels`` (nn.py and checkpoint.py once
    imported them from the api, which re-exported the kernels' copies)."""
    home = "fp8ref/spec/checks.py"
    below = {"fp8ref/spec/dense.py": {"check_dense"}}  # under quant.py, which runs it; checks re-exports it
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, (ast.FunctionDef, ast.Assign)) and rel != home
                    and ({node.name} if isinstance(node, ast.FunctionDef)
                         else {t.id for t in node.targets if isinstance(t, ast.Name)})
                    & (ARG_CHECKS - below.get(rel, set()))):
                bad.append(f"{rel}:{node.lineno} defines an argument check outside {home}")
            if isinstance(node, ast.ImportFrom) and {a.name for a in node.names} & ARG_CHECKS:
                if (node.module or "").split(".")[-1] not in ("checks", "dense"):
                    bad.append(f"{rel}:{node.lineno} imports an argument check from {node.module!r}, not spec.checks")
    assert not bad, "\n".join(bad)


#: What the selector may take from the spec's bounds: the precision classes it admits backends by.
#: Error bounds and comparisons are the checking core's (``fp8ref.check``), which the probe runs.
SELECT_FROM_BOUNDS = {"PrecisionClass"}


def test_the_selector_compares_nothing_itself():
    """``fp8ref.select`` judges a backend only through the checking core (issue 33: the probe runs
    the contracts' checks): it never imports ``spec.compare``, nor an error bound from
    ``spec.bounds`` (at module level or inside a function)."""
    bad = []
    for name in _modules():
        if _area(name) != "fp8ref.select":
            continue
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(name, node.level, node.module)
                names = {a.name for a in node.names}
                if target == "fp8ref.spec.compare" or (target == "fp8ref.spec" and names & {"compare", "bounds"}):
                    bad.append(f"{name}:{node.lineno} imports {sorted(names)} from {target}")
                elif target == "fp8ref.spec.bounds" and names - SELECT_FROM_BOUNDS:
                    bad.append(f"{name}:{node.lineno} imports {sorted(names - SELECT_FROM_BOUNDS)} from {target}")
            elif isinstance(node, ast.Import):
                bad += [f"{name}:{node.lineno} imports {a.name}" for a in node.names
                        if a.name in ("fp8ref.spec.compare", "fp8ref.spec.bounds")]
    assert not bad, "the selector's comparisons belong to fp8ref.check:\n" + "\n".join(bad)


def test_the_checking_core_imports_only_below_it():
    """``fp8ref.check`` sits below the selector and the conformance driver that run it: even inside
    a function it imports only the areas below it (the spec, the registry) and itself, and never
    Hypothesis (the ``conformance`` extra), so the selector runs without that extra."""
    bad = []
    for name in _modules():
        if _area(name) != "fp8ref.check":
            continue
        for target, _, line in _imports(name):
            if _area(target) != "fp8ref.check" and RANK.get(_area(target), len(LAYERS)) >= RANK["fp8ref.check"]:
                bad.append(f"{name}:{line} imports {target}")
        for node in ast.walk(_tree(name)):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bad += [f"{name}:{node.lineno} imports {m}" for m in mods if m.split(".")[0] == "hypothesis"]
    assert not bad, "the checking core imports above itself:\n" + "\n".join(bad)


def test_no_module_below_the_face_reads_it():
    """A module that the package face (``fp8ref/__init__``) imports, directly or not, never imports a
    name from the face (``from .. import __version__``), not even inside a function: that is an arrow
    back up the floors which the cycle checks cannot see (the face is every module's ancestor).
    Shared facts live at the ground floor (``fp8ref/_version.py``). The areas above the face (the
    conformance suite, audits, the CLI) may read it lazily, as its docstring says."""
    edges = _import_time_edges()
    below, todo = set(), ["fp8ref"]
    while todo:
        for t in edges.get(todo.pop(), ()):
            if t not in below:
                below.add(t)
                todo.append(t)
    bad = [f"{name}:{line}" for name in sorted(below - {"fp8ref"})
           for target, _, line in _imports(name) if target == "fp8ref"]
    assert not bad, "modules below fp8ref's package face that import it: " + ", ".join(bad)


def test_the_version_is_written_once():
    """pyproject.toml's version is the one fp8ref reports (``fp8ref/_version.py``)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    ns: dict = {}
    exec(compile((PKG / "_version.py").read_text(), "_version.py", "exec"), ns)  # a constant, nothing imported
    assert ns["__version__"] == declared
