"""spchain's modules import one another without cycles (issue 21).

The graph is read from the source (AST), function-level imports included: a cycle hidden in
a function still ties the modules into one unit that cannot be read, tested or loaded apart.
Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "spchain"


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name → source file, for every module of the package under ``root``."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            # `from . import _backend` imports the submodule; `from .x import f` imports x
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """The import graph of the package at ``root``: module → the modules it imports."""
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    edges = graph()
    assert "spchain._backend" in edges["spchain.sparse"]  # the graph is read at all
    assert cycles(edges) == []


@pytest.mark.parametrize("inside", ["", "def f():\n    "])
def test_a_cycle_is_found_at_module_or_function_level(tmp_path, inside):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(f"{inside}from .a import x\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (package / "d.py").write_text("from .a import x\n")
    assert cycles(graph(package)) == [["pkg.a", "pkg.b"]]
