"""The house rules of the source tree, checked by parsing it (nothing is imported or run).

- The spec (``fp8ref/spec/``) imports nothing else from fp8ref, not even inside a function.
- Module-level imports between fp8ref modules form no cycle, and each module imports at
  module level only from its own area or from areas below it in ``LAYERS`` (the map in
  ``fp8ref/__init__``'s docstring, which must name every area).
- No ``.py`` file under ``fp8ref/`` carries C++ in a string: native code lives in real source
  files (``fp8ref/kernels/csrc/``).
- No module is longer than ``MAX_LINES`` unless its docstring says why, in a paragraph starting
  with ``LONG_MARKER``.
- Every package has a docstring whose first paragraph says what lives there and which mentions
  how its imports flow.
"""

from __future__ import annotations

import ast
import re
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

#: The areas of fp8ref from the bottom up: at module level an area imports only from itself and
#: from areas of a lower rank. ``fp8ref`` is the face (``fp8ref/__init__.py``) alone.
LAYERS = [
    ("fp8ref.spec", "fp8ref._machine", "fp8ref._io", "fp8ref._progress"),
    ("fp8ref.registry",),
    ("fp8ref.kernels",),
    ("fp8ref.select",),
    ("fp8ref.api",),
    ("fp8ref.nn",),
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


def _import_time_edges() -> dict[str, set[str]]:
    """Module -> the fp8ref modules its import runs (importing ``a.b.c`` from outside ``a.b`` runs
    ``a.b``'s ``__init__`` first; one's own enclosing packages are already running)."""
    edges: dict[str, set[str]] = {}
    for name in _modules():
        deps = edges.setdefault(name, set())
        own = set(_ancestors(name)) | ({name} if _is_package(name) else set())
        for target, top, _ in _imports(name):
            if not top:
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


def test_no_import_cycle_at_import_time():
    edges = _import_time_edges()
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
    assert not cycles, "import cycles at import time:\n" + "\n".join(" -> ".join(c) for c in cycles)


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


#: The most positional parameters a function of fp8ref takes (``self``/``cls`` not counted); more
#: go keyword-only or into a small named structure. Triton kernels (``@triton.jit``) are exempt:
#: their launch passes every argument positionally.
MAX_POSITIONAL = 8
#: Functions another engineer is restructuring while this rule lands (module:function -> why).
POSITIONAL_PENDING: dict[str, str] = {
    "fp8ref.api:_call": "api.py's dispatch gets a named structure (issue 33, h3)",
    "fp8ref.api:_fallback": "api.py's dispatch gets a named structure (issue 33, h3)",
}


def _positional_counts(name: str):
    for node in ast.walk(_tree(name)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any("jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        args = [*node.args.posonlyargs, *node.args.args]
        if args and args[0].arg in ("self", "cls"):
            args = args[1:]
        yield node.name, len(args)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_function_takes_more_than_eight_positional_parameters(name):
    long = [f"{fn} ({n})" for fn, n in _positional_counts(name)
            if n > MAX_POSITIONAL and f"{name}:{fn}" not in POSITIONAL_PENDING]
    assert not long, f"{name}: more than {MAX_POSITIONAL} positional parameters: {long}"


def test_positional_exceptions_are_still_needed():
    for key in POSITIONAL_PENDING:
        mod, fn = key.split(":")
        if mod in _modules():
            assert any(f == fn and n > MAX_POSITIONAL for f, n in _positional_counts(mod)), (
                f"{key} takes {MAX_POSITIONAL} or fewer now: drop it from POSITIONAL_PENDING")


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
