"""megarlhf's modules import each other without cycles, counting imports inside functions too
(a lazy import that closes a cycle still ties the modules into one unit nobody can read or
test alone), and so do its packages: each imports only packages below it, and the directions
that matter most are named. Importing megarlhf alone pulls in no heavy library."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("megarlhf", "tools")
LAYERING = (
    # (a package, a package above it that it must not import). The first three and the last
    # were crossed for a piece both used, which now lives in the lower one; roles/ runs on
    # the engine, so the engine importing it would be one more.
    ("megarlhf.data", "megarlhf.roles"),  # SequenceBatch: data/sequences.py
    ("megarlhf.data", "megarlhf.convert"),  # checkpoint and file checks: megarlhf/integrity.py
    ("megarlhf.engine", "megarlhf.convert"),
    ("megarlhf.engine", "megarlhf.roles"),
    ("megarlhf.ppo", "megarlhf.plan"),  # each role's model shape: ppo/sources.py
)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _imports(name: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The project modules the module `name` (source text `source`) imports anywhere in its
    body. `from a.b import c` is an import of a.b.c when that is a module, else of a.b;
    relative imports are resolved."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    # A package's __init__ importing its own submodules is how packages export names, not a
    # cycle between units: those edges are left out.
    return {name: {m for m in _imports(name, path.read_text(), known,
                                       is_package=path.name == "__init__.py")
                   if not (path.name == "__init__.py" and m.startswith(name + "."))}
            for name, path in modules.items()}


def _unit(module: str) -> str:
    """The package a module belongs to (megarlhf.data.pairs -> megarlhf.data); a module at
    the top of megarlhf (megarlhf.integrity) is a unit of its own."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` between units: an edge where any module of one imports a module of another."""
    out: dict[str, set[str]] = {}
    for name, imported in graph.items():
        out.setdefault(_unit(name), set()).update(
            _unit(m) for m in imported if _unit(m) != _unit(name))
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _crossings(graph: dict[str, set[str]], layering) -> list[str]:
    """'importer -> imported' for every import of `graph` that `layering` forbids."""
    return sorted(f"{name} -> {m}" for name, imported in graph.items() for m in imported
                  for lower, higher in layering
                  if _within(name, lower) and _within(m, higher))


def test_the_cycle_finder_sees_lazy_and_relative_imports():
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    graph = {
        "p.a": _imports("p.a", "import p.b\n", known),
        "p.b": _imports("p.b", "def f():\n    from p import c\n", known),  # lazy
        "p.c": _imports("p.c", "from .a import x\n", known),  # relative, a name
        "p.d": _imports("p.d", "from p.a import y\nimport os\n", known),
        "p": set(),
    }
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p": set()}
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_layering_checks_see_every_module_of_a_package():
    known = {"p", "p.low", "p.low.a", "p.high", "p.high.b", "p.shared"}
    graph = {
        "p.low.a": _imports("p.low.a", "def f():\n    from p.high import b\n", known),
        "p.high.b": _imports("p.high.b", "from p.low import a\nimport p.shared\n", known),
        "p.shared": set(),
    }
    assert _crossings(graph, [("p.low", "p.high")]) == ["p.low.a -> p.high.b"]
    assert _package_graph(graph) == {"p.low": {"p.high"}, "p.high": {"p.low", "p.shared"},
                                     "p.shared": set()}
    assert _cycles(_package_graph(graph)) == [["p.high", "p.low"]]


def test_packages_import_only_packages_below_them():
    """No two packages import each other, however indirectly: each piece they share lives in
    the lower one."""
    assert _cycles(_package_graph(_graph())) == []


def test_no_package_imports_a_package_named_above_it():
    assert _crossings(_graph(), LAYERING) == []


def test_importing_megarlhf_pulls_in_no_heavy_library():
    code = ("import sys, megarlhf\n"
            "print(sorted(m for m in ('torch', 'megatron', 'vllm', 'ray', 'transformers')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
